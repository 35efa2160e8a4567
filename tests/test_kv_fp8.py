"""FP8 (e4m3) KV pages: the engine stores K/V in fp8 and both attention paths read them back."""

from paxengine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "Once upon a time, in a land far away, there lived a",
]


def run(**kw):
    # a small pool: XLA emulates fp8 on CPUs, so every byte of cache costs time here
    llm = LLM(
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        show_progress=False,
        token_buckets=[16, 32],
        seq_buckets=[4],
        num_kv_blocks=12 if kw.get("block_size", 64) == 64 else 48,
        **kw,
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_fp8_kv_cache_runs_and_stays_close_to_full_precision():
    import jax
    import jax.numpy as jnp

    from paxengine.kv_memory import kv_bytes_per_block

    _, full = run(kv_cache_dtype="auto")
    # unit scales: the two paths see the same stored values bit for bit (calibrated scales
    # are compared with the oracle in test_kv_scales.py)
    fp8_llm, fp8_xla = run(kv_cache_dtype="fp8", attention_backend="xla", kv_cache_scales="unit")
    k_cache, v_cache = jax.tree_util.tree_leaves(fp8_llm.engine.runner.kv_cache)[:2]
    assert str(k_cache.dtype) == "float8_e4m3fn"
    # fp8 caches take 64-token pages by default, their V pages stored [head_dim, 64]
    D = fp8_llm.engine.model_config.head_dim
    assert fp8_llm.engine.kv.block_size == 64
    assert k_cache.shape[3:] == (64, D) and v_cache.shape[3:] == (D, 64)
    cfg = fp8_llm.engine.model_config  # a quarter of the fp32 bytes: 4x the blocks per budget
    assert 4 * kv_bytes_per_block(cfg, 16, jnp.float8_e4m3fn) == kv_bytes_per_block(
        cfg, 16, jnp.float32
    )
    _, fp8_pallas = run(kv_cache_dtype="fp8", attention_backend="pallas", kv_cache_scales="unit")
    assert fp8_pallas == fp8_xla  # the kernel dequantizes as the XLA path does
    for a, b in zip(fp8_xla, full):  # rounding K/V to 3 mantissa bits moves logits
        assert a[:4] == b[:4]  # a little: the first tokens still agree
    # 16-token pages ([bs, D] V pages, gathered rows in the kernel): the same stored values
    llm16, pallas16 = run(
        kv_cache_dtype="fp8", attention_backend="pallas", kv_cache_scales="unit", block_size=16
    )
    assert jax.tree_util.tree_leaves(llm16.engine.runner.kv_cache)[1].shape[3:] == (16, D)
    assert pallas16 == fp8_pallas
