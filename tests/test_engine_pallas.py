"""The whole engine with the Pallas kernels (interpret mode on the CPU) gives the oracle's
greedy tokens on four of SmolLM2's real layers (conftest.short_smollm: every layer takes the
same kernels; the 30 cost the oracle's forwards and the kernels' interpret mode ~7x), through
chunked prefill, decode and mixed steps, in both layer layouts: scanned stacked weights (the CPU
default) and unrolled per-layer weights and KV caches (the GPU default)."""

import pytest
from prompts import PROMPTS

from paxengine import LLM, SamplingParams
from paxengine.reference import reference_generate

PROMPTS_HERE = PROMPTS[:5] + ["word " * 40]  # the last one needs two prefill chunks


@pytest.fixture(scope="module")
def oracle(short_smollm):
    """The oracle's greedy tokens for each prompt, computed once for both layouts."""
    smollm = short_smollm
    return {
        p: reference_generate(
            smollm.params, smollm.config, smollm.tokenizer.encode(p), 10, smollm.eos_token_ids
        )
        for p in PROMPTS_HERE
    }


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_pallas_backend_matches_oracle(short_smollm, oracle, layer_loop, monkeypatch):
    # the unrolled layout's fused projection takes the RoPE + KV-write kernel in its 16-token
    # buckets (paxengine/attention.py): count the layers traced through it
    import kernels_pallas

    fused = []
    real = kernels_pallas.rope_write_kv
    monkeypatch.setattr(
        kernels_pallas, "rope_write_kv", lambda *a, **k: fused.append(1) or real(*a, **k)
    )
    smollm = short_smollm
    llm = LLM(
        model=smollm.source,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        show_progress=False,
        attention_backend="pallas",
        token_buckets=[16, 32],
        seq_buckets=[4],
        layer_loop=layer_loop,
        store_executables=False,  # traced here, so the count above sees the buckets
    )
    assert llm.engine.runner.backend == "pallas"
    # scan: per-projection weights, no fused qkv; unroll: the (16, 4) bucket, not the 32-token
    # one (its layers are traced once, through one jitted layer function)
    assert len(fused) == (0 if layer_loop == "scan" else 1)
    runner = llm.engine.runner
    assert runner.layer_loop == layer_loop
    if layer_loop == "unroll":  # one donated [1, ...] pair per layer, weights per layer
        assert len(runner.kv_cache) == smollm.config.num_layers == len(runner.params["layers"])
        assert runner.kv_cache[0][0].shape[0] == 1
    outs = llm.generate(PROMPTS_HERE, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    for p, o in zip(PROMPTS_HERE, outs):
        assert o.outputs[0].token_ids == oracle[p], p
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_decode_tuning_knob_reaches_decode_buckets_only(smollm, monkeypatch):
    """PAXENGINE_KERNEL_ATTN_DECODE_TUNING (an A/B knob): its fields go to the attention
    kernel's launches of decode buckets (T <= 2 S), not to prefill / mixed ones; a bad item is
    refused by name."""
    import jax.numpy as jnp

    from kernels_pallas import AttentionMetadata
    from paxengine.attention import PagedAttend, decode_tuning_overrides

    def attend(T, S):
        z = jnp.zeros
        md = AttentionMetadata(
            z((T,), jnp.int32),
            z((S, 4), jnp.int32),
            z((S,), jnp.int32),
            z((S + 1,), jnp.int32),
            z((1,), jnp.int32),
        )
        return PagedAttend(md, "pallas", smollm.config).attn.keywords

    monkeypatch.setenv("PAXENGINE_KERNEL_ATTN_DECODE_TUNING", "num_warps=2,num_stages=3")
    assert decode_tuning_overrides() == {"num_warps": 2, "num_stages": 3}
    assert attend(16, 16)["num_warps"] == 2 and attend(16, 16)["num_stages"] == 3
    assert "num_warps" not in attend(64, 4)  # a prefill bucket keeps its defaults
    monkeypatch.setenv("PAXENGINE_KERNEL_ATTN_DECODE_TUNING", "warps=2")
    with pytest.raises(ValueError, match="bad item 'warps=2'"):
        decode_tuning_overrides()
    monkeypatch.delenv("PAXENGINE_KERNEL_ATTN_DECODE_TUNING")
    assert decode_tuning_overrides() == {} and "num_warps" not in attend(16, 16)
