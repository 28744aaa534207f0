"""GPU check and benchmark of the fused verify stack: run once on an NVIDIA H200.

    python -m benchmarks.kernels.kernels_gpu                      # all five ops
    python -m benchmarks.kernels.kernels_gpu --ops indexer,q_rope # a subset
    python -m benchmarks.kernels.kernels_gpu --smoke               # no GPU: four ops at tiny shapes (interpreter)

For each op, in this one run: compile the Triton kernels for real; run the correctness checks of
docs/kernels.md at production shapes against the PyTorch references (exact equality); capture the fused op in a
CUDA graph and replay it with changed inputs; time fused vs the unfused reference chain (both CUDA-graph replayed,
median over many replays) and against the memory-bandwidth floor (bytes moved / measured copy bandwidth).
Prints every check, then one table: op, shape, fused us, unfused us, speedup, % of bandwidth floor, target.
Each op section runs in its own try/except, so one failure still prints the rest; exit status 1 if anything failed.

Adding an op: write `section_<name>(bench: Bench)` using `bench.check(...)`, `bench.graph_replay_check(...)` and
`bench.time_pair(...)`, and register it in SECTIONS. The slots for ops 4 (mxfp8) and 5 (ratio2_compress_verify) are at
the end."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

# q_rope_store prefill check: 65536 tokens make the padded [T, 64, 512] bf16 buffer 4 GiB (> 2 GiB: int64 offsets)
PREFILL_TOKENS = 65536

# --------------------------------------------------------------------------------------------- shared machinery


@dataclass
class TimingRow:
    op: str
    shape: str
    fused_us: float
    unfused_us: float
    floor_us: float
    target: str = ""

    @property
    def speedup(self) -> float:
        return self.unfused_us / self.fused_us if self.fused_us > 0 else float("nan")


@dataclass
class Bench:
    """Shared helpers: exact-check bookkeeping, CUDA-graph capture, graph-replayed timing, bandwidth floor."""

    device: torch.device
    replays: int
    inner: int
    copy_bytes_per_s: float = 0.0
    checks: list[tuple[str, str, bool, str]] = field(default_factory=list)
    rows: list[TimingRow] = field(default_factory=list)
    section_errors: list[tuple[str, str]] = field(default_factory=list)
    current_op: str = ""
    cuda: bool = True  # False (--smoke on the CPU): calls timed with the wall clock, nothing captured

    # -- correctness ------------------------------------------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((self.current_op, name, bool(ok), detail))
        mark = "ok  " if ok else "FAIL"
        print(f"  [{mark}] {self.current_op}: {name}{(' -- ' + detail) if detail else ''}", flush=True)
        return bool(ok)

    @staticmethod
    def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm up (compiles Triton) on a side stream, then capture one call; returns (graph, static outputs)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        torch.cuda.synchronize()
        return graph, out

    def graph_replay_check(
        self,
        name: str,
        fused: Callable[[], object],
        mutate: Callable[[int], None],
        expect: Callable[[], object],
        equal: Callable[[object, object], bool],
        rounds: int = 3,
    ) -> bool:
        """Capture `fused` once; `rounds` times: mutate the static inputs in place, replay, compare with `expect()`."""
        graph, out = self.capture(fused)
        ok = True
        for i in range(rounds):
            mutate(i)
            graph.replay()
            torch.cuda.synchronize()
            ok &= bool(equal(out, expect()))
        return self.check(f"graph replay x{rounds} with changed inputs: {name}", ok)

    # -- timing -----------------------------------------------------------------------------------------------
    def graph_time_us(self, fn: Callable[[], object]) -> float:
        """Median over `replays` of one graph replay holding `inner` back-to-back calls, per call, in us."""
        if not self.cuda:
            per_call_s = []
            for _ in range(self.replays):
                t = time.perf_counter()
                for _ in range(self.inner):
                    fn()
                per_call_s.append((time.perf_counter() - t) / self.inner)
            return statistics.median(per_call_s) * 1e6
        graph, _ = self.capture(lambda: [fn() for _ in range(self.inner)])
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.replays)]
        for s, e in zip(starts, ends):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        per_call_ms = [s.elapsed_time(e) / self.inner for s, e in zip(starts, ends)]
        del graph
        return statistics.median(per_call_ms) * 1000.0

    def measure_copy_bandwidth(self, nbytes: int = 1 << 30) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        saved = self.inner
        self.inner = 5
        us = self.graph_time_us(lambda: dst.copy_(src))
        self.inner = saved
        self.copy_bytes_per_s = 2 * nbytes / (us * 1e-6)
        src = dst = None  # free both buffers before empty_cache (the lambda above holds the names)
        if self.cuda:
            torch.cuda.empty_cache()
        return self.copy_bytes_per_s

    def time_pair(
        self, shape: str, fused: Callable, unfused: Callable, bytes_moved: int, target: str = ""
    ) -> TimingRow:
        fused_us = self.graph_time_us(fused)
        unfused_us = self.graph_time_us(unfused)
        floor_us = bytes_moved / self.copy_bytes_per_s * 1e6
        row = TimingRow(self.current_op, shape, fused_us, unfused_us, floor_us, target)
        self.rows.append(row)
        print(
            f"  [time] {self.current_op} {shape}: fused {fused_us:.2f} us, unfused {unfused_us:.2f} us, "
            f"x{row.speedup:.2f}, floor {floor_us:.2f} us",
            flush=True,
        )
        if self.cuda:
            torch.cuda.empty_cache()
        return row


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of the stored bits (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0))
        and torch.equal(a.isinf() & (a > 0), b.isinf() & (b > 0))
        and torch.equal(a.isinf() & (a < 0), b.isinf() & (b < 0))
    )


def pair_equal(a, b) -> bool:
    """(tensor, tensor-or-None) results compared exactly (floats with equal_nan)."""
    for x, y in zip(a, b):
        if x is None or y is None:
            if not (x is None and y is None):
                return False
        elif x.dtype.is_floating_point:
            if not equal_nan(x, y):
                return False
        elif not torch.equal(x, y):
            return False
    return True


# ---------------------------------------------------------------------------------- op 1: indexer_postprocess


def _indexer_inputs(rows, width, k, index_dtype, page_size, gen, device):
    """Row-strided scores/indices/page table (views of wider buffers) with the PR's special scores."""
    scores = torch.randn(rows, width + 64, generator=gen, device=device)[:, 16 : 16 + width]
    if width:
        scores[0, 0] = float("-inf")
        if rows > 1:
            scores[1, 0] = float("nan")
        if rows > 2:
            scores[2, 0] = float("inf")
        if rows > 3:
            scores[3] = float("-inf")
    indices = torch.randint(-2, width + 2, (rows, k + 8), generator=gen, device=device).to(index_dtype)[:, 4 : 4 + k]
    indices[:, :5] = 0
    pages = math.ceil(width / page_size)
    table = torch.randint(0, 1 << 20, (rows, pages + 4), generator=gen, device=device, dtype=torch.int32)
    return scores, indices, table[:, 2 : 2 + pages]


