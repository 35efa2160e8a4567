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
    # 8 tokens: the fp8 paths' steps (the Pallas kernels in interpret mode, 30 layers) are what
    # this file costs
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same_greedy_path(got, ref, tie=0.1):
    """Two attention paths over the same stored K/V: the same tokens, or a divergence at a
    near-tie of `ref` (its top two within `tie` nats, the other path's token one of them).
    Each new token's K/V is rounded to e4m3 (3 mantissa bits) before it is stored, so a
    last-bit difference in summation order can flip a rounding and move later logits by a few
    hundredths of a nat; on one CPU the paths gave the same tokens, on another they split at a
    0.001-nat tie. Broken dequantization moves logits by far more, from the first token."""
    for (a, _), (b, lps) in zip(got, ref):
        split = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if split is None:
            assert a == b
            continue
        top = lps[split]
        assert a[split] in top and b[split] in top, (split, a, b, top)
        gap = abs(top[a[split]].logprob - top[b[split]].logprob)
        assert gap < tie, f"paths split at token {split} where the reference's gap is {gap:.3f}"


def test_fp8_kv_cache_runs_and_stays_close_to_full_precision():
    import jax
    import jax.numpy as jnp

    from paxengine.kv_memory import kv_bytes_per_block

    _, full = run(kv_cache_dtype="auto")
    full = [ids for ids, _ in full]
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
    assert_same_greedy_path(fp8_pallas, fp8_xla)  # the kernel dequantizes as the XLA path does
    for (a, _), b in zip(fp8_xla, full):  # rounding K/V to 3 mantissa bits moves logits
        assert a[:4] == b[:4]  # a little: the first tokens still agree
    # 16-token pages ([bs, D] V pages, gathered rows in the kernel): the same stored values
    llm16, pallas16 = run(
        kv_cache_dtype="fp8", attention_backend="pallas", kv_cache_scales="unit", block_size=16
    )
    assert jax.tree_util.tree_leaves(llm16.engine.runner.kv_cache)[1].shape[3:] == (16, D)
    assert_same_greedy_path(pallas16, fp8_pallas)
