"""Where a server cuts work and memory, and how large its KV pool is, from what it exposes itself.

Three sources, read in this order (the first that has a size wins; a flag given to `qualify` beats them all):
- its settings report (`/get_server_info` or `/server_info`: evalpipe's, SGLang's and, in vLLM's dev mode, vLLM's key
  names);
- vLLM's Prometheus `/metrics`: the `vllm:cache_config_info` gauge, whose labels are vLLM's cache config (block
  size, number of blocks, ...), served by every stock vLLM;
- the launch receipt `evalpipe serve` wrote when it started the server: the server report it took at start, the
  engine flags of its argv (vLLM `--block-size`, `--max-num-batched-tokens`, `--num-gpu-blocks-override`; SGLang
  `--page-size`, `--chunked-prefill-size`, `--max-total-tokens`; native `--max-tokens-per-step`) and the
  `sliding_window` of a local model folder's config.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from evalpipe.harness.client import Server
from evalpipe.harness.server_facts import find_key

CACHE_CONFIG_METRIC = "vllm:cache_config_info"

CHUNK_KEYS = ("max_tokens_per_step", "chunked_prefill_size", "max_num_batched_tokens")
PAGE_KEYS = ("page_tokens", "page_size")
WINDOW_KEYS = ("sliding_window", "sliding_window_size")
RATIO_KEYS = ("compress_rates", "compress_ratios", "compress_ratio")
SGLANG_POOL_KEY = "max_total_num_tokens"

# engine flags in a receipt's argv that name a size: engine -> {flag: size}
ARGV_SIZES = {
    "vllm": {
        "--block-size": "page",
        "--max-num-batched-tokens": "chunk",
        "--num-gpu-blocks-override": "pool_blocks",
    },
    "sglang": {"--page-size": "page", "--chunked-prefill-size": "chunk", "--max-total-tokens": "pool"},
    "native": {"--max-tokens-per-step": "chunk"},
}


def _sizes(value: Any) -> list[int]:
    """Whole sizes above 1 in a reported value (a number, a number as text, a list or a {name: size} map)."""
    if isinstance(value, dict):
        value = list(value.values())
    out = set()
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1 and float(v).is_integer():
            out.add(int(v))
    return sorted(out)


def cache_config_info(base_url: str, api_key: Optional[str]) -> Optional[dict]:
    """The labels of vLLM's `vllm:cache_config_info` gauge (strings, as vLLM writes them), None when the server has
    no /metrics or no such gauge."""
    with Server(base_url, api_key) as server:
        resp = server.get("/metrics")
    if resp is None or resp.status_code != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name.startswith(CACHE_CONFIG_METRIC):
                    return dict(sample.labels)
    except ValueError:  # not the Prometheus text format
        return None
    return None


def read_receipt(path: Path) -> dict:
    """A receipt file's content; ValueError saying why when it cannot be one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the receipt {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ValueError(f"the receipt {path} is not JSON") from None
    if not isinstance(data, dict) or "argv" not in data or "engine" not in data:
        raise ValueError(f"{path} is not an `evalpipe serve` receipt (no engine and argv)")
    return data


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _address(url: str) -> tuple[str, Optional[int]]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return ("127.0.0.1" if host in ("localhost", "0.0.0.0") else host), parts.port


def find_receipt(base_url: str, folder: Path = Path("results/receipts")) -> Optional[Path]:
    """The newest receipt in `folder` of a server still running at `base_url`'s address (no stop recorded, its
    process alive on this machine), None when there is none."""
    want = _address(base_url)
    found = []
    for path in Path(folder).glob("*.json"):
        try:
            data = read_receipt(path)
        except ValueError:
            continue
        if data.get("stopped_at") or not data.get("base_url") or not _pid_alive(data.get("pid")):
            continue
        if _address(str(data["base_url"])) == want:
            found.append((str(data.get("ready_at") or data.get("started_at") or ""), path))
    return max(found)[1] if found else None


def _argv_sizes(receipt: dict) -> dict[str, int]:
    flags = ARGV_SIZES.get(str(receipt.get("engine")), {})
    argv = [str(a) for a in receipt.get("argv") or []]
    out: dict[str, int] = {}
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in flags:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            sizes = _sizes(value)
            if sizes:
                out[flags[name]] = sizes[0]
    return out


def _model_window(receipt: dict) -> list[int]:
    """sliding_window of the model folder's config.json (HF layout), when the receipt names a local folder."""
    model = (receipt.get("options") or {}).get("model")
    try:
        config = json.loads((Path(str(model)) / "config.json").read_text()) if model else None
    except (OSError, ValueError):
        return []
    return _sizes(config.get("sliding_window")) if isinstance(config, dict) else []


def gather(info: Any, metrics: Optional[dict], receipt: Optional[dict]) -> dict:
    """{"chunk", "page", "window", "compression": [sizes], "pool_tokens": int or None, "sources": {kind: where}}."""
    out: dict[str, Any] = {"sources": {}}
    receipt = receipt or {}
    argv = _argv_sizes(receipt)
    receipt_info = receipt.get("server_info")
    metrics = metrics or {}
    from_metrics = {"page": _sizes(metrics.get("block_size")), "window": _sizes(metrics.get("sliding_window"))}
    kinds = (("chunk", CHUNK_KEYS), ("page", PAGE_KEYS), ("window", WINDOW_KEYS), ("compression", RATIO_KEYS))
    for kind, keys in kinds:
        candidates = [
            ("server info", _sizes(find_key(info, keys))),
            ("/metrics vllm:cache_config_info", from_metrics.get(kind, [])),
            ("receipt server info", _sizes(find_key(receipt_info, keys))),
            ("receipt argv", [argv[kind]] if kind in argv else []),
            ("receipt model config", _model_window(receipt) if kind == "window" else []),
        ]
        for source, sizes in candidates:
            if sizes:
                out[kind], out["sources"][kind] = sizes, source
                break
    out["pool_tokens"] = None
    pool_candidates = [
        ("server info", _info_pool(info)),
        ("/metrics vllm:cache_config_info", _metric_pool(metrics)),
        ("receipt server info", _info_pool(receipt_info)),
        ("receipt argv", _argv_pool(argv, out.get("page"))),
    ]
    for source, sizes in pool_candidates:
        if sizes:
            out["pool_tokens"], out["sources"]["pool_tokens"] = sizes[0], source
            break
    return out


def _info_pool(info: Any) -> list[int]:
    """evalpipe's `kv_pool.tokens`, else SGLang's max_total_num_tokens."""
    pool = find_key(info, ("kv_pool",))
    if isinstance(pool, dict) and _sizes(pool.get("tokens")):
        return _sizes(pool.get("tokens"))
    return _sizes(find_key(info, (SGLANG_POOL_KEY,)))


def _metric_pool(metrics: dict) -> list[int]:
    """vLLM's kv_cache_size_tokens label, else num_gpu_blocks x block_size (its CPU build counts its pool in the
    same labels)."""
    tokens = _sizes(metrics.get("kv_cache_size_tokens"))
    if tokens:
        return tokens
    blocks, size = _sizes(metrics.get("num_gpu_blocks")), _sizes(metrics.get("block_size"))
    return [blocks[0] * size[0]] if blocks and size else []


def _argv_pool(argv: dict, page: Optional[list]) -> list[int]:
    if "pool" in argv:
        return [argv["pool"]]
    if "pool_blocks" in argv and page:
        return [argv["pool_blocks"] * page[0]]
    return []