def section_indexer(bench: Bench) -> None:
    from evalpipe.kernels.candidate_block_mask import candidate_block_mask
    from evalpipe.kernels.indexer_postprocess import indexer_postprocess, indexer_postprocess_reference

    dev, ps, k = bench.device, 64, 512
    gen = torch.Generator(device=dev).manual_seed(0)
    ok = True
    for rows in (1, 2, 6, 64, 384):
        for width in (1, 65, 4096, 16384):
            for index_dtype in (torch.int32, torch.int64):
                scores, indices, table = _indexer_inputs(rows, width, k, index_dtype, ps, gen, dev)
                for raw in (False, True):
                    got = indexer_postprocess(scores, indices, table, ps, return_raw=raw, backend="triton")
                    want = indexer_postprocess_reference(scores, indices, table, ps, return_raw=raw)
                    ok &= pair_equal(got, want)
    bench.check("R {1,2,6,64,384} x W {1,65,4096,16384} x int32/int64 x raw on/off, exact", ok)

    # graph replay: R = 6, W = 4096; mutate scores (first 32 cols -inf), indices in [-1, W), pages
    scores, indices, table = _indexer_inputs(6, 4096, k, torch.int32, ps, gen, dev)

    def mutate(i):
        scores.copy_(torch.randn(scores.shape, generator=gen, device=dev))
        scores[:, :32] = float("-inf")
        indices.copy_(torch.randint(-1, 4096, indices.shape, generator=gen, device=dev).to(indices.dtype))
        table.copy_(torch.randint(0, 1 << 20, table.shape, generator=gen, device=dev, dtype=torch.int32))

    bench.graph_replay_check(
        "R=6 W=4096",
        lambda: indexer_postprocess(scores, indices, table, ps, return_raw=True, backend="triton"),
        mutate,
        lambda: indexer_postprocess_reference(scores, indices, table, ps, return_raw=True),
        pair_equal,
    )

    # 384 rows (64 requests x 6 verify rows): candidate-masked top-k + filter == plain top-k as a multiset
    width, rows = 16384, 384
    base = torch.tensor([0, 506, 4096, 16378], device=dev).repeat(16)  # 64 requests; the last ends at 16384
    lens = (base[:, None] + torch.arange(1, 7, device=dev)[None, :]).reshape(-1).clamp(max=width).to(torch.int32)
    logits = torch.randn(rows, width, generator=gen, device=dev)
    logits[torch.arange(width, device=dev)[None, :] >= lens[:, None].long()] = 1e6  # unread positions: must not win
    _, keep = candidate_block_mask(logits, lens, 2048, 8, backend="triton")  # source layer publishes
    restricted, _ = candidate_block_mask(logits, lens, 2048, 8, keep, backend="triton")  # consumer layer
    top = torch.topk(restricted, k, dim=1, sorted=False).indices.to(torch.int32)
    table = torch.arange(width // ps, device=dev, dtype=torch.int32).repeat(rows, 1)
    _, raw = indexer_postprocess(restricted, top, table, ps, return_raw=True, backend="triton")
    multiset_ok = True
    for r in range(rows):
        n = int(lens[r])
        want = torch.topk(logits[r, :n], min(k, n)).indices.sort().values
        got = raw[r][raw[r] >= 0].long().sort().values
        multiset_ok &= torch.equal(got, want)
    bench.check(
        "384 rows, lens {0,506,4096,16378}+1..6: candidate-masked top-k + filter == plain top-k (multiset)", multiset_ok
    )

    for rows, width in [(2, 4096), (6, 16384), (48, 16384), (384, 16384)]:
        scores, indices, table = _indexer_inputs(rows, width, k, torch.int32, ps, gen, dev)
        indices.clamp_(0, width - 1)
        moved = rows * k * (4 + 4 + 4 + 4 + 4)  # index read, score + page gathers, page + raw writes
        bench.time_pair(
            f"R={rows} W={width} K={k} raw",
            lambda: indexer_postprocess(scores, indices, table, ps, return_raw=True, backend="triton"),
            lambda: indexer_postprocess_reference(scores, indices, table, ps, return_raw=True),
            moved,
            target=">=2x",
        )


# --------------------------------------------------------------------------------- op 2: candidate_block_mask


def _candidate_inputs(rows, width, gen, device):
    logits = torch.randn(rows, width + 32, generator=gen, device=device)[:, 8 : 8 + width]
    pattern = [0, 1, width // 2, width - 1, width, width]
    lens = torch.tensor([pattern[i % 6] for i in range(rows)], dtype=torch.int32, device=device)
    if rows >= 6:
        logits[3] = 0.0
        logits[4, 0] = float("nan")
        logits[5] = float("-inf")
    return logits, lens


def section_candidate(bench: Bench) -> None:
    from evalpipe.kernels.candidate_block_mask import candidate_block_mask, candidate_block_mask_reference

    dev = bench.device
    gen = torch.Generator(device=dev).manual_seed(1)
    bad = []
    matrix = [(65, 32, 8), (4096, 128, 8), (32768, 2048, 8), (1048576, 2048, 8), (4096, 8, 2048), (1048576, 8, 2048)]
    for width, group, topk in matrix:
        logits, lens = _candidate_inputs(6, width, gen, dev)
        for lens_t in (lens, lens.long()):
            got = candidate_block_mask(logits, lens_t, topk, group, backend="triton")
            want = candidate_block_mask_reference(logits, lens_t, topk, group)
            if not pair_equal(got, want):
                rows = [r for r in range(6) if not pair_equal((got[0][r], got[1][r]), (want[0][r], want[1][r]))]
                bad.append(f"source W={width} G={group} top{topk} {lens_t.dtype} rows {rows}")
            pub = want[1]
            if not pair_equal(
                candidate_block_mask(logits, lens_t, topk, group, pub, backend="triton"),
                candidate_block_mask_reference(logits, lens_t, topk, group, pub),
            ):
                bad.append(f"consumer W={width} G={group}")
    bench.check(
        "PR matrix (W,G,topk) incl. W=1,048,576, source + consumer, int32/int64 lens, equal_nan",
        not bad,
        "; ".join(bad) + (" (row 3 = all-equal ties)" if bad else ""),
    )

    logits, lens = _candidate_inputs(48, 131072, gen, dev)

    def mutate(i):
        logits.copy_(torch.randn(logits.shape, generator=gen, device=dev))
        logits[i, :100] = float("nan")
        lens.copy_(torch.randint(0, 131073, lens.shape, generator=gen, device=dev).to(torch.int32))

    bench.graph_replay_check(
        "source R=48 W=131072 G=8 topk=2048",
        lambda: candidate_block_mask(logits, lens, 2048, 8, backend="triton"),
        mutate,
        lambda: candidate_block_mask_reference(logits, lens, 2048, 8),
        pair_equal,
    )
    published = torch.rand(logits.shape, generator=gen, device=dev) < 0.3

    def mutate_consumer(i):
        mutate(i)
        published.copy_(torch.rand(logits.shape, generator=gen, device=dev) < 0.3)

    bench.graph_replay_check(
        "consumer R=48 W=131072",
        lambda: candidate_block_mask(logits, lens, 2048, 8, published, backend="triton"),
        mutate_consumer,
        lambda: candidate_block_mask_reference(logits, lens, 2048, 8, published),
        pair_equal,
    )

    for rows, width in [(6, 16384), (384, 16384), (6, 131072), (6, 1048576), (48, 131072)]:
        logits, lens = _candidate_inputs(rows, width, gen, dev)
        nb = width // 8
        moved = rows * width * (4 + 4 + 1) + rows * nb * 4 * 2  # logits in, masked + keep out, block scores
        bench.time_pair(
            f"source R={rows} W={width} G=8 top2048",
            lambda: candidate_block_mask(logits, lens, 2048, 8, backend="triton"),
            lambda: candidate_block_mask_reference(logits, lens, 2048, 8),
            moved,
            target=">=2x",
        )
    for rows, width in [(6, 131072), (48, 131072)]:
        logits, lens = _candidate_inputs(rows, width, gen, dev)
        published = torch.rand(logits.shape, generator=gen, device=dev) < 0.3
        bench.time_pair(
            f"consumer R={rows} W={width}",
            lambda: candidate_block_mask(logits, lens, 2048, 8, published, backend="triton"),
            lambda: candidate_block_mask_reference(logits, lens, 2048, 8, published),
            rows * width * (4 + 1 + 4),
            target=">=2x",
        )


# --------------------------------------------------------------------------------------- op 3: q_rope_store


def _rope_tables(max_pos, rope_dim, device, theta=160000.0):
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64, device=device), inv)
    return angles.cos().float().contiguous(), angles.sin().float().contiguous()


