"""A hostile client against one real `evalpipe serve` process (loopback, API key on): hundreds of generated
malformed requests, client disconnects, and an interrupted `evalpipe run`.

Every malformed request must get a 4xx with OpenAI's error body, and must leave the keep-alive connection usable:
a valid request follows each one on the same connection (the client's local address never changes, so the
server never dropped it). Disconnects must abort generation within one engine step: the running count in
/get_server_info drops within a second, for streamed and non-streamed requests alike.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.support.core_helpers import DATA_DIR, evalpipe_cmd
from tests.support.server_harness import ServerProcess

KEY = "sk-hostile-7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}
MAX_QUEUE = 8
VOCAB = 512  # the tiny model's
DROP_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def server():
    # short engine steps (128 rows): "aborted within one step" is then well inside a second even on a loaded
    # 2-core machine, where a 512-row prefill step of six GSM8K prompts alone can take longer
    srv = ServerProcess(
        "--api-key", KEY, "--max-batch", "8", "--max-queue", str(MAX_QUEUE), "--max-tokens-per-step", "128"
    )
    yield srv
    # an impatient double Ctrl-C: uvicorn then forces the stop and skips the app's shutdown; still exit 0, one line
    # about it, no traceback
    rc = srv.stop(again_after=0.05)
    assert rc == 0, srv.output()
    out = srv.output()
    assert "Traceback" not in out and "unhandled error" not in out, out[-3000:]
    assert "second stop signal: forced stop" in out and "evalpipe serve: stopped" in out, out[-3000:]


def raw(obj) -> bytes:
    """JSON with lone surrogates kept as escapes (json.dumps writes them as \\udXXX; ensure_ascii keeps it)."""
    return json.dumps(obj).encode()


# ----------------------------------------------------------------------------------------- the cases
BASE_COMPLETION = {"prompt": "hi", "max_tokens": 2}
BASE_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
INT_BAD = ["1", 1.5, True, [], {}, None, "inf"]
FLOAT_BAD = ["0.5", True, [], {}, "nan"]
BOOL_BAD = ["true", 1, 0, [], {}, None, "yes"]
STR_BAD = [1, 1.5, True, [], {}]
SAMPLING_FIELDS = {
    # field: wrong values (each is a 400); None is valid for Optional fields, so it is only in the lists that refuse it
    "max_tokens": ["1", 1.5, True, [], {}, 0, -5],
    "temperature": FLOAT_BAD + [None, -0.1, 100.5, 1e308],
    "top_p": FLOAT_BAD + [None, 0, -1, 1.5],
    "top_k": INT_BAD + [-2],
    "min_p": FLOAT_BAD + [None, -0.1, 1.1],
    "n": INT_BAD + [0, -1, 65, 10**9],
    "stop": [1, [1], {}, True, [["a"]], 1.5],
    "stop_token_ids": ["1", [1.5], ["a"], [-1], [VOCAB], [2**40], 5, {}],
    "seed": ["1", 1.5, True, [], {}],
    "stream": BOOL_BAD,
    "stream_options": ["x", [], 5, True],
    "ignore_eos": BOOL_BAD,
    "repetition_penalty": ["1", True, [], 1.3, 0.5],
    "frequency_penalty": ["0", True, [], 0.5, -1],
    "presence_penalty": ["0", True, [], 0.5, -1],
    "return_token_ids": BOOL_BAD,
    "user": STR_BAD,
    "model": STR_BAD,
    "min_tokens": INT_BAD + [-1, 3],  # 3: more than max_tokens (2)
    "min_new_tokens": ["1", 1.5, True, -1, 3],
    "include_stop_str_in_output": BOOL_BAD,
    "no_stop_trim": BOOL_BAD,
    "truncate_prompt_tokens": ["1", 1.5, True, -2, 0, 10**6],
    "use_beam_search": [True],
    "skip_special_tokens": [False],
}
COMPLETION_FIELDS = {
    "prompt": [1, True, {}, [], [[]], [1.5], ["a", 1], [-1], [VOCAB], [2**40], [[1], "a"], None, [[[1]]]],
    "logprobs": ["1", 1.5, True, [], -1, 21],
    "echo": ["x", 1],
    "prompt_logprobs": ["1", 1.5, True, -1, 21],
    "add_special_tokens": BOOL_BAD,
    "suffix": [1, [], "tail"],
    "best_of": ["1", 1.5, 3],
}
CHAT_FIELDS = {
    "messages": [
        "x",
        [],
        {},
        [{}],
        [5],
        [{"role": "bot", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [5]}],
        [{"role": 1, "content": "x"}],
        [{"role": "user", "content": "x", "name": 5}],
        None,
    ],
    "max_completion_tokens": ["1", 1.5, 0, -1],
    "logprobs": ["yes", 1, []],
    "top_logprobs": ["1", -1, 21],
    "chat_template_kwargs": ["x", [], 5, {"add_generation_prompt": 1}, {"messages": 1}],
    "reasoning_effort": STR_BAD,
    "add_generation_prompt": BOOL_BAD,
}
# on /v1/completions every value of these is refused; on chat only the malformed ones
# (tests/server/test_server_structured.py covers what chat accepts)
CHAT_ONLY = {
    "tools": [[{"type": "function", "function": {"name": "f", "parameters": {}}}], 5, "x", {}],
    "tool_choice": ["auto", "required", {"type": "function", "function": {"name": "f"}}, 5],
    "parallel_tool_calls": [True, False, "x"],
    "response_format": [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}, "json", 5],
}
CHAT_ONLY_BAD = {
    "tools": [
        5,
        "x",
        {},
        [{"type": "function"}],
        [{"type": "function", "function": {"name": "a b"}}],
        [{"type": "function", "function": {"name": "f", "parameters": 5}}],
    ],
    "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}, 5, "always", {"type": "function"}],
    "parallel_tool_calls": ["x", 1],
    "response_format": [
        "json",
        5,
        {"type": "regex"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": 5},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
    ],
}
STRUCTURED = {
    "functions": [[{"name": "f"}], 5],
    "function_call": ["auto", {"name": "f"}],
    "logit_bias": [{"5": 100}, {"x": "y"}, [1], 5],
    "guided_json": [{"type": "object"}, "{}"],
    "guided_regex": ["[0-9]+"],
    "guided_choice": [["a", "b"]],
    "guided_grammar": ["root ::= 'a'"],
    "regex": ["a+"],
    "json_schema": [{"type": "object"}],
    "ebnf": ["root ::= 'a'"],
    "structural_tag": [{"x": 1}],
}
SURROGATE = "\ud800"


def generated_cases() -> list[tuple[str, str, dict, bytes, int, str | None]]:
    """(name, method path, headers, body, expected status, expected error code or None)."""
    cases = []

    def add(name, path, body, status=400, code=None, headers=JSON, method="POST"):
        cases.append((name, f"{method} {path}", headers, body if isinstance(body, bytes) else raw(body), status, code))

    for path, base, fields in (
        ("/v1/completions", BASE_COMPLETION, {**SAMPLING_FIELDS, **COMPLETION_FIELDS}),
        ("/v1/chat/completions", BASE_CHAT, {**SAMPLING_FIELDS, **CHAT_FIELDS}),
    ):
        for field, values in fields.items():
            for value in values:
                body = {**base, field: value}
                if field == "stream_options":
                    body["stream"] = True
                if field == "model" and isinstance(value, str):
                    continue
                add(f"{path} {field}={value!r}"[:120], path, body)
        refused = {**STRUCTURED, **(CHAT_ONLY_BAD if "chat" in path else CHAT_ONLY)}
        for field, values in refused.items():
            for value in values:
                add(f"{path} {field}={value!r}"[:120], path, {**base, field: value})
        # missing fields and non-object bodies
        add(f"{path} empty object", path, {})
        add(f"{path} only model", path, {"model": "evalpipe-tiny-dsv4"})
        for body in ([], [base], "x", 5, None, True):
            add(f"{path} body {body!r}"[:80], path, body)
        # lone surrogates wherever a string can go
        add(f"{path} model surrogate", path, {**base, "model": SURROGATE})
        add(f"{path} user surrogate", path, {**base, "user": "a" + SURROGATE})
        add(f"{path} stop surrogate", path, {**base, "stop": [SURROGATE]})
        add(f"{path} extra field surrogate", path, {**base, "x_extra": {"deep": [SURROGATE]}})
        add(f"{path} key surrogate", path, {**base, SURROGATE: 1})
        add(f"{path} low surrogate", path, {**base, "user": "\udc80"})
        # unknown model, huge n, batches the queue can never hold
        add(f"{path} unknown model", path, {**base, "model": "gpt-9"}, 404, "model_not_found")
        add(f"{path} 1 MB model name", path, {**base, "model": "m" * 1_000_000}, 404, "model_not_found")
        add(f"{path} n beyond the queue", path, {**base, "n": MAX_QUEUE + 1}, 400, "batch_too_large")
        add(f"{path} streamed n beyond the queue", path, {**base, "n": 40, "stream": True}, 400, "batch_too_large")
        add(f"{path} stream_options without stream", path, {**base, "stream_options": {"include_usage": True}})
        # wrong content types (a JSON body that does not say so is not read as JSON)
        for ctype in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/xml",
            "multipart/form-data; boundary=x",
        ):
            add(f"{path} content-type {ctype}", path, base, headers={"content-type": ctype})
        # broken JSON
        for text in (
            b"{",
            b"{'prompt': 'x'}",
            b"",
            b"\xff\xfe\x00",
            b'{"prompt": "x",}',
            b'{"prompt": "x"} trailing',
            b'{"prompt": NaN}',
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "\\ud800',
            b"[" * 100_000,
            b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}",
        ):
            add(f"{path} bad json {text[:20]!r}", path, text)
        # wrong methods
        add(f"{path} GET", path, b"", 405, headers={}, method="GET")
        add(f"{path} PUT", path, base, 405, method="PUT")
        add(f"{path} DELETE", path, b"", 405, headers={}, method="DELETE")

    prompt = "/v1/completions"
    add("surrogate prompt", prompt, {**BASE_COMPLETION, "prompt": SURROGATE}, 400, "invalid_unicode")
    add(
        "surrogate in a prompt batch",
        prompt,
        {**BASE_COMPLETION, "prompt": ["ok", "x" + SURROGATE]},
        400,
        "invalid_unicode",
    )
    add("surrogate suffix", prompt, {**BASE_COMPLETION, "suffix": SURROGATE})
    add("1 MB prompt", prompt, {**BASE_COMPLETION, "prompt": "a" * 1_000_000}, 400, "context_length_exceeded")
    add(
        "1 MB prompt ending in a surrogate",
        prompt,
        {**BASE_COMPLETION, "prompt": "a" * 1_000_000 + SURROGATE},
        400,
        "invalid_unicode",
    )
    add("200k token ids", prompt, {**BASE_COMPLETION, "prompt": [5] * 200_000}, 400, "context_length_exceeded")
    add("out-of-vocabulary id among many", prompt, {**BASE_COMPLETION, "prompt": [5] * 100 + [VOCAB]})
    add(
        "batch beyond the queue", prompt, {**BASE_COMPLETION, "prompt": ["a"] * (MAX_QUEUE + 1)}, 400, "batch_too_large"
    )
    add(
        "batch x n beyond the queue",
        prompt,
        {**BASE_COMPLETION, "prompt": ["a", "b", "c"], "n": 3},
        400,
        "batch_too_large",
    )
    add("deeply nested prompt", prompt, {**BASE_COMPLETION, "prompt": json.loads("[" * 400 + "]" * 400)})
    add("temperature 1e999 (inf)", prompt, b'{"prompt": "x", "max_tokens": 2, "temperature": 1e999}')
    add("temperature Infinity", prompt, b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}')
    add("top_p -Infinity", prompt, b'{"prompt": "x", "max_tokens": 2, "top_p": -Infinity}')
    chat = "/v1/chat/completions"
    add(
        "surrogate content",
        chat,
        {**BASE_CHAT, "messages": [{"role": "user", "content": SURROGATE}]},
        400,
        "invalid_unicode",
    )
    add(
        "surrogate in a text part",
        chat,
        {**BASE_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}]},
        400,
        "invalid_unicode",
    )
    add(
        "surrogate role", chat, {**BASE_CHAT, "messages": [{"role": SURROGATE, "content": "x"}]}, 400, "invalid_unicode"
    )
    add(
        "surrogate template kwarg",
        chat,
        {**BASE_CHAT, "chat_template_kwargs": {"thinking": SURROGATE}},
        400,
        "invalid_unicode",
    )
    add("surrogate reasoning_effort", chat, {**BASE_CHAT, "reasoning_effort": SURROGATE}, 400, "invalid_unicode")
    add(
        "chat over the context",
        chat,
        {**BASE_CHAT, "messages": [{"role": "user", "content": "b" * 5000}]},
        400,
        "context_length_exceeded",
    )
    # routes: unknown ones and the documentation routes (off by default)
    for path in ("/v1/nope", "/v1/completions/x", "/docs", "/redoc", "/openapi.json", "/%FF%FE", "/v1/模型"):
        add(f"GET {path}", path, b"", 404, headers={}, method="GET")
    # authentication comes first: no key or a wrong one is a 401 whatever the body
    for name, headers in (
        ("no key", {}),
        ("wrong key", {"Authorization": "Bearer nope"}),
        ("empty bearer", {"Authorization": "Bearer"}),
        ("basic auth", {"Authorization": "Basic eDp5"}),
        ("key without scheme", {"Authorization": KEY}),
        ("key with suffix", {"Authorization": f"Bearer {KEY}x"}),
    ):
        for path, body in (
            ("/v1/completions", raw(BASE_COMPLETION)),
            ("/v1/completions", b"{not json"),
            ("/v1/chat/completions", raw({**BASE_CHAT, "model": SURROGATE})),
            ("/get_server_info", b""),
            ("/docs", b""),
            ("/v1/nope", b""),
        ):
            method = "POST" if path.startswith("/v1/c") else "GET"
            cases.append(
                (
                    f"{name} {method} {path} {body[:12]!r}",
                    f"{method} {path}",
                    {**JSON, **headers, "x-no-auth": "1"},
                    body,
                    401,
                    "invalid_api_key",
                )
            )
    return cases


CASES = generated_cases()


def client_address(resp: httpx.Response):
    return resp.extensions["network_stream"].get_extra_info("client_addr")


def assert_openai_error(resp: httpx.Response, status: int, code: str | None, name: str) -> None:
    assert resp.status_code == status, f"{name}: {resp.status_code} {resp.text[:300]}"
    body = resp.json()
    assert set(body) == {"error"}, f"{name}: {body}"
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"], name
    if code is not None:
        assert err["code"] == code, f"{name}: {err}"


def test_generated_malformed_requests_get_openai_4xx_and_keep_the_connection(server):
    assert len(CASES) >= 300, len(CASES)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    addresses = set()
    statuses: dict[int, int] = {}
    t0 = time.monotonic()
    with httpx.Client(base_url=server.base, limits=limits, timeout=60) as client:
        for name, route, headers, body, status, code in CASES:
            method, path = route.split(" ", 1)
            headers = dict(headers)
            if not headers.pop("x-no-auth", None):
                headers.update(AUTH)
            resp = client.request(method, path, content=body, headers=headers)
            addresses.add(client_address(resp))
            assert resp.status_code < 500, f"{name}: {resp.status_code} {resp.text[:300]}"
            assert_openai_error(resp, status, code, name)
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            # the same keep-alive connection still serves a valid request
            ok = client.get("/v1/models", headers=AUTH)
            assert ok.status_code == 200 and ok.json()["data"], f"after {name}: {ok.status_code}"
            addresses.add(client_address(ok))
        elapsed = time.monotonic() - t0
        assert len(addresses) == 1, f"the server dropped the connection {len(addresses) - 1} time(s)"
        # a real generation on that same connection, then the server is healthy
        gen = client.post(
            "/v1/completions",
            json={"prompt": "ok", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
            headers=AUTH,
        )
        assert gen.status_code == 200 and gen.json()["usage"]["completion_tokens"] == 3
        assert client_address(gen) in addresses
    assert httpx.get(server.base + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.base + "/get_server_info", headers=AUTH).json()["internal_states"]
    assert info["running"] == 0 and info["waiting"] == 0 and info["allocated_slots"] == 0
    assert set(statuses) <= {400, 401, 404, 405}, statuses
    print(f"{len(CASES)} malformed requests in {elapsed:.1f}s: {statuses}")


def test_neutral_values_of_refused_fields_are_accepted(server):
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}}
    r = httpx.post(server.base + "/v1/chat/completions", headers=AUTH, timeout=60, json={**BASE_CHAT, **neutral})
    assert r.status_code == 200, r.text


def test_doc_routes_are_off_and_health_is_open(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.base + path).status_code == 401  # auth first
        assert httpx.get(server.base + path, headers=AUTH).status_code == 404
    for path in ("/health", "/health_generate"):
        assert httpx.get(server.base + path, timeout=30).status_code == 200


# ----------------------------------------------------------------------------------------- disconnects
def internal(server) -> dict:
    return httpx.get(server.base + "/get_server_info", headers=AUTH, timeout=10).json()["internal_states"]


def open_request(server, body: dict) -> socket.socket:
    """A raw HTTP/1.1 request on a socket we can close at the moment we choose."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def wait_for(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what} not within {timeout}s")
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_disconnect_aborts_generation_within_a_second(server, stream):
    before = internal(server)
    assert before["running"] == 0
    body = {"prompt": "abort me", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": stream}
    sock = open_request(server, body)
    try:
        wait_for(lambda: internal(server)["running"] == 1, 30, "the request running")
        if stream:  # tokens are flowing
            sock.settimeout(30)
            seen = b""
            while b"data: {" not in seen:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the stream"
                seen += chunk
        time.sleep(0.3)  # decoding, several engine steps in
    finally:
        sock.close()
    took = wait_for(lambda: internal(server)["running"] == 0, 5, "running back to 0")
    after = internal(server)
    print(f"running dropped {took:.3f}s after the disconnect")
    assert took < DROP_WITHIN_S, f"running dropped only after {took:.2f}s"
    assert after["allocated_slots"] == 0 and after["waiting"] == 0
    assert after["stats"]["aborted"] == before["stats"]["aborted"] + 1
    assert after["stats"]["generated_tokens"] - before["stats"]["generated_tokens"] < 3000


def test_interrupted_run_aborts_every_in_flight_request(server, tmp_path):
    """Ctrl-C of `evalpipe run`: exit 130 with the resume command, and nothing keeps generating on the server."""
    env = dict(os.environ, EVALPIPE_DATA_DIR=str(DATA_DIR), EVALPIPE_API_KEY=KEY)
    proc = subprocess.Popen(
        evalpipe_cmd(
            "run",
            "gsm8k",
            "--base-url",
            server.base + "/v1",
            "--out",
            tmp_path,
            "--num-examples",
            "6",
            "--concurrency",
            "6",
            "--max-tokens",
            "1000",
            "--no-progress",
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: internal(server)["running"] + internal(server)["waiting"] >= 6, 60, "six requests in")
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        took = wait_for(lambda: internal(server)["running"] + internal(server)["waiting"] == 0, 5, "server idle")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "evalpipe run --resume" in err, err
    print(f"server idle {took:.3f}s after Ctrl-C")
    # this includes the run process handling the signal and closing six connections (0.1-0.7 s measured on the
    # shared 2-core machine); before the disconnect watcher the requests ran on for minutes
    assert took < 2 * DROP_WITHIN_S, f"in-flight requests still ran {took:.2f}s after Ctrl-C"
    assert internal(server)["allocated_slots"] == 0
