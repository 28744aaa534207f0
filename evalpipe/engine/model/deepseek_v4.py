"""The DeepSeek-V4 decoder stack for serving: embeddings -> [mHC(attention), mHC(MoE)] x L -> hyper head -> norm
-> lm_head, over the flattened new rows of a ForwardBatch with state in StatePools."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.engine.cache import StatePools
from evalpipe.engine.forward_batch import ForwardBatch
from evalpipe.engine.model.attention import Attention
from evalpipe.engine.model.config import rope_tables
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.model.hyper import HyperConnection, HyperHead
from evalpipe.engine.model.moe import MoE
from evalpipe.engine.model.primitives import rms_norm

# Parameters transformers keeps in float32 whatever the model dtype (norm gains, sinks, mHC, biases).
_FP32_MARKERS = ("norm", "sinks", "position_bias", "e_score_correction_bias", "_hc.", "hc_head", "tid2eid")


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        keep = any(m in name for m in _FP32_MARKERS) or not t.is_floating_point()
        out[name] = t.to(device=device, dtype=t.dtype if not t.is_floating_point() else
                         (torch.float32 if keep else dtype))
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
        streams = HyperConnection.merge(streams, self.attn(rms_norm(x, self.attn_norm, self.eps), batch, pool),
                                        post, comb)
        post, comb, x = self.ffn_hc(streams)
        y = self.mlp(rms_norm(x, self.mlp_norm, self.eps), batch.input_ids)
        return HyperConnection.merge(streams, y, post, comb)


class DeepseekV4Model:
    def __init__(self, config, state: dict[str, torch.Tensor], *, dtype: torch.dtype, device, max_positions: int,
                 sites: SiteSettings | None = None):
        sd = cast_state(state, dtype, device)
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        ropes = rope_tables(config, max_positions, device)
        self.embed = sd["model.embed_tokens.weight"]
        self.lm_head = sd["lm_head.weight"] if "lm_head.weight" in sd else self.embed
        self.norm = sd["model.norm.weight"].float()
        self.head = HyperHead(sd["model.hc_head.hc_fn"], sd["model.hc_head.hc_base"], sd["model.hc_head.hc_scale"],
                              config)
        self.layers = [DecoderLayer(sd, i, config, ropes, sites) for i in range(config.num_hidden_layers)]
        self.num_parameters = sum(t.numel() for t in state.values())

    def forward(self, batch: ForwardBatch, pools: StatePools, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run all layers over the batch rows (updating the pools); float32 logits of `logit_rows`."""
        x = F.embedding(batch.input_ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer, pool in zip(self.layers, pools.layers):
            streams = layer(streams, batch, pool)
        h = rms_norm(self.head(streams[logit_rows]), self.norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
