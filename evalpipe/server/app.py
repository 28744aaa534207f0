"""The FastAPI application: OpenAI routes, health and info routes, API-key check, error bodies.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
GET /tokenizer_info (server/tokenization.py), GET /health, GET /health_generate,
GET /get_server_info (alias /server_info), GET /get_model_info (SGLang's fields), GET|POST /flush_cache,
GET /version. With API keys configured (any one of them is accepted), every route except /health and /health_generate
needs
`Authorization: Bearer <key>`, checked before the body is read (`middleware.RequireAPIKey`). The interactive
docs (/docs, /redoc, /openapi.json) exist only with `serve --docs`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from evalpipe import __version__
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.server import generation, tokenization, validation
from evalpipe.server.engine_client import ENGINE_DEAD, EngineCallError, EngineDead
from evalpipe.server.errors import APIError, SafeJSONResponse, install_error_handlers
from evalpipe.server.middleware import ContainErrors, RequireAPIKey
from evalpipe.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from evalpipe.server.state import ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.start_loading()
        yield
        state.shutdown()

    docs = state.settings.docs
    app = FastAPI(
        title="evalpipe native server",
        version=__version__,
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(RequireAPIKey, api_keys=state.settings.api_keys())
    app.add_middleware(ContainErrors)  # outermost: also answers for an error in the key check
    app.include_router(routes)
    return app


routes = APIRouter()


def served(request: Request) -> ServerState:
    """The server state of the app a request reached."""
    return request.app.state.server


def ready(state: ServerState = Depends(served)) -> ServerState:
    """The server state, once the model serves; a 503 saying why before then."""
    if state.load_error:
        raise APIError(503, f"model failed to load: {state.load_error}", type="server_error")
    if state.engine_error:
        raise APIError(503, f"the engine process died: {state.engine_error}", type="server_error", code="engine_dead")
    if not state.ready.is_set():
        raise APIError(
            503, "The model is still loading. Retry later.", code="model_loading", headers={"Retry-After": "1"}
        )
    return state


def not_serving(state: ServerState) -> JSONResponse | None:
    if state.engine_error:
        return JSONResponse({"status": "engine process died"}, status_code=503)
    if not state.ready.is_set():
        return JSONResponse({"status": "loading" if not state.load_error else "failed"}, status_code=503)
    return None


@routes.get("/health")
async def health(state: ServerState = Depends(served)):
    return not_serving(state) or {"status": "ok"}


@routes.get("/health_generate")
async def health_generate(state: ServerState = Depends(served)):
    down = not_serving(state)
    if down is not None:
        return down
    if not await _one_token(state):
        return JSONResponse({"status": "generation failed or timed out"}, status_code=503)
    return {"status": "ok"}


@routes.get("/v1/models")
async def models(state: ServerState = Depends(ready)):
    model = {
        "id": state.model_id,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "evalpipe",
        "root": state.settings.engine.model or state.model_id,
        "max_model_len": state.max_seq_len,
    }
    return {"object": "list", "data": [model]}


@routes.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: ServerState = Depends(ready)):
    return await generation.respond(state, validation.completion_job(state, req), request)


@routes.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: ServerState = Depends(ready)):
    return await generation.respond(state, validation.chat_job(state, req), request)


@routes.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: ServerState = Depends(ready)):
    validation.check_model(state, req.model)
    return tokenization.tokenize(state, req)


@routes.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: ServerState = Depends(ready)):
    validation.check_model(state, req.model)
    return tokenization.detokenize(state, req)


@routes.get("/tokenizer_info")
async def tokenizer_info(state: ServerState = Depends(ready)):
    return tokenization.tokenizer_info(state)


@routes.get("/get_server_info")
@routes.get("/server_info")
async def server_info(state: ServerState = Depends(served)):
    return await state.info()


@routes.get("/get_model_info")
@routes.get("/model_info")
async def model_info(state: ServerState = Depends(ready)):
    return {
        "model_path": state.settings.engine.model or state.engine.info.static_info.get("model_path"),
        "tokenizer_path": state.settings.engine.tokenizer,
        "is_generation": True,
        "served_model_name": state.model_id,
    }


@routes.get("/flush_cache")
@routes.post("/flush_cache")
async def flush_cache(state: ServerState = Depends(ready)):
    # Runs in the engine process between two steps; sequences in flight keep the pages they hold (so, unlike
    # SGLang, a flush while busy needs no retry), and no later request can hit what was cached before.
    try:
        result = await state.engine.call("flush_cache")
    except TimeoutError as exc:
        raise APIError(
            503, f"cache flush timed out: {exc}", type="server_error", headers={"Retry-After": "1"}
        ) from None
    except EngineDead as exc:
        raise APIError(503, f"the engine process died: {exc}", type="server_error", code="engine_dead") from None
    if not result.get("enabled"):
        return {
            "flushed": True,
            "flushed_pages": 0,
            "message": "the prefix cache is off (--prefix-cache off); nothing to flush",
        }
    pages = result["flushed_pages"]
    return {"flushed": True, "flushed_pages": pages, "message": f"prefix cache flushed ({pages} pages)"}


@routes.get("/version")
async def version():
    return {"version": __version__}


async def _one_token(state: ServerState) -> bool:
    """Generate one greedy token from the BOS token through the engine process.

    As in SGLang, a step that completes while the probe waits (other requests being served) also proves the
    engine alive: then the probe is withdrawn and the answer is 200 without waiting for its own turn.
    """
    engine = state.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    try:
        rid, queue = await engine.submit([[engine.info.bos_token_id]], [params], 1)
    except (EngineCallError, EngineDead, TimeoutError):
        return False
    try:
        while time.monotonic() - t0 < HEALTH_GENERATE_TIMEOUT_S:
            try:
                ev = await asyncio.wait_for(queue.get(), 0.25)
            except asyncio.TimeoutError:
                if engine.last_step_at > t0:
                    return True
                continue
            if ev is ENGINE_DEAD:
                return False
            if ev.finish_reason is not None:
                return ev.error is None and ev.completion_tokens == 1
        return False
    finally:
        engine.abort(rid)
