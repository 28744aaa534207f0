"""A generation route's flow: compile the job's grammar, submit it, then answer with the whole response or an SSE
stream (validation.py builds the job, jobs.py runs it, responses.py shapes what the client gets)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse

from evalpipe.server.errors import APIError, SafeJSONResponse
from evalpipe.server.jobs import Job, compile_grammar, events, submit
from evalpipe.server.responses import full_response, sse_stream


async def respond(state, job: Job, request: Request):
    """Run `job`; a failed generation is a 500, a client that left before the end gets a 499 nobody reads."""
    await compile_grammar(state, job)
    await submit(state, job)
    if job.stream:
        return StreamingResponse(
            sse_stream(state, job, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    async for ev in events(state, job, request):
        if ev.error:
            raise APIError(500, f"generation failed: {ev.error}", type="server_error")
    if job.disconnected:  # nobody is listening; uvicorn drops what is sent to a closed connection
        return APIError(
            499,
            "client closed the connection; generation aborted",
            type="invalid_request_error",
            code="client_disconnected",
        ).response()
    return SafeJSONResponse(full_response(state, job))
