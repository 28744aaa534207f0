"""Answer extraction and grading.

Three graders:
- `exact_text`: the reply, stripped of surrounding whitespace, must equal the expected string (synthetic lanes).
- `legacy_last_int`: the legacy SGLang GSM8K scorer (commas removed, last run of ASCII digits, Python-literal
  parse, INVALID = -9999999 otherwise). Pure and fast, so it runs inline.
- `ns_last_boxed`: sgl-eval's vendored NeMo-Skills grader (last `\\boxed{}` of the content, then `math_equal`
  through math-verify). math-verify arms SIGALRM, which only works in a main thread, and `parse` can hang
  past its own timeout (Math-Verify #65). So `math_equal` runs in worker *processes*, each answer under a
  hard deadline; a worker that misses it is killed and replaced and the answer is `grader_timeout`.
"""

from __future__ import annotations

import ast
import asyncio
import multiprocessing as mp
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from evalpipe.lanes import sgl_eval_adapter

# ---------------------------------------------------------------------------------------------- GSM8K legacy

INVALID = -9999999
_DIGITS = re.compile(r"\d+")


def legacy_answer_value(text: Optional[str]) -> int:
    """Legacy GSM8K value of a text: last digit run after removing commas; INVALID when none/unparsable.

    Used for gold and prediction alike: `-10` reads as 10, `3.5` as 5, `07` is INVALID (not a literal)."""
    nums = _DIGITS.findall((text or "").replace(",", ""))
    if not nums:
        return INVALID
    try:
        return ast.literal_eval(nums[-1])
    except SyntaxError:
        return INVALID


# ------------------------------------------------------------------------------------------- AIME / boxed


def extract_boxed(text: Optional[str]) -> Optional[str]:
    """Content of the last `\\boxed{...}` (brace-matched), as the vendored NS extractor returns it."""
    return sgl_eval_adapter.search_boxed(text or "")


@dataclass
class GradeResult:
    correct: bool
    status: str  # "ok" | "grader_timeout" | "grader_error"
    error: Optional[str] = None
    grader_ms: float = 0.0


# NS MathEvaluatorConfig defaults, used by sgl-eval 0.1.0 for AIME
NS_NUMERIC_PRECISION = 15
NS_VERIFY_TIMEOUT_S = 10


def _worker_main(conn) -> None:
    """Worker process loop: import the grader once (warm), then answer (gold, pred) requests."""
    math_equal = sgl_eval_adapter.math_equal()
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        gold, pred = msg
        try:
            ok = bool(
                math_equal(gold, pred, numeric_precision=NS_NUMERIC_PRECISION, timeout_seconds=NS_VERIFY_TIMEOUT_S)
            )
            conn.send(("ok", ok, None))
        except BaseException as exc:  # noqa: BLE001 - any grader failure is a recorded status, not a crash
            conn.send(("error", False, f"{type(exc).__name__}: {exc}"[:500]))


class _Worker:
    def __init__(self, ctx):
        parent, child = ctx.Pipe()
        self.conn = parent
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="evalpipe-grader")
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> bool:
        if not self.ready and self.conn.poll(timeout):
            self.ready = self.conn.recv() == "ready"
        return self.ready

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(5)
        except Exception:
            pass
        try:
            self.conn.close()
        except Exception:
            pass


class GraderPool:
    """A warm pool of grader processes with a hard per-answer timeout.

    `grade(gold, pred)` is blocking and thread-safe; `agrade` awaits it from asyncio without blocking the
    loop. Startup and timeout replacement use the `spawn` context: safe from a process with threads.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 30.0, startup_timeout_s: float = 120.0):
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self._ctx = mp.get_context("spawn")
        self._idle: "queue.Queue[_Worker]" = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grader")
        self.n_timeouts = 0
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        if self._closed:
            return
        w = _Worker(self._ctx)
        with self._lock:
            self._all.append(w)
        self._idle.put(w)

    def _retire(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            if w in self._all:
                self._all.remove(w)

    def grade(self, gold: Any, pred: Optional[str]) -> GradeResult:
        w = self._idle.get()
        t0 = time.perf_counter()
        try:
            if not w.wait_ready(self.startup_timeout_s):
                raise RuntimeError("grader worker did not start")
            w.conn.send((gold, pred))
            if w.conn.poll(self.timeout_s):
                status, ok, err = w.conn.recv()
                self._idle.put(w)
                return GradeResult(
                    ok, "ok" if status == "ok" else "grader_error", err, 1e3 * (time.perf_counter() - t0)
                )
            self.n_timeouts += 1
            self._retire(w)
            self._spawn()
            return GradeResult(
                False,
                "grader_timeout",
                f"no verdict within {self.timeout_s:g}s; worker killed",
                1e3 * (time.perf_counter() - t0),
            )
        except (EOFError, OSError, RuntimeError, BrokenPipeError) as exc:  # worker died: replace it
            self._retire(w)
            self._spawn()
            return GradeResult(False, "grader_error", f"{type(exc).__name__}: {exc}", 1e3 * (time.perf_counter() - t0))

    async def agrade(self, gold: Any, pred: Optional[str]) -> GradeResult:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.grade, gold, pred)

    def close(self, wait: bool = True) -> None:
        """Stop the workers; `wait=False` (after Ctrl-C) kills them without waiting for answers in progress."""
        self._closed = True
        self._threads.shutdown(wait=wait, cancel_futures=not wait)
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            try:
                w.conn.send(None)
            except Exception:
                pass
            w.proc.join(1)
            w.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------- one response


def grader_pool(grader: str, workers: int, timeout_s: float) -> Optional[GraderPool]:
    """The worker pool `grade_text` needs for `grader`, or None for the graders that run inline."""
    return GraderPool(workers=workers, timeout_s=timeout_s) if grader == "ns_last_boxed" else None


async def grade_text(
    grader: str, expected: Any, text: str, truncated: bool, pool: Optional[GraderPool]
) -> tuple[Any, bool, str]:
    """Shared by the runner and `evalpipe audit`: (extracted_answer, correct, grade_status)."""
    if grader == "legacy_last_int":
        value = legacy_answer_value(text)
        if truncated:
            return value, False, "truncated"
        if value == INVALID:
            return value, False, "no_answer"
        return value, value == expected, "ok"
    if grader == "exact_text":
        value = (text or "").strip()
        if truncated:
            return value, False, "truncated"
        if not value:
            return value, False, "no_answer"
        return value, value == expected, "ok"
    if grader == "ns_last_boxed":
        pred = extract_boxed(text)
        if truncated:
            return pred, False, "truncated"
        if pred is None:
            return None, False, "no_answer"
        res = await pool.agrade(expected, pred)
        return pred, res.correct, res.status
    raise ValueError(f"unknown grader {grader!r}")
