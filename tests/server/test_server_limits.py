"""Server limits through real HTTP: API key (401), bounded queue (503 + Retry-After), clean SIGTERM exit; the same
server runs `--prefix-cache off` and says so."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from tests.support.server_harness import ServerProcess

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "--api-key", KEY, "--max-batch", "1", "--max-queue", "1", "--max-seq-len", "512", "--prefix-cache", "off"
    )
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.output()
    assert "evalpipe serve: stopped" in srv.output()


def info(server):
    return httpx.get(server.base + "/get_server_info", headers=AUTH, timeout=30).json()


def test_api_key_required_except_health(server):
    body = {"prompt": "x", "max_tokens": 1}
    missing = httpx.post(server.base + "/v1/completions", json=body)
    wrong = httpx.post(server.base + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    for resp in (missing, wrong):
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base + "/get_server_info").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200
    ok = httpx.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0).models.list().data


def test_full_queue_answers_503_with_retry_after(server):
    long_body = {"prompt": "a", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    queued: dict = {}

    def queued_request():
        queued["resp"] = httpx.post(
            server.base + "/v1/completions",
            headers=AUTH,
            timeout=120,
            json={"prompt": "b", "max_tokens": 2, "temperature": 0},
        )

    with httpx.stream("POST", server.base + "/v1/completions", json=long_body, headers=AUTH, timeout=60) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the long request occupies the one slot
        waiter = threading.Thread(target=queued_request)
        waiter.start()
        deadline = time.monotonic() + 20
        while info(server)["internal_states"]["waiting"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert info(server)["internal_states"]["waiting"] == 1  # the second request fills the one-place queue
        full = httpx.post(
            server.base + "/v1/completions", headers=AUTH, timeout=30, json={"prompt": "c", "max_tokens": 2}
        )
        assert full.status_code == 503
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
    waiter.join(60)  # closing the long stream aborts it; the queued request then runs
    assert queued["resp"].status_code == 200
    assert queued["resp"].json()["usage"]["completion_tokens"] >= 1
    assert info(server)["internal_states"]["allocated_slots"] == 0


def test_prefix_cache_off_is_reported(server):
    """`--prefix-cache off` builds a runner without a cache, and the info and /flush_cache say so."""
    served = info(server)
    assert served["prefix_cache"] == {"enabled": False} and served["server_args"]["prefix_cache"] == "off"
    assert served["internal_states"]["prefix_cache"] == {"enabled": False}  # the runner keeps no cache
    flushed = httpx.post(server.base + "/flush_cache", headers=AUTH, timeout=30)
    assert flushed.status_code == 200 and flushed.json()["flushed_pages"] == 0
    assert "the prefix cache is off" in flushed.json()["message"]
