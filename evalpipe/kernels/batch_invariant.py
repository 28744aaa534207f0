"""Batch-invariant GEMMs and reductions: each output row is computed in one fixed order and tiling, whatever the
number of rows beside it, so a token's numbers do not depend on its batch (`--deterministic`).

Why the default CUDA path varies with the batch (the engine's serving path; what `--deterministic` changes):
- torch GEMMs (`F.linear`, `torch.matmul`, `torch.bmm`: engine/model/attention.py, compressor.py, moe.py, hyper.py,
  deepseek_v4.py's LM head, engine/static/model.py): cuBLAS picks its kernel, tile and split-K from M, so a row's
  K order changes with the rows beside it. Here: `matmul`, one tile shape per weight shape (`tile_for`, never M),
  K walked in order, split into a fixed number of slices summed in slice order (prompt chunks); or `slab_matmul`
  and `slab_bmm`, the library's own GEMMs on products of exactly 64 rows (the CUDA-graph step, whose C64 decode is
  one such slab).
- torch reductions over a dim (`.sum`/`.mean`: the eager RMSNorms of primitives.py in bf16, the compressor's pooled
  sum, the indexer's head sum): TensorIterator splits a reduction across threads and blocks by the output count.
  Here: `reduce_sum`, one program per output, fixed block, fixed order.
- kernels/attention.py `plan`: the key-split count and head block follow T rows x SMs, and the split merge sums
  the partial states. Deterministic: a fixed 512-key split size and 16-head blocks (`plan(invariant=True)`).
- kernels/moe.py: GEMV below MM_MIN_TOKENS, tl.dot above, and MM_LARGE launch shapes by T. Deterministic: the
  tl.dot paths (down's "rows") with one launch shape (MM_INVARIANT) for every T. The eager MoE
  (engine/model/moe.py) uses torch._grouped_mm and an atomic `index_add_` (order of the top-k adds varies run to
  run): deterministic prefill takes kernels.moe instead.
- kernels/hyper.py: `mix_block` (32, 64 or 128 columns per partial by T) and the tl.dot path from DOT_MIN_ROWS rows.
  Deterministic: 128-column partials and the per-row kernel at every T.
- kernels/mxfp8.py (`--wo-quant mxfp8`): one fused launch with an atomic ticket for M <= 16, partials + reduce
  above. Deterministic: partials + reduce at every M.
- The CSA top-k (engine/model/fused_sites.csa_rows): `causal_topk` keeps a row's entries in index order when its
  group has at most index_topk entries and in score order above, and the group's entry count follows the chunk and
  the longest request beside it; the attention kernel sums its entry slots in slot order. Deterministic: the picks
  sorted by entry index (`compressor.index_order`).
- The attention merge (kernels/attention.py): a tl.sum over the split states, whose lane count S_PAD grows with a
  longer entry axis beside the row. Deterministic: the splits summed in split order.
Prompt rows run the eager forward (engine/model) and decode/verify rows the CUDA-graph step (engine/static) in every
arm (cache on or off, any batch, speculation on or off), so each path must be invariant on its own -- to chunking,
cache hits and neighbours for the first, to the bucket and the verify width for the second -- not equal to the other.
Deterministic, the engine marks its prompt chunks, so a chunk of a graph width (the 1-row rest after a cache hit)
stays on the eager path (engine/static/graphs.py).

Unchanged (per row already): the Triton norm, q_rope_store, indexer, compress and ratio2_compress_verify kernels (one
program per row or entry), torch softmax on CUDA (one block or warp per row, configured from the row and inner lengths),
argmax (first maximum; the sampler's greedy choice), causal_topk (ties by entry index), elementwise ops. Not covered:
the CPU path (torch's CPU GEMMs vary with M; the overrides act on CUDA tensors) and sampled requests' top-k/top-p.

On the GPU one tile's tl.dot computes every row of the tile with the same tensor-core instructions, so a row's bits
depend on its data and the K order only. Triton's CPU interpreter runs tl.dot as numpy's BLAS, whose result for a
row changes with its slot in the tile, so there the tile product is an elementwise product and a sum over K (same
tiles, same K order); the interpreter tests check the tiling, masks and order, the GPU script
(benchmarks/serving/deterministic_gpu.py) checks the tensor-core rows.

`invariant_ops()` routes aten's mm/addmm/bmm and sum/mean over dims on CUDA tensors to these kernels while it is
open (torch.library overrides of the CUDA dispatch key, as Thinking Machines' batch_invariant_ops does), so the
model code keeps its plain torch calls; the kernels are plain Triton launches and library calls, so CUDA-graph
capture works inside it. The eager forward opens it with `gemm="tiles"`, the CUDA-graph step with `gemm="slabs"`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from evalpipe.kernels._backend import interpret_mode, jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One tile shape for every M (the point of the module): 64-row output tiles; the rest of the tile follows the weight's
# shape (N, K, batch), the dtype and the device's shared memory only (`tile_for`).
BLOCK_M, BLOCK_K = 64, 64
WIDE_N = 20000  # from here 128-column tiles (LM heads): fewer programs re-reading the same rows
DEEP_K = 2048  # from here 256-deep K steps with 8 warps
MIN_PROGRAMS = 100  # split K (up to MAX_SPLIT slices) until a product has this many programs
MAX_SPLIT = 4
STAGES = 3


@dataclass(frozen=True)
class Tile:
    """A launch shape of the GEMM kernel. It may follow N and K (a weight's shape), never M: that is the point."""

    block_n: int
    block_k: int = BLOCK_K
    num_warps: int = 4
    num_stages: int = STAGES
    split_k: int = 1  # K slices summed in fp32 in slice order (more programs for few rows, same order for any M)


def tile_for(n: int, k: int, batch: int = 1, itemsize: int = 2, smem: int = 160 * 1024) -> Tile:
    """The tile every [batch, M, k] @ [batch, k, n] product uses, whatever M. Chosen from a sweep of 50 tiles on the
    H200 at M = 64 (the C64 decode step's nine weight shapes, benchmarks/kernels/invariant_gemm_gpu.py): wider
    tiles for wide N, deeper K steps for deep K, and K split into up to 4 slices when the N tiles alone leave the
    SMs idle. `smem`: the device's shared memory per block; K steps shrink until the pipelined tiles fit."""
    block_n = 32 if n <= 32 else 128 if n >= WIDE_N else 64
    block_k, warps = (256, 8) if k >= DEEP_K and block_n <= 64 else (128, 4)
    while block_k > 16 and STAGES * (BLOCK_M + block_n) * block_k * itemsize > smem:
        block_k //= 2
    programs = triton.cdiv(n, block_n) * batch
    split = 1
    while programs * split < MIN_PROGRAMS and split < MAX_SPLIT and k >= 2 * split * block_k:
        split *= 2
    return Tile(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=STAGES, split_k=split)


def _smem_bytes(device: torch.device) -> int:
    """Shared memory one block may use on `device` (opt-in maximum); the interpreter: no limit that matters."""
    if device.type != "cuda":
        return 1 << 30
    if device not in _SMEM:
        props = torch.cuda.get_device_properties(device)
        _SMEM[device] = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024) - 8 * 1024
    return _SMEM[device]


