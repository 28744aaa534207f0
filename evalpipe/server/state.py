"""What the server holds: its settings, and the engine it loads on a background thread after binding.

Loading after the port is open lets `/health` and `/health_generate` answer 503 while weights are created or
read, which is how launchers (and SGLang) tell "starting" from "dead".
"""

from __future__ import annotations

import logging
import shlex
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from evalpipe import __version__
from evalpipe.engine.build import build
from evalpipe.engine.cache import PoolExhausted
from evalpipe.engine.engine import Engine
from evalpipe.engine.model.config import DEFAULT_MODEL_NAME
from evalpipe.redact import redact, redact_argv

log = logging.getLogger("evalpipe.server")


@dataclass
class ServerSettings:
    model: str | None = None
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 64
    max_tokens_per_step: int = 512
    max_queue: int = 1024
    max_seq_len: int = 4096
    api_key: str | None = None
    more_api_keys: tuple[str, ...] = ()  # further keys accepted beside api_key (`--api-key` given several times)
    docs: bool = False  # serve /docs, /redoc and /openapi.json (behind the key when one is set)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    # block speculation (evalpipe/engine/spec/decoder.py): "off" | "block", G drafts per verify, drafter spec
    # (None: layerskip over 3/4 of the layers), simulated accept length (None: off; performance runs only)
    speculative: str = "off"
    block_size: int = 5
    drafter: str | None = None
    simulate_acc_len: float | None = None
    # LOSSY acceptance (evalpipe/engine/spec/accept.py, AcceptRule), off unless set: a draft among the target's top K
    # (K >= 2), or SGLang's probability thresholds below 1.0 (sampled requests). None: exact acceptance.
    spec_accept_topk: int | None = None
    spec_accept_threshold_single: float | None = None
    spec_accept_threshold_acc: float | None = None
    # CUDA serving path (evalpipe/engine/static/): verify through the Triton kernels or the reference
    # chains; capture decode/verify steps as CUDA graphs. Both only act with device "cuda".
    fused: str = "on"
    cuda_graphs: str = "on"
    # output projection: "none" (model dtype) or "mxfp8" (WO-A wo_a_mxfp8, WO-B mxfp8_linear on MXFP8-rounded o_b
    # weights; lossy; evalpipe/engine/model/fused_sites.py). Acts on every device (the kernels' references on the CPU).
    wo_quant: str = "none"
    # prefix cache (evalpipe/engine/prefix_cache.py): "on" | "off"
    prefix_cache: str = "on"

    def public(self) -> dict:
        """The settings as /get_server_info shows them: secrets redacted (evalpipe.redact's rule)."""
        return redact(asdict(self), self.api_keys())

    def api_keys(self) -> list[str]:
        """Every key the server accepts; empty: no key required."""
        return [k for k in (self.api_key, *self.more_api_keys) if k]


def default_tokenizer_factory(settings: ServerSettings) -> Any:
    from evalpipe.engine.tokenizer import has_hf_tokenizer, load_tokenizer

    path = settings.tokenizer
    if path is None and settings.model is not None and has_hf_tokenizer(settings.model):
        path = settings.model
    return load_tokenizer(path)


