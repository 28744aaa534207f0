"""What the server holds: its settings, the tokenizer, and the client of the engine process it starts after binding.

Loading after the port is open lets `/health` and `/health_generate` answer 503 while weights are created or
read, which is how launchers (and SGLang) tell "starting" from "dead". The model lives in the engine process
(engine/process.py); the server keeps what the engine reported when it became ready (`engine.info`) and asks it
for the moving parts of /get_server_info.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from evalpipe import __version__
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.model.names import DEFAULT_MODEL_NAME
from evalpipe.redact import redact, redact_argv
from evalpipe.server.engine_client import EngineClient, EngineLoadError

log = logging.getLogger("evalpipe.server")


@dataclass
class ServerSettings:
    """The HTTP server's own settings beside the engine's (`engine`, the only part the engine process receives)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    more_api_keys: tuple[str, ...] = ()  # further keys accepted beside api_key (`--api-key` given several times)
    docs: bool = False  # serve /docs, /redoc and /openapi.json (behind the key when one is set)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    def public(self) -> dict:
        """The settings as /get_server_info shows them (one flat mapping, the engine's fields among the server's):
        secrets redacted (evalpipe.redact's rule)."""
        own = asdict(self)
        return redact({**own.pop("engine"), **own}, self.api_keys())

    def api_keys(self) -> list[str]:
        """Every key the server accepts; empty: no key required."""
        return [k for k in (self.api_key, *self.more_api_keys) if k]


def default_tokenizer_factory(settings: EngineConfig) -> Any:
    from evalpipe.engine.tokenizer import has_hf_tokenizer, load_tokenizer

    path = settings.tokenizer
    if path is None and settings.model is not None and has_hf_tokenizer(settings.model):
        path = settings.model
    return load_tokenizer(path)


def build_in_engine_process(settings: EngineConfig) -> tuple[Any, Any]:
    """engine.build.build, imported where it runs: the HTTP process never builds a model and never imports torch
    (seconds of start-up; `test_the_http_process_never_imports_torch` in tests/server/test_server_api.py)."""
    from evalpipe.engine.build import build

    return build(settings)


