"""`evalpipe ARGS` for the tests as a fork of a process that has already imported the CLI.

Each of the suite's several hundred short commands (`run`, `compare`, `audit`, `qualify`, ...) spent about a second
of CPU importing openai, httpx, scipy and evalpipe before its own work, and the 2-core CI machine is CPU bound. The
server here imports every subcommand once per test process, then forks one child per command. The child is a real
process running the real entry point, `evalpipe.cli.main`, as `python -m evalpipe.cli ARGS` would: its own argv
(click names the program as such a run does), working folder, environment, stdin from /dev/null, stdout and stderr
in files, Python's own SIGINT handler, and interpreter shutdown (atexit) when main returns. Only the imported modules,
the TLS context and the skill lanes' generated items (preload_cli) come from its parent; no module of evalpipe reads
the environment when it is imported, the items do not depend on it, and no test sets the TLS context's variables
(SSL_CERT_FILE, SSL_CERT_DIR). Tests of start-up itself, of signals and of long-lived processes start
`python -m evalpipe.cli` as before (core_helpers.evalpipe_cmd). With EVALPIPE_TESTS_FORK=0 run_forked starts no
server and runs each command in a fresh interpreter instead.

A second kind of server, `torch`, has imported torch, NumPy and transformers (about 3 s of CPU on the quiet 2-core
machine) and runs `python -m MODULE ARGS` (runpy, as `-m` does): the benchmark scripts' `--smoke` runs
(tests/support/benchmark_smoke.py). It imports nothing that imports Triton, so a script can still choose Triton's
interpreter before its first Triton import, and it is started with one OpenMP thread, as those runs ask for.

    python -m tests.support.cli_fork_server SOCKET [cli|torch]   # prints "ready" once listening; exits with its parent
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARENT_CHECK_S = 1.0  # how often an idle server checks that its test process is still there


# ---- the server -------------------------------------------------------------------------------------------------


# Modules the commands import on first use rather than at import: the async HTTP transport's backend (the first
# request), the progress bar and console, what each command imports in its body, and compare's plots (matplotlib
# and PIL, for report.html), each seen new in a command run after the imports above.
FIRST_USE_MODULES = (
    "anyio._backends._asyncio",
    "anyio.streams.tls",
    "tqdm",
    "multiprocessing.synchronize",
    "aiohttp",
    "evalpipe.console",
    "evalpipe.ab.run",
    "evalpipe.compare.planning",
    "evalpipe.compare.workflow",
    "evalpipe.harness.audit",
    "evalpipe.harness.bench",
    "evalpipe.harness.imports.lm_eval",
    "evalpipe.harness.imports.sgl_eval",
    "evalpipe.harness.lane_run",
    "evalpipe.harness.repeat",
    "evalpipe.lanes.repeat_fixtures",
    "evalpipe.launchers.launch",
    "evalpipe.qualify.run",
    "evalpipe.compare.report.plots",
    "matplotlib.backends.backend_agg",
    *(f"PIL.{name}" for name in ("BmpImagePlugin", "GifImagePlugin", "JpegImagePlugin", "PngImagePlugin")),
    *(f"PIL.{name}" for name in ("PpmImagePlugin", "ImageOps", "features")),
)


def preload_cli() -> None:
    """Import the CLI and every subcommand's module (none imports torch), as each command would on its own, and the
    modules they import on first use; then build the TLS context and generate the skill lanes' items, once.
    SkillLane.items keeps a lane's items per process: run, audit and compare of a skill lane each generate its
    200-1,200 items (0.2-1.6 s of CPU apiece), which every forked child would otherwise repeat. The items are the same
    in any process, and each command still checks their digest against the lane's pins."""
    from evalpipe import cli

    for module_name, _ in cli.SUBCOMMANDS.values():
        importlib.import_module(module_name)
    for module_name in FIRST_USE_MODULES:
        importlib.import_module(module_name)
    from evalpipe.harness.client import ssl_context
    from evalpipe.lanes import all_lanes
    from evalpipe.lanes.skill_lane import SkillLane

    ssl_context()  # the process's one TLS context (loading the CA bundle: ~0.1 s), which every client asks for
    for lane in all_lanes():
        if isinstance(lane, SkillLane):
            lane.items()


def preload_torch() -> None:
    """Import what every benchmark script imports first; none of these imports Triton."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401


PRELOADS = {"cli": preload_cli, "torch": preload_torch}
KIND_ENV = {"cli": {}, "torch": {"OMP_NUM_THREADS": "1"}}  # the environment a kind's server starts with


def serve(path: str, kind: str = "cli") -> None:
    parent = os.getppid()
    PRELOADS[kind]()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # A child's exit wakes the selector through the signal wake-up fd (a SIGCHLD handler must be installed for it to
    # be written), so the server sleeps between events instead of polling for finished children.
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write.fileno())
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that waits for its exit status
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=PARENT_CHECK_S):
            if key.fileobj is wake_read:
                drain(wake_read)
                continue
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                for own in (listener, wake_read, wake_write, *waiting.values(), conn):
                    own.close()
                run_child(request)  # never returns
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        reap(waiting)
    for pid in waiting:  # the test process is gone: so is the reason to finish
        os.kill(pid, signal.SIGKILL)


def drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


def reap(waiting: dict[int, socket.socket]) -> None:
    """Send each finished child's exit status (subprocess's returncode: -N for a signal) to its connection."""
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:  # the client gave up (its timeout) and closed
                pass
            conn.close()


def run_child(request: dict) -> None:
    """In the forked child: become `python -m evalpipe.cli ARGV` (or `python -m MODULE ARGV` where the request names
    a module) in the request's folder and environment."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        redirect(0, os.devnull, os.O_RDONLY)
        redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        if request.get("module"):
            sys.argv = [request["module"], *request["argv"]]  # runpy puts the module's file first, as -m does
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            cli = sys.modules["evalpipe.cli"]
            sys.modules["__main__"] = cli  # what `-m evalpipe.cli` makes it: click's program name, spawned workers
            sys.argv = [cli.__file__, *request["argv"]]
            cli.main()  # click's standalone mode ends in SystemExit
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)


