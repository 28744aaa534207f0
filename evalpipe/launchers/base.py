"""One interface for every engine: build the command and environment, start, wait until ready, describe, stop.

A launcher never guesses: each engine subclass turns the same `LaunchOptions` into that engine's argv (or refuses
them with a `LaunchConfigError`), and this base class owns the process: its own process group so that stopping it
leaves no orphan, a log file, a readiness poll on the engine's generation health check, and the facts a receipt
records.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

import httpx

from evalpipe.engine.config import EngineConfig
from evalpipe.launchers.env import (
    ChildEnvironment,
    build_child_env,
    is_secret_env_name,
    redact_argv,
    redact_env,
    redact_tree,
)
from evalpipe.launchers.errors import ServerStartError
from evalpipe.launchers.rules import check_acceptance
from evalpipe.redact import redact_text

LOG_TAIL_LINES = 40


@dataclass
class LaunchOptions:
    """Engine-neutral launch settings; each launcher maps them to its own flags or refuses them."""

    engine: str = "native"
    model: str | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    tp: int | None = None
    ep: int | None = None
    dp: int | None = None
    dtype: str | None = None
    device: str | None = None
    max_batch: int | None = None
    api_key: str | None = None  # the key this launcher itself sends (the first --api-key)
    more_api_keys: tuple[str, ...] = ()  # further keys the server accepts (native only)
    # speculation profile: native off|block; sglang/vllm off|dspark|eagle|eagle3|nextn. None = engine default (off)
    speculative: str | None = None
    block_size: int | None = None
    drafter: str | None = None
    draft_model: str | None = None
    spec_steps: int | None = None
    spec_topk: int | None = None
    spec_draft_tokens: int | None = None
    deterministic: bool = False
    simulate_acc_len: float | None = None
    # LOSSY acceptance asked for on purpose (evaluation only): native top-k and thresholds, SGLang's thresholds
    spec_accept_topk: int | None = None
    spec_accept_threshold_single: float | None = None
    spec_accept_threshold_acc: float | None = None
    keep_env: tuple[str, ...] = ()
    set_env: dict[str, str] = field(default_factory=dict)
    engine_command: tuple[str, ...] | None = None  # replaces the program prefix (another venv, a wrapper)
    engine_python: str | None = None  # interpreter of the environment where the engine lives (sglang/vllm)
    ngram_min: int | None = None  # vllm ngram: prompt_lookup_min
    ngram_max: int | None = None  # vllm ngram: prompt_lookup_max
    tool_call_parser: str | None = None  # vllm: a parser name, "off", or None (from the chat template)
    extra_args: tuple[str, ...] = ()
    # --engine native: the EngineConfig these flags give a native server (the fields above that a native server
    # reads, defaults filled in, plus its own flags); None for sglang/vllm, which never read it
    native: EngineConfig | None = None

    def recorded(self) -> dict:
        """The options as a receipt stores them (secrets hidden; a native server reports its own settings)."""
        out = asdict(self)
        out.pop("native")
        return redact_tree(out, self.more_api_keys)

    @property
    def speculation_on(self) -> bool:
        return self.speculative not in (None, "off")

    @property
    def lossy_acceptance(self) -> dict | None:
        """The lossy acceptance settings these options ask for ({"topk": 3} or the thresholds), None when exact."""
        given = {
            name: value
            for name, value in (
                ("topk", self.spec_accept_topk),
                ("threshold_single", self.spec_accept_threshold_single),
                ("threshold_acc", self.spec_accept_threshold_acc),
            )
            if value is not None
        }
        lossy = "topk" in given or any(v < 1.0 for k, v in given.items() if k != "topk")
        return given if lossy else None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def fmt_number(value: float) -> str:
    """1.0 -> '1.0', 3.5 -> '3.5': floats as a user would type them, stable for exact argv comparisons."""
    return repr(float(value))


def console_script_python(script: str) -> str | None:
    """The interpreter behind a console script on PATH: its `#!` line, pip's `exec` form for long paths, or the
    `python` beside it."""
    found = shutil.which(script)
    if found is None:
        return None
    try:
        head = Path(found).read_bytes()[:2048].decode(errors="replace").splitlines()
    except OSError:
        return None
    if head and head[0].startswith("#!"):
        first = head[0][2:].split()
        if first and "python" in Path(first[0]).name:
            return first[0]
    for line in head[1:3]:  # pip: `#!/bin/sh` then `'''exec' '/long/path/python' "$0" "$@"`
        if line.startswith("'''exec'"):
            parts = shlex.split(line[len("'''exec'") :])
            if parts:
                return parts[0]
    sibling = Path(found).parent / "python"
    return str(sibling) if sibling.exists() else None


def engine_interpreter(given: str | None, module: str, script: str) -> str:
    """The Python an engine started as `python -m ...` runs under.

    --engine-python wins; else this interpreter when it can import `module`; else the interpreter behind the
    engine's console script on PATH; else this interpreter (start() then says it cannot import the engine)."""
    if given:
        return os.path.abspath(given)  # not resolved: a venv's python is a symlink that must stay one
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    return console_script_python(script) or sys.executable


