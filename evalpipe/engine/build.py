"""`build(config)`: the one place an `EngineConfig` becomes a runner and a decoder.

The engine process (engine/process.py) calls it with the server's `EngineConfig`. The runner is a ModelRunner whose
fused-site settings are fixed at construction (`site_settings`), so a bare
`ModelRunner(..., sites=site_settings(config))` runs exactly the served path. On CUDA it is wrapped in a
GraphRunner whose decode and (with speculation) (G+1)-row verify steps are captured at start-up for every batch
bucket up to max_batch, one extra slot being the padding slot; on the CPU the plain ModelRunner serves (the fused
kernels and graphs are CUDA-only). The decoder is None (plain decoding) or block speculation, whose model drafter
gets captured one-row steps like the target's.
"""

from __future__ import annotations

import torch

from evalpipe.engine.config import EngineConfig
from evalpipe.engine.engine import Decoder, PlainDecoder, Runner
from evalpipe.engine.faults import batch_variant_linear, faults_of
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.spec.decoder import SpeculativeDecoder, decoder_from_settings
from evalpipe.engine.spec.drafters import RunnerDrafter
from evalpipe.engine.static.graphs import DEFAULT_BUCKETS, GraphRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def site_settings(config: EngineConfig) -> SiteSettings:
    """The model's fused-site settings a server runs with (`--wo-quant`, `--deterministic`; every candidate block
    kept)."""
    return SiteSettings(wo_quant=config.wo_quant, deterministic=config.deterministic)


def build(config: EngineConfig) -> tuple[Runner, Decoder | None]:
    """(runner, decoder) for the engine config; decoder None is plain decoding. A planted `batch-variant` fault
    (engine/faults.py) replaces the eager model's LM-head matmul."""
    runner = build_runner(config)
    faults = faults_of(config)
    if "batch-variant" in faults:
        runner.model.head_linear = batch_variant_linear
    decoder = decoder_from_settings(config, runner)
    if decoder is None and faults:
        decoder = PlainDecoder(faults)
    if isinstance(decoder, SpeculativeDecoder):
        capture_drafter(decoder, runner)
    return runner, decoder


def build_runner(config: EngineConfig) -> ModelRunner | GraphRunner:
    """The target runner: a ModelRunner on the CPU, a GraphRunner over one (every step captured) on CUDA."""

    def model_runner(max_seqs: int) -> ModelRunner:
        return ModelRunner(
            config.model,
            device=config.device,
            dtype=_DTYPES[config.dtype],
            max_seqs=max_seqs,
            max_seq_len=config.max_seq_len,
            sites=site_settings(config),
            prefix_cache=config.prefix_cache == "on",
        )

    max_batch = config.max_batch
    if config.device != "cuda":
        return model_runner(max_batch)
    if not torch.cuda.is_available():  # checked here: the HTTP process that parsed --device never imports torch
        raise RuntimeError("CUDA is not available on this machine (--device cuda)")
    widths = (1,) + ((config.block_size + 1,) if config.speculation_on else ())
    buckets = tuple(sorted(set(b for b in DEFAULT_BUCKETS if b < max_batch) | {max_batch}))
    graph = GraphRunner(
        model_runner(max_batch + 1),
        widths=widths,
        buckets=buckets,
        fused=config.fused == "on",
        use_graphs=config.cuda_graphs == "on",
    )
    graph.capture_all()
    return graph


def capture_drafter(decoder: SpeculativeDecoder, target: ModelRunner | GraphRunner) -> bool:
    """Give a model drafter (layerskip:N, self, model:PATH -- a RunnerDrafter over its own runner) captured one-row
    decode steps like the target's, so the G sequential draft forwards replay graphs too. The n-gram drafter has no
    model: nothing to capture. Returns whether the drafter's runner was wrapped."""
    drafter = decoder.drafter
    if not isinstance(target, GraphRunner) or not isinstance(drafter, RunnerDrafter):
        return False
    inner = drafter.runner
    if not isinstance(inner, ModelRunner) or drafter.forward_kwargs:  # a GraphRunner already, or layerskip
        return False
    graph = GraphRunner(
        inner,
        widths=(1,),
        buckets=target.buckets,
        fused=target.fused,
        use_graphs=target.use_graphs,
        kernel_backend=target.static_model.backend,
    )
    if graph.use_graphs:
        graph.capture_all()
    drafter.runner = graph
    return True
