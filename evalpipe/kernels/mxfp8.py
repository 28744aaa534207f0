"""MXFP8 activations for the grouped output projection: quantizer, WO-A with a fused reduce+quantize, and WO-B.

MXFP8 here means FlashInfer's swizzled layout: float8_e4m3fn values and one E8M0 (power-of-two) scale byte per 32
consecutive values of a row. Scale rule per 32-group (fp32 bit arithmetic, "positive rounding")::

    n = amax * fp32(1/448); e, mant = exponent and mantissa bits of n
    bump = mant != 0 and not (e == 0 and mant <= 0x400000)
    sf = 0 if n <= 0 else min(e + bump, 254)                    # scale = 2^(sf - 127)
    inv = 0 if sf == 0 else 2^(127 - sf)                        # exact power of two, built from bits
    q = e4m3_rne(clamp(y * inv, -448, 448))

Scales are stored 128x4-swizzled in a flat uint8 buffer of Mp * Gp bytes (Mp = rows padded to 128, Gp = N/32
padded to 4); byte of (row t, group g) = ((t // 128) * (Gp // 4) + g // 4) * 512 + (t % 32) * 16
+ ((t // 32) % 4) * 4 + g % 4. Every padding byte (rows >= M, groups >= N/32) is written 0 on every call, so
CUDA-graph replays and reused buffers never leak stale scales. Inputs must be finite (NaN/inf are not specified).

Exactness: the Triton quantizer and reduce+quantize are byte-identical to the references (integer bit arithmetic
for the scale, the bf16 rounding and the e4m3 round-to-nearest-even encode; checked under the interpreter).
WO-A partials are fp32 GEMMs whose in-split summation order is the kernel's (they agree with the reference to fp32
rounding, not bitwise); the 8-way split reduction is sequential s = 0..7 in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalpipe.kernels._backend import interpret_mode, jit, use_triton
from evalpipe.kernels.batch_invariant import tile_dot

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional on non-Linux hosts
    triton = None

GROUP = 32  # values per E8M0 scale
SPLITS = 8  # WO-A split-K count (fixed: the reduction order is part of the contract)
SPLIT_ALIGN = 128  # split boundaries are multiples of this many K elements
_INV_448 = 1.0 / 448.0  # rounded to fp32 where used, as FlashInfer does


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def scale_buffer_size(rows: int, cols: int) -> int:
    """Bytes of the swizzled scale buffer for an [rows, cols] MXFP8 tensor."""
    return _ceil_to(rows, 128) * _ceil_to(cols // GROUP, 4)


def swizzled_scale_offsets(rows: int, cols: int, device=None) -> torch.Tensor:
    """int64 [rows, cols // 32]: position of each (row, group) scale byte in the flat swizzled buffer."""
    gp = _ceil_to(cols // GROUP, 4)
    t = torch.arange(rows, device=device)[:, None]
    g = torch.arange(cols // GROUP, device=device)[None, :]
    return ((t // 128) * (gp // 4) + g // 4) * 512 + (t % 32) * 16 + ((t // 32) % 4) * 4 + g % 4


def _e8m0_to_float(sf: torch.Tensor) -> torch.Tensor:
    """2^(sf - 127) as fp32, built from bits (byte 0 -> 2^-127, a subnormal)."""
    sf = sf.to(torch.int32)
    return torch.where(sf == 0, torch.full_like(sf, 0x00400000), sf << 23).view(torch.float32)


@dataclass(frozen=True)
class Mxfp8Tensor:
    """An MXFP8 activation: `data` float8_e4m3fn [M, N] and `scales` uint8 [scale_buffer_size(M, N)] swizzled.

    A type of its own so a consumer (WO-B) can tell it apart from a plain tensor or a legacy (fp8, scale) tuple.
    """

    data: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        if self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 2 or self.data.shape[1] % GROUP:
            raise ValueError(
                f"data must be float8_e4m3fn [M, N] with N % 32 == 0, got {self.data.dtype} {tuple(self.data.shape)}"
            )
        want = scale_buffer_size(*self.data.shape)
        if self.scales.dtype != torch.uint8 or self.scales.shape != (want,):
            raise ValueError(f"scales must be uint8 [{want}], got {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @staticmethod
    def empty(rows: int, cols: int, device=None) -> "Mxfp8Tensor":
        return Mxfp8Tensor(
            torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(scale_buffer_size(rows, cols), dtype=torch.uint8, device=device),
        )

    def scale_grid(self) -> torch.Tensor:
        """The E8M0 bytes un-swizzled: uint8 [M, N // 32]."""
        return self.scales[swizzled_scale_offsets(*self.data.shape, device=self.scales.device)]

    def dequantize(self) -> torch.Tensor:
        """float32 [M, N]: each e4m3 value times 2^(sf - 127) (exact unless the product leaves the fp32 range)."""
        scale = _e8m0_to_float(self.scale_grid())
        return (self.data.float().unflatten(1, (-1, GROUP)) * scale[..., None]).flatten(1)


# ----------------------------------------------------------------------------------------------------------------
# references


def _scale_bytes_and_inverse(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E8M0 rule of the module docstring on fp32 amax: (uint8 scale bytes, fp32 exact inverse scales)."""
    n = amax.float() * torch.tensor(_INV_448, dtype=torch.float32)
    bits = n.view(torch.int32)
    e = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    bump = (mant != 0) & ~((e == 0) & (mant <= 0x400000))
    sf = torch.where(n <= 0, torch.zeros_like(e), torch.clamp(e + bump.to(torch.int32), max=254))
    inv_bits = torch.where(sf == 254, torch.full_like(sf, 0x00400000), (254 - sf) << 23)
    inv = torch.where(sf == 0, torch.zeros_like(n), inv_bits.view(torch.float32))
    return sf.to(torch.uint8), inv


def mxfp8_quantize_reference(y: torch.Tensor, *, out: Mxfp8Tensor | None = None) -> Mxfp8Tensor:
    """Quantize y [M, N] (any float dtype, taken as fp32 values) to MXFP8 with the rule above, in plain PyTorch."""
    _check_quant_input(y, out)
    m, n = y.shape
    out = out if out is not None else Mxfp8Tensor.empty(m, n, device=y.device)
    groups = y.float().unflatten(1, (-1, GROUP))
    sf, inv = _scale_bytes_and_inverse(groups.abs().amax(-1))
    q = torch.clamp(groups * inv[..., None], -448.0, 448.0).to(torch.float8_e4m3fn)
    out.data.copy_(q.flatten(1))
    out.scales.zero_()
    out.scales[swizzled_scale_offsets(m, n, device=y.device)] = sf
    return out


def wo_a_split_bounds(kg: int) -> list[tuple[int, int]]:
    """The fixed K ranges of the 8 WO-A splits: length ceil(Kg / 8) rounded up to 128; trailing ones may be empty.

    For the production Kg = 4096 this is [512 s, 512 s + 512).
    """
    length = _ceil_to(-(-kg // SPLITS), SPLIT_ALIGN)
    return [(min(s * length, kg), min((s + 1) * length, kg)) for s in range(SPLITS)]


def wo_a_partials_reference(x: torch.Tensor, w_a: torch.Tensor) -> torch.Tensor:
    """fp32 split-K partials [8, M, G*R]: partial[s, t, g*R + n] = sum over split s of x[t, g, k] * w_a[g, n, k]."""
    _check_wo_a(x, w_a)
    m, g, _ = x.shape
    parts = [
        torch.einsum("tgk,gnk->tgn", x[..., k0:k1].float(), w_a[..., k0:k1].float()).reshape(m, -1)
        for k0, k1 in wo_a_split_bounds(x.shape[2])
    ]
    return torch.stack(parts)


def reduce_partials_bf16(partials: torch.Tensor) -> torch.Tensor:
    """y = bf16(partial[0] + partial[1] + ... + partial[7]), summed strictly in that order in fp32."""
    acc = partials[0].float()
    for s in range(1, partials.shape[0]):
        acc = acc + partials[s].float()
    return acc.to(torch.bfloat16)


def mxfp8_reduce_quantize_reference(partials: torch.Tensor, *, out: Mxfp8Tensor | None = None) -> Mxfp8Tensor:
    """The unfused tail of WO-A: sequential fp32 reduce of [S, M, N] partials, bf16 rounding, MXFP8 quantize."""
    return mxfp8_quantize_reference(reduce_partials_bf16(partials), out=out)


def wo_a_mxfp8_reference(x: torch.Tensor, w_a: torch.Tensor, *, out: Mxfp8Tensor | None = None) -> Mxfp8Tensor:
    """WO-A (grouped projection) then MXFP8 quantization of its bf16 output, as separate plain PyTorch steps."""
    return mxfp8_reduce_quantize_reference(wo_a_partials_reference(x, w_a), out=out)


def mxfp8_linear_reference(a: Mxfp8Tensor, w_b: torch.Tensor, *, out_dtype=torch.bfloat16) -> torch.Tensor:
    """WO-B on an MXFP8 activation: dequantize(a) [M, K] @ w_b[N, K]^T in fp32, then out_dtype."""
    _check_linear(a, w_b)
    return (a.dequantize() @ w_b.float().t()).to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# checks


def _check_quant_input(y: torch.Tensor, out: Mxfp8Tensor | None) -> None:
    if y.dim() != 2 or y.shape[1] % GROUP or not y.is_floating_point():
        raise ValueError(f"y must be a float [M, N] tensor with N % 32 == 0, got {y.dtype} {tuple(y.shape)}")
    if out is not None:
        if not isinstance(out, Mxfp8Tensor) or out.shape != y.shape:
            raise ValueError(f"out must be an Mxfp8Tensor of shape {tuple(y.shape)}")


def _check_wo_a(x: torch.Tensor, w_a: torch.Tensor) -> None:
    if x.dim() != 3 or w_a.dim() != 3 or x.shape[1] != w_a.shape[0] or x.shape[2] != w_a.shape[2]:
        raise ValueError(f"x must be [M, G, Kg] and w_a [G, R, Kg]; got {tuple(x.shape)} and {tuple(w_a.shape)}")
    if (w_a.shape[0] * w_a.shape[1]) % GROUP:
        raise ValueError(f"G * R must be a multiple of 32, got {w_a.shape[0] * w_a.shape[1]}")


def _check_linear(a, w_b: torch.Tensor) -> None:
    if not isinstance(a, Mxfp8Tensor):
        raise TypeError(f"a must be an Mxfp8Tensor, got {type(a).__name__}")
    if w_b.dim() != 2 or w_b.shape[1] != a.shape[1]:
        raise ValueError(f"w_b must be [N, {a.shape[1]}], got {tuple(w_b.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Triton

if triton is not None:

    def _rne_bf16(x):
        """fp32 -> nearest-even bf16 value, kept in fp32 (bit arithmetic: the CPU interpreter truncates casts)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True)

    def _e4m3_bits(v):
        """fp32 v with |v| <= 448 -> float8_e4m3fn code (int32 0..255), round to nearest even, from the bits."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag_bits = bits & 0x7FFFFFFF
        a = mag_bits.to(tl.float32, bitcast=True)
        # subnormal e4m3 (|v| < 2^-6): step 2^-9; rne via the 2^23 magic add (exact scaling by 512 first)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        # normal: keep 3 mantissa bits with nearest-even carry, rebias the exponent 127 -> 7
        rounded = (mag_bits + (0x7FFFF + ((mag_bits >> 20) & 1))) >> 20
        normal = rounded - (120 << 3)
        code = tl.where(a < 0.015625, sub, normal)
        return code | sign

    def _quantize_tile(
        y, M, row0, col_group0, data_ptr, data_stride, scale_ptr, GP, N, BM: tl.constexpr, GB: tl.constexpr
    ):
        """Quantize an fp32 tile [BM, GB*32] (rows row0.., groups col_group0..) and store data + swizzled scales.

        Scale bytes are written for every (row, group) of the tile inside the padded [Mp, GP] grid: 0 for padding.
        """
        rows = row0 + tl.arange(0, BM)
        groups = col_group0 + tl.arange(0, GB)
        g3 = tl.reshape(y, (BM, GB, 32))
        amax = tl.max(tl.abs(g3), axis=2)  # [BM, GB]
        n = amax * 0.002232142857142857  # fp32(1/448), as the reference
        nb = n.to(tl.int32, bitcast=True)
        e = (nb >> 23) & 0xFF
        mant = nb & 0x7FFFFF
        bump = (mant != 0) & ((e != 0) | (mant > 0x400000))
        sf = tl.where(n <= 0, 0, tl.minimum(e + bump.to(tl.int32), 254))
        inv_bits = tl.where(sf == 254, 0x00400000, (254 - sf) << 23)
        inv = tl.where(sf == 0, 0.0, inv_bits.to(tl.float32, bitcast=True))
        q = tl.minimum(tl.maximum(g3 * inv[:, :, None], -448.0), 448.0)
        codes = tl.reshape(_e4m3_bits(q), (BM, GB * 32))

        live_row = rows < M
        live_group = groups * 32 < N
        sf = tl.where(live_row[:, None] & live_group[None, :], sf, 0)
        off = (
            ((rows[:, None] // 128) * (GP // 4) + groups[None, :] // 4) * 512
            + (rows[:, None] % 32) * 16
            + ((rows[:, None] // 32) % 4) * 4
            + groups[None, :] % 4
        )
        tl.store(scale_ptr + off, sf.to(tl.uint8))
        cols = col_group0 * 32 + tl.arange(0, GB * 32)
        dmask = live_row[:, None] & (cols < N)[None, :]
        tl.store(data_ptr + rows[:, None].to(tl.int64) * data_stride + cols[None, :], codes.to(tl.uint8), mask=dmask)

    def _mxfp8_quantize_kernel(
        y_ptr, y_stride, data_ptr, data_stride, scale_ptr, M, N, GP, BM: tl.constexpr, GB: tl.constexpr
    ):
        row0 = tl.program_id(0) * BM
        g0 = tl.program_id(1) * GB
        rows = row0 + tl.arange(0, BM)
        cols = g0 * 32 + tl.arange(0, GB * 32)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        y = tl.load(y_ptr + rows[:, None].to(tl.int64) * y_stride + cols[None, :], mask=mask, other=0.0)
        _quantize_tile(y.to(tl.float32), M, row0, g0, data_ptr, data_stride, scale_ptr, GP, N, BM, GB)

    def _reduce_quantize_kernel(
        p_ptr,
        p_split_stride,
        p_row_stride,
        data_ptr,
        data_stride,
        scale_ptr,
        M,
        N,
        GP,
        S: tl.constexpr,
        BM: tl.constexpr,
        GB: tl.constexpr,
    ):
        """WO-A tail: y = bf16(sum_s partial[s]) summed s = 0..S-1 in order, then MXFP8 quantize."""
        row0 = tl.program_id(0) * BM
        g0 = tl.program_id(1) * GB
        rows = row0 + tl.arange(0, BM)
        cols = g0 * 32 + tl.arange(0, GB * 32)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        ptrs = p_ptr + rows[:, None].to(tl.int64) * p_row_stride + cols[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0)
        for s in tl.static_range(1, S):
            acc = acc + tl.load(ptrs + s * p_split_stride, mask=mask, other=0.0)
        _quantize_tile(_rne_bf16(acc), M, row0, g0, data_ptr, data_stride, scale_ptr, GP, N, BM, GB)

    def _wo_a_partials_kernel(
        x_ptr,
        sx_t,
        sx_g,
        w_ptr,
        sw_g,
        sw_n,
        p_ptr,
        M,
        R,
        Kg,
        SPLIT_LEN: tl.constexpr,
        G: tl.constexpr,
        S: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT_FP32: tl.constexpr,
        ROWWISE: tl.constexpr = False,
    ):
        """partial[s, t, g*R + n] = sum_{k in split s} x[t, g, k] * w[g, n, k]; fp32 accumulate (tl.dot).

        The split loop is unrolled (SPLIT_LEN is a compile-time constant) so all weight tiles of a program are
        requested up front: for M <= 16 this kernel is a weight-streaming GEMV and lives on memory parallelism.
        """
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_gs = tl.program_id(2)
        g = pid_gs // S
        s = pid_gs % S
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        k_lo = s * SPLIT_LEN
        k_hi = tl.minimum(k_lo + SPLIT_LEN, Kg)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        x_base = x_ptr + rows[:, None].to(tl.int64) * sx_t + g * sx_g
        w_base = w_ptr + g.to(tl.int64) * sw_g + cols[None, :].to(tl.int64) * sw_n
        for kk in tl.static_range(0, SPLIT_LEN, BK):
            ks = k_lo + kk + tl.arange(0, BK)
            kin = ks < k_hi
            a = tl.load(x_base + ks[None, :], mask=(rows < M)[:, None] & kin[None, :], other=0.0)
            b = tl.load(w_base + ks[:, None], mask=kin[:, None] & (cols < R)[None, :], other=0.0)
            if DOT_FP32:  # CPU interpreter: its dot reads bf16 operands as raw integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tile_dot(a, b, acc, False, ROWWISE)
        out = p_ptr + s.to(tl.int64) * M * (G * R) + rows[:, None].to(tl.int64) * (G * R) + g * R + cols[None, :]
        tl.store(out, acc, mask=(rows < M)[:, None] & (cols < R)[None, :])

    def _gpu_fence(dep):
        """fence.acq_rel.gpu (CUDA's __threadfence) in every thread; `dep` only gives the asm an operand."""
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [dep.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1
        )

    def _wo_a_fused_kernel(
        x_ptr,
        sx_t,
        sx_g,
        w_ptr,
        sw_g,
        sw_n,
        p_ptr,
        cnt_ptr,
        data_ptr,
        data_stride,
        scale_ptr,
        M,
        R,
        Kg,
        GP,
        SPLIT_LEN: tl.constexpr,
        G: tl.constexpr,
        S: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT_FP32: tl.constexpr,
        FENCE: tl.constexpr,
    ):
        """Single-launch WO-A for M <= BM: program (column tile c, split s) writes its fp32 partial; the last of
        the S programs of a column tile to arrive (atomic ticket) reduces s = 0..S-1 in order, rounds to bf16,
        quantizes, writes its scale column for all 128 padded rows and resets the ticket for the next call."""
        c = tl.program_id(0)
        s = tl.program_id(1)
        N = G * R
        col0 = c * BN
        g = col0 // R
        n0 = col0 % R
        rows = tl.arange(0, BM)
        cols = tl.arange(0, BN)
        k_lo = s * SPLIT_LEN
        k_hi = tl.minimum(k_lo + SPLIT_LEN, Kg)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        x_base = x_ptr + rows[:, None].to(tl.int64) * sx_t + g * sx_g
        w_base = w_ptr + g.to(tl.int64) * sw_g + (n0 + cols[None, :]).to(tl.int64) * sw_n
        for kk in tl.static_range(0, SPLIT_LEN, BK):
            ks = k_lo + kk + tl.arange(0, BK)
            kin = ks < k_hi
            a = tl.load(x_base + ks[None, :], mask=(rows < M)[:, None] & kin[None, :], other=0.0)
            b = tl.load(w_base + ks[:, None], mask=kin[:, None], other=0.0)
            if DOT_FP32:  # CPU interpreter: its dot reads bf16 operands as raw integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        tile = p_ptr + rows[:, None].to(tl.int64) * N + col0 + cols[None, :]
        live = (rows < M)[:, None] & (cols < BN)[None, :]
        tl.store(tile + s.to(tl.int64) * M * N, acc, mask=live)
        if FENCE:  # __threadfence() in every thread, then the CTA barrier, then one acq_rel ticket
            _gpu_fence(s)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + c, 1, sem="acq_rel", scope="gpu")
        if ticket == S - 1:
            if FENCE:
                _gpu_fence(s)
            tl.debug_barrier()
            y = tl.load(tile, mask=live, other=0.0, cache_modifier=".cg")
            for t in tl.static_range(1, S):
                y = y + tl.load(tile + t * M * N, mask=live, other=0.0, cache_modifier=".cg")
            _quantize_tile(_rne_bf16(y), M, 0, col0 // 32, data_ptr, data_stride, scale_ptr, GP, N, BM, BN // 32)
            grp = col0 // 32 + tl.arange(0, BN // 32)
            for rb in tl.static_range(BM, 128, BM):  # padded scale rows of this column tile: 0 on every call
                prow = rb + tl.arange(0, BM)
                off = (
                    (grp[None, :] // 4) * 512
                    + (prow[:, None] % 32) * 16
                    + ((prow[:, None] // 32) % 4) * 4
                    + grp[None, :] % 4
                )
                tl.store(scale_ptr + off, tl.zeros((BM, BN // 32), dtype=tl.uint8))
            tl.store(cnt_ptr + c, 0)

    def _mxfp8_linear_kernel(
        a_ptr,
        a_stride,
        scale_ptr,
        w_ptr,
        w_stride,
        o_ptr,
        o_stride,
        M,
        N,
        K,
        GP,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT_FP32: tl.constexpr,
        OUT_BF16: tl.constexpr,
        STAGES: tl.constexpr = 3,
        ROWWISE: tl.constexpr = False,
    ):
        """out[t, n] = sum_k dequant(a)[t, k] * w[n, k]: e4m3 decoded from bits, times 2^(sf-127), bf16 dot."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            ks = k + tl.arange(0, BK)
            amask = (rows < M)[:, None] & (ks < K)[None, :]
            code = tl.load(a_ptr + rows[:, None].to(tl.int64) * a_stride + ks[None, :], mask=amask, other=0)
            code = code.to(tl.int32)
            ex = (code >> 3) & 0xF
            mt = code & 0x7
            mag = tl.where(
                ex == 0, mt.to(tl.float32) * 0.001953125, ((ex + 120) << 23 | (mt << 20)).to(tl.float32, bitcast=True)
            )
            val = tl.where((code & 0x80) != 0, -mag, mag)
            grp = ks // 32
            soff = (
                ((rows[:, None] // 128) * (GP // 4) + grp[None, :] // 4) * 512
                + (rows[:, None] % 32) * 16
                + ((rows[:, None] // 32) % 4) * 4
                + grp[None, :] % 4
            )
            sf = tl.load(scale_ptr + soff, mask=amask, other=127).to(tl.int32)
            scale = tl.where(sf == 0, 0x00400000, sf << 23).to(tl.float32, bitcast=True)
            a = val * scale
            b = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * w_stride + ks[:, None],
                mask=(ks < K)[:, None] & (cols < N)[None, :],
                other=0.0,
            )
            if DOT_FP32:  # CPU interpreter: its dot reads bf16 operands as raw integers
                b = b.to(tl.float32)
            else:
                a = a.to(tl.bfloat16)  # exact: 4 significant bits (underflow below 2^-133 aside)
            acc = tile_dot(a, b, acc, False, ROWWISE)
        if OUT_BF16:
            acc = _rne_bf16(acc)  # then the cast below is exact (the interpreter's cast would truncate)
        tl.store(
            o_ptr + rows[:, None].to(tl.int64) * o_stride + cols[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=(rows < M)[:, None] & (cols < N)[None, :],
        )


# device functions the kernels call, in dependency order (kernels._backend.jit gives each kernel them jitted)
_HELPERS = (_rne_bf16, _e4m3_bits, _quantize_tile, _gpu_fence, tile_dot) if triton is not None else ()


def _launch_quantize(y_or_partials: torch.Tensor, out: Mxfp8Tensor, splits: int) -> None:
    m, n = out.shape
    if m == 0:
        return
    gp = _ceil_to(n // GROUP, 4)
    bm, gb = 16, 4
    grid = (_ceil_to(m, 128) // bm, gp // gb)
    data_u8 = out.data.view(torch.uint8)
    if splits == 0:
        kernel = jit(_mxfp8_quantize_kernel, helpers=_HELPERS)
        kernel[grid](
            y_or_partials, y_or_partials.stride(0), data_u8, data_u8.stride(0), out.scales, m, n, gp, BM=bm, GB=gb
        )
    else:
        p = y_or_partials
        kernel = jit(_reduce_quantize_kernel, helpers=_HELPERS)
        kernel[grid](
            p, p.stride(0), p.stride(1), data_u8, data_u8.stride(0), out.scales, m, n, gp, S=splits, BM=bm, GB=gb
        )


def mxfp8_quantize(y: torch.Tensor, *, out: Mxfp8Tensor | None = None, backend: str = "auto") -> Mxfp8Tensor:
    """Quantize y [M, N] (fp32/bf16/fp16, N % 32 == 0) to MXFP8; writes `out` (every byte) when given.

    Byte-identical to `mxfp8_quantize_reference`.
    """
    _check_quant_input(y, out)
    out_tensors = [out.data, out.scales] if out is not None else []
    guard = y.stride(1) == 1 and y.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not use_triton(backend, [y, *out_tensors], guard):
        return mxfp8_quantize_reference(y, out=out)
    out = out if out is not None else Mxfp8Tensor.empty(*y.shape, device=y.device)
    _launch_quantize(y, out, 0)
    return out


def mxfp8_reduce_quantize(
    partials: torch.Tensor, *, out: Mxfp8Tensor | None = None, backend: str = "auto"
) -> Mxfp8Tensor:
    """Fused WO-A tail on fp32 partials [S, M, N]: sequential reduce, bf16 round, MXFP8. Byte-exact vs reference."""
    if partials.dim() != 3 or partials.dtype != torch.float32:
        raise ValueError(f"partials must be fp32 [S, M, N], got {partials.dtype} {tuple(partials.shape)}")
    _check_quant_input(partials[0], out)
    out_tensors = [out.data, out.scales] if out is not None else []
    if not use_triton(backend, [partials, *out_tensors], partials.stride(2) == 1):
        return mxfp8_reduce_quantize_reference(partials, out=out)
    out = out if out is not None else Mxfp8Tensor.empty(*partials.shape[1:], device=partials.device)
    _launch_quantize(partials, out, partials.shape[0])
    return out


def _wo_a_guard(x: torch.Tensor, w_a: torch.Tensor) -> bool:
    return (
        x.dtype == w_a.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(2) == 1
        and w_a.stride(2) == 1
        and w_a.shape[1] >= 16
    )


def wo_a_partials(
    x: torch.Tensor, w_a: torch.Tensor, *, backend: str = "auto", invariant: bool = False
) -> torch.Tensor:
    """fp32 split-K partials [8, M, G*R] of the grouped projection (splits: `wo_a_split_bounds`).

    x [M, G, Kg] bf16 with unit last stride (any row/group strides, e.g. a view of the padded attention output),
    w_a [G, R, Kg] bf16. The Triton kernel accumulates each split in its own tile order (fp32), so it agrees with
    the reference to fp32 rounding, not bitwise.
    """
    _check_wo_a(x, w_a)
    if not use_triton(backend, [x, w_a], _wo_a_guard(x, w_a)):
        return wo_a_partials_reference(x, w_a)
    m, g, kg = x.shape
    r = w_a.shape[1]
    split_len = _ceil_to(-(-kg // SPLITS), SPLIT_ALIGN)  # the split length of `wo_a_split_bounds`
    partials = torch.empty(SPLITS, m, g * r, dtype=torch.float32, device=x.device)
    if m == 0:
        return partials
    small = m <= 16 and not invariant  # invariant: one tile shape at every M
    bm = 16 if small else 64
    bn = 32 if small else 64  # small M: more programs in flight over the 8 splits x G groups
    bk = SPLIT_ALIGN
    grid = (triton.cdiv(m, bm), triton.cdiv(r, bn), g * SPLITS)
    kernel = jit(_wo_a_partials_kernel, helpers=_HELPERS)
    kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        w_a,
        w_a.stride(0),
        w_a.stride(1),
        partials,
        m,
        r,
        kg,
        SPLIT_LEN=split_len,
        G=g,
        S=SPLITS,
        BM=bm,
        BN=bn,
        BK=bk,
        DOT_FP32=interpret_mode(),
        ROWWISE=invariant and interpret_mode(),
    )
    return partials


_TICKETS: dict[tuple, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 arrival counters of the single-launch WO-A, one per column tile; every launch leaves them 0.

    Cached per device (allocate outside CUDA-graph capture: the first call normally does). Two single-launch
    WO-A calls must not run concurrently on different streams: they would share these counters.
    """
    key = (device, count)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return _TICKETS[key]


def _single_launch_ok(x: torch.Tensor, w_a: torch.Tensor, bn: int) -> bool:
    g, r, _ = w_a.shape
    return x.shape[0] <= 16 and r % bn == 0 and (g * r // GROUP) % 4 == 0


def wo_a_mxfp8(
    x: torch.Tensor,
    w_a: torch.Tensor,
    *,
    out: Mxfp8Tensor | None = None,
    backend: str = "auto",
    single_launch: bool = True,
    invariant: bool = False,
) -> Mxfp8Tensor:
    """Grouped output projection A fused with MXFP8 quantization of its bf16 output.

    x [M, G, Kg] bf16 (unit last stride), w_a [G, R, Kg] bf16 -> Mxfp8Tensor [M, G*R]. Two launches: the split-K
    partial GEMM (8 fixed splits, fp32) and one reduce+quantize pass (sum s = 0..7 in order, bf16 round, MXFP8
    with every scale padding byte rewritten). Production shape: w_a [2, 1024, 4096], M = 1..8 (one 16-row tile);
    any M works (M > 128 uses several 128-row scale tiles).
    Exactness: byte-equal to `mxfp8_reduce_quantize_reference(wo_a_partials(x, w_a))` on the kernel's partials;
    against the all-reference chain only as close as the fp32 partials (a bf16 tie can flip one code).

    single_launch=True (Triton, M <= 16, R % 32 == 0, G*R % 128 == 0; otherwise the two launches): one kernel in
    which the last split to finish a 32-column tile (atomic ticket) does the reduce+quantize for that tile; same
    partials and the same byte-exact tail. Saves a launch at small M. The default since the H200 run of
    benchmarks/kernels/kernels_gpu.py: bytes equal to the two-launch path for M 1..8 and 16 (twice each) and under
    CUDA-graph
    replay; 8.2-8.4 us against 8.9-9.3 us for two launches at [2, 1024, 4096]. Two concurrent calls on different
    streams must not share the ticket counters (they live per device), so keep it on one stream.

    `invariant` (--deterministic): the two launches with one tile shape at every M (no single launch).
    """
    _check_wo_a(x, w_a)
    m = x.shape[0]
    n = w_a.shape[0] * w_a.shape[1]
    if out is not None and (not isinstance(out, Mxfp8Tensor) or out.shape != (m, n)):
        raise ValueError(f"out must be an Mxfp8Tensor of shape {(m, n)}")
    out_tensors = [out.data, out.scales] if out is not None else []
    if not use_triton(backend, [x, w_a, *out_tensors], _wo_a_guard(x, w_a)):
        return wo_a_mxfp8_reference(x, w_a, out=out)
    if single_launch and not invariant and _single_launch_ok(x, w_a, 32) and m > 0:
        return _wo_a_single_launch(x, w_a, out)
    partials = wo_a_partials(x, w_a, backend="triton", invariant=invariant)
    return mxfp8_reduce_quantize(partials, out=out, backend="triton")


def _wo_a_single_launch(x: torch.Tensor, w_a: torch.Tensor, out: Mxfp8Tensor | None) -> Mxfp8Tensor:
    m, g, kg = x.shape
    r = w_a.shape[1]
    n = g * r
    bn = 32
    out = out if out is not None else Mxfp8Tensor.empty(m, n, device=x.device)
    split_len = _ceil_to(-(-kg // SPLITS), SPLIT_ALIGN)
    partials = torch.empty(SPLITS, m, n, dtype=torch.float32, device=x.device)
    tickets = _tickets(x.device, n // bn)
    data_u8 = out.data.view(torch.uint8)
    jit(_wo_a_fused_kernel, helpers=_HELPERS)[(n // bn, SPLITS)](
        x,
        x.stride(0),
        x.stride(1),
        w_a,
        w_a.stride(0),
        w_a.stride(1),
        partials,
        tickets,
        data_u8,
        data_u8.stride(0),
        out.scales,
        m,
        r,
        kg,
        _ceil_to(n // GROUP, 4),
        SPLIT_LEN=split_len,
        G=g,
        S=SPLITS,
        BM=16,
        BN=bn,
        BK=SPLIT_ALIGN,
        DOT_FP32=interpret_mode(),
        FENCE=not interpret_mode(),
    )
    return out


def mxfp8_linear(
    a: Mxfp8Tensor, w_b: torch.Tensor, *, out_dtype=torch.bfloat16, backend: str = "auto", invariant: bool = False
) -> torch.Tensor:
    """WO-B on an MXFP8 activation: [M, K] x w_b [N, K] (bf16) -> out_dtype [M, N]. `invariant` (--deterministic):
    the large-M tiles (K steps of 64) at every M, so a row's K order does not depend on M.

    The Triton kernel dequantizes each A tile in registers (e4m3 decoded from bits, times the E8M0 scale) and runs
    a bf16 tensor-core dot with fp32 accumulation (no MX tensor cores needed). What is exact: every dequantized
    value (4 significant bits) is exact in bf16, and every product of it with a bf16 weight (<= 12 significant bits)
    is exact in fp32; only the fp32 accumulation order differs from the reference (dequantize, fp32 matmul), so
    |kernel - reference| <= ~K * 2^-24 * sum_k |a_k w_k| before the final out_dtype rounding.
    """
    _check_linear(a, w_b)
    guard = (
        w_b.dtype == torch.bfloat16
        and w_b.stride(1) == 1
        and a.data.stride(1) == 1
        and out_dtype in (torch.bfloat16, torch.float32)
    )
    if not use_triton(backend, [a.data, a.scales, w_b], guard):
        return mxfp8_linear_reference(a, w_b, out_dtype=out_dtype)
    m, k = a.shape
    n = w_b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=w_b.device)
    if m == 0:
        return out
    small = m <= 16 and not invariant  # weight-streaming regime: more, narrower column tiles and longer K steps
    bm, bn, bk = (16 if small else 64), (32 if small else 64), (128 if small else 64)
    gp = _ceil_to(k // GROUP, 4)
    data_u8 = a.data.view(torch.uint8)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    kernel = jit(_mxfp8_linear_kernel, helpers=_HELPERS)
    kernel[grid](
        data_u8,
        data_u8.stride(0),
        a.scales,
        w_b,
        w_b.stride(0),
        out,
        out.stride(0),
        m,
        n,
        k,
        gp,
        BM=bm,
        BN=bn,
        BK=bk,
        DOT_FP32=interpret_mode(),
        OUT_BF16=out_dtype == torch.bfloat16,
        ROWWISE=invariant and interpret_mode(),
    )
    return out
