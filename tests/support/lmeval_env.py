"""A real lm-evaluation-harness for the tests: where its `lm_eval` is, and one way to run it against a server.

lm-eval lives in its own environment (`make lmeval-env` installs it into .venv-lmeval; EVALPIPE_LMEVAL points at
another `lm_eval`). Where it is missing the tests skip and say why; under CI (CI=true) a missing one fails them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LM_EVAL = os.environ.get("EVALPIPE_LMEVAL") or str(REPO / ".venv-lmeval" / "bin" / "lm_eval")
TASKS = REPO / "lm_eval_tasks"


def require_lmeval() -> str:
    """The `lm_eval` executable; skips (or, under CI, fails) when it is not installed."""
    if Path(LM_EVAL).exists():
        return LM_EVAL
    reason = f"no lm-eval at {LM_EVAL} (`make lmeval-env` installs lm-eval[api]==0.4.13 into .venv-lmeval)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the lm-eval tests: {reason}")
    pytest.skip(reason)


def run_lmeval(
    base_url: str,
    out: Path,
    *,
    model: str = "local-completions",
    task: str = "evalpipe_arith_gen",
    limit: int = 30,
    extra: tuple[str, ...] = (),
    timeout: float = 300,
) -> Path:
    """`lm_eval --log_samples` of `task` against `base_url` (…/v1), offline; returns its --output_path."""
    route = "/completions" if model == "local-completions" else "/chat/completions"
    model_args = f"base_url={base_url}{route},model=evalpipe-skills-dsv4,tokenizer_backend=None,num_concurrent=32"
    cmd = [
        require_lmeval(),
        "--model",
        model,
        "--model_args",
        model_args,
        "--include_path",
        str(TASKS),
        "--tasks",
        task,
        "--limit",
        str(limit),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(out.parent))
    assert done.returncode == 0, f"lm_eval failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return out
