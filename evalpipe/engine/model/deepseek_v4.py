"""The DeepSeek-V4 decoder stack for serving: embeddings -> [mHC(attention), mHC(MoE)] x L -> hyper head -> norm
-> lm_head, over the flattened new rows of a ForwardBatch with state in StatePools.

`hidden_through_kernels` is the same stack with the mHC between blocks as two kernels per block boundary
(`kernels.hyper`): the CUDA-graph step runs it with its own attention and MoE, and the eager forward of a model built
with sites (the server) runs it with the layers' own where those kernels apply (CUDA), instead of the ~5 eager ops
and Sinkhorn chain per block boundary (on the H200 the eager merge alone, a batched GEMM of inner size 4, was 13.9
of the 74.8 ms of a 3,500-row prompt chunk)."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F

from evalpipe.engine.cache import StatePools
from evalpipe.engine.forward_batch import ForwardBatch
from evalpipe.engine.model import fused_sites
from evalpipe.engine.model.attention import Attention
from evalpipe.engine.model.config import rope_tables
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.model.hyper import HyperConnection, HyperHead
from evalpipe.engine.model.moe import MoE
from evalpipe.engine.model.primitives import rms_norm
from evalpipe.kernels import hyper, use_triton
from evalpipe.kernels.batch_invariant import invariant_ops
from evalpipe.kernels.moe import moe_forward

# Parameters transformers keeps in float32 whatever the model dtype (norm gains, sinks, mHC, biases).
_FP32_MARKERS = ("norm", "sinks", "position_bias", "e_score_correction_bias", "_hc.", "hc_head", "tid2eid")


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        keep = any(m in name for m in _FP32_MARKERS) or not t.is_floating_point()
        out[name] = t.to(
            device=device, dtype=t.dtype if not t.is_floating_point() else (torch.float32 if keep else dtype)
        )
    return out


class DecoderLayer:
    def __init__(self, sd, i: int, config, ropes, sites: SiteSettings | None):
        p = f"model.layers.{i}."
        self.attn = Attention(sd, p + "self_attn.", config, config.layer_types[i], ropes, sites)
        self.mlp = MoE(sd, p + "mlp.", config, config.mlp_layer_types[i] == "hash_moe")
        self.attn_norm = sd[p + "input_layernorm.weight"].float()
        self.mlp_norm = sd[p + "post_attention_layernorm.weight"].float()
        self.attn_hc = HyperConnection(sd[p + "attn_hc.fn"], sd[p + "attn_hc.base"], sd[p + "attn_hc.scale"], config)
        self.ffn_hc = HyperConnection(sd[p + "ffn_hc.fn"], sd[p + "ffn_hc.base"], sd[p + "ffn_hc.scale"], config)
        self.eps = config.rms_norm_eps

    def __call__(self, streams, batch: ForwardBatch, pool):
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(
            streams, self.attn(rms_norm(x, self.attn_norm, self.eps), batch, pool), post, comb
        )
        post, comb, x = self.ffn_hc(streams)
        y = self.mlp(rms_norm(x, self.mlp_norm, self.eps), batch.input_ids)
        return HyperConnection.merge(streams, y, post, comb)


class DeepseekV4Model:
    def __init__(
        self,
        config,
        state: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device,
        max_positions: int,
        sites: SiteSettings | None = None,
    ):
        sd = cast_state(state, dtype, device)
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        ropes = rope_tables(config, max_positions, device)
        self.embed = sd["model.embed_tokens.weight"]
        self.lm_head = sd["lm_head.weight"] if "lm_head.weight" in sd else self.embed
        self.norm = sd["model.norm.weight"].float()
        self.head = HyperHead(
            sd["model.hc_head.hc_fn"], sd["model.hc_head.hc_base"], sd["model.hc_head.hc_scale"], config
        )
        self.layers = [DecoderLayer(sd, i, config, ropes, sites) for i in range(config.num_hidden_layers)]
        self.num_parameters = sum(t.numel() for t in state.values())
        self.sites = sites
        self.head_linear = F.linear  # the LM head's matmul; engine/faults.py swaps it for the batch-variant fault

    def first_layers(self, n: int) -> "DeepseekV4Model":
        """This model cut after its first `n` decoder layers, with the same final hyper-connection head, norm and LM
        head; every weight is shared, nothing is copied (the layerskip drafter)."""
        cut = copy.copy(self)
        cut.layers = self.layers[:n]
        return cut

    @property
    def deterministic(self) -> bool:
        """Built with `SiteSettings(deterministic=True)` (--deterministic): every forward of this model (eager or
        the CUDA-graph step) runs batch-invariant kernels, GEMMs and reductions (kernels/batch_invariant.py)."""
        return self.sites is not None and self.sites.deterministic

    def forward(self, batch: ForwardBatch, pools: StatePools, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run all layers over the batch rows (updating the pools); float32 logits of `logit_rows`."""
        with invariant_ops(self.deterministic):
            return self._forward(batch, pools, logit_rows)

    def _forward(self, batch: ForwardBatch, pools: StatePools, logit_rows: torch.Tensor) -> torch.Tensor:
        x = F.embedding(batch.input_ids, self.embed)
        if self.sites is not None and use_triton(self.sites.backend, [x]):  # the server's build, on CUDA
            fused_sites.count("eager_mhc_kernels")
            h = self.hidden_through_kernels(
                x,
                lambda i, layer, hx: layer.attn(hx, batch, pools.layers[i]),
                lambda layer, hx: self._eager_moe(layer.mlp, hx, batch.input_ids),
                self.sites.backend,
            )
            return self.head_linear(h[logit_rows], self.lm_head).float()
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer, pool in zip(self.layers, pools.layers):
            streams = layer(streams, batch, pool)
        h = rms_norm(self.head(streams[logit_rows]), self.norm, self.config.rms_norm_eps)
        return self.head_linear(h, self.lm_head).float()

    def _eager_moe(self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """A prompt chunk's MoE: the layer's own grouped GEMMs, or when deterministic the CUDA-graph step's kernels
        in their invariant shape (the grouped GEMM's tiling and its atomic index_add_ vary with the batch)."""
        if self.deterministic:
            return moe_forward(moe, x, input_ids, backend=self.sites.backend, invariant=True)
        return moe(x, input_ids)

    def hidden_through_kernels(self, x: torch.Tensor, attend: Callable, ffn: Callable, backend: str) -> torch.Tensor:
        """Embedded rows x [T, D] -> [mHC, attend(i, layer, normed input), mHC, ffn(layer, normed input)] x L ->
        the head's normed rows [T, D], with each block boundary as two `kernels.hyper` kernels: the merge that ends
        a block also computes the next hyper-connection's mixing partials; the next block starts by reducing them
        (Sinkhorn, collapse and its input RMSNorm)."""
        eps = self.config.rms_norm_eps
        kw = dict(backend=backend, invariant=self.deterministic)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        parts = hyper.hc_mix(streams, self.layers[0].attn_hc, **kw)
        for i, layer in enumerate(self.layers):
            post, comb, h = hyper.hc_pre_norm(streams, parts, layer.attn_hc, layer.attn_norm, eps, **kw)
            a = attend(i, layer, h)
            streams, parts = hyper.hc_merge_mix(streams, a, post, comb, layer.ffn_hc, **kw)
            post, comb, h = hyper.hc_pre_norm(streams, parts, layer.ffn_hc, layer.mlp_norm, eps, **kw)
            y = ffn(layer, h)
            nxt = self.layers[i + 1].attn_hc if i + 1 < len(self.layers) else self.head
            streams, parts = hyper.hc_merge_mix(streams, y, post, comb, nxt, **kw)
        return hyper.hc_head_norm(streams, parts, self.head, self.norm, eps, **kw)
