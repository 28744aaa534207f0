"""Batch-invariant GEMMs and reductions: each output row is computed in one fixed order and tiling, whatever the
number of rows beside it, so a token's numbers do not depend on its batch (`--deterministic`).

Why the default CUDA path varies with the batch (the engine's serving path; what `--deterministic` changes):
- torch GEMMs (`F.linear`, `torch.matmul`, `torch.bmm`: engine/model/attention.py, compressor.py, moe.py, hyper.py,
  deepseek_v4.py's LM head, engine/static/model.py): cuBLAS picks its kernel, tile and split-K from M, so a row's
  K order changes with the rows beside it. Here: `matmul`, one tile shape, K walked in order, no split-K.
- torch reductions over a dim (`.sum`/`.mean`: the eager RMSNorms of primitives.py in bf16, the compressor's pooled
  sum, the indexer's head sum): TensorIterator splits a reduction across threads and blocks by the output count.
  Here: `reduce_sum`, one program per output, fixed block, fixed order.
- kernels/attention.py `plan`: the key-split count and head block follow T rows x SMs, and the split merge sums
  the partial states. Deterministic: a fixed 512-key split size and 16-head blocks (`plan(invariant=True)`).
- kernels/moe.py: GEMV below MM_MIN_TOKENS, tl.dot above, and MM_LARGE launch shapes by T. Deterministic: the
  tl.dot path with one launch shape for every T. The eager MoE (engine/model/moe.py) uses torch._grouped_mm and an
  atomic `index_add_` (order of the top-k adds varies run to run): deterministic prefill takes kernels.moe instead.
- kernels/hyper.py: `mix_block` (32 or 128 columns per partial by T) and the tl.dot path from DOT_MIN_ROWS rows.
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

Unchanged (per row already): the Triton norm, q_rope_store, indexer, compress and c2_verify kernels (one program
per row or entry), torch softmax on CUDA (one block or warp per row, configured from the row and inner lengths),
argmax (first maximum; the sampler's greedy choice), causal_topk (ties by entry index), elementwise ops. Not covered:
the CPU path (torch's CPU GEMMs vary with M; the overrides act on CUDA tensors), sampled requests' top-k/top-p, and
a NaN/inf token in the MoE down kernel's token block (its exact one-hot dot adds 0 x inf to its neighbours).

On the GPU one tile's tl.dot computes every row of the tile with the same tensor-core instructions, so a row's bits
depend on its data and the K order only. Triton's CPU interpreter runs tl.dot as numpy's BLAS, whose result for a
row changes with its slot in the tile, so there the tile product is an elementwise product and a sum over K (same
tiles, same K order); the interpreter tests check the tiling, masks and order, the GPU script
(benchmarks/serving/deterministic_gpu.py) checks the tensor-core rows.

`invariant_ops()` routes aten's mm/addmm/bmm and sum/mean over dims on CUDA tensors to these kernels while it is
open (torch.library overrides of the CUDA dispatch key, as Thinking Machines' batch_invariant_ops does), so the
model code keeps its plain torch calls; the kernels are plain Triton launches, so CUDA-graph capture works inside it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from evalpipe.kernels._backend import interpret_mode, jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# One tile shape for every M (the point of the module): 64-row output tiles, K in steps of 64, in order; the tile's
# width follows N only (a weight's shape): 32 columns below WIDE_N, so a decode step's GEMV-like GEMMs still spread
# over the SMs, 64 from there (the LM head).
BLOCK_M, BLOCK_K = 64, 64
WIDE_N = 8192
MAX_GRID_Z = 65535  # CUDA's limit on the batch axis of the launch grid
REDUCE_BLOCK = 1024  # elements per step of a row reduction (one program per output)


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
    ):
        """c[b] = a[b] @ b[b] (+ bias), fp32 accumulation over K tiles 0, BK, 2BK, ... in order, one rounding."""
        pm, pn, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        a_base = a_ptr + pb * s_ab + rm[:, None] * s_am
        b_base = b_ptr + pb * s_bb + rn[None, :] * s_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(a_base + kk[None, :] * s_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_base + kk[:, None] * s_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tile_dot(a, b, acc, IEEE, ROWWISE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + pb * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

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
    order (BLOCK_K tiles, ascending) with one tile shape whatever M, so a row's result is bitwise the same alone or
    among any other rows. Any strides."""
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
        block_n = 64 if N >= WIDE_N else 32
        kernel = jit(_matmul_kernel, ("M", "N", "K", "s_ab", "s_am", "s_bb", "s_cb", "s_cm"), helpers=(tile_dot,))
        for z in range(0, B, MAX_GRID_Z):
            zs = slice(z, z + MAX_GRID_Z)
            a_z, b_z, c_z = a3[zs], b3[zs], c3[zs]
            kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n), a_z.shape[0])](
                a_z,
                b_z,
                c_z,
                bias if bias is not None else c_z,
                M,
                N,
                K,
                *a_z.stride(),
                *b_z.stride(),
                *c_z.stride(),
                HAS_BIAS=bias is not None,
                IEEE=a.dtype == torch.float32,
                ROWWISE=interpret_mode(),
                BM=BLOCK_M,
                BN=block_n,
                BK=BLOCK_K,
                num_warps=4,
                num_stages=3,
            )
    return c3 if batched else c3[0]


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


# ---- the aten overrides -----------------------------------------------------------------------------------------


def _mm(a, b):
    return matmul(a, b, backend="triton")


def _bmm(a, b):
    return matmul(a, b, backend="triton")


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1] and bias.dtype == a.dtype:
        return matmul(a, b, bias, backend="triton")
    product = matmul(a, b, backend="triton")
    return product * alpha + bias * beta if beta != 0 else product * alpha  # elementwise: per row


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return reduce_sum(x, dim, keepdim, dtype=dtype, backend="triton")


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    return reduce_sum(x, dim, keepdim, mean=True, dtype=dtype, backend="triton")


_OVERRIDES = {"mm": _mm, "bmm": _bmm, "addmm": _addmm, "sum.dim_IntList": _sum, "mean.dim": _mean}
_OPEN: list = []  # the one registration while any invariant_ops() is open, and how deep


@contextlib.contextmanager
def invariant_ops(enabled: bool = True):
    """While open (and `enabled`), aten mm / addmm / bmm and sum / mean over dims of CUDA tensors run the kernels
    above. Nested opens share one registration; the last close removes it. CPU tensors are not affected."""
    if not enabled:
        yield
        return
    if not _OPEN:
        lib = torch.library.Library("aten", "IMPL")
        for name, fn in _OVERRIDES.items():
            lib.impl(name, fn, "CUDA")
        _OPEN.append(lib)
    _OPEN.append(None)
    try:
        yield
    finally:
        _OPEN.pop()
        if len(_OPEN) == 1:
            _OPEN.pop()._destroy()
