"""What the server says about itself, and the speculative statistics it puts on a response.

Why: a score means nothing without the server's identity (model list, launch args, speculative config),
and a server that *simulates* acceptance (a fixed accept length instead of real verification) must never be
scored as if it were real speculative decoding.
"""

from __future__ import annotations

from typing import Any, Optional

import httpx

from evalpipe.redact import redact

# vLLM's /server_info (dev mode) is one text string unless asked for JSON; others ignore the query
SERVER_INFO_PATHS = ("/get_server_info", "/server_info?config_format=json")

_SSL_CONTEXT = None


def ssl_context():
    """One TLS context for every client of a run: building one (loading the CA bundle) costs ~0.1 s each."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = httpx.create_ssl_context()
    return _SSL_CONTEXT


def _get(url: str, headers: dict, timeout_s: float) -> httpx.Response:
    with httpx.Client(verify=ssl_context(), timeout=timeout_s) as client:
        return client.get(url, headers=headers)


def server_root(base_url: str) -> str:
    """`http://h:p/v1` -> `http://h:p` (server-level endpoints live outside the OpenAI prefix)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def v1_hint(base_url: str, status: Optional[int]) -> str:
    """A 404 on /models from a base URL without /v1 is almost always the missing OpenAI prefix: say so."""
    if status == 404 and not base_url.rstrip("/").endswith("/v1"):
        return f"; did you mean --base-url {base_url.rstrip('/')}/v1 ?"
    return ""


class EndpointError(Exception):
    """The endpoint is unreachable or does not behave like an OpenAI-compatible server."""


def fetch_models(base_url: str, api_key: Optional[str], timeout_s: float = 30.0) -> dict:
    """GET {base_url}/models -> the raw JSON (must contain `data: [{id: ...}, ...]`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/models"
    try:
        r = _get(url, headers, timeout_s)
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise EndpointError(f"GET {url} returned HTTP {r.status_code}: {r.text[:300]}" + v1_hint(base_url, r.status_code))
    try:
        body = r.json()
        ids = [m["id"] for m in body["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EndpointError(f"GET {url} did not return an OpenAI model list: {r.text[:300]}") from exc
    if not ids:
        raise EndpointError(f"GET {url} lists no models; pass --model explicitly is not enough: nothing is served")
    return body


def fetch_server_info(base_url: str, api_key: Optional[str], timeout_s: float = 30.0) -> tuple[Optional[str], Any]:
    """(path, json) from the first of /get_server_info, /server_info that answers 200 with JSON, else (None, None).

    The JSON is redacted (evalpipe.redact): a server may echo its key in its settings or launch command."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = server_root(base_url)
    for path in SERVER_INFO_PATHS:
        try:
            r = _get(root + path, headers, timeout_s)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            try:
                return path, redact(r.json(), [api_key or ""])
            except ValueError:
                continue
    return None, None


# Routes that drop a server's prefix cache: SGLang's and ours, then vLLM's (only with VLLM_SERVER_DEV_MODE=1)
CACHE_RESET_PATHS = ("/flush_cache", "/reset_prefix_cache")
CACHE_RESET_MISSING = ("the server offers neither /flush_cache nor /reset_prefix_cache "
                       "(vLLM has /reset_prefix_cache only when started with VLLM_SERVER_DEV_MODE=1)")


async def reset_prefix_cache(client: httpx.AsyncClient, root: str, headers: dict,
                             paths: tuple[str, ...] = CACHE_RESET_PATHS) -> Optional[str]:
    """POST the first of `paths` the server answers with 2xx; returns that path, or None when none did."""
    for path in paths:
        try:
            response = await client.post(root + path, headers=headers)
        except httpx.HTTPError:
            continue
        if 200 <= response.status_code < 300:
            return path
    return None


def _simulate_value(info: Any) -> Any:
    if not isinstance(info, dict):
        return None
    if "simulate_acc_len" in info:
        return info["simulate_acc_len"]
    spec = info.get("speculative")
    if isinstance(spec, dict) and "simulate_acc_len" in spec:
        return spec["simulate_acc_len"]
    return None


def simulation_reason(server_info: Any) -> Optional[str]:
    """A message when the server says speculative acceptance is simulated, else None."""
    value = _simulate_value(server_info)
    if value is None or value == -1 or value == "-1" or value is False:
        return None
    return f"the server reports simulated speculative acceptance (simulate_acc_len={value!r})"


SGLANG_THRESHOLD_KEYS = ("speculative_accept_threshold_single", "speculative_accept_threshold_acc")


def lossy_acceptance(server_info: Any) -> Optional[dict]:
    """The server's LOSSY speculative acceptance setting, else None: evalpipe's `speculative.accept` when it says
    lossy, or SGLang's acceptance thresholds below 1.0 (its server args sit at the top of its server info)."""
    if not isinstance(server_info, dict):
        return None
    spec = server_info.get("speculative")
    accept = spec.get("accept") if isinstance(spec, dict) else None
    if isinstance(accept, dict) and accept.get("lossy") is True:
        return dict(accept)
    values = {k: server_info.get(k) for k in SGLANG_THRESHOLD_KEYS}
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) < 1.0 for v in values.values()):
        return {"rule": "threshold", "threshold_single": values[SGLANG_THRESHOLD_KEYS[0]],
                "threshold_acc": values[SGLANG_THRESHOLD_KEYS[1]], "lossy": True,
                "applies_to": "sampled requests (SGLang verifies all-greedy batches exactly)"}
    return None


def spec_from_response(body: dict, choice: dict) -> Optional[dict]:
    """The speculative statistics block: `choice.spec`, else response-level `sglext`, else `meta_info` spec_* keys."""
    spec = choice.get("spec")
    if isinstance(spec, dict):
        return spec
    ext = body.get("sglext")
    if isinstance(ext, dict):
        return ext.get("spec") if isinstance(ext.get("spec"), dict) else ext
    for holder in (choice, body):
        meta = holder.get("meta_info")
        if isinstance(meta, dict):
            block = {k: v for k, v in meta.items() if k.startswith("spec_")}
            if block:
                return block
    return None
