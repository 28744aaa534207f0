"""Every use of sgl-eval's private modules, in one place (sgl-eval is pinned to 0.1.0 in pyproject).

sgl-eval vendors NeMo-Skills' AIME 2026 data, its MathArena prompt, the `\\boxed{}` extractor, the `math_equal`
grader and the pass@k metrics under private names (`sgl_eval._vendored...`, `sgl_eval.evals._prompts`). Reusing
them keeps evalpipe's AIME protocol identical to sgl-eval's; keeping them here means an sgl-eval upgrade that moves
them breaks this module only, and tests/lanes/test_sgl_eval_adapter.py pins what each one is relied on to do.
The imports are lazy: sympy and math-verify load only where an AIME lane needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional


def aime26_dataset() -> Path:
    """The vendored AIME 2026 problems (JSON lines: id, problem, expected_answer)."""
    import sgl_eval

    return Path(sgl_eval.__file__).resolve().parent / "_vendored" / "nemo_skills" / "dataset" / "aime26" / "test.txt"


def prompt_template(name: str) -> Path:
    """The YAML file of a prompt sgl-eval vendors (e.g. `matharena-aime`)."""
    from sgl_eval.evals._prompts import vendored_prompt

    return vendored_prompt(name)


def render_prompt(template: Path, **fields: Any) -> str:
    """The template's user message with `fields` filled in (`str.format`), as sgl-eval renders it."""
    from sgl_eval.evals._prompts import render_prompt as render

    return render(template, **fields)


def search_boxed(text: str) -> Optional[str]:
    """Content of the last brace-matched `\\boxed{...}` of `text`, else None."""
    from sgl_eval._vendored.nemo_skills.math_grader import search_boxed as search

    return search(text)


def math_equal() -> Callable[..., bool]:
    """NeMo-Skills' `math_equal(gold, pred, numeric_precision=, timeout_seconds=)` (math-verify underneath; it arms
    SIGALRM, so call it from a main thread only). Importing it loads sympy: a grader process does it once, at start."""
    from sgl_eval._vendored.nemo_skills.math_grader import math_equal as equal

    return equal


def math_metrics():
    """A fresh NeMo-Skills `MathMetrics`: `update(samples)` per question, then `get_metrics()`."""
    from sgl_eval._vendored.nemo_skills.math_metrics import MathMetrics

    return MathMetrics()


def eval_category(name: str) -> Optional[str]:
    """sgl-eval's category of a benchmark (`math`, `multichoice`, ...), None for a name it does not register."""
    from sgl_eval.registry import get

    try:
        return get(name).category
    except KeyError:
        return None
