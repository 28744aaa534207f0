"""The prompt path: with `--deterministic`, is every number a prompt token computes the same (bitwise)
whether the prompt is (a) prefilled alone in one chunk, (b) prefilled in chunks packed beside other prompts' chunks,
or (c) prefilled after a prefix-cache hit (only the suffix computed, over cached pages)? Layer by layer, the first
layer and op where a case differs from (a).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python -m benchmarks.engine.prefill_invariance_gpu --data-dir DIR \
        [--prompts 3] [--chunk 700]

In process, on `benchmarks/serving/gpu_serving.py`'s v4-top2 (random bf16 weights, written once), one eager
ModelRunner as the server builds it with `--deterministic` (`evalpipe.engine.build.site_settings`; prefix cache on).
Prompts: the gsm8k lane's five-shot prompts (shared few-shot prefix, so (c) hits the cache). For each prompt:
- (a) `forward([seq], [prompt])`, and once more ("repeat": run-to-run determinism, the baseline);
- (b) the prompt in `--chunk`-row chunks, each in one forward beside two filler requests: one feeding as many rows
  from a later position (same group: a larger entry count E) and one feeding 7 rows more (its own group);
- (c) the previous prompt (or, for the first, the prompt itself) prefilled and freed, so its full pages are indexed;
  then `prefix_cache.attach` and the suffix in one forward.
Compared per prompt position: each decoder layer's attention output and MoE output (the block outputs the hyper
connections mix), the logits of every row; after the prompt, per layer: the compressed entries (compressor and
indexer) and the sliding-window ring rows a next token reads (the last window - 1 positions). In (c) the rows before
the hit are not computed; its entries include the cached ones. Ops are listed in causal order (per layer: entries,
indexer entries, window ring, attention, MoE; then the logits). The table: per case, the first (layer, op) that
differs, at which position (row index for the state), how many rows differ there, and the largest difference.
Every comparison also goes to `OUT/prefill_invariance.json`. `--smoke`: CPU, the tiny config, float32, random
prompts with a shared prefix (a dry run: the CPU runs the PyTorch references, whose GEMMs vary with the row count,
so differences there say nothing about the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.serving import gpu_real_job
from benchmarks.serving.deterministic_gpu import gsm8k_prompts
from evalpipe.engine.build import site_settings
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CASES = ("repeat", "chunked", "cache_hit")
EXTRA = 7  # rows the second filler feeds beyond the target's chunk: a group of its own


class Recorder:
    """Rows of one target request taken from every layer's attention and MoE outputs during the forwards it is in.
    `expect(offset, start, count)` before each forward: its rows sit at flat rows offset.., positions start.."""

    def __init__(self, model):
        self.model, self.where = model, None
        self.rows: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
        index = {id(layer.mlp): i for i, layer in enumerate(model.layers)}
        for i, layer in enumerate(model.layers):
            layer.attn = _Tap(layer.attn, lambda out, i=i: self.take(i, "attention", out))
            layer.mlp = _Tap(layer.mlp, lambda out, i=i: self.take(i, "moe", out))
        original = model._eager_moe

        def eager_moe(moe, x, input_ids):  # the CUDA path calls the MoE kernels with the layer's MoE, not mlp()
            out = original(moe.inner, x, input_ids)
            self.take(index[id(moe.inner)], "moe", out)
            return out

        model._eager_moe = eager_moe

    def expect(self, offset: int, start: int, count: int) -> None:
        self.where = (offset, start, count)

    def take(self, layer: int, op: str, out: torch.Tensor) -> None:
        if self.where is None:
            return
        offset, start, count = self.where
        self.rows.setdefault((layer, op), []).append(
            (start, out.reshape(out.shape[0], -1)[offset : offset + count].clone())
        )

    def stacked(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        return {key: stack(pieces) for key, pieces in self.rows.items()}

    def reset(self) -> None:
        self.rows, self.where = {}, None


class _Tap:
    """A layer's attention or MoE object that hands its output to `record` (attributes are the wrapped one's)."""

    def __init__(self, inner, record):
        self.inner, self.record = inner, record

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.record(out)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def stack(pieces: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [R], rows [R, F]) from (first position, rows) pieces."""
    positions = torch.cat([torch.arange(start, start + rows.shape[0]) for start, rows in pieces])
    return positions, torch.cat([rows for _, rows in pieces])


