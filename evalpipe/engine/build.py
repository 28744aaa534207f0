"""`build(settings)`: the one place the server's settings become a runner and a decoder.

The engine process (engine/process.py) calls it with the server's `ServerSettings` (read by attribute). The
runner is a ModelRunner whose fused-site settings are fixed at construction (`site_settings`), so a bare
`ModelRunner(..., sites=site_settings(settings))` runs exactly the served path. On CUDA it is wrapped in a
GraphRunner whose decode and (with speculation) (G+1)-row verify steps are captured at start-up for every batch
bucket up to max_batch, one extra slot being the padding slot; on the CPU the plain ModelRunner serves (the fused
kernels and graphs are CUDA-only). The decoder is None (plain decoding) or block speculation, whose model drafter
gets captured one-row steps like the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from evalpipe.engine.engine import PlainDecoder
from evalpipe.engine.faults import batch_variant_linear, faults_of
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.spec.decoder import decoder_from_settings
from evalpipe.engine.static.graphs import DEFAULT_BUCKETS, GraphRunner


def site_settings(settings: Any) -> SiteSettings:
    """The model's fused-site settings a server runs with (`--wo-quant`; every candidate block kept)."""
    return SiteSettings(wo_quant=settings.wo_quant)


def build(settings: Any) -> tuple[Any, Any]:
    """(runner, decoder) for the server settings; decoder None is plain decoding. A planted `batch-variant` fault
    (engine/faults.py) replaces the eager model's LM-head matmul."""
    runner = build_runner(settings)
    if "batch-variant" in faults_of(settings):
        runner.model.head_linear = batch_variant_linear
    decoder = decoder_from_settings(settings, runner)
    if decoder is None and faults_of(settings):
        decoder = PlainDecoder(faults_of(settings))
    capture_drafter(decoder, runner)
    return runner, decoder


def build_runner(settings: Any) -> Any:
    def model_runner(max_seqs: int) -> ModelRunner:
        return ModelRunner(settings.model, device=settings.device, dtype=getattr(torch, settings.dtype),
                           max_seqs=max_seqs, max_seq_len=settings.max_seq_len, sites=site_settings(settings),
                           prefix_cache=getattr(settings, "prefix_cache", "off") == "on")

    max_batch = settings.max_batch
    if settings.device != "cuda":
        return model_runner(max_batch)
    if not torch.cuda.is_available():  # checked here: the HTTP process that parsed --device never imports torch
        raise RuntimeError("CUDA is not available on this machine (--device cuda)")
    widths = (1,) + ((settings.block_size + 1,) if settings.speculative == "block" else ())
    buckets = tuple(sorted(set(b for b in DEFAULT_BUCKETS if b < max_batch) | {max_batch}))
    graph = GraphRunner(model_runner(max_batch + 1), widths=widths, buckets=buckets, fused=settings.fused == "on",
                        use_graphs=settings.cuda_graphs == "on")
    graph.capture_all()
    return graph


def capture_drafter(decoder: Any, target: Any) -> bool:
    """Give a model drafter (layerskip:N, self, model:PATH -- a RunnerDrafter over its own runner) captured one-row
    decode steps like the target's, so the G sequential draft forwards replay graphs too. The n-gram drafter has no
    model: nothing to capture. Returns whether the drafter's runner was wrapped."""
    drafter = getattr(decoder, "drafter", None)
    inner = getattr(drafter, "runner", None)
    if not isinstance(target, GraphRunner) or not isinstance(inner, ModelRunner):
        return False
    if getattr(drafter, "forward_kwargs", None):
        return False
    graph = GraphRunner(inner, widths=(1,), buckets=target.buckets, fused=target.fused,
                        use_graphs=target.use_graphs, kernel_backend=target.static_model.backend)
    if graph.use_graphs:
        graph.capture_all()
    drafter.runner = graph
    return True
