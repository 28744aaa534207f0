"""Each of the harness's three clients reuses a busy connection but drops one idle for KEEPALIVE_EXPIRY_S, before a
uvicorn server (5 s) would close it under a request (evalpipe/harness/client.py says why)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from evalpipe.harness.client import (
    KEEPALIVE_EXPIRY_S,
    Server,
    openai_client,
    send,
    sse_json,
    streaming_client,
)


class PortEcho(BaseHTTPRequestHandler):
    """Answers every request with the client's port: the connection it came on. Keeps connections open (HTTP/1.1)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.reply(json.dumps({"data": [{"id": str(self.client_address[1])}]}).encode(), "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        port = str(self.client_address[1])
        if body.get("stream"):
            events = f"data: {json.dumps({'port': port})}\n\ndata: [DONE]\n\n"
            self.reply(events.encode(), "text/event-stream")
        else:
            self.reply(json.dumps({"choices": [{"text": port}]}).encode(), "application/json")


def test_every_client_reuses_a_busy_connection_and_drops_an_idle_one():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PortEcho)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/v1"

    async def ports(server: Server, api, stream) -> list[str]:
        reply = await send(api, "/completions", {"prompt": "x"}, chat=False, max_retries=0, backoff_s=0)
        streamed = [event async for event in sse_json(stream, base + "/completions", {"stream": True})]
        return [server.models()["data"][0]["id"], reply.data["choices"][0]["text"], streamed[0]["port"]]

    async def main() -> list[list[str]]:
        api = openai_client(base, None, timeout_s=10, connections=1)
        with Server(base, trust_env=False) as server:
            async with streaming_client(None, timeout_s=10, connections=1) as stream:
                first, busy = await ports(server, api, stream), await ports(server, api, stream)
                await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
                idle = await ports(server, api, stream)
        await api.close()
        return [first, busy, idle]

    try:
        t0 = time.monotonic()
        first, busy, idle = asyncio.run(main())
    finally:
        httpd.shutdown()
    assert time.monotonic() - t0 < 5 + KEEPALIVE_EXPIRY_S  # no request hung
    assert busy == first, (first, busy)  # Server, openai and aiohttp: the same three connections
    assert all(i != f for i, f in zip(idle, first)), (first, idle)  # each dropped after KEEPALIVE_EXPIRY_S idle