def forward(runner: ModelRunner, rec: Recorder, seqs: list[int], tokens: list[list[int]], target: int):
    """One forward with every row's logits, recording the target's layer rows; (first position, its logits rows)."""
    i = seqs.index(target)
    offset = sum(len(t) for t in tokens[:i])
    start = runner.seq_len(target)
    rec.expect(offset, start, len(tokens[i]))
    logits = runner.forward(seqs, tokens, all_logits=True)
    rec.where = None
    return start, logits[offset : offset + len(tokens[i])]


def state_after(runner: ModelRunner, seq: int, length: int) -> dict[tuple[int, str], torch.Tensor]:
    """Per layer, the state a next token of `seq` reads: compressed entries (compressor, indexer) and the
    window-ring rows of its last window - 1 positions."""
    pools, out = runner.pools, {}
    slot = torch.tensor([seq], device=runner.device)
    keep = runner.config.sliding_window - 1
    positions = torch.arange(max(0, length - keep), length, device=runner.device)
    for i, pool in enumerate(pools.layers):
        out[(i, "window ring")] = pool.window[seq * pools.window_ring + positions % pools.window_ring].clone()
        for name, comp in (("entries", pool.compressor), ("indexer entries", pool.indexer)):
            if comp is not None:
                count = length // comp.ratio
                rows = pools.entry_rows(slot, torch.arange(count, device=runner.device)[None], comp.ratio)[0]
                out[(i, name)] = comp.entries[rows].clone()
    return out


