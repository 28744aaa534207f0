"""The engine in its own process (engine/process.py, server/engine_client.py), against real `evalpipe serve` processes:
a dead engine is a 503 for the requests in flight (streamed or not, never a hang or a 500) and `serve` exits 1;
SIGTERM, and even SIGKILL of the server, leave no engine process behind; `--threads` sets the engine's torch threads."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.support.server_harness import ServerProcess


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether the process has exited (a zombie counts as gone: it runs nothing) within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def running(server: ServerProcess) -> int:
    return httpx.get(server.base + "/get_server_info", timeout=30).json()["internal_states"]["running"]


def test_a_dead_engine_is_a_503_in_flight_and_serve_exits_1():
    server = ServerProcess("--max-batch", "4", "--max-seq-len", "4096")
    try:
        pid = server.engine_pid()
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        body = dict(
            model="evalpipe-tiny-dsv4",
            prompt="keep going",
            max_tokens=3000,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        results: dict = {}

        def plain():
            try:
                results["plain"] = client.completions.create(**body)
            except openai.APIStatusError as exc:
                results["plain"] = exc

        def streamed():
            events = []
            with httpx.stream(
                "POST",
                server.base + "/v1/completions",
                timeout=60,
                json={**{k: v for k, v in body.items() if k != "extra_body"}, "ignore_eos": True, "stream": True},
            ) as resp:
                results["stream_status"] = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            results["stream"] = events

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while running(server) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(server) == 2
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung on the dead engine"
        plain_error = results["plain"]
        assert isinstance(plain_error, openai.APIStatusError) and plain_error.status_code == 503
        assert plain_error.body["code"] == "engine_dead" and "engine process died" in plain_error.message
        assert results["stream_status"] == 200 and results["stream"], "tokens had been streamed"
        last = results["stream"][-1]
        assert last["error"]["code"] == "engine_dead"  # the stream's last event says why it ended
        assert server.proc.wait(30) == 1  # serve stops rather than serve a dead engine
        out = server.output()
        assert "the engine process died" in out and "Traceback" not in out, out[-3000:]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def servers():
    """Two servers shared by the tests below (two boots, not four): `quiet` at the default log level with
    `--threads 2`, `info` at `--log-level info`. The log-level test reads both first; then the SIGTERM test ends
    `quiet` and the SIGKILL test kills `info` (file order)."""
    quiet = ServerProcess("--max-batch", "2", "--max-seq-len", "256", "--threads", "2")
    try:
        info = ServerProcess("--max-batch", "2", "--max-seq-len", "256", "--log-level", "info")
    except BaseException:
        quiet.stop(signal.SIGTERM)
        raise
    yield {"quiet": quiet, "info": info}
    info.stop(signal.SIGTERM)
    quiet.stop(signal.SIGTERM)


def test_log_level_info_logs_the_engines_throughput(servers):
    """`--log-level info`: once the engine runs out of work it logs the window's steps and rates (SGLang's
    decode-batch line), with the time of `Engine.step` beside the whole loop's; the default level stays quiet."""
    quiet, server = servers["quiet"], servers["info"]
    for srv in (quiet, server):
        r = httpx.post(
            srv.base + "/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 12, "ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12

    # the request's window: its prompt's step + 11 decode steps (the first token comes from the prompt's step); the
    # CPU runner has no overlap schedule, so none of them was queued ahead. The readiness probe's one-step window
    # is logged before it, so the wait is for this line itself.
    def window_lines():
        return [
            line
            for line in server.output().splitlines()
            if "generated tok/s" in line and ": 12 steps (0 overlapped, 1 with" in line
        ]

    deadline = time.monotonic() + 10
    while not window_lines() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = window_lines()
    assert len(lines) == 1, server.output()
    assert "0 running, 0 waiting" in lines[0] and "ms per loop of which Engine.step" in lines[0], lines[0]
    assert " 0 generated tok/s" not in lines[0] and " 0 prefilled tok/s" not in lines[0], lines[0]
    # the 11 decode-only steps and the prompt's step, each timed apart (neither window is empty, so neither reads 0)
    split = re.search(r"Engine\.step ([\d.]+) ms without prompt chunks, ([\d.]+) ms with them", lines[0])
    assert split and float(split[1]) > 0 and float(split[2]) > 0, lines[0]
    assert "generated tok/s" not in quiet.output()  # its request ran out of work before the info server's


def test_sigterm_leaves_no_engine_process_and_threads_reach_the_engine(servers):
    server = servers["quiet"]
    try:
        pid = server.engine_pid()
        r = httpx.post(server.base + "/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        info = httpx.get(server.base + "/get_server_info", timeout=30).json()
        assert info["runner"]["threads"] == 2 and info["runner"]["pid"] == pid  # --threads is the engine's
    finally:
        rc = server.stop(signal.SIGTERM)
    assert rc == 0, server.output()
    assert gone(pid), "the engine process outlived the server"
    assert "Traceback" not in server.output()


def test_a_killed_server_takes_its_engine_with_it(servers):
    server = servers["info"]
    pid = server.engine_pid()
    server.proc.kill()
    server.proc.wait(30)
    assert gone(pid), "the engine process was orphaned"
