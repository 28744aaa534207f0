"""The model's call sites of the fused verify ops that are not RoPE or compression (those are engine/static's):

* CSA layers, `candidate_block_mask` (source mode) on the lightning indexer's scores before top-k: blocks of
  `candidate_block_size` compressed entries, the best `candidate_blocks` of them kept. The default budget (None)
  keeps every block, which is exactly the plain causal selection; a smaller budget is an opt-in that CHANGES the
  model's selection (only entries of kept blocks can be picked) -- an approximation, not lossless.
* CSA layers, `indexer_postprocess`: the top-k logical entry indices of each query become pool rows through the
  request's page table. Entry w of a request lives at `page_table[slot, w // per_page] * per_page + w % per_page`
  with per_page = page_tokens // ratio (`StatePools.entry_rows`), which is the kernel's mapping with
  page_size = per_page and the slot's page-table row repeated for each of the request's query rows.
* `--wo-quant mxfp8`: WO-A through `wo_a_mxfp8` (grouped projection, bf16 round, MXFP8 activation) and WO-B through
  `mxfp8_linear` on o_b weights quantized to MXFP8 once, when the layer is built (lossy).

The choice is a construction-time setting of the model: `ModelRunner(..., sites=SiteSettings(...))` hands it to
every attention layer, which quantizes its o_b then. Both the eager ModelRunner and the static (CUDA-graph) step
reach these sites through `Attention._attend` / the output projection, so the same code runs in both. The server
always builds with sites (engine/build.py); `sites=None` (a bare ModelRunner's default) keeps the plain CSA
selection without the kernels' references (see attention.py). `backend="auto"`: Triton on CUDA where the op's guard
passes, the PyTorch reference elsewhere. `site_counts()` counts the host-side calls per op (a graph replay does not call
Python, so under CUDA graphs it counts captures, not replays)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from evalpipe.engine.model.compressor import causal_topk, index_order
from evalpipe.kernels import candidate_block_mask, indexer_postprocess, mxfp8_linear, mxfp8_quantize, wo_a_mxfp8

WO_QUANT_CHOICES = ("none", "mxfp8")
_CALLS: Counter = Counter()


@dataclass(frozen=True)
class SiteSettings:
    """How a model's fused sites run; fixed when the model is built."""

    candidate_block_size: int = 4  # compressed entries per candidate block
    candidate_blocks: int | None = None  # None: keep every block (exact); N: keep the best N (changes selection)
    wo_quant: str = "none"  # "mxfp8": WO-A/WO-B through the MXFP8 kernels on o_b quantized once (lossy)
    backend: str = "auto"
    # --deterministic: every kernel in its batch-invariant shape, GEMMs and reductions through
    # kernels/batch_invariant.py (engine/model/deepseek_v4.py, engine/static/model.py)
    deterministic: bool = False

    def __post_init__(self):
        if self.candidate_block_size < 1:
            raise ValueError(f"candidate_block_size must be >= 1, got {self.candidate_block_size}")
        if self.candidate_blocks is not None and self.candidate_blocks < 1:
            raise ValueError(f"candidate_blocks must be >= 1 (or None for all), got {self.candidate_blocks}")
        if self.wo_quant not in WO_QUANT_CHOICES:
            raise ValueError(f"wo_quant must be one of {WO_QUANT_CHOICES}, got {self.wo_quant!r}")

    def describe(self, model) -> dict:
        """The settings of `model` (built with them) as /get_server_info reports them under "fused_sites"."""
        quantized = sum(layer.attn.wo_b_mxfp8 is not None for layer in model.layers)
        return {
            "wo_quant": self.wo_quant,
            "wo_quant_layers": quantized,
            "candidate_block_size": self.candidate_block_size,
            "candidate_blocks": self.candidate_blocks if self.candidate_blocks is not None else "all",
        }


DEFAULT_SETTINGS = SiteSettings()


def site_counts() -> dict[str, int]:
    """Calls of each fused op through the engine's sites since start-up (host-side; see module docstring)."""
    return dict(_CALLS)


def count(site: str) -> None:
    """One host-side call of `site` (see `site_counts`)."""
    _CALLS[site] += 1


def quantized_wo_b(attn, settings: SiteSettings | None) -> torch.Tensor | None:
    """The layer's MXFP8-rounded o_b under `settings` (None without --wo-quant mxfp8 or where the WO-A shape
    check fails)."""
    if settings is None or settings.wo_quant != "mxfp8" or not _wo_shapes_ok(attn):
        return None
    return quantize_wo_b(attn.o_b)


