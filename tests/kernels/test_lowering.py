"""Every kernel configuration the engine compiles must lower for CUDA (Triton) on a CPU."""

import jax.numpy as jnp
import pytest

from kernels_pallas.lowering import check_cuda_lowering

LLAMA8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
QWEN35_9B_FP8 = dict(
    num_heads=16, num_kv_heads=4, head_dim=256, kv_dtype=jnp.float8_e4m3fn, kv_scales=True
)
CONFIGS = {
    # decode buckets (split-K), prefill / mixed buckets, at Llama-3.1-8B shapes
    "decode_b1": dict(T=16, S=1, P=512, **LLAMA8B),
    "decode_b64": dict(T=64, S=64, P=128, **LLAMA8B),
    "decode_b256": dict(T=256, S=256, P=32, **LLAMA8B),
    "prefill_512": dict(T=512, S=8, P=128, **LLAMA8B),
    "mixed_2048": dict(T=2048, S=64, P=256, **LLAMA8B),  # 256-row prefill tiles (default)
    "prefill_8192": dict(T=8192, S=8, P=128, **LLAMA8B),
    "fp32": dict(T=32, S=8, P=16, dtype=jnp.float32, **LLAMA8B),
    "fp8_kv": dict(T=64, S=64, P=128, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, **LLAMA8B),
    "fp8_kv_mixed": dict(T=512, S=64, P=128, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, **LLAMA8B),
    "window_softcap": dict(T=64, S=8, P=64, sliding_window=4096, soft_cap=50.0, **LLAMA8B),
    # small models: head_dim 64, GQA 3 (SmolLM2-135M: 9 q / 3 kv), block sizes 32 / 64
    "smollm_bs16": dict(T=64, S=16, P=64, num_heads=9, num_kv_heads=3, head_dim=64),
    "d64_bs32": dict(T=128, S=4, P=32, num_heads=16, num_kv_heads=4, head_dim=64, block_size=32),
    "d128_bs64": dict(T=32, S=32, P=16, num_heads=16, num_kv_heads=2, head_dim=128, block_size=64),
    # long prefills at other GQA ratios take the 256-row tiles too (64 tokens x G_pad 4,
    # 32 x 8, 256 x 1)
    "big_tiles_smollm_d64": dict(T=4096, S=8, P=256, num_heads=9, num_kv_heads=3, head_dim=64),
    "big_tiles_gqa8": dict(T=8192, S=8, P=512, num_heads=64, num_kv_heads=8, head_dim=128),
    "big_tiles_mha": dict(T=2048, S=8, P=128, num_heads=32, num_kv_heads=32, head_dim=128),
    "tuned": dict(T=64, S=64, P=128, block_k=128, k_splits=2, num_warps=8, num_stages=4, **LLAMA8B),
    # tuning variants swept on the H200 (benchmarks/kernels/attention.py --tune)
    "prefill_m128_fp16pv": dict(
        T=512,
        S=1,
        P=128,
        block_q=32,
        block_k=64,
        num_warps=8,
        num_stages=3,
        pv_fp16=True,
        **LLAMA8B,
    ),
    "prefill_nosplit_bk128": dict(
        T=512, S=1, P=128, block_q=32, block_k=128, num_warps=8, pv_split=False, **LLAMA8B
    ),
    "decode_bk256_onemask": dict(
        T=64,
        S=64,
        P=128,
        block_k=256,
        num_stages=1,
        split_mask=False,
        reverse_tiles=False,
        **LLAMA8B,
    ),
    "mixed_split": dict(T=512, S=64, P=128, mixed_split=True, **LLAMA8B),
    # split-K merge kernel with k not a power of two, head_dim 64
    "split_k3_d64": dict(T=16, S=4, P=64, num_heads=9, num_kv_heads=3, head_dim=64, k_splits=3),
    "fp8_fp16pv_window": dict(
        T=64,
        S=8,
        P=64,
        kv_dtype=jnp.float8_e4m3fn,
        kv_scales=True,
        pv_fp16=True,
        sliding_window=1024,
        k_splits=2,
        **LLAMA8B,
    ),
    # bf16 V pages (callers other than the engine, whose bf16 caches hold fp16 V): converted
    # in-kernel for the fp16 PV product, or P as bf16 hi + lo
    "bf16_v_fp16pv": dict(
        T=512,
        S=1,
        P=128,
        v_dtype=jnp.bfloat16,
        block_q=32,
        block_k=64,
        num_warps=8,
        num_stages=3,
        pv_fp16=True,
        mosaic=False,
        **LLAMA8B,
    ),
    "bf16_v_decode": dict(T=64, S=64, P=128, v_dtype=jnp.bfloat16, **LLAMA8B),
    # rope_write_kv (RoPE + KV write fused) in place of write_kv: decode buckets, bf16 and fp8
    "rope_write_t1": dict(T=1, S=1, P=512, rope_write=True, **LLAMA8B),
    "rope_write_t16": dict(T=16, S=16, P=128, rope_write=True, **LLAMA8B),
    "rope_write_fp8_t1": dict(
        T=1, S=1, P=512, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, rope_write=True, **LLAMA8B
    ),
    "rope_write_fp8_t16": dict(
        T=16, S=16, P=128, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, rope_write=True, **LLAMA8B
    ),
    # fp8 pages of 64 tokens (the engine's default for fp8 KV): V pages [D, bs], a page per
    # KV block, in the write, the fused RoPE write, decode, mixed and prefill launches
    "fp8_bs64_decode": dict(
        T=64, S=64, P=32, block_size=64, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, **LLAMA8B
    ),
    "fp8_bs64_mixed": dict(
        T=512, S=64, P=32, block_size=64, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, **LLAMA8B
    ),
    "fp8_bs64_prefill": dict(
        T=2048, S=4, P=32, block_size=64, kv_dtype=jnp.float8_e4m3fn, kv_scales=True, **LLAMA8B
    ),
    "rope_write_fp8_bs64_t16": dict(
        T=16,
        S=16,
        P=32,
        block_size=64,
        kv_dtype=jnp.float8_e4m3fn,
        kv_scales=True,
        rope_write=True,
        **LLAMA8B,
    ),
    "rope_write_smollm": dict(
        T=16, S=4, P=64, num_heads=9, num_kv_heads=3, head_dim=64, rope_write=True
    ),
    # Qwen3.5's full-attention layers with an fp8 cache (head_dim 256; 9B: 16 / 4 heads, 27B:
    # 24 / 4): the Triton kernel (Mosaic takes no fp8), 64-token pages
    "qwen35_9b_fp8_decode_b1": dict(T=16, S=1, P=64, block_size=64, **QWEN35_9B_FP8),
    "qwen35_9b_fp8_decode": dict(T=64, S=64, P=32, block_size=64, **QWEN35_9B_FP8),
    "qwen35_27b_fp8_prefill": dict(
        T=2048, S=4, P=32, block_size=64, **dict(QWEN35_9B_FP8, num_heads=24)
    ),
    # ... and a bf16 cache at the engine's default buckets: head_dim 256 keeps the 64-row
    # prefill tiles where 128 takes 256-row ones (over the H100's shared memory at 256)
    "qwen35_9b_decode_b512": dict(T=512, S=512, P=16, num_heads=16, num_kv_heads=4, head_dim=256),
    "qwen35_9b_prefill_8192": dict(T=8192, S=8, P=512, num_heads=16, num_kv_heads=4, head_dim=256),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lowers_for_cuda(name):
    txt = check_cuda_lowering(**CONFIGS[name])
    assert "triton" in txt
    if CONFIGS[name].get("k_splits", 1) > 1:
        assert "merge_splits" in txt  # the split-K merge kernel lowered too
    if CONFIGS[name].get("rope_write"):
        assert "rope_write_kv" in txt


def test_broken_rule_is_caught():
    with pytest.raises(ValueError, match="power of 2"):
        check_cuda_lowering(T=16, S=4, P=8, block_k=48)


CACHES = {  # the engine's default page per KV dtype
    "bf16": dict(block_size=16),
    "fp8_bs64": dict(block_size=64, kv_dtype=jnp.float8_e4m3fn, kv_scales=True),
}


def _engine_kernel_configs():
    """One (T, S, cache) per distinct set of kernel launches the engine compiles at
    Llama-3.1-8B shapes: for the GPU defaults' buckets (the ladder the GPU benchmark measured)
    and for the buckets derived plainly from the same limits, with bf16 16-token pages and fp8
    64-token pages (the defaults of each KV dtype)."""
    from kernels_pallas.tuning import plan_launches
    from paxengine.batch import bucket_pairs, seq_buckets, token_buckets
    from paxengine.config import EngineConfig
    from paxengine.device_defaults import resolve

    gpu = resolve(EngineConfig(), on_gpu=True)
    bucket_sets = [
        (gpu.token_buckets, gpu.seq_buckets),
        (token_buckets(gpu.max_num_batched_tokens), seq_buckets(gpu.max_num_seqs)),
    ]
    configs = {}
    for name, cache in CACHES.items():
        fp8 = "kv_dtype" in cache
        for tb, sb in bucket_sets:
            for T, S in bucket_pairs(tb, sb):
                key = plan_launches(
                    T, S, 32, 8, 128, cache["block_size"], kv_itemsize=1 if fp8 else 2, v_t=fp8
                )
                configs.setdefault((name, key), (T, S, name))
    return list(configs.values())


ENGINE_CONFIGS = _engine_kernel_configs()


@pytest.mark.parametrize("T,S,cache", ENGINE_CONFIGS)
def test_engine_buckets_lower_for_cuda(T, S, cache):
    """Every distinct launch plan of the engine's GPU buckets lowers (not just hand-picked ones)."""
    P = 256 * 16 // CACHES[cache]["block_size"]
    txt = check_cuda_lowering(T=T, S=S, P=P, **LLAMA8B, **CACHES[cache])
    assert "triton" in txt or "mosaic_gpu" in txt  # long prefills: Mosaic GPU on jax 0.11
