"""ModelRunner: the engine's model half. Owns the weights and the state pools; a sequence is a slot with pages and
a length. One `forward` appends any number of tokens to any number of sequences in a single batched model pass.

With `prefix_cache=True` (the server's default) full pages are shared through engine/prefix_cache.py, and
`runner.prefix_cache` (None when off) is that capability: `attach` starts a fresh sequence from the longest cached
page chain of its prompt, `cache` indexes the full pages of tokens that are final (prompt chunks as they are
prefilled), and `free` indexes every full page before letting go. Leading pages that are indexed or shared are
never written again: a truncation below them re-prefills (copy-on-write by recomputation).

`sites` (engine/model/fused_sites.py) is the model's fused-site setting, fixed at construction: the server builds
with SiteSettings (engine/build.py), a bare runner's None keeps the plain CSA selection."""

from __future__ import annotations

import copy
import os

import torch

from evalpipe.engine.cache import PoolExhausted, StatePools
from evalpipe.engine.forward_batch import ForwardBatch
from evalpipe.engine.host_to_device import to_device
from evalpipe.engine.model.config import load_engine_config
from evalpipe.engine.model.deepseek_v4 import DeepseekV4Model
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.model.weights import load_state_dict, resolve_model
from evalpipe.engine.prefix_cache import ROOT, PrefixCache

__all__ = ["ModelRunner", "PoolExhausted", "RunnerPrefixCache"]


class RunnerPrefixCache:
    """A runner's prefix cache, the optional capability `ModelRunner.prefix_cache` (None when off): the page index
    (engine/prefix_cache.py) plus, per live slot, how many leading pages are indexed or shared (read-only) and the
    chain node of the last one."""

    def __init__(self, runner: "ModelRunner"):
        self._runner = runner
        self.index = PrefixCache(runner.pools)
        self._frozen: dict[int, tuple[int, int]] = {}

    @torch.inference_mode()
    def attach(self, seq: int, tokens: list[int]) -> int:
        """Start the empty sequence `seq` from the longest cached prefix of `tokens` (at most len - 1 tokens, so the
        last prompt row is always computed); returns how many tokens it now holds (0: no hit)."""
        runner = self._runner
        if runner.seq_len(seq):
            return 0
        pages, node = self.index.match(tokens, len(tokens) - 1)
        if not pages:
            return 0
        length = len(pages) * runner.pools.page_tokens
        runner.pools.share(seq, pages)
        runner.pools.restore_rings(seq, length)
        runner.append_tokens(seq, tokens[:length])
        self._frozen[seq] = (len(pages), node)
        return length

    def cache(self, seq: int, upto: int) -> None:
        """Index the full pages of the first `upto` tokens of `seq`: the caller vouches they are final (prompt
        tokens, or everything at free). They become read-only for `seq`."""
        runner = self._runner
        done, node = self._frozen.get(seq, (0, ROOT))
        tokens = runner.tokens(seq)[:upto]
        self._frozen[seq] = self.index.insert(tokens, runner.pools.seq_pages.get(seq, []), done, node)

    def flush(self) -> dict:
        """Forget every cached page (idle pages are freed at once); live sequences keep what they hold."""
        return {"enabled": True, "flushed_pages": self.index.flush()}

    def describe(self) -> dict:
        return self.index.describe()

    def read_only_tokens(self, seq: int) -> int:
        """Leading tokens of `seq` in pages that are indexed or shared: never written again."""
        return self._frozen.get(seq, (0, ROOT))[0] * self._runner.pools.page_tokens

    def forget(self, seq: int) -> None:
        """`seq` holds no read-only page any more (freed, or rolled back below its shared pages)."""
        self._frozen.pop(seq, None)


