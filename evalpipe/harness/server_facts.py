"""What the server says about itself (asked through client.Server), and the speculative statistics on a response.

Why: a score means nothing without the server's identity (model list, launch args, speculative config),
and a server that *simulates* acceptance (a fixed accept length instead of real verification) must never be
scored as if it were real speculative decoding.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional


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


DETERMINISTIC_KEYS = ("deterministic", "enable_deterministic_inference")  # evalpipe's, SGLang's server info


def deterministic_mode(server_info: Any, vllm_env: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """Whether the server runs in its batch-invariant (deterministic) mode, as it reports it: evalpipe's
    `deterministic`, SGLang's `enable_deterministic_inference`. vLLM reports it nowhere, so for a vLLM server
    evalpipe launched, `vllm_env` (the environment it was started with) decides, read as vLLM reads it
    (`bool(int(VLLM_BATCH_INVARIANT or "0"))`). None: unknown, never guessed."""
    if isinstance(server_info, dict):
        for key in DETERMINISTIC_KEYS:
            if isinstance(server_info.get(key), bool):
                return server_info[key]
    if vllm_env is None:
        return None
    try:
        return bool(int(vllm_env.get("VLLM_BATCH_INVARIANT", "0")))
    except ValueError:
        return None


def deterministic_label(value: Optional[bool]) -> str:
    """How reports print a deterministic mode: on, off, or unknown (a server that does not say)."""
    return "unknown" if value is None else ("on" if value else "off")


def determinism_note(modes: Iterable[Optional[bool]]) -> str:
    """One line on what a greedy output difference between these servers (arms, or one server asked again) means:
    with every one batch-invariant it is a bug, not noise; otherwise batch shape alone can cause it
    (docs/deterministic.md has the measured sizes)."""
    modes = list(modes)
    if modes and all(m is True for m in modes):
        return "deterministic on everywhere: a greedy output difference between lossless settings is a bug, not noise"
    shown = ", ".join(deterministic_label(m) for m in modes) or "unknown"
    return (
        f"deterministic not on everywhere ({shown}): greedy outputs may differ from batch-shape variance alone "
        "(concurrency, prefix cache, speculation); serve with --deterministic to tell a bug from that noise"
    )


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
