"""What the server says about itself (asked through client.Server), and the speculative statistics on a response.

Why: a score means nothing without the server's identity (model list, launch args, speculative config),
and a server that *simulates* acceptance (a fixed accept length instead of real verification) must never be
scored as if it were real speculative decoding.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


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
        return {
            "rule": "threshold",
            "threshold_single": values[SGLANG_THRESHOLD_KEYS[0]],
            "threshold_acc": values[SGLANG_THRESHOLD_KEYS[1]],
            "lossy": True,
            "applies_to": "sampled requests (SGLang verifies all-greedy batches exactly)",
        }
    return None


def debug_faults(server_info: Any) -> list[str]:
    """The faults planted in the server on purpose (`evalpipe serve --debug-fault`), empty when none."""
    faults = server_info.get("debug_faults") if isinstance(server_info, dict) else None
    return [str(f) for f in faults] if isinstance(faults, list) else []


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


def find_key(obj: Any, names: Iterable[str]) -> Any:
    """First value stored under any of `names` in nested dicts (a server's settings, a manifest), breadth first."""
    names = tuple(names)
    queue = [obj]
    while queue:
        cur = queue.pop(0)
        if isinstance(cur, dict):
            for name in names:
                if name in cur and cur[name] is not None:
                    return cur[name]
            queue.extend(v for v in cur.values() if isinstance(v, dict))
    return None
