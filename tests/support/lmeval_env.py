"""A real lm-evaluation-harness for the tests: where its `lm_eval` is, and how to run it against a server.

lm-eval lives in its own environment (`make lmeval-env` installs it into .venv-lmeval; EVALPIPE_LMEVAL points at
another `lm_eval`). Where it is missing the tests skip and say why; under CI (CI=true) a missing one fails them.

Every `lm_eval` start indexes the ~14,000 task YAMLs lm-eval ships (0.4.13: ~10 s of CPU, before it reads
`--include_path`), and the tests use none of them. `run_lmeval_batch` therefore runs several `lm_eval` command lines
in one Python process of lm-eval's environment, through lm-eval's own CLI entry point (`cli_evaluate`, what the
`lm_eval` script calls), with its TaskManager told not to index the built-in tasks (`include_defaults=False`, a
TaskManager argument the CLI does not expose); the tasks given by `--include_path` load, run and are written out
exactly as by the `lm_eval` command.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
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


def lmeval_python() -> str:
    """The Python interpreter of the `lm_eval` script (its shebang line)."""
    first = Path(require_lmeval()).read_text(errors="replace").splitlines()[0]
    assert first.startswith("#!"), f"{LM_EVAL} is not a Python script: {first!r}"
    return first[2:].strip()


def lmeval_args(
    base_url: str,
    out: Path,
    *,
    model: str = "local-completions",
    task: str = "evalpipe_arith_gen",
    limit: int = 30,
    model_args: str = "tokenizer_backend=None,num_concurrent=32",
    served: str = "evalpipe-skills-dsv4",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`lm_eval` arguments: `task` of lm_eval_tasks/ against `base_url` (…/v1) serving the model named `served`,
    --log_samples into `out`."""
    route = "/completions" if model == "local-completions" else "/chat/completions"
    return [
        "--model",
        model,
        "--model_args",
        f"base_url={base_url}{route},model={served},{model_args}",
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


# Runs in lm-eval's interpreter: argv[1] is a JSON object {name: [lm_eval arguments]}, argv[2] the status file.
# Each run is `lm_eval ARGS` through cli_evaluate; a failing run (an exception, or SystemExit with a non-zero code)
# is recorded with its traceback and the next one still runs.
_DRIVER = """
import json, sys, time, traceback
from lm_eval.tasks.manager import TaskManager
_init = TaskManager.__init__
def _no_builtin_index(self, *args, include_defaults=False, **kwargs):
    _init(self, *args, include_defaults=include_defaults, **kwargs)
TaskManager.__init__ = _no_builtin_index
from lm_eval.__main__ import cli_evaluate
runs, status_file, status = json.loads(sys.argv[1]), sys.argv[2], {}
for name, args in runs.items():
    print(f"===== lm_eval run {name}: lm_eval {' '.join(args)}", file=sys.stderr, flush=True)
    sys.argv, start = ["lm_eval", *args], time.monotonic()
    try:
        cli_evaluate()
        status[name] = None
    except SystemExit as e:
        status[name] = None if e.code in (None, 0) else f"exit {e.code}"
    except BaseException:
        status[name] = traceback.format_exc()
    print(f"===== lm_eval run {name}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    with open(status_file, "w") as f:
        json.dump(status, f)
"""


@dataclass
class LmevalRun:
    out: Path  # its --output_path
    error: str | None  # None when it succeeded
    log: Path  # the lm-eval process's stdout and stderr, every run of the batch

    def ok(self) -> Path:
        """Its output folder; fails the test, with the run's error and the log's tail, when the run failed."""
        assert self.error is None, f"lm_eval failed: {self.error}\n{self.log.read_text()[-6000:]}"
        return self.out


def run_lmeval_batch(runs: dict[str, list[str]], log_dir: Path, *, timeout: float = 600) -> dict[str, LmevalRun]:
    """Each `lm_eval ARGS` of `runs` in one lm-eval process, in order, offline (see the module docstring)."""
    python = lmeval_python()
    log_dir.mkdir(parents=True, exist_ok=True)
    log, status = log_dir / "lmeval.log", log_dir / "lmeval_status.json"
    # lm-eval's own environment, plus the checkout: a task folder outside it (a copy of evalpipe_lanes.py) imports
    # evalpipe from there
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with log.open("w") as f:
        done = subprocess.run(
            [python, "-c", _DRIVER, json.dumps(runs), str(status)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env=env,
            cwd=str(log_dir),
        )
    result = json.loads(status.read_text()) if status.exists() else {}
    return {
        name: LmevalRun(
            Path(args[args.index("--output_path") + 1]),
            result[name] if name in result else f"not run (the lm-eval process exited {done.returncode})",
            log,
        )
        for name, args in runs.items()
    }