def exit_code(exc: SystemExit) -> int:
    """The status the interpreter would exit with for this SystemExit (a non-int code is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


# ---- the client -------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_SERVERS: dict[str, dict] = {}  # kind -> {"proc", "path"}: this test process's servers


def server_path(kind: str = "cli") -> str:
    """The socket of this test process's server of that kind, started on first use (and again if it died)."""
    with _LOCK:
        server = _SERVERS.setdefault(kind, {})
        proc = server.get("proc")
        if proc is None or proc.poll() is not None:
            folder = tempfile.mkdtemp(prefix="evalpipe-cli-fork-")
            path = os.path.join(folder, "socket")
            log = open(os.path.join(folder, "server.log"), "w")
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.cli_fork_server", path, kind],
                cwd=REPO,
                env={**os.environ, **KIND_ENV[kind]},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            if proc.stdout.readline().strip() != "ready":
                proc.kill()
                raise RuntimeError(f"the {kind} fork server did not start:\n{Path(log.name).read_text()[-3000:]}")
            atexit.register(stop_server, proc)
            server.update(proc=proc, path=path)
        return server["path"]


def stop_server(proc: subprocess.Popen) -> None:
    """Kill a fork server and reap it (so its CPU, and its reaped children's, counts in the test process's)."""
    proc.kill()
    proc.wait()


def run_forked(
    argv: list[str],
    *,
    env: dict,
    cwd: str,
    timeout: float,
    module: str | None = None,
    term_grace: float | None = None,
) -> subprocess.CompletedProcess:
    """`subprocess.run(python -m evalpipe.cli ARGV, capture_output=True, text=True, ...)`, in a forked child: the
    same CompletedProcess, and on `timeout` the child killed and TimeoutExpired raised. With `module`: `python -m
    MODULE ARGV`, forked from the `torch` server. With `term_grace`, a child that is still running when the wait ends
    (the timeout, or pytest's own) gets SIGTERM first, to stop what it started, and SIGKILL after that many seconds.
    With EVALPIPE_TESTS_FORK=0 in the test process's environment the child is that command in a fresh interpreter
    instead, started here with the same environment, folder, stdin (/dev/null), output files and stopping."""
    shown = [sys.executable, "-m", module or "evalpipe.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="evalpipe-cli-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        if os.environ.get("EVALPIPE_TESTS_FORK") == "0":
            returncode = run_fresh(shown, env=env, cwd=cwd, timeout=timeout, term_grace=term_grace, out=out, err=err)
            return subprocess.CompletedProcess(shown, returncode, read(out), read(err))
        request = {"argv": argv, "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err), "module": module}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server_path("torch" if module else "cli"))
            conn.sendall(json.dumps(request).encode() + b"\n")
            replies = conn.makefile("rb")
            pid = json.loads(replies.readline())["pid"]
            conn.settimeout(timeout)
            try:
                line = replies.readline()
            except BaseException as exc:
                stop_child(pid, term_grace)
                if isinstance(exc, TimeoutError):
                    raise subprocess.TimeoutExpired(shown, timeout, read(out), read(err)) from None
                raise
        if not line:
            raise RuntimeError(f"the fork server closed before `python {' '.join(shown[1:])}` ended")
        returncode = json.loads(line)["returncode"]
        return subprocess.CompletedProcess(shown, returncode, read(out), read(err))


def run_fresh(
    shown: list[str], *, env: dict, cwd: str, timeout: float, term_grace: float | None, out: Path, err: Path
) -> int:
    """run_forked's child as `shown` in a fresh interpreter: its exit status (-N for a signal), or, when the wait
    ends first, the child stopped as stop_child stops a forked one and TimeoutExpired raised on the timeout."""
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(shown, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
    try:
        return proc.wait(timeout=timeout)
    except BaseException as exc:
        if term_grace is not None:
            proc.terminate()
            try:
                proc.wait(timeout=term_grace)
            except subprocess.TimeoutExpired:
                pass
        proc.kill()  # nothing once it has been reaped
        proc.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(shown, timeout, read(out), read(err)) from None
        raise


def stop_child(pid: int, term_grace: float | None) -> None:
    """SIGKILL, or with `term_grace` SIGTERM and SIGKILL that many seconds later if it has not ended (the fork
    server reaps it, so a gone child leaves no /proc entry, or a zombie for a moment)."""
    try:
        if term_grace is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + term_grace
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not alive(pid):
                return
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an ended child not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


if __name__ == "__main__":
    serve(sys.argv[1], *sys.argv[2:3])
