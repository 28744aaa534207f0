"""The FastAPI application: OpenAI routes, health and info routes, API-key check, error bodies.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /health_generate,
GET /get_server_info (alias /server_info), GET /get_model_info (SGLang's fields), GET|POST /flush_cache,
GET /version. With API keys configured (any one of them is accepted), every route except /health and /health_generate needs
`Authorization: Bearer <key>`, checked before the body is read (`middleware.RequireAPIKey`). The interactive
docs (/docs, /redoc, /openapi.json) exist only with `serve --docs`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from evalpipe import __version__
from evalpipe.engine.engine import SeqEvent
from evalpipe.engine.sampling import SamplingParams
from evalpipe.engine.scheduler import QueueFull, Sequence
from evalpipe.server import generation
from evalpipe.server.errors import APIError, SafeJSONResponse, install_error_handlers
from evalpipe.server.middleware import ContainErrors, RequireAPIKey
from evalpipe.server.protocol import ChatCompletionRequest, CompletionRequest
from evalpipe.server.state import ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.start_loading()
        yield
        state.shutdown()

    docs = state.settings.docs
    app = FastAPI(title="evalpipe native server", version=__version__, lifespan=lifespan,
                  default_response_class=SafeJSONResponse, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(RequireAPIKey, api_keys=state.settings.api_keys())
    app.add_middleware(ContainErrors)  # outermost: also answers for an error in the key check

    def require_ready() -> None:
        if state.load_error:
            raise APIError(503, f"model failed to load: {state.load_error}", type="server_error")
        if not state.ready.is_set():
            raise APIError(503, "The model is still loading. Retry later.", code="model_loading",
                           headers={"Retry-After": "1"})

    @app.get("/health")
    async def health():
        if not state.ready.is_set():
            return JSONResponse({"status": "loading" if not state.load_error else "failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if not state.ready.is_set():
            return JSONResponse({"status": "loading" if not state.load_error else "failed"}, status_code=503)
        ok = await _one_token(state)
        if not ok:
            return JSONResponse({"status": "generation failed or timed out"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        require_ready()
        limit = getattr(state.runner, "max_seq_len", state.settings.max_seq_len)
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": int(state.started_at), "owned_by": "evalpipe",
            "root": state.settings.model or state.model_id, "max_model_len": limit,
        }]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        require_ready()
        return await generation.respond(state, generation.completion_job(state, req), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        require_ready()
        return await generation.respond(state, generation.chat_job(state, req), request)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return state.info()

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        require_ready()
        return {"model_path": state.settings.model or getattr(state.runner, "model_path", None),
                "tokenizer_path": state.settings.tokenizer, "is_generation": True, "served_model_name": state.model_id}

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache():
        # Runs on the engine thread between two steps; sequences in flight keep the pages they hold (so, unlike
        # SGLang, a flush while busy needs no retry), and no later request can hit what was cached before.
        require_ready()
        try:
            result = await asyncio.to_thread(state.engine.flush_cache)
        except TimeoutError as exc:
            raise APIError(503, f"cache flush timed out: {exc}", type="server_error",
                           headers={"Retry-After": "1"}) from None
        if not result.get("enabled"):
            return {"flushed": True, "flushed_pages": 0,
                    "message": "the prefix cache is off (--prefix-cache off); nothing to flush"}
        return {"flushed": True, "flushed_pages": result["flushed_pages"],
                "message": f"prefix cache flushed ({result['flushed_pages']} pages)"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    return app


async def _one_token(state: ServerState) -> bool:
    """Generate one greedy token from the BOS token through the whole engine path.

    As in SGLang, a forward that completes while the probe waits (other requests being served) also proves the
    engine alive: then the probe is withdrawn and the answer is 200 without waiting for its own turn.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def on_event(ev: SeqEvent) -> None:
        if ev.finish_reason is not None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(ev))

    bos = getattr(state.tokenizer, "bos_token_id", None)
    bos = bos if bos is not None else getattr(state.runner.config, "bos_token_id", 0) or 0
    seq = Sequence(prompt=[bos], params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                   on_event=on_event)
    engine = state.engine
    try:
        engine.submit([seq])
    except QueueFull:
        return False
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < HEALTH_GENERATE_TIMEOUT_S:
            try:
                ev = await asyncio.wait_for(asyncio.shield(done), 0.25)
                return ev.error is None and len(seq.output) == 1
            except asyncio.TimeoutError:
                if engine.last_step_at > t0:
                    return True
        return False
    finally:
        engine.abort([seq])
