"""The harness's one HTTP client: every request that run, repeat, bench and ab send to a server goes through here.

- `Server`: the routes beside generation, on one keep-alive connection: who the server is (`/v1/models`,
  `/get_server_info` or vLLM's `/server_info`), its prefix cache (`/flush_cache`, vLLM's `/reset_prefix_cache`), its
  tokenizer (`/tokenize`) and its Prometheus `/metrics` (parsed by spec_metrics). Blocking calls: they are made
  before, between and after workloads, never beside requests in flight. Server info comes back redacted.
- `openai_clients` + `send`: generation through the real `openai.AsyncOpenAI`, posted as `post(path, body=...,
  cast_to=httpx.Response)` (the client's documented route for arbitrary bodies: the body recorded is the body sent,
  and no pydantic parsing on the hot path), with one retry policy (RETRY_POLICY); the client's own retries are off.
- `streaming_client` + `sse_json`: a streamed completion's events on aiohttp, parsed by the SSE spec (bench).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Optional

import httpx
import openai
from httpx_sse import SSEError
from httpx_sse._decoders import SSEDecoder, SSELineDecoder  # the package's spec parser; it exports no other

from evalpipe.harness.server_facts import deterministic_mode
from evalpipe.redact import redact, scrub_values

if TYPE_CHECKING:  # aiohttp is imported where streams are read (bench, qualify): a quarter second of every `run`
    import aiohttp

DEFAULT_BASE_URL = "http://127.0.0.1:30000/v1"  # where `evalpipe serve` listens unless told otherwise
# vLLM's /server_info (dev mode) is one text string unless asked for JSON; others ignore the query
SERVER_INFO_PATHS = ("/get_server_info", "/server_info?config_format=json")
# Routes that drop a server's prefix cache: SGLang's and ours, then vLLM's (only with VLLM_SERVER_DEV_MODE=1)
CACHE_RESET_PATHS = ("/flush_cache", "/reset_prefix_cache")
CACHE_RESET_MISSING = (
    "the server offers neither /flush_cache nor /reset_prefix_cache "
    "(vLLM has /reset_prefix_cache only when started with VLLM_SERVER_DEV_MODE=1)"
)
RETRY_POLICY = "transport errors, timeouts, 5xx, malformed bodies; never 4xx; backoff doubles, cap 30 s"
MAX_BACKOFF_S = 30.0
# httpcore's async pool scans every connection for every request (O(connections) per event), so 64 connections in
# one pool cost more CPU than the requests themselves: generation is spread over small pools instead
CONNECTIONS_PER_CLIENT = 8
# Idle connections are dropped after 2 s, below uvicorn's 5 s keep-alive (vLLM, SGLang and `evalpipe serve` run on
# uvicorn). httpx's own default is also 5 s: a request could then go out on a connection the server was closing at
# that moment and fail as "Connection error" (uvicorn at 1 s with a 5 s client: 1 ReadError in 80 requests sent
# 0.97-1.03 s apart; 0 with a 0.5 s client), which qualify, retrying nothing, counts against the server.
KEEPALIVE_EXPIRY_S = 2.0

_SSL_CONTEXT = None


def ssl_context():
    """One TLS context for every client of a process: building one (loading the CA bundle) costs ~0.1 s each."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = httpx.create_ssl_context()
    return _SSL_CONTEXT


