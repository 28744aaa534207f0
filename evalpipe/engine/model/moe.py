"""Mixture of experts: a learned top-k router (`moe`) or a frozen token-id -> experts table (`hash_moe`), routed
SwiGLU experts with clamped pre-activations, plus the always-on shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.kernels.moe import score


def activation(name: str):
    """The experts' activation by its config name: SiLU (every DeepSeek-V4 config) is F.silu, which is what
    transformers' ACT2FN["silu"] runs; any other name goes through ACT2FN, imported only then (it pulls in
    transformers' hub-kernel and distributed loading code: 1-2 s of every engine start)."""
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class MoE:
    def __init__(self, sd: dict, prefix: str, config, is_hash: bool):
        self.is_hash = is_hash
        self.top_k, self.scoring = config.num_experts_per_tok, config.scoring_func
        self.scaling, self.limit = config.routed_scaling_factor, config.swiglu_limit
        self.act = activation(config.hidden_act)
        self.router = sd[prefix + "gate.weight"]
        self.tid2eid = sd.get(prefix + "gate.tid2eid") if is_hash else None
        bias = sd.get(prefix + "gate.e_score_correction_bias")
        self.bias = bias.float() if bias is not None else None
        self.gate_up = sd[prefix + "experts.gate_up_proj"]  # [E, 2I, D]
        self.down = sd[prefix + "experts.down_proj"]  # [E, D, I]
        self.num_experts = self.gate_up.shape[0]
        self.shared = [sd[prefix + f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")]
        # router | shared gate | shared up read the same input: one GEMM
        self.w_in = torch.cat([self.router, self.shared[0], self.shared[1]], dim=0)
        self.in_splits = [self.router.shape[0], self.shared[0].shape[0], self.shared[1].shape[0]]

    def route(self, x: torch.Tensor, input_ids: torch.Tensor, router_logits: torch.Tensor | None = None):
        scores = score(F.linear(x, self.router) if router_logits is None else router_logits, self.scoring)
        if self.is_hash:
            idx = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.bias if self.bias is not None else scores
            idx = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling

    def _swiglu(self, gate, up):
        return self.act(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        router_logits, shared_gate, shared_up = F.linear(x, self.w_in).split(self.in_splits, dim=-1)
        idx, w = self.route(x, input_ids, router_logits)
        routed = torch.zeros_like(x)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        weight_of = w.flatten()[order]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok = token_of[start:start + c]
            gate, up = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self._swiglu(gate, up), self.down[e]) * weight_of[start:start + c, None]
            routed.index_add_(0, tok, y.to(x.dtype))
            start += c
        return routed + F.linear(self._swiglu(shared_gate, shared_up), self.shared[2])