def section_q_rope(bench: Bench) -> None:
    from evalpipe.kernels.q_rope_store import q_rope_store, q_rope_store_reference
    from evalpipe.kernels.rope import apply_interleaved_rope

    dev, dim, padded, poison = bench.device, 512, 64, 7.0
    gen = torch.Generator(device=dev).manual_seed(2)
    cos, sin = _rope_tables(65536 + 8, 64, dev)

    def q_slice(tokens, heads):
        wide = (torch.randn(tokens, heads + 1, dim, generator=gen, device=dev) * 4).to(torch.bfloat16)
        return wide[:, :heads]  # a [T, H+1, 512] slice

    ok = True
    for tokens in (1, 2, 5, 6, 8):
        for heads in (8, 16, 32):
            for pos_dtype in (torch.int32, torch.int64):
                q = q_slice(tokens, heads)
                before = q.clone()
                pos = torch.randint(0, 65536, (tokens,), generator=gen, device=dev).to(pos_dtype)
                out = torch.full((tokens, padded, dim), poison, dtype=torch.bfloat16, device=dev)
                ref = torch.full_like(out, poison)
                q_rope_store(q, out[:, :heads], cos, sin, pos, backend="triton")
                q_rope_store_reference(q, ref[:, :heads], cos, sin, pos)
                engine = apply_interleaved_rope(q, cos[pos.long()].unsqueeze(1), sin[pos.long()].unsqueeze(1))
                ok &= bitwise_equal(out, ref) and bitwise_equal(out[:, :heads], engine)
                ok &= bitwise_equal(q, before) and bool((out[:, heads:] == poison).all())
    bench.check(
        "T {1,2,5,6,8} x H {8,16,32} x int32/int64: bitwise == engine RoPE + copy, q unchanged, pad heads 7.0", ok
    )

    try:  # the model's own RoPE (per-dim tables) must give the same bits on the GPU too (FMA contraction would not)
        from evalpipe.engine.model.primitives import apply_rope

        cos_full, sin_full = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        engine_ok = True
        for tokens in (6, 48, 384):
            q = q_slice(tokens, 16)
            pos = torch.randint(0, 65536, (tokens,), generator=gen, device=dev)
            out = torch.empty_like(q)
            q_rope_store(q, out, cos, sin, pos, backend="triton")
            engine_ok &= bitwise_equal(out, apply_rope(q, cos_full[pos], sin_full[pos]))
        bench.check("T {6,48,384} H=16: bitwise == evalpipe.engine.model.primitives.apply_rope", engine_ok)
    except ImportError as exc:
        bench.check(
            "bitwise == evalpipe.engine.model.primitives.apply_rope", False, f"engine RoPE not importable: {exc}"
        )

    # prefill size whose padded buffer exceeds 2 GiB (int64 offsets): T = PREFILL_TOKENS, H = 16
    tokens = PREFILL_TOKENS
    q = q_slice(tokens, 16)
    pos = torch.arange(tokens, device=dev)
    out = torch.full((tokens, padded, dim), poison, dtype=torch.bfloat16, device=dev)
    q_rope_store(q, out[:, :16], cos, sin, pos, backend="triton")
    ref = torch.empty_like(q)
    q_rope_store_reference(q, ref, cos, sin, pos)
    big_ok = bitwise_equal(out[:, :16], ref) and bool((out[-1, 16:] == poison).all())
    bench.check(f"T={tokens} H=16 prefill into a {out.numel() * 2 / 2**30:.1f} GiB buffer, bitwise", big_ok)
    del q, out, ref
    torch.cuda.empty_cache()

    # graph replay: T = 6, H = 16, positions 4096..4101 then random each replay
    q = q_slice(6, 16)
    pos = torch.arange(4096, 4102, device=dev, dtype=torch.int32)
    out = torch.full((6, padded, dim), poison, dtype=torch.bfloat16, device=dev)

    def mutate(i):
        q.copy_((torch.randn(q.shape, generator=gen, device=dev) * 4).to(torch.bfloat16))
        if i:
            pos.copy_(torch.randint(0, 65536, (6,), generator=gen, device=dev, dtype=torch.int32))

    def expect():
        ref = torch.full_like(out, poison)
        q_rope_store_reference(q, ref[:, :16], cos, sin, pos)
        return ref

    def fused():
        q_rope_store(q, out[:, :16], cos, sin, pos, backend="triton")
        return out

    bench.graph_replay_check(
        "T=6 H=16",
        fused,
        mutate,
        expect,
        lambda got, want: bitwise_equal(out, want),
    )

    for tokens in (6, 48, 384, 4096):
        q = q_slice(tokens, 16)
        pos = torch.randint(0, 65536, (tokens,), generator=gen, device=dev)
        out = torch.zeros((tokens, padded, dim), dtype=torch.bfloat16, device=dev)
        moved = 2 * tokens * 16 * dim * 2 + tokens * 32 * 4 * 2
        bench.time_pair(
            f"T={tokens} H=16 D=512 rope=64 -> [T,64,512]",
            lambda: q_rope_store(q, out[:, :16], cos, sin, pos, backend="triton"),
            lambda: q_rope_store_reference(q, out[:, :16], cos, sin, pos),
            moved,
            target=">=2x",
        )


