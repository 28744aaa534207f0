"""Streamed text holding U+2028 and U+0085 survives every reader: httpx's aiter_lines, the openai SDK and
`evalpipe bench`, against a real `evalpipe serve` whose tokenizer decodes every token to text with both.

Line readers (str.splitlines, httpx aiter_lines) also break lines at U+0085, U+2028 and U+2029, which JSON allows
raw inside strings; the server escapes them so each SSE event is one line for any reader, and evalpipe's own
client parses events by the SSE spec (lines end only at CR/LF), checked here against a peer that sends them raw.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from evalpipe.harness.bench import stream_request
from evalpipe.harness.client import streaming_client
from tests.support.core_helpers import run_cli
from tests.support.server_harness import ServerProcess

LS, NEL = "\u2028", "\u0085"
N_TOKENS = 24


def write_tokenizer(folder) -> None:
    """A Hugging Face tokenizer whose 299 words all decode to text holding U+2028 and U+0085."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}{LS}x{NEL}": i for i in range(1, 300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("separator-tokenizer")
    write_tokenizer(folder)
    srv = ServerProcess("--tokenizer", str(folder), "--max-seq-len", "256", "--docs")
    yield srv
    assert srv.stop() == 0, srv.output()


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def expected(server):
    """The non-streamed greedy completion: the text every streamed reading must reproduce."""
    r = httpx.post(server.base + "/v1/completions", json=BODY, timeout=60).json()
    text = r["choices"][0]["text"]
    assert LS in text and NEL in text and r["usage"]["completion_tokens"] == N_TOKENS
    return text


def test_docs_routes_exist_with_the_flag(server):
    """Off by default (tests/server/test_server_hostile.py); `serve --docs` turns them on."""
    assert httpx.get(server.base + "/openapi.json").json()["paths"]["/v1/completions"]
    assert httpx.get(server.base + "/docs").status_code == 200


def test_httpx_aiter_lines_gets_whole_events(server, expected):
    async def read() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", server.base + "/v1/completions", json={**BODY, "stream": True}) as resp:
                return [line async for line in resp.aiter_lines()]

    lines = asyncio.run(read())
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    # every non-empty line is a whole event: nothing was split at a separator
    assert all(line == "" or line.startswith("data: ") for line in lines), [
        line for line in lines if line and not line.startswith("data")
    ]
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    # on the wire the separators are JSON escapes, not raw characters
    with httpx.stream("POST", server.base + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as resp:
        wire = resp.read()
    assert LS.encode() not in wire and NEL.encode() not in wire and b"\\u2028" in wire and b"\\u0085" in wire


def test_openai_sdk_stream_reproduces_the_text(server, expected):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model,
        prompt=BODY["prompt"],
        max_tokens=N_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_evalpipe_bench_counts_every_token(server, tmp_path):
    r = run_cli(
        "bench",
        "--base-url",
        server.base + "/v1",
        "--input-len",
        "8",
        "--output-len",
        str(N_TOKENS),
        "--rounds",
        "2",
        "--warmup",
        "0",
        "--out",
        tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["results"]["n_errors"] == 0 and len(bench["requests"]) == 2
    for req in bench["requests"]:
        assert req["completion_tokens"] == N_TOKENS and sum(n for _, n in req["events"]) == N_TOKENS
        assert req["decode_tokens_per_s"] is not None


class RawSeparatorPeer(BaseHTTPRequestHandler):
    """A peer that streams SSE with raw U+2028/U+0085 in its JSON, CRLF line ends, a comment line and an event
    split over two data lines: what a spec-following client must read correctly."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        events = [
            {"choices": [{"index": 0, "text": f"a{LS}b", "token_ids": [1, 2]}]},
            {"choices": [{"index": 0, "text": f"c{NEL}d", "token_ids": [3]}]},
            {"choices": [{"index": 0, "text": "e", "token_ids": [4], "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": 4}},
        ]
        body = b": keep-alive comment\r\n\r\n"
        for i, event in enumerate(events):
            text = json.dumps(event, ensure_ascii=False)
            if i == 1:  # one event in two data lines (joined with LF by the spec)
                head, tail = text[:10], text[10:]
                body += f"data: {head}\r\ndata: {tail}\r\n\r\n".encode()
            else:
                body += f"data: {text}\r\n\r\n".encode()
        body += b"data: [DONE]\r\n\r\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_bench_client_parses_raw_separators_by_the_sse_spec():
    peer = ThreadingHTTPServer(("127.0.0.1", 0), RawSeparatorPeer)
    thread = threading.Thread(target=peer.serve_forever, daemon=True)
    thread.start()
    try:

        async def go():
            async with streaming_client(None, 30, 1) as client:
                return await stream_request(client, f"http://127.0.0.1:{peer.server_port}/v1/completions", {}, {})

        out = asyncio.run(go())
    finally:
        peer.shutdown()
    assert out["error"] is None, out["error"]
    assert [n for _, n in out["events"]] == [2, 1, 1] and out["completion_tokens"] == 4
    assert out["finish_reason"] == "length"