_SMEM: dict = {}


MAX_GRID_Z = 65535  # CUDA's limit on the batch axis of the launch grid
REDUCE_BLOCK = 1024  # elements per step of a row reduction (one program per output)
SUM_BLOCK = 1024  # output elements per program of the K-slice sum


if tl is not None:

    def tile_dot(a, b, acc, IEEE: tl.constexpr, ROWWISE: tl.constexpr):
        """acc + a @ b for one tile, fp32 accumulation. ROWWISE (the interpreter): an elementwise product summed
        over K, whose rows do not depend on their slot in the tile (numpy's BLAS, the interpreter's tl.dot, does);
        IEEE: exact fp32 products (a float32 tl.dot defaults to tf32)."""
        if ROWWISE:
            out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            out = tl.dot(a, b, acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc)
        return out

    def _matmul_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        bias_ptr,
        M,
        N,
        K,
        s_ab,
        s_am,
        s_ak,
        s_bb,
        s_bk,
        s_bn,
        s_cb,
        s_cm,
        s_cn,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        ROWWISE: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        SPLIT: tl.constexpr,
        K_PER: tl.constexpr,
    ):
        """c[b] = a[b] @ b[b] (+ bias), fp32 accumulation over K tiles 0, BK, 2BK, ... in order, one rounding.
        SPLIT > 1: program z of the third axis sums K slice z % SPLIT (K_PER long) of batch z // SPLIT into an
        fp32 c[z] (the caller adds the slices in order)."""
        pm, pn, pz = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        pb = pz // SPLIT
        k_lo = (pz % SPLIT) * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        a_base = a_ptr + pb * s_ab + rm[:, None] * s_am
        b_base = b_ptr + pb * s_bb + rn[None, :] * s_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + rk
            a = tl.load(a_base + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
            b = tl.load(b_base + kk[:, None] * s_bk, mask=(kk[:, None] < k_hi) & (rn[None, :] < N), other=0.0)
            acc = tile_dot(a, b, acc, IEEE, ROWWISE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + pz * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    def bf16_to_f32(x):
        """bfloat16 -> float32 on the bits (exact; the interpreter's cast mishandles subnormals)."""
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    def f32_to_bf16(x):
        """float32 -> bfloat16 rounded to nearest, ties to even, on the bits (as the GPU's cvt.rn; the interpreter's
        cast truncates); a NaN -> 0x7FFF."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FFF, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    def _split_sum_kernel(
        p_ptr,
        bias_ptr,
        c_ptr,
        total,
        M,
        N,
        s_pb,
        s_ps,
        s_pm,
        s_pn,
        s_cb,
        s_cm,
        s_cn,
        SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """c[b, m, n] = (((p[b, 0, m, n] + p[b, 1, m, n]) + p[b, 2, m, n]) + ...) + bias[n]: float32 adds in slice
        order, then one rounding to nearest even into c's dtype; `total` = B * M * N outputs, BLOCK per program."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < total
        n = i % N
        m = (i // N) % M
        b = i // N // M
        p = p_ptr + b * s_pb + m * s_pm + n * s_pn
        acc = tl.load(p, mask=live, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc = acc + tl.load(p + s * s_ps, mask=live, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + n, mask=live, other=0.0)
            if bias_ptr.dtype.element_ty == tl.bfloat16:
                acc = acc + bf16_to_f32(bias)
            else:
                acc = acc + bias.to(tl.float32)
        c = c_ptr + b * s_cb + m * s_cm + n * s_cn
        if c_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(c, f32_to_bf16(acc), mask=live)
        else:
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=live)

    def _row_sum_kernel(x_ptr, out_ptr, L, scale, INT: tl.constexpr, BLOCK: tl.constexpr):
        """out[r] = scale * sum of row r of a contiguous [R, L] x: per-lane fp32 sums over blocks in order, then
        one tree over the lanes (INT: int64 sums, exact in any order)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.int64 if INT else tl.float32)
        for start in range(0, L, BLOCK):
            x = tl.load(x_ptr + row * L + start + offs, mask=start + offs < L, other=0)
            acc += x.to(tl.int64) if INT else x.to(tl.float32)
        if INT:
            tl.store(out_ptr + row, tl.sum(acc, axis=0))
        else:
            tl.store(out_ptr + row, tl.sum(acc, axis=0) * scale)


# ---- GEMM -------------------------------------------------------------------------------------------------------


def _check_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(
            f"matmul takes [M, K] @ [K, N] or [B, M, K] @ [B, K, N], got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"matmul shapes do not fit: {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"matmul takes two tensors of one dtype among {FLOAT_DTYPES}, got {a.dtype}, {b.dtype}")
    if bias is not None and bias.shape != (b.shape[-1],):
        raise ValueError(f"bias must be [N] = [{b.shape[-1]}], got {tuple(bias.shape)}")


def matmul_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (+ bias) with float32 accumulation and one rounding to a's dtype."""
    _check_matmul(a, b, bias)
    out = torch.matmul(a.float(), b.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(a.dtype)


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """a [M, K] @ b [K, N] (or batched [B, M, K] @ [B, K, N]) + bias [N]: every output row reduced over K in one
    order (K tiles ascending, slices summed in order) with one tile shape whatever M, so a row's result is bitwise
    the same alone or among any other rows. Any strides."""
    _check_matmul(a, b, bias)
    tensors = [a, b] + ([bias] if bias is not None else [])
    if not use_triton(backend, tensors):
        return matmul_reference(a, b, bias)
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    B, M, K = a3.shape
    N = b3.shape[2]
    c3 = torch.empty(B, M, N, device=a.device, dtype=a.dtype)
    if c3.numel() and K == 0:
        c3.zero_()
        if bias is not None:
            c3 += bias.to(c3.dtype)
    elif c3.numel():
        launch_matmul(a3, b3, c3, bias, tile_for(N, K, B, a.element_size(), _smem_bytes(a.device)))
    return c3 if batched else c3[0]


def launch_matmul(a3: torch.Tensor, b3: torch.Tensor, c3: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> None:
    """c3 = a3 @ b3 (+ bias) through the Triton kernel with `tile` ([B, M, K] @ [B, K, N] into [B, M, N], K > 0)."""
    B, M, K = a3.shape
    N = b3.shape[2]
    split = max(1, min(tile.split_k, triton.cdiv(K, tile.block_k)))
    k_per = triton.cdiv(triton.cdiv(K, split), tile.block_k) * tile.block_k
    out = c3 if split == 1 else torch.empty(B * split, M, N, device=c3.device, dtype=torch.float32)
    kernel = jit(_matmul_kernel, ("M", "N", "K", "s_ab", "s_am", "s_bb", "s_cb", "s_cm"), helpers=(tile_dot,))
    step = MAX_GRID_Z // split
    for z in range(0, B, step):
        zs = slice(z, z + step)
        a_z, b_z, c_z = a3[zs], b3[zs], out[z * split : (z + step) * split]
        kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, tile.block_n), a_z.shape[0] * split)](
            a_z,
            b_z,
            c_z,
            bias if bias is not None and split == 1 else c_z,
            M,
            N,
            K,
            *a_z.stride(),
            *b_z.stride(),
            *c_z.stride(),
            HAS_BIAS=bias is not None and split == 1,
            IEEE=a3.dtype == torch.float32,
            ROWWISE=interpret_mode(),
            BM=BLOCK_M,
            BN=tile.block_n,
            BK=tile.block_k,
            SPLIT=split,
            K_PER=k_per,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
    if split > 1:
        split_sum(out.view(B, split, M, N), bias, c3, backend="triton")


def _check_split_sum(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if parts.dim() != 4 or parts.dtype != torch.float32:
        raise ValueError(f"split_sum takes float32 parts [B, S, M, N], got {parts.dtype} {tuple(parts.shape)}")
    B, _, M, N = parts.shape
    if out.shape != (B, M, N) or out.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"split_sum writes [B, M, N] = {[B, M, N]} in {FLOAT_DTYPES}, got {out.dtype} {tuple(out.shape)}"
        )
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [N] = [{N}], got {tuple(bias.shape)}")


def split_sum_reference(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = (((parts[:, 0] + parts[:, 1]) + parts[:, 2]) + ...) + bias: float32 elementwise adds in slice order
    (the same for every row), one rounding into out's dtype (`copy_`). Returns out."""
    _check_split_sum(parts, bias, out)
    total = parts[:, 0]
    for s in range(1, parts.shape[1]):
        total = total + parts[:, s]
    if bias is not None:
        total = total + bias.float()
    return out.copy_(total)


def split_sum(
    parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """`split_sum_reference` in one launch (launch_matmul's K slices: fp32 [B, S, M, N] into [B, M, N], any
    strides): the same bits, save that a NaN may come out with other NaN bits. Returns out."""
    _check_split_sum(parts, bias, out)
    tensors = [parts, out] + ([bias] if bias is not None else [])
    if not use_triton(backend, tensors):
        return split_sum_reference(parts, bias, out)
    B, S, M, N = parts.shape
    total = B * M * N
    if total:
        kernel = jit(
            _split_sum_kernel,
            ("total", "M", "N", "s_pb", "s_ps", "s_pm", "s_cb", "s_cm"),
            helpers=(bf16_to_f32, f32_to_bf16),
        )
        kernel[(triton.cdiv(total, SUM_BLOCK),)](
            parts,
            bias if bias is not None else parts,
            out,
            total,
            M,
            N,
            *parts.stride(),
            *out.stride(),
            SPLIT=S,
            HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK,
            num_warps=4,
        )
    return out


# ---- reductions -------------------------------------------------------------------------------------------------


def _reduced_dims(x: torch.Tensor, dims) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.dim()))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % max(x.dim(), 1) for d in dims})


def reduce_sum_reference(x, dims=None, keepdim: bool = False, *, mean: bool = False, dtype=None) -> torch.Tensor:
    """Sum (or mean) of x over `dims` with float32 accumulation, in `dtype` (default x's)."""
    dims = _reduced_dims(x, dims) if x.dim() else []
    if not x.dtype.is_floating_point:
        return x.sum(dim=dims, keepdim=keepdim, dtype=dtype)
    out = x.float().sum(dim=dims, keepdim=keepdim)
    if mean:
        out = out / math.prod(x.shape[d] for d in dims)
    return out.to(dtype or x.dtype)


def reduce_sum(x, dims=None, keepdim: bool = False, *, mean: bool = False, dtype=None, backend: str = "auto"):
    """Sum (or mean) of x over `dims`, each output reduced by one program in a fixed order (REDUCE_BLOCK lanes,
    blocks in ascending order, then one tree): the same bits whatever the other outputs. The reduced dims are moved
    last and made contiguous first (a copy: no arithmetic)."""
    integer = not x.dtype.is_floating_point and not x.dtype.is_complex
    if not (x.dtype in FLOAT_DTYPES or integer) or (mean and integer):
        raise ValueError(f"reduce_sum takes {FLOAT_DTYPES} (or integers/bool for a sum), got {x.dtype}")
    if not use_triton(backend, [x]):
        return reduce_sum_reference(x, dims, keepdim, mean=mean, dtype=dtype)
    dims = _reduced_dims(x, dims) if x.dim() else []
    kept = [d for d in range(x.dim()) if d not in dims]
    L = math.prod(x.shape[d] for d in dims)
    rows_shape = [x.shape[d] for d in kept]
    flat = x.permute(*kept, *dims).reshape(math.prod(rows_shape), L).contiguous()
    out = torch.empty(flat.shape[0], device=x.device, dtype=torch.int64 if integer else torch.float32)
    if flat.shape[0]:
        scale = (1.0 / L if L else float("nan")) if mean else 1.0
        jit(_row_sum_kernel, ("L",))[(flat.shape[0],)](
            flat, out, L, scale, INT=integer, BLOCK=REDUCE_BLOCK, num_warps=4
        )
    out = out.view(rows_shape).to(dtype or (torch.int64 if integer else x.dtype))
    if keepdim:
        out = out.view([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return out


# ---- fixed-height products (the CUDA-graph step) -----------------------------------------------------------------

SLAB_ROWS = 64  # every product of slab_matmul has exactly this many rows: the C64 decode step's own height


def slab_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) as ceil(M / SLAB_ROWS) library products of exactly SLAB_ROWS rows each
    (`mm.out` / `addmm.out` per slab, into one fresh output). The library picks its kernel, tile and split from the
    product's shape, dtype, layout and pointer alignment (to 16 bytes), none of which follows M here: a is taken as
    it is when it is contiguous, 16-byte aligned and whole slabs, and zero-padded into a fresh tensor otherwise. So
    a row's bits do not depend on the rows beside it or their number, as with `matmul`, at the library's speed for 64
    rows. Not for prompt chunks: a 2,048-row chunk would read each weight 32 times."""
    _check_matmul(a, b, bias)
    if a.dim() != 2:
        raise ValueError(f"slab_matmul takes [M, K] @ [K, N], got {tuple(a.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if M == 0:
        return a.new_empty(0, N)
    pad = -M % SLAB_ROWS
    if pad or not a.is_contiguous() or a.data_ptr() % 16:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))  # a fresh contiguous [M + pad, K]
    out = a.new_empty(M + pad, N)
    for start in range(0, M + pad, SLAB_ROWS):
        rows = slice(start, start + SLAB_ROWS)
        # the .out overloads run the library's kernels: invariant_ops overrides only mm.default and addmm.default
        if bias is None:
            torch.mm(a[rows], b, out=out[rows])
        else:
            torch.addmm(bias, a[rows], b, out=out[rows])
    return out[:M]


def slab_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] as ceil(M / SLAB_ROWS) batched library products of [B, SLAB_ROWS, K] each: `a` is
    copied slab-major into one fresh contiguous tensor, zero past M, so every product's shape, strides and alignment
    are the same whatever M, as in `slab_matmul`. Rows are M's: B is the weights' batch (the decode step's grouped
    output projection, B = groups), not the tokens'."""
    _check_matmul(a, b, None)
    if a.dim() != 3:
        raise ValueError(f"slab_bmm takes [B, M, K] @ [B, K, N], got {tuple(a.shape)}")
    B, M, K = a.shape
    N = b.shape[2]
    if M == 0:
        return a.new_empty(B, 0, N)
    full, rest = divmod(M, SLAB_ROWS)
    slabs = full + (rest > 0)
    a_slabs = (torch.zeros if rest else torch.empty)(slabs, B, SLAB_ROWS, K, dtype=a.dtype, device=a.device)
    if full:  # splitting a's row dim is a view whatever its strides: one copy, straight into the slabs
        a_slabs[:full].copy_(a[:, : full * SLAB_ROWS].reshape(B, full, SLAB_ROWS, K).transpose(0, 1))
    if rest:  # the last slab's rows past M stay zero
        a_slabs[full, :, :rest].copy_(a[:, full * SLAB_ROWS :])
    out = torch.empty(slabs, B, SLAB_ROWS, N, dtype=a.dtype, device=a.device)
    for s in range(slabs):
        torch.bmm(a_slabs[s], b, out=out[s])  # bmm.out: the library's kernel (invariant_ops overrides bmm.default)
    return out.transpose(0, 1).reshape(B, slabs * SLAB_ROWS, N)[:, :M]


# ---- the aten overrides -----------------------------------------------------------------------------------------


def _gemm(a, b, bias=None):
    """The innermost open invariant_ops' GEMM."""
    if _GEMM_MODES[-1] == "slabs":
        return slab_matmul(a, b, bias)
    return matmul(a, b, bias, backend="triton")


def _mm(a, b):
    return _gemm(a, b)


def _bmm(a, b):
    if _GEMM_MODES[-1] == "slabs":
        return slab_bmm(a, b)
    return matmul(a, b, backend="triton")


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1] and bias.dtype == a.dtype:
        return _gemm(a, b, bias)
    product = _gemm(a, b)
    return product * alpha + bias * beta if beta != 0 else product * alpha  # elementwise: per row


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return reduce_sum(x, dim, keepdim, dtype=dtype, backend="triton")


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    return reduce_sum(x, dim, keepdim, mean=True, dtype=dtype, backend="triton")


_OVERRIDES = {"mm": _mm, "bmm": _bmm, "addmm": _addmm, "sum.dim_IntList": _sum, "mean.dim": _mean}
_OPEN: list = []  # the one registration while any invariant_ops() is open, and how deep
GEMM_MODES = ("tiles", "slabs")
_GEMM_MODES: list[str] = ["tiles"]  # the innermost open invariant_ops' gemm


@contextlib.contextmanager
def invariant_ops(enabled: bool = True, gemm: str = "tiles"):
    """While open (and `enabled`), aten mm / addmm / bmm and sum / mean over dims of CUDA tensors run the kernels
    above. `gemm`: how mm and addmm run, "tiles" (`matmul`, one launch whatever M: prompt chunks) or "slabs"
    (`slab_matmul`, 64-row library products: the CUDA-graph step, whose products have at most a few slabs); bmm
    likewise runs `matmul` or `slab_bmm`. Both keep a row's bits whatever M, but not the same bits as each other, so
    one forward path keeps one mode. Nested opens share one registration; the last close removes it. CPU tensors are not
    affected."""
    if gemm not in GEMM_MODES:
        raise ValueError(f"gemm must be one of {GEMM_MODES}, got {gemm!r}")
    if not enabled:
        yield
        return
    if not _OPEN:
        lib = torch.library.Library("aten", "IMPL")
        for name, fn in _OVERRIDES.items():
            lib.impl(name, fn, "CUDA")
        _OPEN.append(lib)
    _OPEN.append(None)
    _GEMM_MODES.append(gemm)
    try:
        yield
    finally:
        _GEMM_MODES.pop()
        _OPEN.pop()
        if len(_OPEN) == 1:
            _OPEN.pop()._destroy()