# ------------------------------------------------------------------------------------------------ op 4: mxfp8

MX_MAGNITUDES = (0.0, 1e-37, 1e-7, 1.0, 448.0, 1e10)
WO_A_SHAPE = (2, 1024, 4096)  # per-rank WO-A weight [G, R, Kg]
WO_B_SHAPES = [(5120, 2048), (1792, 5120), (5120, 576)]  # w_b [N, K]


def _mx_magnitude_rows(shape, gen, device):
    """Random values whose 32-groups cycle through MX_MAGNITUDES (rotated by row), last dim a multiple of 32."""
    x = torch.randn(*shape, generator=gen, device=device)
    rows, groups = shape[-2], shape[-1] // 32
    idx = torch.arange(groups, device=device)[None, :] + torch.arange(rows, device=device)[:, None]
    idx = idx % len(MX_MAGNITUDES)
    mags = torch.tensor(MX_MAGNITUDES, device=device)[idx].repeat_interleave(32, dim=1)
    return x * mags


def _mx_same_bytes(a, b) -> bool:
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scales, b.scales)


def section_mxfp8(bench: Bench) -> None:
    from evalpipe.kernels.mxfp8 import (
        Mxfp8Tensor,
        mxfp8_linear,
        mxfp8_linear_reference,
        mxfp8_quantize,
        mxfp8_quantize_reference,
        mxfp8_reduce_quantize,
        mxfp8_reduce_quantize_reference,
        reduce_partials_bf16,
        wo_a_mxfp8,
        wo_a_partials,
        wo_a_partials_reference,
    )

    dev = bench.device
    gen = torch.Generator(device=dev).manual_seed(4)
    g, r, kg = WO_A_SHAPE
    n = g * r

    ok = True
    for rows in (*range(1, 9), 130, 300):
        for dtype in (torch.float32, torch.bfloat16):
            y = _mx_magnitude_rows((rows, n), gen, dev).to(dtype)
            ok &= _mx_same_bytes(mxfp8_quantize(y, backend="triton"), mxfp8_quantize_reference(y))
    bench.check(f"mxfp8_quantize M 1..8,130,300 x N {n} x fp32/bf16, magnitudes {MX_MAGNITUDES}: bytes exact", ok)

    ok = True
    for rows in (*range(1, 9), 130):
        partials = _mx_magnitude_rows((8, rows, n), gen, dev)
        ok &= _mx_same_bytes(
            mxfp8_reduce_quantize(partials, backend="triton"), mxfp8_reduce_quantize_reference(partials)
        )
    bench.check("reduce(s=0..7)+bf16+quantize on partials of every magnitude, M 1..8,130: bytes exact", ok)

    weight = (torch.randn(g, r, kg, generator=gen, device=dev) / 64).to(torch.bfloat16)

    def attn_view(rows):  # x [M, 2, 4096]: heads 0..15 of a padded [M, 64, 512] attention output
        buf = torch.randn(rows, 64, 512, generator=gen, device=dev).to(torch.bfloat16)
        return buf[:, :16].view(rows, g, kg)

    exact, close, part_err, flips = True, True, 0.0, 0
    for rows in (*range(1, 9), 130):
        x = attn_view(rows)
        part = wo_a_partials(x, weight, backend="triton")
        ref_part = wo_a_partials_reference(x, weight)
        part_err = max(part_err, ((part - ref_part).abs() / (ref_part.abs() + 1e-3)).max().item())
        fused = wo_a_mxfp8(x, weight, backend="triton")
        exact &= _mx_same_bytes(fused, mxfp8_reduce_quantize_reference(part))
        ref = mxfp8_reduce_quantize_reference(ref_part)
        flips += int((fused.data.view(torch.uint8) != ref.data.view(torch.uint8)).sum())
        y = reduce_partials_bf16(ref_part).float()
        scale = torch.exp2(ref.scale_grid().float() - 127).repeat_interleave(32, dim=1)
        close &= bool(((fused.dequantize() - y).abs() <= y.abs() * 2.0**-3 + scale * 2.0**-9).all())
    bench.check(
        "wo_a_mxfp8 [2,1024,4096], x = view of [M,64,512], M 1..8,130: bytes == reference reduce+quantize "
        "of the kernel's partials",
        exact,
    )
    bench.check(
        "wo_a_mxfp8 vs all-reference chain: within one e4m3 step",
        close,
        f"partials max rel err {part_err:.2e}; {flips} e4m3 codes differ from the all-reference chain "
        "(bf16 ties after fp32 partials in another order)",
    )

    # single-launch variant (not the default yet: this run is its first on a GPU): same bytes, tickets reset
    ok = True
    for rows in (*range(1, 9), 16):
        x = attn_view(rows)
        for _ in range(2):
            ok &= _mx_same_bytes(
                wo_a_mxfp8(x, weight, backend="triton", single_launch=True), wo_a_mxfp8(x, weight, backend="triton")
            )
    bench.check("wo_a_mxfp8(single_launch=True) M 1..8,16 (twice each) == two-launch bytes", ok)

    ok, worst = True, 0.0
    for nb, kb in WO_B_SHAPES:
        w_b = (torch.randn(nb, kb, generator=gen, device=dev) / math.sqrt(kb)).to(torch.bfloat16)
        for rows in (1, 2, 8, 17, 300):
            a = mxfp8_quantize_reference(torch.randn(rows, kb, generator=gen, device=dev))
            got = mxfp8_linear(a, w_b, out_dtype=torch.float32, backend="triton")
            want = mxfp8_linear_reference(a, w_b, out_dtype=torch.float32)
            bound = kb * 2.0**-24 * (a.dequantize().abs() @ w_b.float().abs().t())
            ok &= bool(((got - want).abs() <= bound).all())
            worst = max(worst, ((got - want).abs() / (want.abs() + 1e-6)).max().item())
    bench.check(
        "mxfp8_linear (w_b [N,K] in (5120,2048),(1792,5120),(5120,576); M 1,2,8,17,300) == dequantized "
        "fp32 reference within the fp32 accumulation-order bound",
        ok,
        f"max rel err {worst:.2e}",
    )

    # graph replay: quantize + WO-A into persistent buffers whose scales are refilled with 255 before each replay
    rows = 8
    x = attn_view(rows)
    out = Mxfp8Tensor.empty(rows, n, device=dev)

    def mutate(i):
        x.copy_(torch.randn(x.shape, generator=gen, device=dev).to(torch.bfloat16) * (10.0**i))
        out.scales.fill_(255)
        out.data.view(torch.uint8).fill_(255)

    bench.graph_replay_check(
        "wo_a_mxfp8 M=8 into a 255-filled Mxfp8Tensor",
        lambda: wo_a_mxfp8(x, weight, out=out, backend="triton"),
        mutate,
        lambda: mxfp8_reduce_quantize_reference(wo_a_partials(x, weight, backend="triton")),
        lambda got, want: _mx_same_bytes(out, want),
    )
    bench.graph_replay_check(
        "wo_a_mxfp8(single_launch=True) M=8 into a 255-filled Mxfp8Tensor",
        lambda: wo_a_mxfp8(x, weight, out=out, backend="triton", single_launch=True),
        mutate,
        lambda: mxfp8_reduce_quantize_reference(wo_a_partials(x, weight, backend="triton")),
        lambda got, want: _mx_same_bytes(out, want),
    )
    y = torch.randn(rows, n, generator=gen, device=dev).to(torch.bfloat16)
    qout = Mxfp8Tensor.empty(rows, n, device=dev)

    def mutate_q(i):
        y.copy_(_mx_magnitude_rows((rows, n), gen, dev).to(torch.bfloat16))
        qout.scales.fill_(255)

    bench.graph_replay_check(
        "mxfp8_quantize M=8 N=2048 into a 255-filled Mxfp8Tensor",
        lambda: mxfp8_quantize(y, out=qout, backend="triton"),
        mutate_q,
        lambda: mxfp8_quantize_reference(y),
        lambda got, want: _mx_same_bytes(qout, want),
    )

    # timing. Unfused WO-A chain = what the model runs without the fusion: bf16 grouped bmm -> quantize (torch).
    for rows in (2, 4, 8):
        x = attn_view(rows)
        out = Mxfp8Tensor.empty(rows, n, device=dev)
        w_t = weight.transpose(1, 2)  # [G, Kg, R]

        def unfused(x=x):
            y = torch.bmm(x.transpose(0, 1), w_t).transpose(0, 1).reshape(x.shape[0], n)
            return mxfp8_quantize_reference(y)

        bench.time_pair(
            f"wo_a_mxfp8 M={rows} W[2,1024,4096]",
            lambda x=x, out=out: wo_a_mxfp8(x, weight, out=out, backend="triton"),
            unfused,
            weight.numel() * 2,
            target="<=1.5x floor",
        )
        bench.time_pair(
            f"wo_a_mxfp8 single_launch M={rows}",
            lambda x=x, out=out: wo_a_mxfp8(x, weight, out=out, backend="triton", single_launch=True),
            unfused,
            weight.numel() * 2,
            target="<=1.5x floor",
        )
    for rows in (8, 300):
        y = torch.randn(rows, n, generator=gen, device=dev).to(torch.bfloat16)
        out = Mxfp8Tensor.empty(rows, n, device=dev)
        bench.time_pair(
            f"mxfp8_quantize M={rows} N={n}",
            lambda y=y, out=out: mxfp8_quantize(y, out=out, backend="triton"),
            lambda y=y: mxfp8_quantize_reference(y),
            rows * n * 3 + out.scales.numel(),
            target=">=2x",
        )
    w_b = (torch.randn(5120, n, generator=gen, device=dev) / 45).to(torch.bfloat16)
    for rows in (2, 8):
        a = mxfp8_quantize_reference(torch.randn(rows, n, generator=gen, device=dev))
        bench.time_pair(
            f"mxfp8_linear M={rows} w_b[5120,2048]",
            lambda a=a: mxfp8_linear(a, w_b, backend="triton"),
            lambda a=a: mxfp8_linear_reference(a, w_b),
            w_b.numel() * 2,
            target=">=2x",
        )


