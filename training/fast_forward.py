"""The default model's training forward as plain tensor code that `torch.compile` takes whole: the same parameters
and the same function as transformers' `DeepseekV4ForCausalLM` forward with eager attention and no cache (the
oracle's path), computed in fewer bytes:

- sliding attention over blocks of `sliding_window` queries against their own and the previous block's keys, not
  an S x S mask; the compressed entries and the per-head sink are extra logit columns of the same softmax;
- the compressed entries' mask built from the indexer's picks without an [B, 1, S, S + T] float bias;
- the experts as two dense matrix products with zero routing weight on unselected experts: no host sync
  (transformers' grouped_mm path reads group sizes on the host, which breaks a compiled graph at every MoE);
- the streams' `comb` mixing as a fused multiply-add instead of a batched 4 x 4 matrix product.

It also returns what the trainer's extra objectives read (`training/objectives.py`), so no forward hook is needed:
the streams after each exit layer, the indexer scores with the attention mass on the compressed entries, and the
routed layers' expert counts. `tests/training/test_fast_forward.py` checks the losses against transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb


@dataclass
class Outputs:
    logits: torch.Tensor
    exit_streams: dict[int, torch.Tensor] = field(default_factory=dict)
    index_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (scores, target mass)
    router_counts: dict[int, torch.Tensor] = field(default_factory=dict)


def forward(model, input_ids: torch.Tensor, exit_layers=()) -> Outputs:
    core = model.model
    config = model.config
    batch, seq_len = input_ids.shape
    embeds = core.embed_tokens(input_ids)
    positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
    rope = {kind: core.rotary_emb(embeds, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
    streams = embeds.unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()
    out = Outputs(logits=None)
    for i, layer in enumerate(core.layers):
        streams = _decoder_layer(layer, streams, input_ids, rope, out, i)
        if i + 1 in exit_layers:
            out.exit_streams[i + 1] = streams
    out.logits = model.lm_head(core.norm(core.hc_head(streams)))
    return out


def _decoder_layer(layer, streams, input_ids, rope, out: Outputs, index: int):
    dtype = streams.dtype
    post, comb, collapsed = layer.attn_hc(streams)
    attn_out = _attention(layer.self_attn, layer.input_layernorm(collapsed), rope, out)
    streams = _mix(post.to(dtype), attn_out, comb.to(dtype), streams)
    post, comb, collapsed = layer.ffn_hc(streams)
    mlp_out = _moe(layer.mlp, layer.post_attention_layernorm(collapsed), input_ids, out, index)
    return _mix(post.to(dtype), mlp_out, comb.to(dtype), streams)


def _mix(post, block_out, comb, streams):
    """post[j] * block_out + sum_i comb[i, j] * streams[i], per token (comb is consumed transposed)."""
    mixed = (comb.unsqueeze(-1) * streams.unsqueeze(-2)).sum(dim=-3)
    return post.unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def _attention(attn, hidden, rope, out: Outputs):
    batch, seq_len, _ = hidden.shape
    cos, sin = rope[attn.rope_layer_type]
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    q = attn.q_b_proj(q_residual).view(batch, seq_len, -1, attn.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(attn.q_b_norm(q), cos, sin)  # [B, H, S, D]
    kv = attn.kv_norm(attn.kv_proj(hidden)).view(batch, seq_len, 1, attn.head_dim).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)[:, 0]  # [B, S, D]: key = value
    compressed, visible = None, None
    if attn.compressor is not None:
        ratio = attn.compressor.compress_rate
        csa = hasattr(attn.compressor, "indexer")
        compressed = _compress(attn.compressor, hidden, overlap=csa)
        if compressed is not None:
            visible = _causal_entries(seq_len, compressed.shape[1], ratio, hidden.device)  # [1, S, T]
            if csa:
                scores = _index_scores(attn.compressor.indexer, hidden.detach(), q_residual.detach(), rope["compress"])
                visible = _picked(scores, visible, attn.compressor.indexer.index_topk)
    output, compressed_mass = _sink_attention(q, kv, compressed, visible, attn.sinks, attn.scaling, attn.sliding_window)
    if compressed is not None and hasattr(attn.compressor, "indexer"):
        out.index_pairs.append((scores, compressed_mass))
    output = apply_rotary_pos_emb(output, cos, -sin).transpose(1, 2)  # [B, S, H, D]
    grouped = attn.o_a_proj(output.reshape(batch, seq_len, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped)


def _windows(module, hidden, overlap: bool):
    """Each closed window's gated sum (softmax over the window's slots), then the module's kv_norm. With `overlap`
    (CSA and its indexer) a window also sees the previous window's first-half series, as transformers lays it out."""
    ratio = module.compress_rate
    batch, seq_len, _ = hidden.shape
    n_windows = seq_len // ratio
    if n_windows == 0:
        return None
    kv = module.kv_proj(hidden)[:, : n_windows * ratio].view(batch, n_windows, ratio, -1)
    gate = module.gate_proj(hidden)[:, : n_windows * ratio].view(batch, n_windows, ratio, -1) + module.position_bias
    if overlap:
        dim = module.head_dim
        prev_kv = F.pad(kv[:, :-1, :, :dim], (0, 0, 0, 0, 1, 0))
        prev_gate = torch.cat([torch.full_like(gate[:, :1, :, :dim], float("-inf")), gate[:, :-1, :, :dim]], dim=1)
        kv = torch.cat([prev_kv, kv[..., dim:]], dim=2)
        gate = torch.cat([prev_gate, gate[..., dim:]], dim=2)
    return module.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))


