"""The fused verify stack: five ops of the DSpark target-verify path, each a Triton kernel with a PyTorch reference.

Every op accepts `backend="auto" | "triton" | "reference"` (see `_backend.py`).
"""

from evalpipe.kernels.indexer_postprocess import indexer_postprocess, indexer_postprocess_reference
from evalpipe.kernels.candidate_block_mask import candidate_block_mask, candidate_block_mask_reference
from evalpipe.kernels.q_rope_store import q_rope_store, q_rope_store_reference
from evalpipe.kernels.mxfp8 import (
    Mxfp8Tensor,
    mxfp8_linear,
    mxfp8_linear_reference,
    mxfp8_quantize,
    mxfp8_quantize_reference,
    wo_a_mxfp8,
    wo_a_mxfp8_reference,
)
from evalpipe.kernels.c2_verify import c2_verify, c2_verify_reference

__all__ = [
    "indexer_postprocess", "indexer_postprocess_reference",
    "candidate_block_mask", "candidate_block_mask_reference",
    "q_rope_store", "q_rope_store_reference",
    "Mxfp8Tensor", "mxfp8_quantize", "mxfp8_quantize_reference", "wo_a_mxfp8", "wo_a_mxfp8_reference",
    "mxfp8_linear", "mxfp8_linear_reference",
    "c2_verify", "c2_verify_reference",
]
