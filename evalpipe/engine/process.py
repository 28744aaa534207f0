"""The engine process's entry point: `main`, which the server (server/engine_client.py) spawns beside itself.

`main` connects the two ZeroMQ pipes of engine/ipc.py, builds the engine (engine/loop.py: torch and the model are
imported here, in this process only; this module stays torch-free because the HTTP process imports it to name the
spawn target), reports `Ready` or `LoadFailed`, then runs the loop until `Shutdown` or until the parent is gone
(exit 0), or until its device is lost (exit EXIT_DEVICE_LOST, engine/device_loss.py).

The process ignores SIGINT (Ctrl-C reaches the whole process group; the server stops it with `Shutdown`) and dies
with its parent (PR_SET_PDEATHSIG on Linux, and a parent check while idle), so it is never left orphaned.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from typing import Callable

import zmq

from evalpipe.engine import ipc
from evalpipe.engine.config import EngineConfig

log = logging.getLogger("evalpipe.engine")


def main(
    config: EngineConfig,
    build: Callable,
    tokenizer_factory: Callable,
    inbox: str,
    outbox: str,
    log_level: int = logging.WARNING,
) -> None:
    """Entry point of the spawned process: build the engine, report Ready (or LoadFailed and exit 1), then loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(inbox)
    send = ctx.socket(zmq.PUSH)
    send.connect(outbox)
    try:
        from evalpipe.engine.loop import EngineLoop, build_engine, ready_message  # torch and the model: here only

        engine = build_engine(config, build, tokenizer_factory)
    except Exception as exc:
        log.debug("engine build failed:\n%s", traceback.format_exc())  # --log-level debug shows where
        send.send_pyobj(ipc.LoadFailed(f"{type(exc).__name__}: {exc}"))
        send.close(linger=5000)
        recv.close(linger=0)  # the context's term() waits for every socket: an open one kept the process alive
        ctx.term()
        sys.exit(1)
    send.send_pyobj(ready_message(config, engine))
    from evalpipe.engine.device_loss import EXIT_DEVICE_LOST, DeviceLost

    code = 0
    try:
        EngineLoop(engine, recv, send, parent, burst_wait_ms=config.burst_wait_ms).run()
    except DeviceLost:  # the loop has told the server (ipc.Lost)
        code = EXIT_DEVICE_LOST
    finally:
        recv.close(linger=0)
        send.close(linger=1000)
        ctx.term()
    exit_after_clean_stop(code)


def exit_after_clean_stop(code: int = 0) -> None:
    """Exit with `code` once everything is stopped and closed: flush the log and the streams, then skip the
    interpreter's teardown (in the engine process, of torch's and transformers' objects: ~1.5-2 s of CPU, which every
    stop waited for; after a lost device, CUDA's teardown would meet the broken context). Both processes of
    `evalpipe serve` end this way; a failed build exits normally."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the server process (its parent) dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
