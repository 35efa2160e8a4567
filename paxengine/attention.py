"""The model's `attend` over the paged KV cache, per attention backend (see llama.Attend).

`PagedAttend(md, backend, cfg)` writes a step's K/V at `md.slot_mapping` and attends over the
pages. Besides the plain call it offers what the model uses when present:
- `takes_kv_scale`: an FP8 cache's per-layer (k_scale, v_scale) go to the kernels, which
  quantize on the write and dequantize in attention (`llama.scaled_attend` would otherwise
  fold them into q, k, v and o with four elementwise kernels);
- `rope_qkv` (the Pallas backend, steps of at most FUSED_ROPE_MAX_TOKENS tokens): RoPE on q and
  k and the KV write from the fused projection's output in one kernel, then `attend_cached`.
  A batch-1 decode step is bound by its ~550 kernel launches on the H200 (~8 us each), and
  between the QKV projection and attention XLA launches five small ones.
"""

from __future__ import annotations

import math
import os
from functools import partial

import jax

import kernels_pallas
from kernels_pallas.tuning import TUNING_FIELDS, is_decode_bucket, parse_tuning_spec
from kernels_pallas.xla_attention import xla_ragged_paged_attention
from paxengine.models.config import ModelConfig

# Steps of up to this many tokens take the fused RoPE + KV-write kernel (the batch-1 and
# small-batch decode buckets). Larger steps keep XLA's scatter and the separate RoPE: there
# the launches are hidden behind the matmuls, and the fused kernel has not been measured.
# PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS overrides it (0: never; part of the executables' key).
FUSED_ROPE_MAX_TOKENS = 16


def fused_rope_max_tokens() -> int:
    return int(os.environ.get("PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS", FUSED_ROPE_MAX_TOKENS))


def decode_tuning_overrides() -> dict:
    """Tuning fields for the attention kernel's decode-bucket launches from
    PAXENGINE_KERNEL_ATTN_DECODE_TUNING ("num_warps=2,num_stages=3"; integer fields of
    kernels_pallas.tuning.Tuning): an A/B knob, part of the executables' key."""
    var = "PAXENGINE_KERNEL_ATTN_DECODE_TUNING"
    return parse_tuning_spec(var, os.environ.get(var, ""), TUNING_FIELDS)


def _scales(kv_scale):
    return (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])


class PagedAttend:
    takes_kv_scale = True

    def __init__(
        self,
        md: kernels_pallas.AttentionMetadata,
        backend: str,
        cfg: ModelConfig,
        fused_rope: bool = True,
    ):
        """fused_rope=False: never `rope_qkv` (the runner under tensor parallelism, where the
        fused kernel has not been tested)."""
        interpret = jax.default_backend() != "gpu"
        self.md, self.cfg = md, cfg
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if backend == "pallas":
            self.write = partial(kernels_pallas.write_kv, interpret=interpret)
            T, S = md.slot_mapping.shape[0], md.block_tables.shape[0]
            over = decode_tuning_overrides() if is_decode_bucket(T, S) else {}
            self.attn = partial(kernels_pallas.ragged_paged_attention, interpret=interpret, **over)
        elif backend == "xla":
            self.write, self.attn = kernels_pallas.ref_write_kv, xla_ragged_paged_attention
        else:
            self.write = kernels_pallas.ref_write_kv
            self.attn = kernels_pallas.ref_ragged_paged_attention
        T, half = md.slot_mapping.shape[0], cfg.head_dim // 2
        small = T <= fused_rope_max_tokens() and half & (half - 1) == 0
        if fused_rope and backend == "pallas" and small:
            self.rope_qkv = partial(self._rope_qkv, interpret=interpret)

    def __call__(self, q, k, v, kv_cache, layer, kv_scale=None):
        ks, vs = _scales(kv_scale)
        kc, vc = self.write(
            kv_cache[0], kv_cache[1], layer, k, v, self.md.slot_mapping, k_scale=ks, v_scale=vs
        )
        return self.attend_cached(q, (kc, vc), layer, kv_scale), (kc, vc)

    def attend_cached(self, q, kv_cache, layer, kv_scale=None):
        """Attention of q over the pages (this step's K/V already written)."""
        ks, vs = _scales(kv_scale)
        return self.attn(
            q,
            kv_cache[0],
            kv_cache[1],
            layer,
            self.md,
            sm_scale=self.scale,
            sliding_window=self.cfg.sliding_window,
            k_scale=ks,
            v_scale=vs,
        )

    def _rope_qkv(self, qkv, rope, kv_cache, layer, kv_scale=None, *, interpret):
        """qkv [T, (Hq + 2 Hkv) D] -> (q after RoPE [T, Hq, D], the cache with k, v written).
        rope: llama.rope_tables (each half of a row the same: the kernel takes one)."""
        ks, vs = _scales(kv_scale)
        D = self.cfg.head_dim
        half = D // 2
        # this device's heads (under tensor parallelism a shard's qkv is its own q | k | v)
        kv_heads = kv_cache[0].shape[1]
        q, kc, vc = kernels_pallas.rope_write_kv(
            qkv,
            rope[0][:, :half],
            rope[1][:, :half],
            kv_cache[0],
            kv_cache[1],
            layer,
            self.md.slot_mapping,
            num_heads=qkv.shape[1] // D - 2 * kv_heads,
            num_kv_heads=kv_heads,
            k_scale=ks,
            v_scale=vs,
            interpret=interpret,
        )
        return q, (kc, vc)
