"""The comparison as compare.json: the result dict as it is, the record every other view is built from."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(result: dict, out_dir: Path) -> Path:
    path = out_dir / "compare.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return path
