"""Find dataset files and refuse ones whose bytes differ from the pin.

Why: SGLang and NeMo-Skills both fetch GSM8K from an unpinned `master` URL. A score is only comparable
when the exact file is known, so every file is hashed and checked against `evalpipe/lanes/pins/<lane>.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]  # the source checkout (this file is evalpipe/lanes/data.py)
CACHE_DIR = REPO_ROOT / ".evalpipe-cache"


class DataError(Exception):
    """A dataset could not be found, or its hash differs from the pin (message says what to do)."""


def data_dir_candidates(data_dir: Optional[Path]) -> list[Path]:
    """--data-dir, then $EVALPIPE_DATA_DIR, then the checkout's sibling `../shared/data`; absolute, so that the path a
    manifest records still names the file when the run is resumed or audited from another directory."""
    out = []
    if data_dir is not None:
        out.append(Path(data_dir).absolute())
        return out  # an explicit flag is never silently replaced by another location
    if os.environ.get("EVALPIPE_DATA_DIR"):
        out.append(Path(os.environ["EVALPIPE_DATA_DIR"]).absolute())
    out.append(REPO_ROOT.parent / "shared" / "data")
    return out


def recorded_data_dir(dataset_path: str) -> Optional[Path]:
    """The data folder a run used, from the dataset path its manifest records (`DIR/gsm8k/test.jsonl`); None for a
    generated lane or a file that is not there any more (the usual search then applies)."""
    path = Path(dataset_path)
    if path.is_absolute() and path.is_file() and path.parent.name == "gsm8k":
        return path.parent.parent
    return None


def find_gsm8k_test(data_dir: Optional[Path]) -> Path:
    """Locate `gsm8k/test.jsonl`; fall back to the `datasets` hub copy (needs network) as a last resort."""
    tried = []
    for d in data_dir_candidates(data_dir):
        p = d / "gsm8k" / "test.jsonl"
        tried.append(str(p))
        if p.is_file():
            return p
    if data_dir is not None:
        raise DataError(f"GSM8K file not found: {tried[0]} (pass --data-dir DIR containing gsm8k/test.jsonl)")
    cached = CACHE_DIR / "gsm8k" / "test.jsonl"
    if cached.is_file():
        return cached
    try:
        return _download_gsm8k(cached)
    except Exception as exc:  # no network, no datasets: say where we looked
        raise DataError(
            "GSM8K test.jsonl not found in "
            + ", ".join(tried)
            + f" and the `datasets` download failed ({type(exc).__name__}: {exc}). "
            "Pass --data-dir DIR (with gsm8k/test.jsonl inside) or set EVALPIPE_DATA_DIR."
        ) from exc


def _download_gsm8k(dest: Path) -> Path:
    """Rebuild test.jsonl from the HF hub copy. Its bytes may differ from the pinned GitHub file: the pin
    check then reports drift, which is the honest outcome."""
    import datasets  # heavy; only on this fallback path

    ds = datasets.load_dataset("openai/gsm8k", "main", split="test")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in ds:
            fh.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    os.replace(tmp, dest)
    return dest


def check_pin(path: Path, actual_sha256: str, pinned_sha256: str, allow_drift: bool) -> bool:
    """Return True when the file drifted (and drift was allowed); raise DataError when not allowed."""
    if actual_sha256 == pinned_sha256:
        return False
    if allow_drift:
        return True
    raise DataError(
        f"dataset {path} has sha256 {actual_sha256}, but the pin is {pinned_sha256}. "
        "Scores on a different file are not comparable. Use the pinned file, or pass --allow-data-drift "
        "to run anyway (the drift is recorded in the manifest and summary)."
    )


def read_jsonl(path: Path) -> list[dict]:
    with open(path, "r", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
