"""`EngineConfig`: what the native engine is built with, and the one place its defaults are written.

Torch-free (the HTTP process and the flag table import it). `ServerSettings` (server/state.py) holds one beside the
HTTP settings, the engine process receives only this object, and the `evalpipe serve` flags of every field take
their defaults from `ENGINE_DEFAULTS` (launchers/flags.py; tests/engine/test_engine_config.py holds the two together).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Rows per forward when --max-tokens-per-step is not given: the prefill chunk. On the CPU a chunk's cost grows
# with its rows, so 512 keeps decode steps short beside it; on a GPU a chunk is launch-bound until thousands of rows
# (H200, v4-top2 eager prefill: 5,600 tok/s at 512, 26,600 at one 3500-row chunk; benchmarks/serving/gpu_real_job.py).
DEFAULT_TOKENS_PER_STEP = {"cpu": 512, "cuda": 8192}
GATHER_CAP = 10  # --burst-wait-ms: an idle engine gathers a burst for at most this many times MS in all
# --burst-wait-ms: a lone request at an idle engine waits MS / LONE_SHARE for a second one. A one-at-a-time client
# pays this wait on every first token, while a burst's second request follows its first within a few ms (the
# 2-core CPU at 20: 7 of 12 C32 rounds still went as one prompt step; benchmarks/serving/burst_wait.py).
LONE_SHARE = 4


@dataclass(frozen=True)
class EngineConfig:
    """The native engine's settings; every field is one `evalpipe serve` flag of the same name."""

    model: str | None = None  # checkpoint directory or built-in name (None: the default trained model)
    tokenizer: str | None = None  # None: the model directory's tokenizer, else the built-in byte-level one
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 64
    max_tokens_per_step: int | None = None  # None: DEFAULT_TOKENS_PER_STEP of the device (resolved at construction)
    max_queue: int = 1024
    max_seq_len: int = 4096
    threads: int = 1  # torch intra-op threads of the engine process on the CPU (the HTTP process runs no torch op)
    # block speculation (engine/spec/decoder.py): "off" | "block", G drafts per verify, drafter spec
    # (None: layerskip over 3/4 of the layers), simulated accept length (None: off; performance runs only)
    speculative: str = "off"
    block_size: int = 5
    drafter: str | None = None
    simulate_acc_len: float | None = None
    # LOSSY acceptance (engine/spec/settings.py, AcceptRule), off unless set: a draft among the target's top
    # K (K >= 2), or SGLang's probability thresholds below 1.0 (sampled requests). None: exact acceptance.
    spec_accept_topk: int | None = None
    spec_accept_threshold_single: float | None = None
    spec_accept_threshold_acc: float | None = None
    # CUDA serving path (engine/static/): verify through the Triton kernels or the reference chains; capture
    # decode/verify steps as CUDA graphs. Both only act with device "cuda".
    fused: str = "on"
    cuda_graphs: str = "on"
    # output projection: "none" (model dtype) or "mxfp8" (engine/model/fused_sites.py; lossy). Every device.
    wo_quant: str = "none"
    prefix_cache: str = "on"  # engine/prefix_cache.py: "on" | "off"
    overlap_schedule: str = "on"  # engine/engine.py: queue greedy decode steps one ahead on the CUDA-graph runner
    prefill_delay_factor: float = 0.0  # Engine._admit_now: new prompts wait F x the last prompt step's time
    burst_wait_ms: float = 0.0  # EngineLoop._gather: an idle engine gathers a burst of requests before its first step
    stream_interval: int = 1  # output.deliver: streamed events carry N tokens (the first excepted)
    # ask for batch-invariant kernels (evalpipe/kernels, tests/kernels/test_batch_invariant.py): a greedy output
    # should then depend on its prompt alone, not on the batch it ran in; reported in /get_server_info
    deterministic: bool = False
    debug_faults: tuple[str, ...] = ()  # planted faults (engine/faults.py, --debug-fault): never on by default

    def __post_init__(self):
        if self.max_tokens_per_step is None:
            chunk = DEFAULT_TOKENS_PER_STEP["cuda" if self.device == "cuda" else "cpu"]
            object.__setattr__(self, "max_tokens_per_step", chunk)
        object.__setattr__(self, "debug_faults", tuple(sorted(set(self.debug_faults))))

    @classmethod
    def from_values(cls, values: dict) -> "EngineConfig":
        """From a mapping that may hold other keys too (parsed flags): this config's fields that are set (not
        None) are taken, the others keep their defaults."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if values.get(f.name) is not None})

    @property
    def speculation_on(self) -> bool:
        return self.speculative == "block"


ENGINE_DEFAULTS = EngineConfig()
