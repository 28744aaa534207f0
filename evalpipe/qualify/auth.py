"""Gate `auth`: every configured key is accepted, and a missing or a wrong key is refused, on every route.

Routes: the OpenAI ones (`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`) and the server-info
route the server answered when asked who it is (`/get_server_info` or vLLM's `/server_info`). Refused means HTTP
401 or 403. Keys are never written: records name them `key #1`, `key #2`, `missing`, `wrong`.
"""

from __future__ import annotations

import secrets
import time

from evalpipe.harness.client import Server
from evalpipe.qualify.core import Endpoint, GateResult, bounded, check, exchange

REFUSED = (401, 403)


def routes(ep: Endpoint) -> list[tuple[str, str, dict | None]]:
    """(method, path relative to the server root, body) of every route probed."""
    prefix = "/v1" if ep.base_url.endswith("/v1") else ""
    tiny = {"model": ep.model, "max_tokens": 1, "temperature": 0.0}
    out = [
        ("GET", f"{prefix}/models", None),
        ("POST", f"{prefix}/completions", {**tiny, "prompt": "Question: 1+1\nAnswer:"}),
        ("POST", f"{prefix}/chat/completions", {**tiny, "messages": [{"role": "user", "content": "1+1"}]}),
    ]
    info_path = ep.facts.get("server_info_path")
    if info_path:
        out.append(("GET", info_path, None))
    return out


def _call(server: Server, method: str, path: str, body: dict | None):
    return server.get(path) if method == "GET" else server.post(path, body)


def run(ep: Endpoint) -> GateResult:
    result = GateResult("auth")
    t0 = time.perf_counter()
    keys = list(ep.cfg.api_keys)
    if not keys:
        result.skipped = (
            "skipped: no --api-key given, so there is no key to check (start the server with keys and "
            "pass the same keys here to run it)"
        )
        return result
    wrong = "qualify-wrong-" + secrets.token_hex(8)
    credentials = [(f"key #{i + 1}", k, True) for i, k in enumerate(keys)] + [
        ("missing", None, False),
        ("wrong", wrong, False),
    ]
    for label, key, accept in credentials:
        with Server(ep.base_url, key) as server:
            for method, path, body in routes(ep):
                started = time.perf_counter()
                resp = _call(server, method, path, body)
                status = None if resp is None else resp.status_code
                if accept:
                    ok = status == 200
                    detail = f"HTTP {status}" + (
                        "" if ok else f": {(bounded(resp.text) if resp is not None else 'unreachable')}"
                    )
                    checks = [check("accepted", ok, detail)]
                else:
                    ok = status in REFUSED
                    how = "without a key" if key is None else "with a wrong key"
                    checks = [
                        check(
                            "refused",
                            ok,
                            f"HTTP {status}" + ("" if ok else f" {how}: the route answered without valid credentials"),
                        )
                    ]
                    if resp is not None:
                        text = resp.text
                        checks.append(
                            check(
                                "no secret echoed",
                                all(k not in text for k in keys + [wrong]),
                                "the refusal does not repeat a key",
                            )
                        )
                result.records.append(
                    exchange(
                        f"{label} {method} {path}",
                        "auth",
                        None,
                        None,
                        checks,
                        credential=label,
                        method=method,
                        path=path,
                        status=status,
                        latency_s=round(time.perf_counter() - started, 4),
                    )
                )
    result.notes = {"keys": len(keys), "routes": [f"{m} {p}" for m, p, _ in routes(ep)]}
    result.wall_s = time.perf_counter() - t0
    return result