# ----------------------------------------------------------------------------------------- op 5: ratio2_compress_verify

C2_HD, C2_ROPE, C2_PAGE, C2_D, C2_RING = 512, 64, 128, 6, 8  # kv|gate rows 1024 wide; ring 1 << (D+1).bit_length()


class _C2Layer:
    """One ratio-2 layer's weights, tables and persistent ring/pool for `slots` requests, seeded randomly."""

    def __init__(self, slots, gen, dev, max_pos=4096, kv_dtype=torch.float32):
        hd = C2_HD
        self.bias = torch.randn(2, hd, generator=gen, device=dev)
        self.norm_w = torch.rand(hd, generator=gen, device=dev) + 0.5
        self.cos, self.sin = _rope_tables(max_pos, C2_ROPE, dev)
        pages = max_pos // 2 // C2_PAGE
        self.page_table = torch.randperm(slots * pages + 5, generator=gen, device=dev)[: slots * pages]
        self.page_table = self.page_table.view(slots, pages).to(torch.int32)
        self.ring = torch.randn(slots * C2_RING, 2 * hd, generator=gen, device=dev).to(kv_dtype)
        self.pool = torch.randn((slots * pages + 5) * C2_PAGE, hd, generator=gen, device=dev).to(torch.bfloat16)

    def run(self, fn, kv_gate, positions, req, valid, d, ring=None, pool=None):
        fn(
            kv_gate,
            positions,
            req,
            valid,
            self.bias,
            self.norm_w,
            1e-6,
            self.cos,
            self.sin,
            C2_ROPE,
            self.ring if ring is None else ring,
            self.pool if pool is None else pool,
            self.page_table,
            C2_PAGE,
            C2_RING,
            d,
        )