def _compress(module, hidden, overlap: bool):
    compressed = _windows(module, hidden, overlap)
    if compressed is None:
        return None
    return _rope_entries(compressed, module.compress_rate, module.rotary_emb)


def _rope_entries(compressed, ratio, rotary):
    positions = (torch.arange(compressed.shape[1], device=compressed.device) * ratio).unsqueeze(0)
    cos, sin = rotary(compressed, position_ids=positions.expand(compressed.shape[0], -1), layer_type="compress")
    return apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)


def _causal_entries(seq_len, n_entries, ratio, device):
    """Query t sees compressed entry w once its window is closed: w < (t + 1) // ratio."""
    threshold = (torch.arange(seq_len, device=device) + 1) // ratio
    return (torch.arange(n_entries, device=device)[None, :] < threshold[:, None]).unsqueeze(0)


def _index_scores(indexer, hidden, q_residual, rope):
    """The lightning indexer's scores [B, S, T] (`sum_h w_h * relu(q_h . k)`), on detached inputs: it learns only
    from the KL objective."""
    batch, seq_len, _ = hidden.shape
    keys = _compress(indexer, hidden, overlap=True)
    cos, sin = rope
    q = indexer.q_b_proj(q_residual).view(batch, seq_len, -1, indexer.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [B, S, H, d]
    scorer = indexer.scorer
    scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [B, S, H, T]
    weights = scorer.weights_proj(hidden).float() * scorer.weights_scaling
    return (F.relu(scores) * scorer.softmax_scale * weights.unsqueeze(-1)).sum(dim=2)


def _picked(scores, visible, top_k):
    """The entries each query attends: its indexer top-k among the visible ones (all visible ones when k >= T)."""
    n_entries = scores.shape[-1]
    if top_k >= n_entries:
        return visible.expand(scores.shape[0], -1, -1)
    picks = scores.masked_fill(~visible, float("-inf")).topk(top_k, dim=-1).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picks, True)
    return chosen & visible


