"""`evalpipe run --sample-seeds BASE`: one seed per (question, repeat), derived from BASE alone.

seed = the first 8 bytes of SHA-256("evalpipe-sample-seed/v1:{BASE}:{question_id}:{repeat}") as a big-endian
integer, shifted right by one bit (63 bits, so every OpenAI-compatible server takes it as a non-negative int64).
The same BASE gives the same seed to the same (question, repeat) in every arm, run and machine, and different
questions and repeats different seeds. On a server whose sampled tokens are a function of the prompt and the seed
(evalpipe serve --deterministic: keyed sampling), two arms given the same BASE draw the same tokens wherever their
distributions agree, so `evalpipe compare` can check them for identity.
"""

from __future__ import annotations

import hashlib
from typing import Any

DERIVATION = "sha256('evalpipe-sample-seed/v1:{base}:{question_id}:{repeat}')[:8] >> 1"


def sample_seed(base: int, question_id: Any, repeat: int) -> int:
    """The seed of (question_id, repeat) under --sample-seeds `base` (module docstring)."""
    key = f"evalpipe-sample-seed/v1:{int(base)}:{question_id}:{int(repeat)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1