def _c2_rows(batch, d, gen, dev, kv_dtype=torch.float32, pos_dtype=torch.int64, n_pad=0, max_start=4000):
    kv_gate = torch.randn(batch * d, 2 * C2_HD, generator=gen, device=dev).to(kv_dtype)
    starts = torch.randint(8, max_start, (batch,), generator=gen, device=dev)
    starts = starts - starts % 2 + torch.arange(batch, device=dev) % 2  # alternating head parity
    live = torch.arange(batch, device=dev) < batch - n_pad
    positions = torch.where(live[:, None], starts[:, None] + torch.arange(d, device=dev), 0).reshape(-1)
    req = torch.randperm(batch, generator=gen, device=dev).repeat_interleave(d)  # padding aliases live slots
    valid = live.repeat_interleave(d)
    return kv_gate, positions.to(pos_dtype), req.to(pos_dtype), valid


def _c2_pool_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Entries agree within 2^-7 of each entry row's largest magnitude (about one bf16 ulp of the row; a one-ulp
    change of a normed value can move a RoPE output that cancels to near zero by more than its own ulp)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= b.abs().amax(dim=1, keepdim=True) * 2.0**-7).all())


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def section_ratio2_compress_verify(bench: Bench) -> None:
    from evalpipe.kernels.ratio2_compress_verify import ratio2_compress_verify, ratio2_compress_verify_reference

    dev = bench.device
    gen = torch.Generator(device=dev).manual_seed(5)
    fused = lambda *a: ratio2_compress_verify(*a, backend="triton")  # noqa: E731
    d = C2_D

    ring_ok, single_ok, close_ok, worst_ulps, differing = True, True, True, 0, 0
    for batch in (1, 2, 3, 8, 32, 64, 128):
        for kv_dtype, pos_dtype in ((torch.float32, torch.int64), (torch.bfloat16, torch.int32)):
            layer = _C2Layer(batch, gen, dev, kv_dtype=kv_dtype)
            rows = _c2_rows(batch, d, gen, dev, kv_dtype, pos_dtype, n_pad=1 if batch > 2 else 0)
            f_ring, f_pool = layer.ring.clone(), layer.pool.clone()
            r_ring, r_pool = layer.ring.clone(), layer.pool.clone()
            s_ring, s_pool = layer.ring.clone(), layer.pool.clone()
            layer.run(fused, *rows, d, f_ring, f_pool)
            layer.run(ratio2_compress_verify_reference, *rows, d, r_ring, r_pool)
            for j in range(d):  # D single-row (decode) launches
                idx = torch.arange(j, batch * d, d, device=dev)
                layer.run(fused, *(t[idx] for t in rows), 1, s_ring, s_pool)
            ring_ok &= bitwise_equal(f_ring, r_ring)
            single_ok &= bitwise_equal(f_ring, s_ring) and bitwise_equal(f_pool, s_pool)
            close_ok &= _c2_pool_close(f_pool, r_pool)
            worst_ulps = max(worst_ulps, _bf16_ulps(f_pool, r_pool))
            differing += int((f_pool != r_pool).any(1).sum())
    bench.check(
        "c2 hd 512 (kv|gate 1024), D 6, batch 1..128, fp32+int64 / bf16+int32, padded request: "
        "ring bitwise == reference",
        ring_ok,
    )
    bench.check("c2: one D-row launch == D single-row launches, pool and ring bitwise", single_ok)
    bench.check(
        "c2: pool entries within 2^-7 of their row's max |value| of the reference",
        close_ok,
        f"max {worst_ulps} bf16 ulp; {differing} entries not bitwise equal (sum-of-squares order on GPU)",
    )

    # rejected prefix: accept k of 6, verify again at pos0 + k == history that decoded only accepted rows
    ok = True
    layer = _C2Layer(3, gen, dev)
    first = _c2_rows(3, d, gen, dev)
    for accepted in range(1, d + 1):
        second = list(_c2_rows(3, d, gen, dev))
        second[1] = torch.where(first[3], first[1] + accepted, 0)
        second[2] = first[2]
        v_ring, v_pool = layer.ring.clone(), layer.pool.clone()
        h_ring, h_pool = layer.ring.clone(), layer.pool.clone()
        layer.run(fused, *first, d, v_ring, v_pool)
        layer.run(fused, *second, d, v_ring, v_pool)
        for j in range(accepted):
            idx = torch.arange(j, 3 * d, d, device=dev)
            layer.run(fused, *(t[idx] for t in first), 1, h_ring, h_pool)
        layer.run(fused, *second, d, h_ring, h_pool)
        ok &= bitwise_equal(v_ring, h_ring) and bitwise_equal(v_pool, h_pool)
    bench.check("c2 rollback: accept 1..6 then next launch == history of accepted rows only (bitwise)", ok)

    # graph replay with changed inputs (rows, positions) on the persistent ring/pool
    batch = 8
    layer = _C2Layer(batch, gen, dev)
    rows = list(_c2_rows(batch, d, gen, dev, n_pad=1))
    snapshot = {}

    def mutate(i):
        new = _c2_rows(batch, d, gen, dev, n_pad=1 + i % 2)
        for t, s in zip(rows, new):
            t.copy_(s)
        snapshot["ring"], snapshot["pool"] = layer.ring.clone(), layer.pool.clone()

    def expect():
        ring, pool = snapshot["ring"], snapshot["pool"]
        layer.run(ratio2_compress_verify_reference, *rows, d, ring, pool)
        return ring, pool

    bench.graph_replay_check(
        "c2 batch 8 x 6 rows, new rows/positions/padding each replay",
        lambda: layer.run(fused, *rows, d),
        mutate,
        expect,
        lambda got, want: bitwise_equal(layer.ring, want[0]) and _c2_pool_close(layer.pool, want[1]),
    )

    for batch, dd in ((1, 6), (1, 2), (8, 6), (64, 6), (128, 6), (128, 2)):
        layer = _C2Layer(batch, gen, dev)
        rows = _c2_rows(batch, dd, gen, dev)
        n_rows = batch * dd
        moved = n_rows * 2 * C2_HD * 4 + n_rows // 2 * (C2_HD * 2 + 2 * C2_HD * 4) + batch * 2 * C2_HD * 4
        bench.time_pair(
            f"ratio2_compress_verify batch {batch} x {dd} rows, kv|gate 1024 fp32 -> bf16 pool",
            lambda layer=layer, rows=rows, dd=dd: layer.run(fused, *rows, dd),
            lambda layer=layer, rows=rows, dd=dd: layer.run(ratio2_compress_verify_reference, *rows, dd),
            moved,
            target="<=2.5us" if (batch, dd) == (1, 6) else ">=2x",
        )


