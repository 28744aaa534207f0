"""Write the byte tokenizer's Hugging Face files (evalpipe/engine/tokenizer_files.py) into the shipped default
model's folder and pin their sha256 in manifests/default_model.json, beside the weights' pins.

    python training/write_tokenizer_files.py            # rewrite evalpipe/models/evalpipe-skills-dsv4 and its pins
    python training/write_tokenizer_files.py --check    # exit 1 if the shipped files differ from what is built now
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evalpipe.digest import file_sha256  # noqa: E402
from evalpipe.engine.model.names import DEFAULT_MODEL_NAME  # noqa: E402
from evalpipe.engine.model.weights import MODEL_PINS, PACKAGED_MODELS_DIR  # noqa: E402
from evalpipe.engine.tokenizer_files import TOKENIZER_FILES, write_tokenizer_files  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; write nothing (exit 1 on a difference)")
    args = ap.parse_args(argv)
    folder = PACKAGED_MODELS_DIR / DEFAULT_MODEL_NAME
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            built = {p.name: file_sha256(p) for p in write_tokenizer_files(tmp)}
        shipped = {
            name: file_sha256(folder / name) if (folder / name).is_file() else "missing" for name in TOKENIZER_FILES
        }
        for name in TOKENIZER_FILES:
            print(f"{name}: {'same' if built[name] == shipped[name] else 'DIFFERS'}")
        return 0 if built == shipped else 1
    pins = json.loads(MODEL_PINS.read_text())
    files = pins[DEFAULT_MODEL_NAME]["files"]
    for path in write_tokenizer_files(folder):
        files[path.name] = file_sha256(path)
        print(f"{path}: sha256 {files[path.name]}")
    MODEL_PINS.write_text(json.dumps(pins, indent=2) + "\n")
    print(f"pins updated: {MODEL_PINS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
