"""What evalpipe relies on from sgl-eval's private modules (evalpipe/lanes/sgl_eval_adapter.py), pinned: an sgl-eval
that moves or changes any of them fails here, by name, before an AIME score silently changes."""

from __future__ import annotations

import pytest

from evalpipe.digest import file_sha256
from evalpipe.lanes import load_pins, sgl_eval_adapter
from evalpipe.lanes.data import read_jsonl


def test_the_vendored_aime26_file_is_the_pinned_one():
    path = sgl_eval_adapter.aime26_dataset()
    assert file_sha256(path) == load_pins("aime26")["dataset_sha256"]
    rows = read_jsonl(path)
    assert [r["id"] for r in rows] == [f"aime26-{i}" for i in range(30)]
    assert all({"id", "problem", "expected_answer"} <= set(r) for r in rows)


def test_the_matharena_prompt_is_the_pinned_one_and_renders_with_str_format():
    template = sgl_eval_adapter.prompt_template("matharena-aime")
    assert file_sha256(template) == load_pins("aime26")["template_sha256"]
    assert sgl_eval_adapter.render_prompt(template, problem="Find {x}.") == (
        "Please reason step by step, and put your final answer within \\boxed{}.\n"
        "The answer is an integer between 0 and 999 inclusive.\n\nFind {x}."
    )


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{12} and then \\boxed{\\frac{1}{2}} end", "\\frac{1}{2}"),  # the last box counts
        ("\\boxed{a{b}c}", "a{b}c"),  # braces matched, not the first closing one
        ("no box here: 12", None),
        ("", None),
    ],
)
def test_search_boxed_takes_the_last_brace_matched_box(text, boxed):
    assert sgl_eval_adapter.search_boxed(text) == boxed


@pytest.mark.parametrize(
    "gold, pred, equal",
    [
        ("12", "12", True),
        ("12", "12.0", True),
        ("1/2", "\\frac{1}{2}", True),
        ("12", "13", False),
        ("12", None, False),
    ],
)
def test_math_equal_verdicts(gold, pred, equal):
    math_equal = sgl_eval_adapter.math_equal()
    assert math_equal(gold, pred, numeric_precision=15, timeout_seconds=10) is equal


def test_math_metrics_names_the_figures_summary_reads():
    """summary.repeated_metrics reads pass@k, majority@k and pass@1[avg-of-k] (symbolic_correct, no_answer, the
    spread across repeats), in percent. Two questions x two samples: right+none, wrong+wrong."""
    metrics = sgl_eval_adapter.math_metrics()
    metrics.update(
        [{"predicted_answer": "1", "symbolic_correct": True}, {"predicted_answer": None, "symbolic_correct": False}]
    )
    metrics.update(
        [{"predicted_answer": "2", "symbolic_correct": False}, {"predicted_answer": "2", "symbolic_correct": False}]
    )
    got = metrics.get_metrics()
    assert got["pass@2"]["symbolic_correct"] == pytest.approx(50.0)
    assert got["majority@2"]["symbolic_correct"] == pytest.approx(50.0)
    avg = got["pass@1[avg-of-2]"]
    assert avg["symbolic_correct"] == pytest.approx(25.0)
    assert avg["no_answer"] == pytest.approx(25.0)  # NeMo-Skills counts a sample without an answer, whatever why
    assert avg["symbolic_correct_statistics"]["std_dev_across_runs"] == pytest.approx(0.5**0.5 / 2)
    assert avg["symbolic_correct_statistics"]["std_err_across_runs"] == pytest.approx(0.25)