# --------------------------------------------------------------------------------------------------- driver


def section_smoke(bench: Bench) -> None:
    """--smoke on the CPU: four ops once at a tiny shape, the Triton kernel (in Triton's interpreter) against its
    reference, exact, then the pair timed by the wall clock (the table's layout; CPU times say nothing of a GPU)."""
    from evalpipe.kernels.candidate_block_mask import candidate_block_mask, candidate_block_mask_reference
    from evalpipe.kernels.indexer_postprocess import indexer_postprocess, indexer_postprocess_reference
    from evalpipe.kernels.mxfp8 import mxfp8_quantize, mxfp8_quantize_reference
    from evalpipe.kernels.q_rope_store import q_rope_store, q_rope_store_reference

    dev, ps, k = bench.device, 64, 8
    gen = torch.Generator(device=dev).manual_seed(5)

    bench.current_op = "indexer"
    scores, indices, table = _indexer_inputs(6, 65, k, torch.int32, ps, gen, dev)
    fused = lambda: indexer_postprocess(scores, indices, table, ps, return_raw=True, backend="triton")  # noqa: E731
    ref = lambda: indexer_postprocess_reference(scores, indices, table, ps, return_raw=True)  # noqa: E731
    bench.check("R=6 W=65 K=8, exact", pair_equal(fused(), ref()))
    bench.time_pair(f"R=6 W=65 K={k} raw", fused, ref, 6 * k * 20)

    bench.current_op = "candidate"
    logits, lens = _candidate_inputs(6, 256, gen, dev)
    fused = lambda: candidate_block_mask(logits, lens, 64, 8, backend="triton")  # noqa: E731
    ref = lambda: candidate_block_mask_reference(logits, lens, 64, 8)  # noqa: E731
    bench.check("source R=6 W=256 G=8 top64, equal_nan", pair_equal(fused(), ref()))
    bench.time_pair("source R=6 W=256 G=8 top64", fused, ref, 6 * 256 * 4)

    bench.current_op = "q_rope"
    cos, sin = _rope_tables(64, 64, dev)
    q = (torch.randn(2, 3, 512, generator=gen, device=dev) * 4).to(torch.bfloat16)[:, :2]
    pos = torch.randint(0, 64, (2,), generator=gen, device=dev)
    out, want = (torch.full((2, 4, 512), 7.0, dtype=torch.bfloat16, device=dev) for _ in range(2))
    fused = lambda: q_rope_store(q, out[:, :2], cos, sin, pos, backend="triton")  # noqa: E731
    ref = lambda: q_rope_store_reference(q, want[:, :2], cos, sin, pos)  # noqa: E731
    fused(), ref()
    bench.check("T=2 H=2, bitwise, pad heads untouched", bitwise_equal(out, want))
    bench.time_pair("T=2 H=2 D=512 rope=64", fused, ref, 2 * 2 * 512 * 4)

    bench.current_op = "mxfp8"
    y = _mx_magnitude_rows((2, 64), gen, dev).to(torch.bfloat16)
    fused = lambda: mxfp8_quantize(y, backend="triton")  # noqa: E731
    ref = lambda: mxfp8_quantize_reference(y)  # noqa: E731
    bench.check("mxfp8_quantize M=2 N=64, bytes exact", _mx_same_bytes(fused(), ref()))
    bench.time_pair("mxfp8_quantize M=2 N=64", fused, ref, 2 * 64 * 3)


