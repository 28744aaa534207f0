"""The training stream's batch shapes: `--short-buckets` is checked before torch loads, `batch_shapes` names every
shape the stream yields (what `--step compiled` compiles before its clock starts), and that precompile pass leaves
the weights, gradients and router counts as they were."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training import buckets, data, trainer
from training.train_default_model import parse_args

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "short, long_every",
    [((512, 1024), 3), (buckets.SHORT_BUCKETS, 0)],
)
def test_batch_shapes_names_every_shape_the_stream_yields(short, long_every):
    predicted = set(buckets.batch_shapes(6000, 9000, long_every, short))
    stream = iter(
        data.BatchStream(seed=5, batch_tokens=6000, long_tokens=9000, long_every=long_every, short_buckets=short)
    )
    seen = {tuple(next(stream)["input_ids"].shape) for _ in range(24)}
    assert seen <= predicted, seen - predicted
    assert len(seen) >= 2  # more than one bucket drawn, so the check above compares shapes, not a single one
    if long_every:
        assert any(width in buckets.LONG_BUCKETS for _, width in seen)


@pytest.mark.parametrize(
    "text, why",
    [
        ("512,256,1024", "rising"),
        ("256,512", "at least 1024"),
        ("0,1024", "rising positive"),
        ("a,1024", "comma-separated lengths"),
        ("", "rising positive"),
    ],
)
def test_bad_short_buckets_are_refused_before_torch_loads(text, why):
    with pytest.raises(ValueError, match=why):
        buckets.parse_short(text)
    proc = subprocess.run(
        [sys.executable, "training/train_default_model.py", "--out", "/tmp/unused", "--short-buckets", text],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and f"--short-buckets {text!r}: " in proc.stderr and why in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_precompile_runs_each_shape_and_top_k_and_leaves_the_model_as_it_was():
    args = parse_args(
        ["--out", "/dev/null", "--batch-tokens", "300", "--long-every", "0", "--short-buckets", "96,1024"]
    )
    device = torch.device("cpu")
    model = trainer.build_model(args, device)
    taps = trainer.objectives.Taps(model, [3, 4])
    losses = trainer.step_losses(model, args, [3, 4], device, "fast")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ran = trainer.precompile(
        model, taps, args, device, lambda: torch.autocast("cpu", enabled=False), losses, [10**9, 32]
    )
    assert ran == 2 * 2  # shapes (4, 96) and (1, 1024), each at the dense and the sparse top-k
    assert all(p.grad is None for p in model.parameters())
    assert taps.router_counts == {}
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