def run_case(runner, rec, case: str, prompt: list[int], fillers: list[list[int]], donor: list[int], chunk: int):
    """(layer rows, logits rows, state, hit length) of the target prompt under one case."""
    rec.reset()
    runner.prefix_cache.flush()
    seq, logits, hit = runner.allocate(), [], 0
    try:
        if case in ("alone", "repeat"):
            logits.append(forward(runner, rec, [seq], [prompt], seq))
        elif case == "chunked":
            others = [runner.allocate() for _ in fillers]
            try:
                for s, f in zip(others, fillers):  # fillers start further on: a larger E in the shared group
                    runner.forward([s], [f[: len(prompt) // 8 + 1]])
                for lo in range(0, len(prompt), chunk):
                    piece = prompt[lo : lo + chunk]
                    at = [runner.seq_len(s) for s in others]
                    feed = [fillers[0][at[0] : at[0] + len(piece)], fillers[1][at[1] : at[1] + len(piece) + EXTRA]]
                    seqs = [others[0], seq, others[1]]
                    logits.append(forward(runner, rec, seqs, [feed[0], piece, feed[1]], seq))
            finally:
                for s in others:
                    runner.free(s)
        else:  # cache_hit: the donor's full pages are indexed when it is freed
            d = runner.allocate()
            runner.forward([d], [donor])
            runner.free(d)
            hit = runner.prefix_cache.attach(seq, prompt)
            logits.append(forward(runner, rec, [seq], [prompt[hit:]], seq))
        return rec.stacked(), stack(logits), state_after(runner, seq, len(prompt)), hit
    finally:
        runner.free(seq)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (NaN == NaN when the bits are equal, -0 != +0)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints)


def diff_rows(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor] | None) -> dict | None:
    """The rows of b (positions, rows) against a's rows at the same positions (a holds every position in order)."""
    if b is None or not b[0].numel():
        return None
    return diff_tensors(a[1][b[0].to(a[1].device)], b[1], b[0].tolist())


def diff_tensors(x: torch.Tensor, y: torch.Tensor, positions: list[int] | None = None) -> dict:
    differ = (bits(x) != bits(y)).reshape(x.shape[0], -1).any(dim=1) if x.numel() else torch.zeros(0, dtype=torch.bool)
    where = differ.nonzero().flatten().tolist()
    first = (positions[where[0]] if positions else where[0]) if where else None
    delta = (x.float() - y.float()).abs()
    return {
        "rows": x.shape[0],
        "differ": len(where),
        "first": first,
        "max_abs": float(delta[torch.isfinite(delta)].max()) if where and torch.isfinite(delta).any() else 0.0,
    }


ORDER = ("entries", "indexer entries", "window ring", "attention", "moe")  # within a layer, in causal order


def compare(base, other) -> list[dict]:
    """How `other` differs from `base`, per layer in causal order (the compressed entries a layer's attention reads,
    its window ring, its attention output, its MoE output), then the logits."""
    layers_a, logits_a, state_a, _ = base
    layers_b, logits_b, state_b, _ = other
    out = []
    for key in sorted(set(layers_a) | set(state_a), key=lambda k: (k[0], ORDER.index(k[1]))):
        if key in state_a:
            out.append(
                {"layer": key[0], "op": key[1] + " (after the prompt)", **diff_tensors(state_a[key], state_b[key])}
            )
        else:
            res = diff_rows(layers_a[key], layers_b.get(key))
            if res is not None:
                out.append({"layer": key[0], "op": key[1], **res})
    res = diff_rows(logits_a, logits_b)
    if res is not None:
        out.append({"layer": "head", "op": "logits", **res})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "prefill-invariance"), help="folder for the JSON report")
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("EVALPIPE_DATA_DIR", str(REPO.parent / "shared" / "data")),
        help="folder holding gsm8k/test.jsonl",
    )
    ap.add_argument("--prompts", type=int, default=3, help="GSM8K prompts compared (each against all three cases)")
    ap.add_argument("--chunk", type=int, default=700, help="rows per prompt chunk in case (b)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny config, float32, 2 random 200-token prompts")
    args = ap.parse_args()
    if args.prompts < 1 or args.chunk < 1:
        print("prefill_invariance_gpu: --prompts and --chunk must be >= 1", file=sys.stderr)
        return 2
    placed = gpu_real_job.place("prefill_invariance_gpu", args.smoke)
    if placed is None:
        return 2
    device, dtype = placed
    if args.smoke:
        args.prompts, args.chunk = 2, 70
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    model_dir = Path(tempfile.mkdtemp(prefix="v4-top2-")) / "model"
    params = gpu_real_job.write_checkpoint(model_dir, args.smoke)
    tokenizer = load_tokenizer(None)
    if args.smoke:
        gen = torch.Generator().manual_seed(0)
        shared = torch.randint(2, 250, (150,), generator=gen).tolist()
        prompts = [shared + torch.randint(2, 250, (50 + 9 * i,), generator=gen).tolist() for i in range(3)]
    else:
        prompts = gsm8k_prompts(args.data_dir, args.prompts + 1, tokenizer)
    longest = max(len(p) for p in prompts)
    # longer than any target (the shared group's E is the filler's): an eighth ahead, then every chunk's rows (+ EXTRA)
    need = longest // 8 + 1 + longest + EXTRA * -(-longest // args.chunk)
    fillers = [(p * (need // len(p) + 1))[:need] for p in prompts[-1:] * 2]
    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype, deterministic=True)
    runner = ModelRunner(
        config.model,
        device=device,
        dtype=getattr(torch, dtype),
        max_seqs=4,
        max_seq_len=max(len(f) for f in fillers) + 64,
        sites=site_settings(config),
        prefix_cache=True,
    )
    log(f"checkpoint {params / 1e9:.3f} B parameters; {len(prompts) - 1} prompts of {longest} tokens at most")
    rec = Recorder(runner.model)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "argv": sys.argv}
    report["prompts"] = []
    for k, prompt in enumerate(prompts[: args.prompts]):
        donor = prompts[k - 1] if k else prompt
        base = run_case(runner, rec, "alone", prompt, fillers, donor, args.chunk)
        entry = {"tokens": len(prompt)}
        for case in CASES:
            t0 = time.perf_counter()
            res = run_case(runner, rec, case, prompt, fillers, donor, args.chunk)
            entry[case] = {"hit": res[3], "ops": compare(base, res)}
            log(f"prompt {k} ({len(prompt)} tokens) {case}: {time.perf_counter() - t0:.1f}s, cache hit {res[3]}")
        report["prompts"].append(entry)
    (out / "prefill_invariance.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print("\n| prompt | case | cache hit | ops differing | first differing layer/op | at position | rows | max abs |")
    print("|---|---|---|---|---|---|---|---|")
    for k, entry in enumerate(report["prompts"]):
        for case in CASES:
            ops = entry[case]["ops"]
            bad = [o for o in ops if o["differ"]]
            first = bad[0] if bad else None
            where = f"{first['layer']} {first['op']}" if first else "none: bitwise equal"
            at = first["first"] if first else "-"
            rows = f"{first['differ']}/{first['rows']}" if first else "-"
            big = f"{first['max_abs']:.3g}" if first else "-"
            print(f"| {k} | {case} | {entry[case]['hit']} | {len(bad)}/{len(ops)} | {where} | {at} | {rows} | {big} |")


if __name__ == "__main__":
    sys.exit(main())
