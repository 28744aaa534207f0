"""A scripted OpenAI-compatible server: a stand-in for a remote peer in tests and benchmarks.

It is a real process (uvicorn, raw ASGI app for speed) on 127.0.0.1 that answers `/v1/completions` and
`/v1/chat/completions` from a canned answer table, in one of several behaviours.

Python API (reuse it in your tests):

    from tests.support.scripted_server import start_scripted_server, stop_scripted_server, answer_table

    base_url, proc = start_scripted_server(mode="correct", answers=answer_table("gsm8k"))
    ...  # base_url is "http://127.0.0.1:<port>/v1"
    stop_scripted_server(proc)

or the context manager `scripted_server(**config)` yielding `base_url`.

Config keys (all optional; any subset is also POSTable to `/scripted/config` (`set_config`) to change it at
runtime, which also restarts the per-question counts that `fail_first` uses):
  mode         "correct" | "wrong" | "truncated" | "error500" | "error400" | "timeout" | "malformed" |
               "bad_shape" | "no_answer" | "mixed"   (default "correct")
               malformed = truncated JSON body; bad_shape = valid JSON whose choice has no message object.
               error400 answers {"error": {"message": error_message}} (default "scripted bad request").
               mixed = deterministic per question: by sha256(question) % 10 -> 0-5 correct, 6 wrong,
               7 truncated, 8 always HTTP 500, 9 no answer. Use `mixed_bucket(question)` to predict.
  answers      {question text: gold answer string}; see `answer_table(lane)`.
  delay_s      sleep before every answer (default 0); mode "timeout" sleeps `timeout_sleep_s` (default 30).
  fail_first   the first N requests of every question get HTTP 500 before the mode applies (default 0).
  models       ids listed by /v1/models (default ["scripted-model"]).
  server_info  JSON returned by /get_server_info (default {"scripted": true}); null -> 404.
  spec         object put on every choice (every mode) as `spec` (e.g. {"accept_length": 2.5, "simulated": false}).
  meta_info    object put on every choice as `meta_info` (SGLang's per-response shape, e.g. its spec_* keys).
  token_ids    when true (default) and the request has return_token_ids, the choice carries `token_ids`.
  api_keys     when non-empty, every route but /health* and /scripted/* needs `Authorization: Bearer <one of them>`.
  faults       list of deliberate faults (for `evalpipe qualify`'s gates):
               "open_route" /get_server_info answers without a key; "any_key" any non-empty key is accepted;
               "lose_needle" retrieval answers a wrong code; "early_stop" every answer stops half way
               (finish_reason "length"); "leak_tool_protocol" tool calls come back as `<|tool_call|>` text;
               "drop_images" (mode "skills") chat image_url parts are accepted and ignored: answered as if absent,
               with logprobs when asked (the same for every image).
               mode "skills" only (for the kv-pressure gate): "stale_cache" a prompt seen before is answered with
               the previous other prompt's answer (a stale page), its cached tokens still reported;
               "evict_live" a completion that overlaps another one in flight has its digits corrupted (a live
               sequence's pages evicted).
  stream_delay_s  pause between streamed events (default 0.002).
  reply_format  mode "skills", chat: the format of a needle's code or a copy's text as the reply (default
               "{reply}"; e.g. " {reply}\n" pads it, "The code is {reply}." decorates it).
  bytes_per_token when set (mode "skills"), POST /tokenize answers {"tokens", "count"}: a prompt, or the messages as
               ChatML with the generation prompt, counted as ceil(UTF-8 bytes / bytes_per_token) + 1; without it
               the server has no /tokenize (404), as SGLang's or vLLM's peers may not.
Mode "skills" answers the formats of evalpipe.skills the way a perfect model would: a retrieval question with the
needle's code, a tool ask with the matching call (tools given; the fixed tools of `chat` and the drawn ones of
`tools`), a tool result by stating it, a JSON ask under response_format with the object; any other prompt with a
continuation determined by the prompt (max_tokens long with ignore_eos; a chat prompt's image parts included, as a
vision model sees them); it has /flush_cache (other modes have none). It is byte-level: token ids are bytes + 16
and usage.prompt_tokens is the prompt's bytes + 1. It keeps a prefix cache of the completion prompts since the
last flush: usage.prompt_tokens_details.cached_tokens is the longest prefix shared with one of them, in whole
pages of PAGE_BYTES.
Every mode streams (`stream: true`) as SSE, chunk by chunk, ending with `[DONE]`.
A request with `logprobs` gets well-formed fake logprobs (top-k as asked) in the OpenAI shape of its endpoint.
Introspection: GET /scripted/stats -> {"n_requests": total, "per_question": {question: count}, "bodies": last 50}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx

REPO = Path(__file__).resolve().parents[2]

DEFAULT_CONFIG: dict = {
    "mode": "correct",
    "answers": {},
    "delay_s": 0.0,
    "timeout_sleep_s": 30.0,
    "fail_first": 0,
    "models": ["scripted-model"],
    "server_info": {"scripted": True},
    "spec": None,
    "meta_info": None,
    "token_ids": True,
    "api_keys": [],
    "faults": [],
    "stream_delay_s": 0.002,
    "error_message": None,
    "bytes_per_token": None,
    "reply_format": "{reply}",
}
OPEN_PATHS = ("/health", "/health_generate")
PAGE_BYTES = 16  # the skills mode's prefix-cache page
CACHED_PROMPTS = 64  # prompts its prefix cache remembers
TOOL_MARK = "<|tool_call|>"


# ------------------------------------------------------------------------------------------- helpers (API)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def question_of(body: dict) -> str:
    """The question a request asks: text after the last "Question: " (raw prompt) or after the first blank line
    of the last user message (chat prompts: instruction, blank line, problem)."""
    if "prompt" in body:
        p = body["prompt"] if isinstance(body["prompt"], str) else str(body["prompt"])
        q = p[p.rfind("Question: ") + len("Question: ") :] if "Question: " in p else p
        return q[: -len("\nAnswer:")] if q.endswith("\nAnswer:") else q
    content = body.get("messages", [{}])[-1].get("content", "")
    if not isinstance(content, str):
        content = json.dumps(content)
    head, sep, tail = content.partition("\n\n")
    return tail if sep else content


def mixed_bucket(question: str) -> str:
    b = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 10
    return "correct" if b <= 5 else {6: "wrong", 7: "truncated", 8: "error500", 9: "no_answer"}[b]


def answer_table(lane: str, data_dir: Optional[Path] = None) -> dict:
    """{question: gold} for a lane, read from the same files evalpipe reads (gold as the grader sees it)."""
    if lane == "gsm8k":
        from evalpipe.lanes.data import find_gsm8k_test, read_jsonl
        from evalpipe.lanes.grading import legacy_answer_value

        return {r["question"]: str(legacy_answer_value(r["answer"])) for r in read_jsonl(find_gsm8k_test(data_dir))}
    from evalpipe.lanes.data import read_jsonl
    from evalpipe.lanes.sgl_eval_adapter import aime26_dataset

    return {r["problem"]: str(r["expected_answer"]) for r in read_jsonl(aime26_dataset())}


def start_scripted_server(
    config: Optional[dict] = None, *, startup_timeout_s: float = 30.0, **kwargs
) -> tuple[str, subprocess.Popen]:
    """Start the server as a subprocess on a free 127.0.0.1 port; returns (base_url ending in /v1, process).

    `config` and keyword arguments are merged over DEFAULT_CONFIG (e.g. `mode="mixed", answers=...`)."""
    cfg = dict(DEFAULT_CONFIG)
    cfg.update(config or {})
    cfg.update(kwargs)
    port = free_port()
    import tempfile

    fd, cfg_path = tempfile.mkstemp(prefix="scripted-server-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(cfg, fh)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.scripted_server", "--port", str(port), "--config", cfg_path],
        cwd=str(REPO),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + startup_timeout_s
    with httpx.Client(timeout=1) as client:  # one for the wait: a bare httpx.get builds a TLS context (~34 ms of CPU)
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"scripted server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if client.get(base + "/health").status_code == 200:
                    os.unlink(cfg_path)
                    return base + "/v1", proc
            except httpx.HTTPError:
                time.sleep(0.05)
    proc.kill()
    raise RuntimeError("scripted server did not start in time")


def stop_scripted_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def scripted_server(**config):
    base_url, proc = start_scripted_server(config)
    try:
        yield base_url
    finally:
        stop_scripted_server(proc)


def server_stats(base_url: str) -> dict:
    return httpx.get(base_url.rsplit("/v1", 1)[0] + "/scripted/stats", timeout=10).json()


def set_config(base_url: str, **changes) -> None:
    httpx.post(base_url.rsplit("/v1", 1)[0] + "/scripted/config", json=changes, timeout=10).raise_for_status()


# ------------------------------------------------------------------------------------------- the ASGI app


class ScriptedApp:
    def __init__(self, config: dict):
        self.cfg = dict(DEFAULT_CONFIG, **config)
        self.n_requests = 0
        self.per_question: dict[str, int] = {}
        self.bodies: list = []
        self.prompts: list[tuple[str, str]] = []  # skills mode: (completion prompt, its answer) since the last flush
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/health" or path == "/health_generate":
            return await self._send(send, 200, b"{}")
        if not path.startswith("/scripted/") and not self._authorized(scope):
            return await self._json(
                send, 401, {"error": {"message": "Incorrect API key provided.", "code": "invalid_api_key"}}
            )
        if path == "/flush_cache" and self.cfg["mode"] == "skills":  # other modes stand in for a server without one
            self.prompts = []
            return await self._json(send, 200, {"flushed": True})
        if path == "/tokenize" and method == "POST" and self.cfg["mode"] == "skills" and self.cfg["bytes_per_token"]:
            return await self._json(send, 200, scripted_tokenize(json.loads(raw), self.cfg["bytes_per_token"]))
        if path == "/v1/models":
            data = [{"id": m, "object": "model", "owned_by": "scripted"} for m in self.cfg["models"]]
            return await self._json(send, 200, {"object": "list", "data": data})
        if path == "/get_server_info":
            if self.cfg["server_info"] is None:
                return await self._json(send, 404, {"detail": "not found"})
            return await self._json(send, 200, self.cfg["server_info"])
        if path == "/scripted/stats":
            return await self._json(
                send,
                200,
                {"n_requests": self.n_requests, "per_question": self.per_question, "bodies": self.bodies[-50:]},
            )
        if path == "/scripted/config" and method == "POST":
            self.cfg.update(json.loads(raw))
            self.per_question = {}  # fail_first counts restart with every new configuration
            return await self._json(send, 200, {"ok": True})
        if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            return await self._generate(send, json.loads(raw), chat=path.endswith("chat/completions"))
        return await self._json(send, 404, {"error": {"message": f"no route {path}"}})

    def _authorized(self, scope) -> bool:
        keys, faults = self.cfg["api_keys"], self.cfg["faults"]
        if not keys or ("open_route" in faults and scope["path"] == "/get_server_info"):
            return True
        given = dict(scope["headers"]).get(b"authorization", b"").decode()
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        return bool(token) and ("any_key" in faults or token in keys)

    async def _generate(self, send, body: dict, chat: bool):
        cfg = self.cfg
        if cfg["mode"] == "skills":
            self.n_requests += 1
            choice, n_prompt = skills_choice(body, chat, cfg["faults"], cfg["reply_format"])
            cached = None if chat else self._cache(body, choice, cfg["faults"])
            if "evict_live" in cfg["faults"] and not chat:
                self.in_flight += 1
                try:
                    await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap
                    if self.in_flight > 1:
                        choice["text"] = choice["text"].translate(str.maketrans("0123456789", "9876543210"))
                finally:
                    self.in_flight -= 1
            return await self._answer(send, body, chat, with_spec(choice, cfg), n_prompt, cached)
        q = question_of(body)
        self.n_requests += 1
        n_q = self.per_question[q] = self.per_question.get(q, 0) + 1
        self.bodies.append(body if len(self.bodies) < 1000 else None)
        if len(self.bodies) > 1000:
            self.bodies = self.bodies[-50:]
        if cfg["delay_s"]:
            await asyncio.sleep(cfg["delay_s"])
        mode = cfg["mode"]
        if mode == "mixed":
            mode = mixed_bucket(q)
        if n_q <= cfg["fail_first"] or mode == "error500":
            return await self._json(send, 500, {"error": {"message": "scripted internal error", "code": 500}})
        if mode == "error400":
            message = cfg.get("error_message") or "scripted bad request"
            return await self._json(send, 400, {"error": {"message": message, "code": 400}})
        if mode == "timeout":
            await asyncio.sleep(cfg["timeout_sleep_s"])
        if mode == "malformed":
            return await self._send(send, 200, b'{"id": "x", "choices": [ {"text": "unterminated')
        if mode == "bad_shape":  # valid JSON, wrong shape
            return await self._json(send, 200, {"id": "x", "choices": [{"message": "not an object", "index": 0}]})
        gold = cfg["answers"].get(q, "0")
        finish = "stop"
        if mode in ("correct", "timeout"):
            answer = gold
        elif mode == "wrong":
            answer = str(int(gold) + 1) if gold.lstrip("-").isdigit() else gold + "1"
        elif mode == "truncated":
            answer, finish = gold, "length"
        else:  # no_answer
            answer = None
        if chat:
            text = "Working it out step by step." + (
                f" The answer is \\boxed{{{answer}}}." if answer is not None else " I am not sure."
            )
        else:
            text = " We compute the result.\n#### " + answer if answer is not None else " We cannot tell."
        if finish == "length":
            text = text[: max(1, len(text) // 2)] + (f" {answer}" if answer else "")
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "reasoning_content": "thinking..."}
        else:
            choice["text"] = text
            choice["logprobs"] = None
        if finish == "stop":
            choice["matched_stop"] = "Question" if not chat else None
        with_spec(choice, cfg)
        n_out = max(1, len(text) // 4)
        if cfg["token_ids"] and body.get("return_token_ids"):
            choice["token_ids"] = list(range(100, 100 + n_out))
        if body.get("logprobs"):
            choice["logprobs"] = fake_logprobs(text, body, chat)
        prompt_len = len(body.get("prompt", "")) if not chat else len(json.dumps(body.get("messages", [])))
        resp = {
            "id": f"cmpl-{self.n_requests}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_len // 4,
                "completion_tokens": n_out,
                "total_tokens": prompt_len // 4 + n_out,
            },
        }
        if body.get("stream"):
            return await self._stream(send, body, chat, choice, resp["usage"])
        return await self._json(send, 200, resp)

    def _cache(self, body: dict, choice: dict, faults: list) -> int:
        """Cached prompt tokens of a completion (whole pages shared with a remembered prompt); remembers it. With
        "stale_cache", a prompt seen before gets the answer of the last other prompt."""
        prompt = body.get("prompt") if isinstance(body.get("prompt"), str) else json.dumps(body.get("prompt"))
        shared = max((len(os.path.commonprefix([prompt, seen])) for seen, _ in self.prompts), default=0)
        answer = choice["text"]  # remembered as computed: a stale answer is another prompt's real one
        if "stale_cache" in faults and any(seen == prompt for seen, _ in self.prompts):
            other = next((text for seen, text in reversed(self.prompts) if seen != prompt), None)
            if other is not None:
                choice["text"] = other
        self.prompts = [p for p in self.prompts if p[0] != prompt][-(CACHED_PROMPTS - 1) :] + [(prompt, answer)]
        return shared // PAGE_BYTES * PAGE_BYTES

    async def _answer(self, send, body: dict, chat: bool, choice: dict, n_prompt: int, cached: Optional[int] = None):
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(text.encode()),
            "total_tokens": n_prompt + len(text.encode()),
        }
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if body.get("return_token_ids"):
            choice["token_ids"] = [b + 16 for b in text.encode()]
        if "drop_images" in self.cfg["faults"] and chat and body.get("logprobs"):  # as a real server's, image or not
            choice["logprobs"] = fake_logprobs(text, body, chat)
        if body.get("stream"):
            return await self._stream(send, body, chat, choice, usage)
        resp = {
            "id": f"cmpl-{self.n_requests}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": usage,
        }
        return await self._json(send, 200, resp)

    async def _stream(self, send, body: dict, chat: bool, choice: dict, usage: dict):
        """The choice as SSE chunks: its text a few characters at a time (token ids alongside), tool calls as a
        name then their arguments in two pieces, the finish reason last, usage when asked for, then [DONE]."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def event(payload: dict) -> None:
            data = {
                "id": f"cmpl-{self.n_requests}",
                "object": obj,
                "created": int(time.time()),
                "model": body.get("model"),
                **payload,
            }
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(data)}\n\n".encode(), "more_body": True}
            )
            if self.cfg["stream_delay_s"]:
                await asyncio.sleep(self.cfg["stream_delay_s"])

        msg = choice.get("message") or {}
        text = (msg.get("content") if chat else choice.get("text")) or ""
        ids = choice.get("token_ids")
        raw = text.encode()
        for i in range(0, len(raw), 2):
            piece = raw[i : i + 2].decode(errors="ignore")
            c: dict[str, Any] = {"index": 0, "finish_reason": None}
            c.update({"delta": {"content": piece}} if chat else {"text": piece})
            if ids is not None:
                c["token_ids"] = ids[i : i + 2]
            await event({"choices": [c]})
        for k, call in enumerate(msg.get("tool_calls") or []):
            args = call["function"]["arguments"]
            await event(
                {
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": None,
                            "delta": {
                                "tool_calls": [
                                    {
                                        "index": k,
                                        "id": call["id"],
                                        "type": "function",
                                        "function": {"name": call["function"]["name"], "arguments": ""},
                                    }
                                ]
                            },
                        }
                    ]
                }
            )
            for part in (args[: len(args) // 2], args[len(args) // 2 :]):
                await event(
                    {
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": None,
                                "delta": {"tool_calls": [{"index": k, "function": {"arguments": part}}]},
                            }
                        ]
                    }
                )
        last: dict[str, Any] = {"index": 0, "finish_reason": choice.get("finish_reason")}
        last.update({"delta": {}} if chat else {"text": ""})
        await event({"choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({"choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _json(self, send, status: int, obj: Any):
        return await self._send(send, status, json.dumps(obj).encode())

    @staticmethod
    async def _send(send, status: int, payload: bytes):
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def fake_logprobs(text: str, body: dict, chat: bool) -> dict:
    """Fake but well-formed logprobs of `text` in the OpenAI shape of the endpoint: one entry per 4-char "token",
    top-k as the request asks."""
    toks = [text[i : i + 4] for i in range(0, len(text), 4)]
    k = int((body.get("top_logprobs", body.get("logprobs")) if chat else body.get("logprobs")) or 0)
    if chat:
        return {
            "content": [
                {"token": t, "logprob": -0.1, "top_logprobs": [{"token": t, "logprob": -0.1 - j} for j in range(k)]}
                for t in toks
            ]
        }
    return {
        "tokens": toks,
        "token_logprobs": [-0.1] * len(toks),
        "top_logprobs": [{t + str(j): -0.1 - j for j in range(k)} for t in toks],
    }


def with_spec(choice: dict, cfg: dict) -> dict:
    """The choice with the configured `spec` and `meta_info` objects, where set."""
    for key in ("spec", "meta_info"):
        if cfg[key] is not None:
            choice[key] = cfg[key]
    return choice


# ------------------------------------------------------------------------------------------- mode "skills"

COPY_ASK = re.compile(r"^Copy the text exactly: (\S+)")  # evalpipe.skills.copy_text
NEEDLE_ASK = re.compile(r"What is the secret code of the ([a-z]+ [a-z]+)\?")
COUNT_ASK = re.compile(r"How many (.+) does (.+) have\?")
JSON_ASK = re.compile(r"^(.+) has (\d+) (.+)\. Reply in JSON")
DRAWN_TOOL_ASK = re.compile(r"^Please (\w+) the (\w+) with (.+)\.$")  # evalpipe.skills.tools


def drawn_tool_call(ask: str, tools: list) -> Optional[tuple[str, dict]]:
    """(name, arguments) for an ask of evalpipe.skills.tools, typed by the offered tool's schema; None otherwise."""
    m = DRAWN_TOOL_ASK.match(ask)
    spec = m and next((t["function"] for t in tools if t.get("function", {}).get("name") == f"{m[1]}_{m[2]}"), None)
    if not spec:
        return None
    props = spec["parameters"]["properties"]
    args = dict(pair.split(" ", 1) for pair in m[3].split(", "))
    return spec["name"], {k: int(v) if props.get(k, {}).get("type") == "integer" else v for k, v in args.items()}


def _continuation(prompt: str, n: int) -> str:
    """Text determined by the prompt alone: the same prompt always continues the same way."""
    out, seed = "", hashlib.sha256(prompt.encode()).digest()
    while len(out) < n:
        seed = hashlib.sha256(seed).digest()
        out += "".join("abcdefghij klmnopqrstuvwxyz"[b % 27] for b in seed)
    return out[:n]


def without_images(message: dict) -> dict:
    """A chat message with its image_url content parts removed (what a server that drops images answers)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": [p for p in content if not (isinstance(p, dict) and p.get("type") == "image_url")]}


def needle_code(text: str, ask: re.Match) -> Optional[str]:
    """The code the needle of the asked key gives in `text`, or None."""
    found = re.search(r"The secret code of the " + re.escape(ask.group(1)) + r" is (\d+)\.", text)
    return found.group(1) if found else None


def scripted_tokenize(body: dict, bytes_per_token: float) -> dict:
    """/tokenize of mode "skills" with `bytes_per_token` (module docstring): token ids are the count's range."""
    if body.get("messages") is not None:
        text = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n" for m in body["messages"])
        text += "<|im_start|>assistant\n" if body.get("add_generation_prompt", True) else ""
    else:
        text = str(body.get("prompt", ""))
    count = -(-len(text.encode()) // bytes_per_token) + 1
    return {"tokens": list(range(int(count))), "count": int(count), "max_model_len": None}


def skills_choice(body: dict, chat: bool, faults: list, reply_format: str = "{reply}") -> tuple[dict, int]:
    """(choice, prompt tokens) for mode "skills"; see the module docstring."""
    max_tokens = int(body.get("max_tokens") or 16)
    finish, calls = "stop", None
    if chat:
        messages = body.get("messages") or [{}]
        if "drop_images" in faults:
            messages = [without_images(m) for m in messages]
        prompt = json.dumps(messages)
        last = messages[-1]
        ask = str(messages[0].get("content") or "")
        needle, count, fact = NEEDLE_ASK.search(ask), COUNT_ASK.search(ask), JSON_ASK.search(ask)
        wants_tools = bool(body.get("tools")) and body.get("tool_choice") != "none" and "no_tools" not in faults
        if last.get("role") == "tool":
            text = f"The answer is {last.get('content')}."
        elif wants_tools and (needle or count or drawn_tool_call(ask, body["tools"])):
            name, args = (
                ("get_secret_code", {"place": needle.group(1)})
                if needle
                else ("count_items", {"person": count.group(2), "item": count.group(1)})
                if count
                else drawn_tool_call(ask, body["tools"])
            )
            # a named call ends with "stop", as OpenAI ends a forced call
            text, finish = "", "stop" if isinstance(body.get("tool_choice"), dict) else "tool_calls"
            calls = [{"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]
            if "leak_tool_protocol" in faults:
                text, calls, finish = TOOL_MARK + json.dumps({"name": name, "arguments": args}), None, "stop"
        elif needle and needle_code(ask, needle):
            code = needle_code(ask, needle)
            text = reply_format.format(reply=str((int(code) + 1) % 100000) if "lose_needle" in faults else code)
        elif COPY_ASK.search(ask):
            text = reply_format.format(reply=COPY_ASK.search(ask).group(1))
        elif fact and body.get("response_format"):
            text = json.dumps({"name": fact.group(1), "count": int(fact.group(2))})
        else:
            text = _continuation(prompt, min(max_tokens, 24))
    else:
        prompt = body.get("prompt") if isinstance(body.get("prompt"), str) else json.dumps(body.get("prompt"))
        needle = NEEDLE_ASK.search(prompt[-200:])
        value = needle_code(prompt, needle) if needle else None
        if value:
            text = " " + (str((int(value) + 1) % 100000) if "lose_needle" in faults else value)
        else:
            n = max_tokens if body.get("ignore_eos") else min(max_tokens, 24)
            text = _continuation(prompt, n)
            finish = "length" if n == max_tokens else "stop"
    if "early_stop" in faults and text:
        text, finish = text[: max(1, len(text) // 2)], "length"
    text = text[:max_tokens] if not calls else text
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text or None, "tool_calls": calls}
    else:
        choice["text"] = text
    return choice, len(prompt.encode()) + 1


def main(argv: Optional[list] = None) -> None:
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description="Scripted OpenAI-compatible server for tests and benchmarks.")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", help="JSON file with the config (see module docstring)")
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text()) if args.config else {}
    uvicorn.run(ScriptedApp(cfg), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
