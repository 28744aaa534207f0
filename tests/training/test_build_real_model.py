"""training/build_real_model.py (`make real-model`): the folder it built verifies against manifests/real_models.json
and is left alone; a converted file or a downloaded wheel that differs from its pin is refused (exit 1, naming it,
nothing built). Needs what `make real-model` leaves in .evalpipe-cache (skipped where absent; under CI=true, where
.ci/run builds it, a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "training" / "build_real_model.py"
SPEC = json.loads((REPO / "manifests" / "real_models.json").read_text())["SmolLM2-135M-Instruct"]
MODEL_DIR = REPO / ".evalpipe-cache" / "models" / "SmolLM2-135M-Instruct"
WHEEL = REPO / ".evalpipe-cache" / "downloads" / SPEC["wheel"]["file"]


def require(path: Path) -> None:
    if path.exists():
        return
    reason = f"{path} is missing (`make real-model` builds it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must test the real model's build: {reason}")
    pytest.skip(reason)


def build(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_built_folder_verifies_and_a_corrupted_copy_is_refused(tmp_path):
    require(MODEL_DIR)
    r = build("--out", MODEL_DIR)
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in MODEL_DIR.iterdir() if not p.name.startswith(".")) == sorted(SPEC["files"])

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in MODEL_DIR.iterdir():
        if f.name == "model.safetensors":
            (copy / f.name).symlink_to(f)  # read, never written: the weights stay as built
        else:
            (copy / f.name).write_bytes(f.read_bytes())
    assert build("--check", "--out", copy).returncode == 0
    flip_a_byte(copy / "config.json")
    r = build("--check", "--out", copy)
    assert r.returncode == 1 and r.stderr.startswith("sha256 mismatch, refused: converted file config.json"), r.stderr
    assert SPEC["files"]["config.json"] in r.stderr  # the pin it was held to
    (copy / "config.json").unlink()
    r = build("--check", "--out", copy)
    assert r.returncode == 1 and "files missing ['config.json']" in r.stderr, r.stderr


def test_a_corrupted_wheel_is_refused_before_anything_is_built(tmp_path):
    require(WHEEL)
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / WHEEL.name).write_bytes(WHEEL.read_bytes())
    flip_a_byte(downloads / WHEEL.name)
    r = build("--cache", tmp_path / "cache", "--out", tmp_path / "out")
    assert r.returncode == 1 and r.stderr.startswith(f"sha256 mismatch, refused: wheel {WHEEL.name}"), r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache" / "gguf").exists()