class ModelRunner:
    def __init__(
        self,
        model_path: str | None = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_seqs: int = 64,
        max_seq_len: int = 4096,
        rollback_margin: int = 32,
        num_pages: int | None = None,
        sites: SiteSettings | None = None,
        prefix_cache: bool = False,
        page_tokens: int | None = None,
    ):
        path, self.model_name = resolve_model(model_path)  # None: the default (trained) model
        self.model_path = str(path)
        self.config = load_engine_config(path)
        # read by check_rows for every sequence of every step; on a first start the config is transformers' own,
        # whose attribute reads are Python calls
        self._vocab = int(self.config.vocab_size)
        self.device, self.dtype = torch.device(device), dtype
        self.max_seq_len, self.max_seqs = int(max_seq_len), int(max_seqs)
        self.model = DeepseekV4Model(
            self.config,
            load_state_dict(path),
            dtype=dtype,
            device=self.device,
            max_positions=self.max_seq_len,
            sites=sites,
        )
        self.fused_sites = sites.describe(self.model) if sites is not None else None  # /get_server_info
        self._new_state(rollback_margin, num_pages, page_tokens, prefix_cache)

    def _new_state(
        self, rollback_margin: int, num_pages: int | None, page_tokens: int | None, prefix_cache: bool
    ) -> None:
        """Empty state pools, slots and (optionally) prefix cache for this runner's model."""
        self.pools = StatePools(
            self.config,
            max_seqs=self.max_seqs,
            max_seq_len=self.max_seq_len,
            device=self.device,
            dtype=self.dtype,
            rollback_margin=rollback_margin,
            num_pages=num_pages,
            page_tokens=page_tokens,
            prefix_tails=prefix_cache,
        )
        self.prefix_cache = RunnerPrefixCache(self) if prefix_cache else None
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self._tokens: dict[int, list[int]] = {}  # per live slot: every appended token (for deep rollbacks)

    def view(self, num_layers: int | None = None) -> "ModelRunner":
        """A runner over this one's weights with its OWN state pools, slots and prefix cache (when this one has
        one): the `self` and `layerskip:N` drafters. With `num_layers`, only the first N decoder layers run,
        followed by the model's own hyper-connection head, final norm and LM head; the weights are shared, never
        copied."""
        view = ModelRunner.__new__(ModelRunner)
        view.model_path, view.device, view.dtype = self.model_path, self.device, self.dtype
        view.max_seq_len, view.max_seqs, view.fused_sites = self.max_seq_len, self.max_seqs, self.fused_sites
        view.model_name, view.model, view.config = self.model_name, self.model, self.config
        view._vocab = self._vocab
        if num_layers is not None:
            view.model = self.model.first_layers(num_layers)
            view.config = copy.copy(self.config)
            view.config.layer_types = list(self.config.layer_types[:num_layers])
            view.model_name = f"{self.model_name}[layers 0..{num_layers - 1}]"
        view._new_state(self.pools.margin, None, self.pools.page_tokens, self.prefix_cache is not None)
        return view

    @property
    def eager_runner(self) -> "ModelRunner":
        """The runner whose forward is the plain eager one (drafter views are built on it): this one."""
        return self

    @property
    def decodes_async(self) -> bool:
        """Whether `decode_async`/`settle` (the engine's overlap schedule) are offered: only by GraphRunner."""
        return False

    # ---- slots -----------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free_slots:
            raise PoolExhausted(f"all {self.max_seqs} sequence slots are in use")
        seq = self._free_slots.pop()
        self._tokens[seq] = []
        return seq

    def free(self, seq: int) -> None:
        self._check(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.cache(seq, len(self._tokens[seq]))  # everything it computed is final now
            self.prefix_cache.forget(seq)
        self.pools.shrink(seq, 0)
        del self._tokens[seq]
        self._free_slots.append(seq)

    def seq_len(self, seq: int) -> int:
        self._check(seq)
        return len(self._tokens[seq])

    def tokens(self, seq: int) -> list[int]:
        self._check(seq)
        return list(self._tokens[seq])

    def check_rows(self, seq: int, tokens: list[int | None]) -> int:
        """Validate that `tokens` may be appended to `seq` (allocated, ids in the vocabulary, within max_seq_len;
        None: a token the device supplies) and return where they start (ValueError/KeyError otherwise)."""
        self._check(seq)
        vocab = self._vocab
        for t in tokens:  # a loop, not any(<generator>): this runs for every sequence of every step
            if t is not None and not 0 <= t < vocab:
                raise ValueError(f"sequence {seq}: token id out of range [0, {vocab})")
        start = len(self._tokens[seq])
        if start + len(tokens) > self.max_seq_len:
            raise ValueError(f"sequence {seq}: length {start + len(tokens)} exceeds max_seq_len {self.max_seq_len}")
        return start

    def append_tokens(self, seq: int, tokens: list[int]) -> None:
        """Record tokens whose state a forward (this runner's, or a static step over its pools) has written; -1
        holds the place of a token still on the device (`set_token` fills it)."""
        self._check(seq)
        self._tokens[seq].extend(map(int, tokens))

    def set_token(self, seq: int, position: int, token: int) -> None:
        """Fill a placeholder that `append_tokens` recorded at `position`."""
        self._check(seq)
        self._tokens[seq][position] = int(token)

    def _check(self, seq: int) -> None:
        if seq not in self._tokens:
            raise KeyError(f"sequence {seq} is not allocated")

    # ---- model -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, seqs: list[int], tokens: list[list[int]], *, all_logits: bool = False, prompt_chunks: int = 0
    ) -> torch.Tensor:
        """Append `tokens[i]` to `seqs[i]` in one eager pass (`prompt_chunks`, how many leading requests are prompt
        chunks, changes nothing here: every row takes the eager forward)."""
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError("forward needs one non-empty token list per sequence")
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence may appear only once per forward")
        starts, counts = [], []
        for seq, toks in zip(seqs, tokens):
            if not toks:
                raise ValueError(f"sequence {seq}: empty token list")
            starts.append(self.check_rows(seq, toks))
            counts.append(len(toks))
        self.pools.reserve({seq: s + c for seq, s, c in zip(seqs, starts, counts)})
        for seq, s, c in zip(seqs, starts, counts):
            self.pools.tails_before(seq, s, s + c)  # the model writes the tails of this forward's rows
        flat = [t for toks in tokens for t in toks]
        input_ids = to_device(torch.tensor(flat, dtype=torch.long), self.device)
        batch = ForwardBatch(self.pools, seqs, starts, counts, input_ids, pad_groups=not self.model.deterministic)
        rows = torch.arange(batch.num_rows, device=self.device) if all_logits else batch.last_rows
        logits = self.model.forward(batch, self.pools, rows)
        for seq, toks in zip(seqs, tokens):
            self.append_tokens(seq, toks)
        return logits

    @torch.inference_mode()
    def truncate(self, seq: int, new_len: int) -> None:
        """Roll back to the first `new_len` tokens. Within `rollback_margin` tokens this only moves the length (the
        position-indexed state needs no undo, see cache.py); deeper, the kept prefix is re-prefilled."""
        self._check(seq)
        old = len(self._tokens[seq])
        if not 0 <= new_len <= old:
            raise ValueError(f"truncate({seq}, {new_len}): length is {old}")
        kept = self._tokens[seq][:new_len]
        cache = self.prefix_cache
        if cache is not None and new_len < cache.read_only_tokens(seq):  # recompute into private pages
            cache.forget(seq)
        elif old - new_len <= self.pools.margin:
            self._tokens[seq] = kept
            self.pools.shrink(seq, new_len)
            return
        self._tokens[seq] = []
        self.pools.shrink(seq, 0)
        chunk = 512
        for i in range(0, new_len, chunk):
            self.forward([seq], [kept[i : i + chunk]])

    def describe(self) -> dict:
        c = self.config
        return {
            "model": self.model_name,
            "model_path": self.model_path,
            "architecture": "DeepseekV4ForCausalLM",
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "parameters": self.model.num_parameters,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "layer_types": list(c.layer_types),
            "mlp_layer_types": list(c.mlp_layer_types),
            "compress_rates": dict(c.compress_rates),
            "sliding_window": c.sliding_window,
            "index_topk": c.index_topk,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_id,
            "max_seq_len": self.max_seq_len,
            "live_sequences": len(self._tokens),
            "pools": self.pools.describe(),
            "prefix_cache": self.prefix_cache.describe() if self.prefix_cache is not None else {"enabled": False},
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }
