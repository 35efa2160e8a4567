"""paxengine kernels: attention, the KV write (plain or fused with RoPE) and the FP8-weight
matmul, the gated activation quantized for it, the residual add with RMSNorm, jnp oracles and Pallas kernels.

Contract: ARCHITECTURE.md ("KV cache and attention"). See README.md here for the design.
"""

from kernels_pallas.add_norm import add_rms_norm
from kernels_pallas.attention_mgpu import prepare_runtime
from kernels_pallas.dispatch import ragged_paged_attention
from kernels_pallas.fp8_gemv import fp8_matmul
from kernels_pallas.glu_quant import glu_quant
from kernels_pallas.kv_write import write_kv
from kernels_pallas.layout import quantize_kv, v_transposed, value_cache_dtype, value_page_shape
from kernels_pallas.metadata import AttentionMetadata, token_to_seq
from kernels_pallas.reference import (
    ref_add_rms_norm,
    ref_fp8_matmul,
    ref_glu_quant,
    ref_ragged_paged_attention,
    ref_rope_write_kv,
    ref_write_kv,
)
from kernels_pallas.rope_write import rope_write_kv
from kernels_pallas.tuning import Tuning, default_tuning

__all__ = [
    "AttentionMetadata",
    "token_to_seq",
    "ref_ragged_paged_attention",
    "ref_write_kv",
    "ref_rope_write_kv",
    "rope_write_kv",
    "quantize_kv",
    "value_cache_dtype",
    "value_page_shape",
    "v_transposed",
    "ragged_paged_attention",
    "default_tuning",
    "Tuning",
    "write_kv",
    "prepare_runtime",
    "fp8_matmul",
    "ref_fp8_matmul",
    "glu_quant",
    "ref_glu_quant",
    "add_rms_norm",
    "ref_add_rms_norm",
]
