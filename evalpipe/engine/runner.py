"""ModelRunner: the engine's model half. Owns the weights and the state pools; a sequence is a slot with pages and
a length. One `forward` appends any number of tokens to any number of sequences in a single batched model pass.

With `prefix_cache=True` (the server's default) full pages are shared through engine/prefix_cache.py:
`attach_prefix` starts a fresh sequence from the longest cached page chain of its prompt, `cache_prefix` indexes
the full pages of tokens that are final (prompt chunks as they are prefilled), and `free` indexes every full page
before letting go. Leading pages that are indexed or shared are never written again: a truncation below them
re-prefills (copy-on-write by recomputation).

`sites` (engine/model/fused_sites.py) is the model's fused-site setting, fixed at construction: the server builds
with SiteSettings (engine/build.py), a bare runner's None keeps the plain CSA selection."""

from __future__ import annotations

import os

import torch

from evalpipe.engine.cache import PoolExhausted, StatePools
from evalpipe.engine.forward_batch import ForwardBatch
from evalpipe.engine.model.config import load_config
from evalpipe.engine.model.deepseek_v4 import DeepseekV4Model
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.model.weights import load_state_dict, resolve_model
from evalpipe.engine.prefix_cache import ROOT, PrefixCache

__all__ = ["ModelRunner", "PoolExhausted"]


class ModelRunner:
    def __init__(self, model_path: str | None = None, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_seqs: int = 64, max_seq_len: int = 4096, rollback_margin: int = 32,
                 num_pages: int | None = None, sites: SiteSettings | None = None, prefix_cache: bool = False,
                 page_tokens: int | None = None):
        path, self.model_name = resolve_model(model_path)  # None: the default (trained) model
        self.model_path = str(path)
        self.config = load_config(path)
        self.device, self.dtype = torch.device(device), dtype
        self.max_seq_len, self.max_seqs = int(max_seq_len), int(max_seqs)
        self.model = DeepseekV4Model(self.config, load_state_dict(path), dtype=dtype, device=self.device,
                                     max_positions=self.max_seq_len, sites=sites)
        self.fused_sites = sites.describe(self.model) if sites is not None else None  # /get_server_info
        self.pools = StatePools(self.config, max_seqs=self.max_seqs, max_seq_len=self.max_seq_len,
                                device=self.device, dtype=dtype, rollback_margin=rollback_margin,
                                num_pages=num_pages, page_tokens=page_tokens, prefix_tails=prefix_cache)
        self.prefix = PrefixCache(self.pools) if prefix_cache else None
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self._tokens: dict[int, list[int]] = {}  # per live slot: every appended token (for deep rollbacks)
        # per live slot, prefix cache: (leading pages indexed or shared, i.e. read-only; chain node of the last one)
        self._frozen: dict[int, tuple[int, int]] = {}

    # ---- slots -----------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free_slots:
            raise PoolExhausted(f"all {self.max_seqs} sequence slots are in use")
        seq = self._free_slots.pop()
        self._tokens[seq] = []
        self._frozen[seq] = (0, ROOT)
        return seq

    def free(self, seq: int) -> None:
        self._check(seq)
        self.cache_prefix(seq, len(self._tokens[seq]))  # everything it computed is final now
        self.pools.shrink(seq, 0)
        del self._tokens[seq]
        del self._frozen[seq]
        self._free_slots.append(seq)

    # ---- prefix cache ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def attach_prefix(self, seq: int, tokens: list[int]) -> int:
        """Start the empty sequence `seq` from the longest cached prefix of `tokens` (at most len - 1 tokens, so the
        last prompt row is always computed); returns how many tokens it now holds (0: no hit or cache off)."""
        self._check(seq)
        if self.prefix is None or self._tokens[seq]:
            return 0
        pages, node = self.prefix.match(tokens, len(tokens) - 1)
        if not pages:
            return 0
        length = len(pages) * self.pools.page_tokens
        self.pools.share(seq, pages)
        self.pools.restore_rings(seq, length)
        self._tokens[seq] = list(tokens[:length])
        self._frozen[seq] = (len(pages), node)
        return length

    def cache_prefix(self, seq: int, upto: int) -> None:
        """Index the full pages of the first `upto` tokens of `seq`: the caller vouches they are final (prompt
        tokens, or everything at free). They become read-only for `seq`."""
        if self.prefix is None:
            return
        done, node = self._frozen[seq]
        tokens = self._tokens[seq][:upto]
        self._frozen[seq] = self.prefix.insert(tokens, self.pools.seq_pages.get(seq, []), done, node)

    def flush_prefix_cache(self) -> dict:
        """Forget every cached page (idle pages are freed at once); live sequences keep what they hold."""
        if self.prefix is None:
            return {"enabled": False, "flushed_pages": 0}
        return {"enabled": True, "flushed_pages": self.prefix.flush()}

    def prefix_cache_info(self) -> dict:
        return self.prefix.describe() if self.prefix is not None else {"enabled": False}

    def seq_len(self, seq: int) -> int:
        self._check(seq)
        return len(self._tokens[seq])

    def tokens(self, seq: int) -> list[int]:
        self._check(seq)
        return list(self._tokens[seq])

    def _check(self, seq: int) -> None:
        if seq not in self._tokens:
            raise KeyError(f"sequence {seq} is not allocated")

    # ---- model -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list[int], tokens: list[list[int]], *, all_logits: bool = False) -> torch.Tensor:
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError("forward needs one non-empty token list per sequence")
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence may appear only once per forward")
        starts, counts = [], []
        vocab = self.config.vocab_size
        for seq, toks in zip(seqs, tokens):
            self._check(seq)
            if not toks:
                raise ValueError(f"sequence {seq}: empty token list")
            if any(not 0 <= t < vocab for t in toks):
                raise ValueError(f"sequence {seq}: token id out of range [0, {vocab})")
            start = len(self._tokens[seq])
            if start + len(toks) > self.max_seq_len:
                raise ValueError(f"sequence {seq}: length {start + len(toks)} exceeds max_seq_len {self.max_seq_len}")
            starts.append(start)
            counts.append(len(toks))
        self.pools.reserve({seq: s + c for seq, s, c in zip(seqs, starts, counts)})
        for seq, s, c in zip(seqs, starts, counts):
            self.pools.tails_before(seq, s, s + c)  # the model writes the tails of this forward's rows
        flat = [t for toks in tokens for t in toks]
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        batch = ForwardBatch(self.pools, seqs, starts, counts, input_ids)
        rows = torch.arange(batch.num_rows, device=self.device) if all_logits else batch.last_rows
        logits = self.model.forward(batch, self.pools, rows)
        for seq, toks in zip(seqs, tokens):
            self._tokens[seq].extend(int(t) for t in toks)
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
        frozen_tokens = self._frozen[seq][0] * self.pools.page_tokens
        if new_len < frozen_tokens:  # shared pages are read-only: recompute into private pages
            self._frozen[seq] = (0, ROOT)
        elif old - new_len <= self.pools.margin:
            self._tokens[seq] = kept
            self.pools.shrink(seq, new_len)
            return
        self._tokens[seq] = []
        self.pools.shrink(seq, 0)
        chunk = 512
        for i in range(0, new_len, chunk):
            self.forward([seq], [kept[i:i + chunk]])

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
            "prefix_cache": self.prefix_cache_info(),
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }
