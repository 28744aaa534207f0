"""Every Triton kernel of evalpipe, each beside a PyTorch reference with the same signature.

Called by the engine: the model's fused sites (engine/model/fused_sites.py) and the CUDA-graph step
(engine/static/model.py). Imports nothing else from evalpipe; a layer object an op takes (a hyper-connection, a MoE,
a compressor) is read through its attributes. Every op accepts `backend="auto" | "triton" | "reference"` and its
kernels are built by the one selector and JIT cache in `_backend.py`.

- the DSpark verify ops: indexer_postprocess, candidate_block_mask, q_rope_store (rope.py: its RoPE), mxfp8
  (wo_a_mxfp8, mxfp8_linear), ratio2_compress_verify (the ratio-2 compressor);
- the graph step's ops: norm (RMSNorms, q/kv norms), hyper (mHC), attention (the attention core), indexer (scores,
  CSA top-k), moe (the MoE block), compress (the other compressor windows), step_meta (a step's index arrays);
- `--deterministic`: batch_invariant (GEMMs and reductions in one order whatever the batch, as aten overrides while
  `invariant_ops()` is open) and the `invariant=True` launch shapes of attention, moe, hyper and mxfp8.
"""

from evalpipe.kernels._backend import use_triton  # the one selector; callers with a chain of their own ask it too
from evalpipe.kernels.candidate_block_mask import candidate_block_mask, candidate_block_mask_reference
from evalpipe.kernels.indexer_postprocess import indexer_postprocess, indexer_postprocess_reference
from evalpipe.kernels.mxfp8 import (
    Mxfp8Tensor,
    mxfp8_linear,
    mxfp8_linear_reference,
    mxfp8_quantize,
    mxfp8_quantize_reference,
    wo_a_mxfp8,
    wo_a_mxfp8_reference,
)
from evalpipe.kernels.q_rope_store import q_rope_store, q_rope_store_reference
from evalpipe.kernels.ratio2_compress_verify import ratio2_compress_verify, ratio2_compress_verify_reference

__all__ = [
    "use_triton",
    "indexer_postprocess",
    "indexer_postprocess_reference",
    "candidate_block_mask",
    "candidate_block_mask_reference",
    "q_rope_store",
    "q_rope_store_reference",
    "Mxfp8Tensor",
    "mxfp8_quantize",
    "mxfp8_quantize_reference",
    "wo_a_mxfp8",
    "wo_a_mxfp8_reference",
    "mxfp8_linear",
    "mxfp8_linear_reference",
    "ratio2_compress_verify",
    "ratio2_compress_verify_reference",
]
