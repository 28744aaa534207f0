"""Two plain ASGI layers around the application: the API-key check, and the last answer to an unexpected error.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) so that streamed responses pass through untouched.
`RequireAPIKey` answers before anything reads the body, so a client without the key learns nothing about its
request (not even whether it was valid JSON). `ContainErrors` turns an exception that escaped every handler into
a 500 with OpenAI's body and keeps the connection usable; Starlette's own catch-all re-raises to the server,
which then drops the connection, and the client's next request on it fails.
"""

from __future__ import annotations

import hmac
import logging

from starlette.requests import ClientDisconnect

from evalpipe.server.errors import APIError, internal_error

log = logging.getLogger("evalpipe.server")

# Routes a load balancer or launcher polls without credentials (as in vLLM and SGLang).
OPEN_PATHS = frozenset({"/health", "/health_generate"})


async def _send_error(send, err: APIError) -> None:
    response = err.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class RequireAPIKey:
    """`Authorization: Bearer <key>` with any one of `api_keys` on every HTTP route except OPEN_PATHS, checked
    first. Every key is compared (constant time each), so the answer's timing does not tell which one matched."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys if k]

    async def __call__(self, scope, receive, send):
        if not self.keys or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
        if not token:
            return await _send_error(
                send, APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
            )
        matches = [hmac.compare_digest(token, key) for key in self.keys]
        if not any(matches):
            return await _send_error(send, APIError(401, "Incorrect API key provided.", code="invalid_api_key"))
        return await self.app(scope, receive, send)


class ContainErrors:
    """An exception no handler answered: a 500 with OpenAI's body if nothing was sent yet, else the response is
    ended where it stands. Never re-raised, so the connection stays open for the client's next request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False}

        async def tracked(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # the client left mid-response: nobody to answer
            return
        except Exception as exc:  # the last place an error can be answered
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            try:
                if not state["started"]:
                    await _send_error(send, internal_error(exc))
                elif not state["ended"]:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # the client is gone; nothing left to tell it
                pass
