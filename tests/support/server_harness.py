"""Start a real `evalpipe serve` subprocess on a free port and wait until it generates (shared by server tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

READY_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_loaded(pid: int) -> bool:
    """Whether process `pid` has torch's native library mapped (`import torch` maps libtorch; nothing unmaps it)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


class ServerProcess:
    """`evalpipe serve --model MODEL ARGS...`; the random tiny model unless `model` says otherwise (fast, and the
    API tests need no skill)."""

    def __init__(self, *args: str, model: str = "evalpipe-tiny-dsv4"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="evalpipe-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "evalpipe.cli", "serve", "--port", str(self.port), "--model", model, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        # One client for the whole wait: each bare httpx.get builds a TLS context (~34 ms of CPU), ten a second
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    if client.get(self.base + "/health_generate").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {READY_TIMEOUT_S}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def engine_pid(self) -> int:
        """The server's engine process (a child of this HTTP process), as its /get_server_info reports it."""
        info = httpx.get(self.base + "/get_server_info", timeout=30).json()["internal_states"]["engine_process"]
        assert info["alive"] is True and info["pid"] != self.proc.pid
        return info["pid"]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30, again_after: float | None = None) -> int:
        """Send `sig` (and, with `again_after`, once more that many seconds later, as an impatient Ctrl-C does) and
        wait for the exit; killed after `timeout`. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if again_after is not None:
                time.sleep(again_after)
                if self.proc.poll() is None:
                    self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
