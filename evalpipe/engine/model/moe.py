"""Mixture of experts: a learned top-k router (`moe`) or a frozen token-id -> experts table (`hash_moe`), routed
SwiGLU experts with clamped pre-activations, plus the always-on shared expert."""

from __future__ import annotations

import functools

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


@functools.cache
def grouped_gemm_device(device: torch.device) -> bool:
    """Whether torch's grouped GEMM serves this device: CUDA from compute capability 9.0 (Hopper) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


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
        routed = self.routed(x, idx, w, grouped=x.dtype == torch.bfloat16 and grouped_gemm_device(x.device))
        return routed + F.linear(self._swiglu(shared_gate, shared_up), self.shared[2])

    def routed(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *, grouped: bool) -> torch.Tensor:
        """The routed experts' weighted sum for picks idx/w [T, K]. The picks are sorted by expert; then either one
        GEMM pair per expert (`grouped=False`: the CPU path, which needs the per-expert counts on the host) or both
        GEMMs for all experts at once through torch's grouped GEMM on device offsets (`grouped=True`, bf16 on
        CUDA: no host synchronisation, so a prompt chunk's launches keep running ahead of the GPU)."""
        routed = torch.zeros_like(x)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        weight_of = w.flatten()[order]
        if grouped:  # counts by scatter: torch.bincount on CUDA reads its input's range back (a sync mid-forward)
            counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
            offs = torch.cumsum(counts.scatter_add_(0, flat, torch.ones_like(flat)), 0).to(torch.int32)
            gate, up = torch._grouped_mm(x[token_of], self.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y = torch._grouped_mm(self._swiglu(gate, up), self.down.transpose(1, 2), offs=offs) * weight_of[:, None]
            return routed.index_add_(0, token_of, y.to(x.dtype))
        start = 0
        for e, c in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if c == 0:
                continue
            tok = token_of[start : start + c]
            gate, up = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self._swiglu(gate, up), self.down[e]) * weight_of[start : start + c, None]
            routed.index_add_(0, tok, y.to(x.dtype))
            start += c
        return routed
