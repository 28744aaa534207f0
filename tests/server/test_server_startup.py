"""Server start-up: 503 (with an OpenAI body) while the model loads, a load failure reported, `--tokenizer`.

The loading test runs a real uvicorn server on 127.0.0.1 in this process (its engine in a spawned engine process),
with the real engine build held back by a gate file until the test has seen the "loading" answers.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from evalpipe.engine.config import EngineConfig
from evalpipe.server.app import create_app
from evalpipe.server.state import ServerSettings, ServerState
from tests.engine.test_server_tokenizer import hf_dir  # noqa: F401  (fixture: a small Hugging Face tokenizer directory)
from tests.support.gated_build import GATE_ENV, build_after_gate
from tests.support.server_harness import free_port


def test_loading_answers_503_then_serves_with_hf_tokenizer(hf_dir, tmp_path, monkeypatch):  # noqa: F811
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    port = free_port()
    settings = ServerSettings(EngineConfig(tokenizer=str(hf_dir), max_batch=2, max_seq_len=128), port=port)
    state = ServerState(settings, build=build_after_gate)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        assert httpx.get(base + "/health").status_code == 503
        assert httpx.get(base + "/health_generate").status_code == 503
        loading = httpx.get(base + "/v1/models")
        assert loading.status_code == 503 and loading.headers["retry-after"] == "1"
        assert loading.json()["error"]["code"] == "model_loading"
        assert httpx.get(base + "/get_server_info").json()["ready"] is False

        gate.touch()
        assert state.ready.wait(120), state.load_error
        assert httpx.get(base + "/health_generate", timeout=60).status_code == 200
        info = httpx.get(base + "/get_server_info").json()
        assert info["tokenizer"]["kind"] == "huggingface"
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={
                "messages": [{"role": "user", "content": "hello world"}],
                "max_tokens": 2,
                "return_token_ids": True,
                "chat_template_kwargs": {"thinking": True},
            },
        )
        assert r.status_code == 200, r.text
        expected = state.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], thinking=True)
        assert r.json()["choices"][0]["prompt_token_ids"] == expected
        assert expected == state.tokenizer.encode("user : hello world assistant : think")
    finally:
        gate.touch()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def test_a_model_that_fails_to_load_exits_1_with_the_reason(tmp_path):
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "evalpipe.cli", "serve", "--model", str(tmp_path), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "model failed to load" in proc.stderr and "Traceback" not in proc.stderr


def test_busy_port_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "evalpipe.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1 and f"cannot bind 127.0.0.1:{port}" in proc.stderr