SECTIONS: dict[str, Callable[[Bench], None]] = {
    "indexer": section_indexer,
    "candidate": section_candidate,
    "q_rope": section_q_rope,
    "mxfp8": section_mxfp8,
    "c2": section_ratio2_compress_verify,
}


def target_verdict(row: TimingRow) -> str:
    if row.target == ">=2x":
        return "met" if row.speedup >= 2.0 else "MISSED"
    if row.target.startswith("<=") and row.target.endswith("us"):
        return "met" if row.fused_us <= float(row.target[2:-2]) else "MISSED"
    if row.target.startswith("<=") and row.target.endswith("x floor"):
        return "met" if row.fused_us <= float(row.target[2:].split("x")[0]) * row.floor_us else "MISSED"
    return ""


def print_table(bench: Bench) -> None:
    header = ["op", "shape", "fused us", "unfused us", "speedup", "floor us", "% of bw floor", "target"]
    body = [
        [
            r.op,
            r.shape,
            f"{r.fused_us:.2f}",
            f"{r.unfused_us:.2f}",
            f"{r.speedup:.2f}x",
            f"{r.floor_us:.2f}",
            f"{100 * r.floor_us / r.fused_us:.1f}%",
            f"{r.target} {target_verdict(r)}".strip(),
        ]
        for r in bench.rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in body:
        print(line(cells))


def import_kernel_modules() -> None:
    """Import `evalpipe.kernels`; if a sibling op's module is missing or broken, still let the others import.

    The package __init__ imports all five ops, so one missing module would otherwise stop every section.
    """
    try:
        import evalpipe.kernels  # noqa: F401
    except Exception as exc:
        import os
        import types

        import evalpipe

        print(f"warning: `import evalpipe.kernels` failed ({type(exc).__name__}: {exc}); importing ops one by one")
        for name in [m for m in sys.modules if m == "evalpipe.kernels" or m.startswith("evalpipe.kernels.")]:
            del sys.modules[name]
        package = types.ModuleType("evalpipe.kernels")
        package.__path__ = [os.path.join(os.path.dirname(evalpipe.__file__), "kernels")]
        sys.modules["evalpipe.kernels"] = package


def smoke() -> int:
    """section_smoke on the CPU, with the kernels imported under Triton's interpreter."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before evalpipe.kernels (and triton) are imported
    import_kernel_modules()
    bench = Bench(device=torch.device("cpu"), replays=1, inner=1, cuda=False)
    bench.measure_copy_bandwidth(1 << 20)
    try:
        section_smoke(bench)
    except Exception as exc:
        traceback.print_exc()
        bench.section_errors.append((bench.current_op, f"{type(exc).__name__}: {exc}"))
    failed = [c for c in bench.checks if not c[2]]
    print(f"checks: {len(bench.checks) - len(failed)} passed, {len(failed)} failed\n")
    print_table(bench)
    return 1 if failed or bench.section_errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--replays", type=int, default=200, help="graph replays per timing (median taken)")
    parser.add_argument("--inner", type=int, default=20, help="back-to-back calls captured per graph replay")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CI check without a GPU: four ops at tiny shapes in Triton's interpreter (section_smoke)",
    )
    args = parser.parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        return smoke()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in SECTIONS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(SECTIONS)}")
    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA GPU (this is the H200 benchmark; CPU checks live in tests/kernels)")
        return 2

    import triton

    import_kernel_modules()
    bench = Bench(device=torch.device("cuda"), replays=args.replays, inner=args.inner)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bw = bench.measure_copy_bandwidth()
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s (read + write of a 1 GiB buffer)\n", flush=True)

    for name in ops:
        bench.current_op = name
        print(f"== {name}", flush=True)
        started = time.time()
        try:
            SECTIONS[name](bench)
        except Exception as exc:  # one op failing must not hide the others
            traceback.print_exc()
            bench.section_errors.append((name, f"{type(exc).__name__}: {exc}"))
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        print(f"   ({time.time() - started:.1f} s)\n", flush=True)

    failed = [c for c in bench.checks if not c[2]]
    print(f"checks: {len(bench.checks) - len(failed)} passed, {len(failed)} failed")
    for op, name, _, detail in failed:
        print(f"  FAILED {op}: {name} {detail}")
    for op, err in bench.section_errors:
        print(f"  SECTION ERROR {op}: {err}")
    print()
    print_table(bench)
    return 1 if failed or bench.section_errors else 0


if __name__ == "__main__":
    sys.exit(main())