class ServerState:
    def __init__(
        self,
        settings: ServerSettings,
        *,
        build: Callable[[ServerSettings], tuple[Any, Any]] = build,
        tokenizer_factory: Callable[[ServerSettings], Any] = default_tokenizer_factory,
        on_ready: Callable[["ServerState"], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self._build = build  # settings -> (runner, decoder); decoder None: plain decoding
        self._tokenizer_factory = tokenizer_factory
        self._on_ready = on_ready
        self._on_error = on_error
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.engine: Engine | None = None
        self.runner: Any = None
        self.tokenizer: Any = None
        self.model_id: str = settings.model or DEFAULT_MODEL_NAME
        self.started_at = time.time()
        self.load_seconds: float | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="evalpipe-loader", daemon=True).start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            self.tokenizer = self._tokenizer_factory(self.settings)
            self.runner, decoder = self._build(self.settings)
            self.model_id = getattr(self.runner, "model_name", None) or self.model_id
            vocab = getattr(self.runner.config, "vocab_size", None)
            if vocab is not None and self.tokenizer.vocab_size > vocab:
                raise ValueError(f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
            self.engine = Engine(
                self.runner, self.tokenizer, max_batch=self.settings.max_batch,
                max_tokens_per_step=self.settings.max_tokens_per_step, max_queue=self.settings.max_queue,
                decoder=decoder, exhausted=(PoolExhausted,),
            )
            self.engine.start()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.debug("model loading failed:\n%s", traceback.format_exc())  # --log-level debug shows where
            if self._on_error:
                self._on_error(self.load_error)
            return
        self.load_seconds = time.perf_counter() - t0
        self.ready.set()
        if self._on_ready:
            self._on_ready(self)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    # -- introspection -----------------------------------------------------------------------------
    def info(self) -> dict:
        s = self.settings
        info: dict[str, Any] = {
            "model": self.model_id,
            "model_path": s.model,
            "version": __version__,
            "ready": self.ready.is_set(),
            "load_error": self.load_error,
            "load_seconds": self.load_seconds,
            "dtype": s.dtype,
            "device": s.device,
            "launch": {"argv": redact_argv(s.argv), "command": shlex.join(redact_argv(s.argv))},
            "server_args": s.public(),
            "engine": {
                "max_batch": s.max_batch, "max_tokens_per_step": s.max_tokens_per_step,
                "max_queue": s.max_queue, "max_seq_len": s.max_seq_len,
            },
            "wo_quant": s.wo_quant,
            "prefix_cache": {"enabled": s.prefix_cache == "on"},
            "speculative": {"mode": s.speculative, "block_size": s.block_size, "drafter": s.drafter,
                            "simulate_acc_len": s.simulate_acc_len, **_accept_setting(s)},
            "structured_output": _structured_output_backend(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        }
        # Everything that moves while serving lives under internal_states (SGLang's name), so that run manifests
        # comparing /get_server_info at start and end see only configuration above it.
        internal: dict[str, Any] = {}
        if self.runner is not None:
            cfg = self.runner.config
            info["config"] = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
            described = _safe(self.runner.describe)
            info["runner"] = {k: v for k, v in described.items() if k not in RUNNER_VOLATILE_KEYS}
            internal["runner"] = described
            info["engine"]["max_seq_len"] = getattr(self.runner, "max_seq_len", s.max_seq_len)
            cache = described.get("prefix_cache") if isinstance(described, dict) else None
            if isinstance(cache, dict):
                info["prefix_cache"] = {k: cache[k] for k in ("enabled", "page_tokens") if k in cache}
                internal["prefix_cache"] = cache
            sites = getattr(self.runner, "fused_sites", None)
            if sites is not None:
                from evalpipe.engine.model.fused_sites import site_counts

                info["fused_sites"] = sites
                internal["fused_site_calls"] = site_counts()
        if self.tokenizer is not None:
            info["tokenizer"] = self.tokenizer.describe()
        if self.engine is not None:
            spec = dict(self.engine.decoder.describe())
            if "totals" in spec:
                internal["speculative_totals"] = spec.pop("totals")
            info["speculative"] = spec
            internal.update(self.engine.describe())
        internal["peak_rss_mb"] = _peak_rss_mb()
        internal["uptime_s"] = time.time() - self.started_at
        info["internal_states"] = internal
        return redact(info, s.api_keys())  # no setting or echoed command line carries the key out


def _accept_setting(settings: ServerSettings) -> dict:
    """The acceptance rule as `speculative.accept` reports it before the engine has loaded (block mode only)."""
    if settings.speculative != "block":
        return {}
    from evalpipe.engine.spec.decoder import accept_rule_from_settings

    try:
        return {"accept": accept_rule_from_settings(settings).describe()}
    except ValueError as exc:  # `serve` validates first; a bad rule built in code still reports, never raises here
        return {"accept": {"error": str(exc)}}


# runner.describe() keys that change while serving (moved under internal_states only)
RUNNER_VOLATILE_KEYS = {"live_sequences", "pools", "free_pages", "free_slots", "prefix_cache"}


def _structured_output_backend() -> dict:
    """The grammar library behind tools and response_format, and its version (a receipt names what masked)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"backend": "xgrammar", "version": version("xgrammar")}
    except PackageNotFoundError:
        return {"backend": "xgrammar", "version": None}


def _peak_rss_mb() -> float:
    """Peak resident memory of this server process (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # introspection must never break /get_server_info
        return {"error": f"{type(exc).__name__}: {exc}"}

