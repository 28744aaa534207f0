"""What the default model is trained on besides next-token loss, attached to transformers' own modules by hooks.

- Early exit (LayerSkip): the hidden streams after layer N go through the model's own hyper head, final norm and
  LM head, exactly what the engine's `layerskip:N` drafter computes, and get the same answer-token loss.
- Lightning indexer: top-k selection gives the indexer no gradient, so (as DeepSeek-V3.2's DSA) its scores are
  trained with a KL loss towards the main attention's distribution over the compressed entries, summed over heads.
  The indexer's inputs are detached: it learns only from that loss, the model only from the LM losses.
- Routed MoE balance (DeepSeek-V3's auxiliary-loss-free rule): after every step each routed layer's selection bias
  moves by `rate` towards experts that got fewer tokens than the mean. Hash-routed layers need no balancing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Taps:
    """Forward hooks that keep what the extra objectives read from one forward."""

    def __init__(self, model, exit_layers: list[int]):
        self.model = model
        self.exit_layers = exit_layers
        self.hidden: dict[int, torch.Tensor] = {}
        self.index_scores: dict[int, torch.Tensor] = {}
        self.attn_probs: dict[int, torch.Tensor] = {}
        self.router_counts: dict[int, torch.Tensor] = {}
        self.csa_layers = [i for i, t in enumerate(model.config.layer_types) if t == "compressed_sparse_attention"]
        self._handles = []
        layers = model.model.layers
        for n in exit_layers:
            self._handles.append(layers[n - 1].register_forward_hook(self._keep(self.hidden, n)))
        for i in self.csa_layers:
            attn = layers[i].self_attn
            indexer = attn.compressor.indexer
            self._handles.append(indexer.register_forward_pre_hook(_detach_inputs))
            self._handles.append(indexer.scorer.register_forward_hook(self._keep(self.index_scores, i)))
            self._handles.append(attn.register_forward_hook(self._keep(self.attn_probs, i, index=1)))
        for i, layer in enumerate(layers):
            if not layer.mlp.is_hash:
                self._handles.append(layer.mlp.gate.register_forward_hook(self._count(i)))

    @staticmethod
    def _keep(store: dict, key: int, index: int | None = None):
        def hook(module, args, output):
            store[key] = output if index is None else output[index]

        return hook

    def _count(self, layer: int):
        n_experts = self.model.config.n_routed_experts

        def hook(module, args, output):
            indices = output[2].detach().reshape(-1)
            self.router_counts[layer] = torch.bincount(indices, minlength=n_experts)

        return hook

    def clear(self) -> None:
        self.hidden.clear()
        self.index_scores.clear()
        self.attn_probs.clear()
        self.router_counts.clear()

    def set_index_topk(self, k: int) -> None:
        for i in self.csa_layers:
            self.model.model.layers[i].self_attn.compressor.indexer.index_topk = k


def _detach_inputs(module, args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def exit_logits(model, streams: torch.Tensor) -> torch.Tensor:
    """The engine's layerskip head: hyper head -> final norm -> LM head over the streams after layer N."""
    return model.lm_head(model.model.norm(model.model.hc_head(streams)))


def indexer_kl(taps: Taps, ratio: int, seq_len: int) -> torch.Tensor:
    """Mean over CSA layers and query rows of KL(attention over compressed entries || indexer softmax)."""
    pairs = []
    for i in taps.csa_layers:
        scores = taps.index_scores.get(i)
        probs = taps.attn_probs.get(i)
        if scores is None or probs is None or scores.shape[-1] == 0:
            continue
        pairs.append((scores, probs[..., seq_len : seq_len + scores.shape[-1]].sum(dim=1)))  # [B, S, T]
    return compressed_kl(pairs, ratio, taps.model.device)


def compressed_kl(pairs: list[tuple[torch.Tensor, torch.Tensor]], ratio: int, device) -> torch.Tensor:
    """`indexer_kl` over (indexer scores [B, S, T], attention mass on the compressed entries summed over heads
    [B, S, T]) pairs, one per CSA layer; rows (and layers) with no mass on them are left out. No boolean indexing,
    so it compiles without a host sync."""
    losses, counted = [], []
    for scores, mass_per_entry in pairs:
        n_entries = scores.shape[-1]
        target = mass_per_entry.detach().float()
        mass = target.sum(-1, keepdim=True)
        rows = mass.squeeze(-1) > 1e-6
        target = target / mass.clamp_min(1e-12)
        positions = torch.arange(scores.shape[1], device=scores.device)
        visible = torch.arange(n_entries, device=scores.device)[None, :] < ((positions + 1) // ratio)[:, None]
        logq = torch.log_softmax(scores.float().masked_fill(~visible, float("-inf")), dim=-1)
        kl = torch.xlogy(target, target) - torch.where(target > 0, target * logq, torch.zeros_like(logq))
        kl = kl.sum(-1)
        losses.append((kl * rows).sum() / rows.sum().clamp_min(1))
        counted.append(rows.any())
    if not losses:
        return torch.zeros((), device=device)
    counted = torch.stack(counted).float()
    return (torch.stack(losses) * counted).sum() / counted.sum().clamp_min(1)


@torch.no_grad()
def update_router_bias(taps: Taps, rate: float) -> None:
    for i, counts in taps.router_counts.items():
        gate = taps.model.model.layers[i].mlp.gate
        counts = counts.float()
        gate.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)


def seed_hash_routing(model, seed: int) -> None:
    """tid2eid for every hash-routed layer: a seeded draw of top_k distinct experts per token id (transformers
    initialises the table to zeros, which would send every token to expert 0)."""
    gen = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(model.model.layers):
        if layer.mlp.is_hash:
            table = layer.mlp.gate.tid2eid
            n_experts = model.config.n_routed_experts
            draws = torch.stack(
                [torch.randperm(n_experts, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]
            )
            table.copy_(draws.to(table.device))