class ServerState:
    def __init__(
        self,
        settings: ServerSettings,
        *,
        build: Callable[[EngineConfig], tuple[Any, Any]] = build_in_engine_process,
        tokenizer_factory: Callable[[EngineConfig], Any] = default_tokenizer_factory,
        on_ready: Callable[["ServerState"], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self._build = build  # EngineConfig -> (runner, decoder), run in the engine process (a picklable function)
        self._tokenizer_factory = tokenizer_factory
        self._on_ready = on_ready
        self._on_error = on_error  # called with the sentence to show: the load failed, or the engine died
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.engine_error: str | None = None  # the engine process died after loading
        self.engine: EngineClient | None = None
        self.tokenizer: Any = None
        self.model_id: str = settings.engine.model or DEFAULT_MODEL_NAME
        self.started_at = time.time()
        self.load_seconds: float | None = None
        self._loading: asyncio.Task | None = None

    # -- what the engine reported when it became ready ------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.engine.info.max_seq_len if self.engine and self.engine.info else self.settings.engine.max_seq_len

    @property
    def speculative(self) -> dict:
        return dict(self.engine.info.static_info["speculative"]) if self.engine and self.engine.info else {}

    # -- lifecycle -------------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Start the engine process (from the event loop's thread: the process dies with the thread that made it)."""
        self._loading = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        t0 = time.perf_counter()
        config = self.settings.engine
        self.engine = EngineClient(config, self._build, self._tokenizer_factory, on_dead=self._engine_died)
        tokenizer = asyncio.ensure_future(asyncio.to_thread(self._tokenizer_factory, config))
        try:
            ready = await self.engine.start()
            self.tokenizer = await tokenizer
        except Exception as exc:
            self.load_error = str(exc) if isinstance(exc, EngineLoadError) else f"{type(exc).__name__}: {exc}"
            if self._on_error:
                self._on_error(f"model failed to load: {self.load_error}")
            return
        self.model_id = ready.model_id
        self.load_seconds = time.perf_counter() - t0
        self.ready.set()
        if self._on_ready:
            self._on_ready(self)

    def _engine_died(self, reason: str) -> None:
        self.engine_error = reason
        if self._on_error:
            self._on_error(f"the engine process died ({reason}); the server stops")

    def shutdown(self) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self.engine is not None:
            self.engine.close()

    # -- introspection -----------------------------------------------------------------------------
    async def info(self) -> dict:
        info = self._configured_info()
        # Everything that moves while serving lives under internal_states (SGLang's name), so that run manifests
        # comparing /get_server_info at start and end see only configuration above it.
        internal: dict[str, Any] = {}
        engine_rss = 0.0
        if self.ready.is_set():
            self._add_loaded_engine_info(info)
            engine_rss = await self._add_live_engine_state(internal)
        if self.tokenizer is not None:
            info["tokenizer"] = self.tokenizer.describe()
        internal.update(self._footprint(engine_rss))
        info["internal_states"] = internal
        return redact(info, self.settings.api_keys())  # no setting or echoed command line carries the key out

    def _configured_info(self) -> dict[str, Any]:
        """What the settings fix before the engine reports anything (the engine's own view replaces parts later)."""
        s = self.settings.engine
        return {
            "model": self.model_id,
            "model_path": s.model,
            "version": __version__,
            "ready": self.ready.is_set() and self.engine_error is None,
            "load_error": self.load_error,
            "load_seconds": self.load_seconds,
            "dtype": s.dtype,
            "device": s.device,
            "launch": {"argv": redact_argv(self.settings.argv), "command": shlex.join(redact_argv(self.settings.argv))},
            "server_args": self.settings.public(),
            "engine": {
                "max_batch": s.max_batch,
                "max_tokens_per_step": s.max_tokens_per_step,
                "max_queue": s.max_queue,
                "max_seq_len": s.max_seq_len,
            },
            "wo_quant": s.wo_quant,
            "deterministic": s.deterministic,  # `serve --deterministic`: batch-invariant kernels asked for
            # how sampled requests draw (engine/sampling.py): "keyed" under --deterministic (noise of seed, output index
            # and vocab id; sampled speculation verifies by sample-verify), else "stream" (a seeded torch.Generator)
            "sampling_noise": "keyed" if s.deterministic else "stream",
            "debug_faults": sorted(set(s.debug_faults)),
            # reported logprobs: log-softmax of the raw logits, before temperature/top-k/top-p (vLLM's name)
            "logprobs_mode": "raw_logprobs",
            "prefix_cache": {"enabled": s.prefix_cache == "on"},
            "speculative": {
                "mode": s.speculative,
                "block_size": s.block_size,
                "drafter": s.drafter,
                "simulate_acc_len": s.simulate_acc_len,
                **_accept_setting(s),
            },
            "structured_output": _structured_output_backend(),
            "torch": _package_version("torch"),  # the engine process's (this process never imports it)
            "python": sys.version.split()[0],
        }

    def _add_loaded_engine_info(self, info: dict[str, Any]) -> None:
        """Add (or overwrite in place) what the engine reported when it became ready."""
        static = self.engine.info.static_info
        info["config"] = static["config"]
        described = static["runner"]
        info["runner"] = {k: v for k, v in described.items() if k not in RUNNER_VOLATILE_KEYS}
        info["engine"]["max_seq_len"] = self.max_seq_len
        pools = described.get("pools") if isinstance(described, dict) else None
        if isinstance(pools, dict) and {"num_pages", "page_tokens"} <= set(pools):
            # the KV pool every sequence and the prefix cache share (qualify's kv-pressure fills it past its size)
            info["kv_pool"] = {
                "tokens": pools["num_pages"] * pools["page_tokens"],
                "pages": pools["num_pages"],
                "page_tokens": pools["page_tokens"],
            }
        cache = described.get("prefix_cache") if isinstance(described, dict) else None
        if isinstance(cache, dict):
            info["prefix_cache"] = {k: cache[k] for k in ("enabled", "page_tokens") if k in cache}
        if "fused_sites" in static:
            info["fused_sites"] = static["fused_sites"]
        spec = dict(static["speculative"])
        spec.pop("totals", None)
        info["speculative"] = spec

    async def _add_live_engine_state(self, internal: dict[str, Any]) -> float:
        """Add the engine's live counters to `internal`; returns the engine process's peak RSS (0.0 when unknown)."""
        engine_rss = 0.0
        live = await self._engine_state()
        if "error" in live:
            internal["engine_error"] = live["error"]
        else:
            internal["runner"] = live["runner"]
            if isinstance(live["runner"], dict) and isinstance(live["runner"].get("prefix_cache"), dict):
                internal["prefix_cache"] = live["runner"]["prefix_cache"]
            if "fused_site_calls" in live:
                internal["fused_site_calls"] = live["fused_site_calls"]
            if "totals" in live["speculative"]:
                internal["speculative_totals"] = live["speculative"]["totals"]
            internal.update(live["engine"])
            engine_rss = live["peak_rss_mb"]
        internal["engine_process"] = {"pid": self.engine.pid, "alive": self.engine_error is None}
        return engine_rss

    def _footprint(self, engine_rss: float) -> dict[str, Any]:
        """The server's memory (HTTP process + engine process) and uptime."""
        http_rss = _peak_rss_mb()
        return {
            "peak_rss_mb": http_rss + engine_rss,  # the server's footprint: HTTP process + engine process
            "peak_rss_mb_by_process": {"http": http_rss, "engine": engine_rss},
            "uptime_s": time.time() - self.started_at,
        }

    async def _engine_state(self) -> dict:
        """The engine's live counters, or {"error": why} (a dead or unresponsive engine never breaks the info)."""
        if self.engine_error is not None:
            return {"error": self.engine_error}
        try:
            return await self.engine.call("describe", timeout=10.0)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}


def _accept_setting(settings: EngineConfig) -> dict:
    """The acceptance rule as `speculative.accept` reports it before the engine has loaded (block mode only)."""
    if settings.speculative != "block":
        return {}
    from evalpipe.engine.spec.settings import accept_rule_from_settings

    try:
        return {"accept": accept_rule_from_settings(settings).describe()}
    except ValueError as exc:  # `serve` validates first; a bad rule built in code still reports, never raises here
        return {"accept": {"error": str(exc)}}


# runner.describe() keys that change while serving (moved under internal_states only)
RUNNER_VOLATILE_KEYS = {"live_sequences", "pools", "free_pages", "free_slots", "prefix_cache"}


def _structured_output_backend() -> dict:
    """The grammar library behind tools and response_format, and its version (a receipt names what masked)."""
    return {"backend": "xgrammar", "version": _package_version("xgrammar")}


def _package_version(name: str) -> str | None:
    """An installed distribution's version (the engine process imports it from the same interpreter)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _peak_rss_mb() -> float:
    """Peak resident memory of this (HTTP) process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
