"""The sha256 of a file, read in 1 MiB blocks: one definition for the pins the lanes, the run folder and the
shipped model's manifest are checked against."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
