"""Keyed noise: the random numbers of a seeded request as a pure function of (seed, completion index, vocab id).

A counter-based generator, no stream state: the noise for output token i of a request with seed s is computed from
(s, i, v) alone, so a token depends only on its distribution and that key -- not on the batch it ran in, not on how
many draws came before it, not on whether a drafter proposed it (spec/decoder.py's sample-verify relies on this).

The key of a row (s, i) is mixed in Python with exact integers (SplitMix64, Steele et al. 2014), giving two 32-bit
row keys. Per vocab id v the tensor part applies the MurmurHash3 32-bit finalizer (`fmix32`) four times, keyed by the
row keys; every intermediate is a non-negative int64 below 2**49 (a 32-bit value times a 16-bit half of a constant),
so no operation overflows or shifts a sign bit, and the integers are the same on any device. They become a uniform
u = (2m + 1) / 2**53 from 52 bits m (strictly inside (0, 1)), and E = -log(u) ~ Exp(1) in float64 (the device's log:
spec on/off and batch shapes run on one device, so their noise is the same bits).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
SALT_TOKEN = 0  # the token sample at a position
SALT_FAULT = 1  # planted faults' extra draws (engine/faults.py), so they never reuse the token's noise
SALT_COIN = 2  # a lossy acceptance rule's coin at a position (spec/accept.py keyed_accept)


def splitmix64(x: int) -> int:
    """SplitMix64's output function on a 64-bit integer (exact Python ints)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, index: int, salt: int = SALT_TOKEN) -> tuple[int, int]:
    """The two 32-bit keys of output token `index` of a request seeded `seed` (any int, taken modulo 2**64)."""
    z = splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ (index & _MASK64)) ^ salt)
    return z & _MASK32, z >> 32


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 a in [0, 2**32): c split in 16-bit halves, so every product stays below 2**49."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of [0, 2**32)) on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def hash_bits(keys: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit hashes per (row, vocab id): keys [rows, 2] int64 row keys -> two [rows, vocab] int64 tensors."""
    v = torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0)
    k1, k2 = keys[:, :1], keys[:, 1:]
    h1 = fmix32(fmix32(v ^ k1) ^ k2)  # distinct v give distinct h1 (bijections of v)
    h2 = fmix32(fmix32(h1 ^ k1 ^ 0x6A09E667) ^ k2)
    return h1, h2


def row_keys(rows: list[tuple[int, int]], salt: int, device) -> torch.Tensor:
    """[len(rows), 2] int64 row keys of (seed, output index) pairs, which may come from many requests."""
    return torch.tensor([row_key(seed, index, salt) for seed, index in rows], dtype=torch.int64, device=device).view(
        len(rows), 2
    )


def uniforms_of(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 uniforms in (0, 1) of row keys [rows, 2]."""
    h1, h2 = hash_bits(keys, vocab)
    m = (h1 >> 6) * (1 << 26) + (h2 >> 6)  # 26 + 26 bits
    return (2 * m + 1).to(torch.float64) * 2.0**-53


def exponentials_of(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 Exp(1) draws, each > 0, of row keys [rows, 2]."""
    return -torch.log(uniforms_of(keys, vocab))


class KeyedNoise:
    """A request's noise source under keyed sampling (`--deterministic`): `seed` and nothing else."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    def keys(self, start: int, rows: int, salt: int, device) -> torch.Tensor:
        return row_keys([(self.seed, start + r) for r in range(rows)], salt, device)

    def uniforms(self, start: int, rows: int, vocab: int, device, salt: int = SALT_TOKEN) -> torch.Tensor:
        """[rows, vocab] float64 uniforms in (0, 1) for output tokens start .. start + rows - 1."""
        return uniforms_of(self.keys(start, rows, salt, device), vocab)

    def exponentials(self, start: int, rows: int, vocab: int, device, salt: int = SALT_TOKEN) -> torch.Tensor:
        """[rows, vocab] float64 Exp(1) draws, each > 0."""
        return exponentials_of(self.keys(start, rows, salt, device), vocab)

    def __repr__(self) -> str:
        return f"KeyedNoise(seed={self.seed})"
