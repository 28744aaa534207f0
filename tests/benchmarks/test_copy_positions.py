"""benchmarks/model/copy_positions.py: the per-position table's arithmetic, its refusals, and one short measurement
of the
shipped model (every row present, one cell per block of the longest answer)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.model import copy_positions as cp


def test_summarize_counts_each_block_over_the_rows_that_reach_it():
    rows = [[1, 1, 1, 0, 1], [1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]
    out = cp.summarize(rows, 3)
    assert out == {"n": 3, "exact": round(1 / 3, 3), "positions": [round(8 / 9, 3), round(4 / 5, 3), 1.0]}
    assert cp.summarize([[1], [1]], 1) == {"n": 2, "exact": 1.0, "positions": [1.0]}
    assert cp.summarize([[0, 0]], 16)["positions"] == [0.0]


def test_table_leaves_blocks_past_a_rows_end_blank():
    text = cp.table(
        "t",
        {"short": {"exact": 0.5, "positions": [0.25]}, "long": {"exact": 0.0, "positions": [1.0, 0.0]}},
        ["0-", "16-"],
    )
    short, long = text.splitlines()[2:]
    assert short.split() == ["short", "0.50", "0.25"] and long.split() == ["long", "0.00", "1.00", "0.00"]


def test_refuses_a_folder_without_a_checkpoint_and_a_zero_count(tmp_path):
    with pytest.raises(SystemExit, match="no config.json there"):
        cp.main(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="at least 1"):
        cp.main(["--n", "0"])


def test_measures_every_row_of_the_shipped_model():
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM.from_pretrained(cp.DEFAULT_MODEL, dtype=torch.float32).eval()
    out = cp.measure(model, 1, seed=11, depths=cp.DEPTHS[:1])
    assert list(out["copy"]) == [label for label, _, _ in cp.COPY_ROWS]
    for (label, lo, hi), row in zip(cp.COPY_ROWS, out["copy"].values()):
        assert math.ceil(lo / cp.BLOCK) <= len(row["positions"]) <= math.ceil(hi / cp.BLOCK)
        assert all(0.0 <= v <= 1.0 for v in row["positions"]) and row["n"] == 1
    (depth,) = out["retrieval"].values()
    assert len(depth["positions"]) == 6  # the leading space and five digits
    assert depth["positions"][0] == 1.0  # the shipped model starts every answer with the space
