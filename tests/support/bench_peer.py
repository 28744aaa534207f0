"""A scripted OpenAI-compatible peer for the bench and repeat tests (this module holds no tests itself).

What tests/support/scripted_server.py does not script, this one does:
- streaming with several tokens per event (`stream_groups`, `event_delay_s`), with chunk `token_ids` and
  cumulative usage (`continuous_usage_stats`), so a client that counts chunks gets the wrong answer;
- forced non-determinism at temperature 0: the k-th request carrying a given prompt gets completion
  `variants[k % len(variants)]`, so the number of distinct completions over N requests is min(N, len(variants));
- /flush_cache that counts its calls, /get_server_info with vocab_size, usage.prompt_tokens_details.cached_tokens.

Run as a real process: `python -m tests.support.bench_peer --port P --config JSON`; see `start_peer`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.support.scripted_server import free_port, stop_scripted_server

REPO = Path(__file__).resolve().parents[2]

DEFAULT = {
    "variants": [[11, 12, 13, 14, 15, 16]],
    "stream_groups": [2, 1, 3, 1, 4, 1],
    "event_delay_s": 0.02,
    "vocab_size": 512,
    "model": "peer-model",
    "accept_length": None,
    "completion_delay_s": 0.0,
    "max_model_len": None,  # listed in /v1/models when set, as vLLM/SGLang/native do
}


@contextlib.contextmanager
def start_peer(**config):
    """Yield (base_url ending in /v1, stats getter) for a peer process started with `config`."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.bench_peer",
            "--port",
            str(port),
            "--config",
            json.dumps(dict(DEFAULT, **config)),
        ],
        cwd=str(REPO),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        # One client for the wait and for stats(), which tests poll: a bare httpx.get builds a TLS context (~34 ms)
        with httpx.Client(timeout=1) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"peer exited: {proc.stderr.read().decode()[-2000:]}")
                try:
                    if client.get(root + "/v1/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError("peer did not start")
                time.sleep(0.05)
            yield root + "/v1", lambda: client.get(root + "/peer/stats", timeout=10).json()
    finally:
        stop_scripted_server(proc)


def _text(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def build_app(cfg: dict):
    app = FastAPI()
    state = {"flushes": 0, "requests": 0, "per_prompt": {}, "seen_prompts": set()}

    @app.get("/v1/models")
    async def models():
        entry = {"id": cfg["model"], "object": "model", "owned_by": "peer"}
        if cfg["max_model_len"] is not None:
            entry["max_model_len"] = cfg["max_model_len"]
        return {"object": "list", "data": [entry]}

    @app.get("/get_server_info")
    async def info():
        return {"vocab_size": cfg["vocab_size"], "internal_states": [{"avg_spec_accept_length": cfg["accept_length"]}]}

    @app.post("/flush_cache")
    async def flush():
        state["flushes"] += 1
        state["seen_prompts"].clear()
        return {"flushed": True}

    @app.get("/peer/stats")
    async def stats():
        return {"flushes": state["flushes"], "requests": state["requests"], "per_prompt": state["per_prompt"]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["requests"] += 1
        prompt = json.dumps(body.get("prompt"))
        k = state["per_prompt"].get(prompt, 0)
        state["per_prompt"][prompt] = k + 1
        n_prompt = len(body["prompt"]) if isinstance(body.get("prompt"), list) else len(str(body.get("prompt")).split())
        cached = n_prompt if prompt in state["seen_prompts"] else 0
        state["seen_prompts"].add(prompt)
        if body.get("stream"):
            return StreamingResponse(_stream(body, n_prompt), media_type="text/event-stream")
        await asyncio.sleep(cfg["completion_delay_s"])
        ids = cfg["variants"][k % len(cfg["variants"])][: body.get("max_tokens", 16)]
        choice = {"index": 0, "text": _text(ids), "finish_reason": "length", "logprobs": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("logprobs") is not None:
            toks = [f"<{i}>" for i in ids]
            # variant v scores its token at position p with -0.1*(v+1); the runner-up sits 0.25 below
            lp = [-0.1 * (1 + k % len(cfg["variants"]))] * len(ids)
            choice["logprobs"] = {
                "tokens": toks,
                "token_logprobs": lp,
                "top_logprobs": [{t: x, "<0>": x - 0.25} for t, x in zip(toks, lp)],
            }
        return JSONResponse(
            {
                "id": f"cmpl-{state['requests']}",
                "object": "text_completion",
                "model": cfg["model"],
                "choices": [choice],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": len(ids),
                    "total_tokens": n_prompt + len(ids),
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            }
        )

    async def _stream(body: dict, n_prompt: int):
        groups = list(cfg["stream_groups"])
        opts = body.get("stream_options") or {}
        cont, incl = opts.get("continuous_usage_stats"), opts.get("include_usage")
        done = 0
        tok = 100
        for i, g in enumerate(groups):
            await asyncio.sleep(cfg["event_delay_s"])
            ids = list(range(tok, tok + g))
            tok += g
            done += g
            choice = {"index": 0, "text": _text(ids), "finish_reason": "length" if i == len(groups) - 1 else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            if i == len(groups) - 1 and cfg["accept_length"] is not None:
                choice["spec"] = {"accept_length": cfg["accept_length"]}
            chunk = {"object": "text_completion", "model": cfg["model"], "choices": [choice]}
            if cont:
                chunk["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": done, "total_tokens": n_prompt + done}
            yield f"data: {json.dumps(chunk)}\n\n"
        if incl:
            usage = {"prompt_tokens": n_prompt, "completion_tokens": done, "total_tokens": n_prompt + done}
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", default="{}")
    args = ap.parse_args()
    uvicorn.run(
        build_app(dict(DEFAULT, **json.loads(args.config))), host="127.0.0.1", port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