class Launcher(ABC):
    """Base for the native, sglang and vllm launchers."""

    engine: str = ""
    health_path = "/health_generate"
    info_paths: tuple[str, ...] = ("/get_server_info", "/server_info")
    version_path: str | None = None
    accept_rules: tuple[str, ...] = ()  # lossy acceptance rules this engine offers on purpose: "topk", "threshold"
    engine_module: str | None = None  # the module an interpreter must import to start this engine

    def __init__(self, options: LaunchOptions, parent_env: Mapping[str, str] | None = None):
        self.options = options
        self.validate_accept_rule()
        self.validate()
        self.child_env: ChildEnvironment = build_child_env(
            os.environ if parent_env is None else parent_env,
            keep=options.keep_env,
            set_vars={**self.engine_variables(), **options.set_env},
        )
        self.argv: list[str] = self.command()
        self.process: subprocess.Popen | None = None
        self._log_copier: threading.Thread | None = None
        self.log_path: Path | None = None
        self.started_at: str | None = None
        self.ready_at: str | None = None
        self.stopped_at: str | None = None
        self.exit_code: int | None = None

    # ----- what each engine defines -------------------------------------------------------------
    @abstractmethod
    def command(self) -> list[str]:
        """The full argv of the server process."""

    def engine_variables(self) -> dict[str, str]:
        """Variables this engine sets on purpose (simulation, determinism); applied after hygiene."""
        return {}

    def validate(self) -> None:
        """Refuse settings this engine cannot honour; raise LaunchConfigError."""

    def validate_accept_rule(self) -> None:
        """--spec-accept-*: only the rules this engine offers (`accept_rules`), by the one rule (rules.py)."""
        check_acceptance(self.options, self.engine, self.accept_rules)

    @property
    def interpreter(self) -> str | None:
        """The Python that runs the server (None when --engine-command replaced the program)."""
        return None

    def check_installed(self) -> None:
        """Raise ServerStartError when the interpreter cannot import the engine (before anything is started)."""
        python = self.interpreter
        if python is None or self.engine_module is None:
            return
        probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({self.engine_module!r}) else 3)"
        try:
            code = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ServerStartError(f"cannot run the engine interpreter {python!r}: {exc}") from exc
        if code != 0:
            raise ServerStartError(
                f"{python} cannot import {self.engine_module}: install {self.engine} there, "
                "or pass --engine-python PATH "
                f"(the python of the environment where {self.engine} lives, e.g. .venv-vllm/bin/python)"
            )

    # ----- shared behaviour ---------------------------------------------------------------------
    @property
    def connect_host(self) -> str:
        host = self.options.host
        return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    @property
    def base_url(self) -> str:
        return f"http://{self.connect_host}:{self.options.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}

    def secret_values(self) -> list[str]:
        """Values that must never appear in a receipt: the API key and secret-named environment values."""
        values = [self.options.api_key or "", *self.options.more_api_keys]
        values += [v for k, v in self.child_env.env.items() if is_secret_env_name(k)]
        return [v for v in values if v]

    def shell_command(self, redact: bool = True) -> str:
        """A copy-pasteable `env -u ... NAME=VALUE prog args` line."""
        env = self.child_env
        parts = ["env"]
        for name in env.removed:
            parts += ["-u", name]
        shown = redact_env(env.set) if redact else env.set
        parts += [f"{name}={value}" for name, value in sorted(shown.items())]
        argv = redact_argv(self.argv) if redact else self.argv
        return shlex.join(parts + list(argv)) if len(parts) > 1 else shlex.join(argv)

    def dry_run(self) -> dict:
        """Everything a launch would do, started nothing."""
        return {
            "engine": self.engine,
            "argv": redact_argv(self.argv),
            "command": self.shell_command(),
            "env_removed": self.child_env.removed,
            "env_kept": self.child_env.kept,
            "env_set": redact_env(self.child_env.set),
            "health_url": self.base_url + self.health_path,
            "performance_only": self.options.simulate_acc_len is not None,
            "lossy_acceptance": self.options.lossy_acceptance,
            "engine_python": self.interpreter,
        }

    def start(self, log_path: str | os.PathLike) -> None:
        """Start the server in its own process group, stdout and stderr into `log_path`.

        The output goes through a pipe and a copying thread that redacts secrets line by line (engines print
        their settings at start-up, SGLang its api_key among them), so the key never reaches the log file."""
        if self.process is not None:
            raise RuntimeError("launcher already started")
        self.check_installed()
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                self.argv,
                env=self.child_env.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_terminate_with_parent(),
            )
        except OSError as exc:
            log.close()
            raise ServerStartError(f"cannot start {self.argv[0]!r}: {exc}") from exc
        self._log_copier = threading.Thread(
            target=_copy_redacted,
            args=(self.process.stdout, log, self.secret_values()),
            name=f"{self.engine}-log",
            daemon=True,
        )
        self._log_copier.start()
        self.started_at = utc_now()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(log is empty)"

    def wait_ready(self, timeout: float, poll_interval: float = 0.2) -> None:
        """Poll the health check until 200; on exit or timeout stop the whole group and raise with the log tail."""
        assert self.process is not None, "start() first"
        url = self.base_url + self.health_path
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        with httpx.Client(headers=self.headers(), trust_env=False) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    self.stop()
                    raise ServerStartError(
                        f"{self.engine} server exited with code {code} before it was ready.\n"
                        f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    response = client.get(url, timeout=max(1.0, min(30.0, remaining)))
                    if response.status_code == 200:
                        self.ready_at = utc_now()
                        return
                    last = f"HTTP {response.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))
        self.stop()
        raise ServerStartError(
            f"{self.engine} server was not ready after {timeout:g}s ({url}: {last}); stopped it.\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds; idempotent."""
        proc = self.process
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the leader's pid is the group id
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Sweep stragglers of the group (workers that outlived the leader) and reap the leader.
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._log_copier is not None:
            self._log_copier.join(timeout=5)  # the group is gone, so the pipe is at EOF: the log is complete
        if self.stopped_at is None:
            self.stopped_at = utc_now()
            self.exit_code = proc.returncode
        return proc.returncode

    @property
    def pgid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def describe(self) -> dict:
        """The launch half of a receipt: what was started, how, when (secrets redacted)."""
        return {
            "engine": self.engine,
            "argv": redact_argv(self.argv),
            "command": self.shell_command(),
            "env": redact_env(self.child_env.env),
            "env_removed": self.child_env.removed,
            "env_kept": self.child_env.kept,
            "env_set": redact_env(self.child_env.set),
            "options": self.options.recorded(),
            "engine_python": self.interpreter,
            "performance_only": self.options.simulate_acc_len is not None,
            "lossy_acceptance": self.options.lossy_acceptance,
            "base_url": self.base_url,
            "health_path": self.health_path,
            "pid": self.process.pid if self.process else None,
            "log": str(self.log_path) if self.log_path else None,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "stopped_at": self.stopped_at,
            "exit_code": self.exit_code,
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


LOG_PIECE_MAX = 1 << 16  # a line longer than this (a progress bar that never ends its line) is written in pieces


def _copy_redacted(pipe, log, secrets: list[str]) -> None:
    """Server output -> log file, secrets redacted (evalpipe.redact) one line at a time (CR ends a line too, for
    progress bars); flushed as it comes so a failed boot's log tail is current."""

    def write(piece: bytes) -> None:
        text = piece.decode("utf-8", "surrogateescape")
        log.write(redact_text(text, secrets).encode("utf-8", "surrogateescape"))

    pending = b""
    try:
        while chunk := pipe.read1(LOG_PIECE_MAX):
            pending += chunk
            *lines, pending = re.split(rb"(?<=[\r\n])", pending)
            for line in lines:
                write(line)
            if len(pending) > LOG_PIECE_MAX:
                write(pending)
                pending = b""
            log.flush()
        write(pending)
    except (OSError, ValueError):  # the log or the pipe was closed under us
        pass
    finally:
        pipe.close()
        log.close()


def _terminate_with_parent():
    """Linux: ask the kernel to SIGTERM the server when its launcher dies, even by SIGKILL (no orphan)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command name: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just said was free (bind to 0); the server binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