def _wo_shapes_ok(attn) -> bool:
    """The shape checks of wo_a_mxfp8 / mxfp8_linear: G * R (the o_b input width) a multiple of 32."""
    return (attn.groups * attn.o_rank) % 32 == 0 and attn.o_b.shape[1] == attn.groups * attn.o_rank


def quantize_wo_b(w_b: torch.Tensor) -> torch.Tensor:
    """o_b [N, G*R] rounded to MXFP8 (e4m3 values, one E8M0 scale per 32 inputs) and held as the dequantized
    values in the weight's dtype (exact in bf16/fp32): what `mxfp8_linear` consumes. Lossy."""
    return mxfp8_quantize(w_b).dequantize().to(w_b.dtype).contiguous()


def wo_project(attn, out: torch.Tensor) -> torch.Tensor:
    """The grouped output projection with MXFP8 activations: out [T, H, D] -> [T, hidden]."""
    settings = attn.site_settings or DEFAULT_SETTINGS
    x = out.reshape(out.shape[0], attn.groups, -1)
    if x.dtype != attn.o_a.dtype:
        x = x.to(attn.o_a.dtype)
    a = wo_a_mxfp8(x, attn.o_a, backend=settings.backend, invariant=settings.deterministic)
    count("wo_a_mxfp8")
    out_dtype = torch.bfloat16 if attn.wo_b_mxfp8.dtype == torch.bfloat16 else torch.float32
    y = mxfp8_linear(
        a, attn.wo_b_mxfp8, out_dtype=out_dtype, backend=settings.backend, invariant=settings.deterministic
    )
    count("mxfp8_linear")
    return y.to(out.dtype)


def csa_entries(attn, idx_q, group, batch, pool) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed entries each query of a CSA group attends to: ([G, n, k, D] entries, [G, n, k] True where
    the pick is empty). Scores -> candidate_block_mask -> causal top-k -> indexer_postprocess -> pool gather."""
    scores, visible, k = attn.indexer.scores(*idx_q, group, batch.pools, pool.indexer)  # [G, n, E]
    G, n, E = scores.shape
    entries = pool.compressor.entries
    if k == 0:
        return entries.new_empty(G, n, 0, entries.shape[1]), torch.ones(G, n, 0, dtype=torch.bool, device=scores.device)
    rows = csa_rows(attn, scores.masked_fill(~visible, float("-inf")).reshape(G * n, E), group, batch, k)
    rows = rows.view(G, n, k)
    return entries[rows.clamp(min=0).long()], rows < 0


def csa_rows(attn, scores: torch.Tensor, group, batch, k: int) -> torch.Tensor:
    """[G * n, k] pool rows of the entries each query of a CSA group attends to (-1 = none), from the indexer's
    scores [G * n, E] (invisible entries at -inf): candidate_block_mask -> causal top-k -> indexer_postprocess.
    Device ops only, so the CUDA-graph step calls it too."""
    settings = attn.site_settings or DEFAULT_SETTINGS
    GN, E = scores.shape
    G, n = group.size, group.n
    # visibility is the prefix w < (t + 1) // ratio: the kernel's lens
    lens = ((group.pos + 1) // attn.ratio).reshape(-1)
    block = settings.candidate_block_size
    budget = settings.candidate_blocks or math.ceil(E / block)
    masked, keep = candidate_block_mask(scores, lens, budget, block, backend=settings.backend)
    count("candidate_block_mask")
    # only entries of kept blocks stay candidates; the default budget keeps every block with a visible entry, so
    # this is the plain causal selection (finite scores); a set budget narrows it
    masked = masked.masked_fill(~keep, float("-inf"))
    visible = (torch.arange(E, device=scores.device)[None] < lens[:, None]) & keep
    picked = causal_topk(masked.view(G, n, E), visible.view(G, n, E), k)  # [G, n, k] logical indices, -1 = none
    if settings.deterministic:  # the same picks in the same slots whatever E (the chunk, the batch): index order
        picked = index_order(picked)
    pools = batch.pools
    table = pools.page_table_on_device()[group.slots]  # [G, P]: rows of one request share its page table
    table = table.unsqueeze(1).expand(G, n, table.shape[1]).reshape(G * n, -1)
    rows, _ = indexer_postprocess(
        masked, picked.reshape(G * n, k), table, pools.page_tokens // attn.ratio, backend=settings.backend
    )
    count("indexer_postprocess")
    return rows