def server_root(base_url: str) -> str:
    """`http://h:p/v1` -> `http://h:p` (server-level routes live outside the OpenAI prefix)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def v1_hint(base_url: str, status: Optional[int]) -> str:
    """A 404 on /models from a base URL without /v1 is almost always the missing OpenAI prefix: say so."""
    if status == 404 and not base_url.rstrip("/").endswith("/v1"):
        return f"; did you mean --base-url {base_url.rstrip('/')}/v1 ?"
    return ""


def auth_headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def timeout(timeout_s: float) -> httpx.Timeout:
    """`timeout_s` per request; connecting gives up after 30 s at most."""
    return httpx.Timeout(timeout_s, connect=min(30.0, timeout_s))


class EndpointError(Exception):
    """The endpoint is unreachable or does not behave like an OpenAI-compatible server."""


class Server:
    """One endpoint's routes beside generation (module docstring). Use as a context manager, or `close()` it."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout_s: float = 30.0, trust_env: bool = True):
        self.base_url = base_url.rstrip("/")
        self.root = server_root(base_url)
        self.api_key = api_key
        self._http = httpx.Client(
            verify=ssl_context(),
            timeout=timeout(timeout_s),
            headers=auth_headers(api_key),
            trust_env=trust_env,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def models(self) -> dict:
        """GET {base_url}/models -> the raw JSON, which lists at least one `data[].id`; else EndpointError."""
        url = self.base_url + "/models"
        try:
            r = self._http.get(url)
        except httpx.HTTPError as exc:
            raise EndpointError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise EndpointError(
                f"GET {url} returned HTTP {r.status_code}: {r.text[:300]}" + v1_hint(self.base_url, r.status_code)
            )
        try:
            body = r.json()
            ids = [m["id"] for m in body["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise EndpointError(f"GET {url} did not return an OpenAI model list: {r.text[:300]}") from exc
        if not ids:
            raise EndpointError(f"GET {url} lists no models; pass --model explicitly is not enough: nothing is served")
        return body

    def get(self, path: str) -> Optional[httpx.Response]:
        """GET <server root><path>; None when the server cannot be reached."""
        try:
            return self._http.get(self.root + path)
        except httpx.HTTPError:
            return None

    def post(self, path: str, body: Optional[dict] = None) -> Optional[httpx.Response]:
        """POST <server root><path> (JSON `body`, if any); None when the server cannot be reached."""
        try:
            return self._http.post(self.root + path, json=body)
        except httpx.HTTPError:
            return None

    @staticmethod
    def json_of(response: Optional[httpx.Response]) -> Any:
        """The JSON body of a 200 answer, else None."""
        if response is None or response.status_code != 200:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    def server_info(self) -> tuple[Optional[str], Any]:
        """(path, redacted JSON) from the first of SERVER_INFO_PATHS that answers 200 with JSON, else (None, None).

        Redacted (evalpipe.redact): a server may echo its key in its settings or launch command."""
        for path in SERVER_INFO_PATHS:
            info = self.json_of(self.get(path))
            if info is not None:
                return path, redact(info, [self.api_key or ""])
        return None, None

    def describe(self) -> dict:
        """{"models", "server_info_path", "server_info", "deterministic"}: the server facts a run manifest records
        (`deterministic`: its batch-invariant mode as it reports it, None when it does not say)."""
        try:
            models: Any = self.models()
        except EndpointError as exc:
            models = {"error": str(exc)}
        path, info = self.server_info()
        deterministic = deterministic_mode(info)
        return {"models": models, "server_info_path": path, "server_info": info, "deterministic": deterministic}

    def count_tokens(self, model: str, prompt: Optional[str] = None, messages: Optional[list] = None) -> Optional[int]:
        """The length in the server's own tokens of a completion `prompt` (special tokens added as a completion adds
        them) or of a chat's `messages` (rendered by the model's chat template with the generation prompt), from
        POST /tokenize (vLLM, SGLang and `evalpipe serve` answer `count`); None when the server has no such route or
        cannot render the chat (no chat template)."""
        body: dict[str, Any] = {"model": model}
        body.update({"prompt": prompt} if messages is None else {"messages": messages, "add_generation_prompt": True})
        answer = self.json_of(self.post("/tokenize", body))
        count = answer.get("count") if isinstance(answer, dict) else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    def reset_prefix_cache(self, paths: tuple[str, ...] = CACHE_RESET_PATHS) -> Optional[str]:
        """POST the first of `paths` the server answers with 2xx; that path, or None when none did."""
        for path in paths:
            response = self.post(path)
            if response is not None and 200 <= response.status_code < 300:
                return path
        return None


# ------------------------------------------------------------------------------------------------- generation


def openai_client(base_url: str, api_key: Optional[str], timeout_s: float, connections: int) -> openai.AsyncOpenAI:
    """An AsyncOpenAI on its own pool of `connections`, with the client's retries off (`send` retries)."""
    limits = httpx.Limits(
        max_connections=connections + 2,
        max_keepalive_connections=connections + 2,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    http = openai.DefaultAsyncHttpxClient(limits=limits, verify=ssl_context(), timeout=timeout(timeout_s))
    return openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s, http_client=http
    )


def openai_clients(
    base_url: str, api_key: Optional[str], timeout_s: float, concurrency: int
) -> list[openai.AsyncOpenAI]:
    """Clients for `concurrency` requests in flight, CONNECTIONS_PER_CLIENT connections each (see there)."""
    n_clients = max(1, -(-concurrency // CONNECTIONS_PER_CLIENT))
    per_client = -(-concurrency // n_clients)
    return [openai_client(base_url, api_key, timeout_s, per_client) for _ in range(n_clients)]


@dataclass
class Reply:
    data: Optional[dict]  # the response JSON; None when the request failed for good
    latency_s: float  # client wall time of the deciding attempt
    error: Optional[dict]  # {"type", "status", "message", "retries_exhausted"} when data is None
    attempts: list  # [{"start", "end", "error"}], one per try; the last one decides


async def send(
    client: openai.AsyncOpenAI,
    path: str,
    body: dict,
    *,
    chat: bool,
    max_retries: int,
    backoff_s: float,
    secrets: Iterable[str] = (),
) -> Reply:
    """POST `body` to `path` (relative to the client's base URL) under RETRY_POLICY.

    A 200 whose body is not JSON with a `choices[0]` object (with a `message` object on chat) is malformed and
    retried like a transport error. Error messages have `secrets` scrubbed: a server may echo what it was sent."""
    attempts: list[dict] = []
    n_tries = 1 + max(0, max_retries)
    for i in range(n_tries):
        start = time.time()
        t0 = time.perf_counter()
        err: Optional[dict] = None
        retryable = False
        try:
            resp = await client.post(path, body=body, cast_to=httpx.Response)
            try:
                data = json.loads(resp.content)
                choice = data["choices"][0]
                if not isinstance(choice, dict):
                    raise TypeError("choice is not an object")
                if chat and not isinstance(choice.get("message"), dict):
                    raise TypeError("chat choice has no message object")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                err = {
                    "type": "malformed_response",
                    "status": resp.status_code,
                    "message": f"{type(exc).__name__}: {exc}; body starts {resp.text[:200]!r}",
                }
                retryable = True
            else:
                attempts.append({"start": start, "end": time.time(), "error": None})
                return Reply(data, time.perf_counter() - t0, None, attempts)
        except openai.APIStatusError as exc:
            err = {"type": type(exc).__name__, "status": exc.status_code, "message": str(exc)[:2000]}
            retryable = exc.status_code >= 500
        except (openai.APITimeoutError, openai.APIConnectionError) as exc:
            err = {"type": type(exc).__name__, "status": None, "message": str(exc)[:2000]}
            retryable = True
        err = scrub_values(err, [s for s in secrets if s])
        attempts.append({"start": start, "end": time.time(), "error": err})
        if not retryable or i == n_tries - 1:
            return Reply(None, time.perf_counter() - t0, dict(err, retries_exhausted=retryable), attempts)
        await asyncio.sleep(min(MAX_BACKOFF_S, backoff_s * (2**i)))
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------------- streaming


def streaming_client(api_key: Optional[str], timeout_s: float, connections: int) -> aiohttp.ClientSession:
    """An aiohttp session for `connections` streams in flight (enter it inside the event loop that reads them).

    aiohttp, not httpx, reads streams: its C HTTP parser costs less client CPU per streamed event (measured by
    benchmarks/harness/bench_client_ceiling.py), and a bench whose client is the bound measures the client. Same
    timeouts (`timeout`), TLS context, key and proxy settings."""
    import aiohttp

    limits = timeout(timeout_s)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections + 4, ssl=ssl_context(), keepalive_timeout=KEEPALIVE_EXPIRY_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=limits.connect, sock_read=limits.read),
        headers=auth_headers(api_key),
        trust_env=True,
    )


class StreamRefused(Exception):
    """A streamed request answered with another status than 200."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text}")
        self.status, self.text = status, text


async def sse_json(
    client: aiohttp.ClientSession, url: str, body: dict, headers: Optional[dict] = None
) -> AsyncIterator[dict]:
    """POST `body` and yield each event's JSON payload as it arrives, up to `[DONE]`; StreamRefused on a non-200,
    SSEError when the answer is not an event stream.

    Events are parsed by the SSE spec (httpx-sse's decoders: a line ends only at CR/LF, an event at a blank line),
    never by a line reader: text may hold U+2028 or U+0085, which line readers take for line breaks. Close the
    generator (contextlib.aclosing) when leaving it early, so the connection goes back to the pool."""
    async with client.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise StreamRefused(resp.status, (await resp.read()).decode(errors="replace")[:2000])
        if "text/event-stream" not in resp.headers.get("content-type", "").partition(";")[0]:
            raise SSEError(f"expected a text/event-stream answer, got {resp.headers.get('content-type')!r}")
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        lines, events = SSELineDecoder(), SSEDecoder()
        async for data in resp.content.iter_any():
            for line in lines.decode(text.decode(data)):
                event = events.decode(line)
                if event is None:
                    continue
                payload = event.data.strip()
                if payload == "[DONE]":
                    return
                if payload:
                    yield json.loads(payload)