def _sink_attention(q, kv, compressed, visible, sinks, scaling, window):
    """softmax over [the `window` most recent keys | the visible compressed entries | the head's sink] of q . k,
    then the weighted sum of values (key = value). Queries go in blocks of `window` against the keys of their own
    and the previous block. Returns the output [B, H, S, D] and, with compressed entries, the attention mass on
    them summed over heads [B, S, T] (detached: the indexer's KL target)."""
    batch, heads, seq_len, dim = q.shape
    n_blocks = -(-seq_len // window)
    padded = n_blocks * window
    q_blocks = F.pad(q, (0, 0, 0, padded - seq_len)).view(batch, heads, n_blocks, window, dim)
    q_blocks = q_blocks.transpose(1, 2).reshape(batch, n_blocks, heads * window, dim)
    keys = F.pad(kv, (0, 0, window, padded - seq_len)).unfold(1, 2 * window, window)  # [B, nb, D, 2W]
    local = torch.matmul(q_blocks, keys).view(batch, n_blocks, heads, window, 2 * window)
    local = local.transpose(1, 2).reshape(batch, heads, padded, 2 * window)[:, :, :seq_len].float() * scaling
    query = torch.arange(padded, device=q.device)[:, None]
    key = (query // window - 1) * window + torch.arange(2 * window, device=q.device)[None, :]
    local_ok = (key <= query) & (key > query - window) & (key >= 0)
    parts = [local.masked_fill(~local_ok[:seq_len], float("-inf"))]
    if compressed is not None:
        far = torch.matmul(q, compressed.transpose(-1, -2).unsqueeze(1)).float() * scaling  # [B, H, S, T]
        parts.append(far.masked_fill(~visible.unsqueeze(1), float("-inf")))
    parts.append(sinks.float().view(1, heads, 1, 1).expand(batch, heads, seq_len, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    p_local = probs[..., : 2 * window].to(kv.dtype)
    p_local = F.pad(p_local, (0, 0, 0, padded - seq_len)).view(batch, heads, n_blocks, window, 2 * window)
    p_local = p_local.transpose(1, 2).reshape(batch, n_blocks, heads * window, 2 * window)
    output = torch.matmul(p_local, keys.transpose(-1, -2)).view(batch, n_blocks, heads, window, dim)
    output = output.transpose(1, 2).reshape(batch, heads, padded, dim)[:, :, :seq_len]
    mass = None
    if compressed is not None:
        p_far = probs[..., 2 * window : -1]
        output = output + torch.matmul(p_far.to(compressed.dtype), compressed.unsqueeze(1))
        mass = p_far.detach().sum(dim=1)
    return output, mass


def _moe(mlp, hidden, input_ids, out: Outputs, index: int):
    """Routed experts (dense over experts, unselected ones weighted 0) plus the shared expert."""
    batch, seq_len, dim = hidden.shape
    flat = hidden.reshape(-1, dim)
    gate = mlp.gate
    scores = gate.score_fn(F.linear(flat, gate.weight))
    if mlp.is_hash:
        picks = gate.tid2eid[input_ids.reshape(-1)].long()
    else:
        picks = torch.topk(scores + gate.e_score_correction_bias, gate.top_k, dim=-1, sorted=False).indices
        picked = picks.detach().reshape(-1)  # counted by scatter, not bincount: a fixed shape, no graph break
        out.router_counts[index] = torch.zeros(gate.num_experts, dtype=torch.long, device=picked.device).scatter_add_(
            0, picked, torch.ones_like(picked)
        )
    weights = scores.gather(1, picks)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
    dense = torch.zeros_like(scores).scatter(1, picks, weights)  # [N, E]
    experts = mlp.experts
    n_experts, _, inner = experts.down_proj.shape
    gate_up = F.linear(flat, experts.gate_up_proj.reshape(-1, dim)).view(flat.shape[0], n_experts, -1)
    act = experts._apply_gate(gate_up) * dense.unsqueeze(-1).to(gate_up.dtype)  # [N, E, I]
    down = experts.down_proj.permute(1, 0, 2).reshape(dim, n_experts * inner)
    routed = F.linear(act.reshape(flat.shape[0], -1), down).view(batch, seq_len, dim)
    return routed + mlp.shared_experts(hidden)
