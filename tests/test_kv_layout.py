"""bf16 KV caches keep their V pages in fp16 (kernels_pallas.value_cache_dtype): the same bytes,
no value lost, and the attention kernels' fp16 PV product reads them without a conversion."""
import jax.numpy as jnp

import kernels_pallas
from paxengine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fib(n):",
           "Once upon a time, in a land far away, there lived a"]


def run():
    llm = LLM(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, show_progress=False,
              token_buckets=[16, 32], seq_buckets=[4], num_kv_blocks=48, dtype="bfloat16",
              attention_backend="xla")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_bf16_cache_stores_values_in_fp16_without_changing_tokens(monkeypatch):
    llm, tokens = run()
    k_cache, v_cache = llm.engine.runner.kv_cache
    assert k_cache.dtype == jnp.bfloat16 and v_cache.dtype == jnp.float16
    assert k_cache.nbytes == v_cache.nbytes
    # The same engine with bf16 V pages: every stored value is the same number, so the XLA
    # path (which computes in fp32) gives the same greedy tokens.
    monkeypatch.setattr(kernels_pallas, "value_cache_dtype", jnp.dtype)
    llm_bf16, tokens_bf16 = run()
    assert llm_bf16.engine.runner.kv_cache[1].dtype == jnp.bfloat16
    assert tokens == tokens_bf16
    assert all(len(t) == 12 for t in tokens)
