"""FP8 weights (issue #17, the correctness path): e4m3 projections with per-output-channel
scales against their oracle, and the real SmolLM2 quantized online: teacher-forced agreement
with the float32 model, and the engine's greedy tokens equal to the oracle's on the same
quantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from prompts import PROMPTS

from paxengine import LLM, SamplingParams
from paxengine.models.quant import (
    FP8_MAX,
    Fp8Weight,
    dequantize,
    linear,
    quantize_fp8,
    quantize_params,
    weight_dtype,
)
from paxengine.reference import reference_generate, reference_logits


@pytest.mark.parametrize("shape", [(64, 48), (3, 40, 24), (1, 7, 5)])
def test_quantize_error_is_e4m3_rounding_per_channel(shape):
    key = jax.random.PRNGKey(sum(shape))
    # channels of very different magnitudes: a per-tensor scale would flush the small ones
    w = jax.random.normal(key, shape) * jnp.logspace(-3, 2, shape[-1])
    q = quantize_fp8(w)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scales.shape == shape[:-2] + (1, shape[-1])
    dq, wn = np.asarray(dequantize(q)), np.asarray(w)
    scales = np.asarray(q.scales)
    # 3 mantissa bits: relative error <= 2^-4 for normal values, <= scale * 2^-9 below them
    bound = np.abs(wn) * 2.0**-4 + scales * 2.0**-9
    assert np.all(np.abs(dq - wn) <= bound * (1 + 1e-6))
    # each channel's largest |w| maps to 448 and comes back
    np.testing.assert_allclose(np.abs(dq).max(axis=-2), np.abs(wn).max(axis=-2), rtol=1e-6)
    assert float(jnp.max(jnp.abs(q.values.astype(jnp.float32)))) == FP8_MAX


def test_zero_channel_and_fused_slices_keep_their_scales():
    a = jax.random.normal(jax.random.PRNGKey(0), (16, 8)).at[:, 3].set(0.0)
    b = 100.0 * jax.random.normal(jax.random.PRNGKey(1), (16, 4))
    qa, qb = quantize_fp8(a), quantize_fp8(b)
    assert float(jnp.abs(dequantize(qa)[:, 3]).max()) == 0.0
    fused = quantize_fp8(jnp.concatenate([a, b], axis=-1))  # as wqkv / w_gate_up are
    np.testing.assert_array_equal(fused.scales, jnp.concatenate([qa.scales, qb.scales], -1))


def test_linear_is_the_product_with_the_dequantized_weight():
    w = quantize_fp8(jax.random.normal(jax.random.PRNGKey(2), (32, 24)))
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 32))
    np.testing.assert_allclose(linear(x, w), x @ dequantize(w), rtol=1e-5, atol=1e-5)
    y = jax.jit(linear)(x.astype(jnp.bfloat16), w)  # a pytree through jit, bf16 activations
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), x @ dequantize(w), rtol=0.03, atol=0.05)


# Natural text (prose and code) for the teacher-forced comparison: 173 tokens.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press adapted from those used "
    "to make wine. Within fifty years, presses were at work in more than two hundred cities across "
    "Europe, and the price of books fell so far that ordinary merchants could afford them. "
    "Scholars argue about how quickly ideas spread as a result, but most agree that the press "
    "changed how people learned to read, how governments kept records, and how scientists shared "
    "their results. Today we take printed text for granted, yet each page still depends on the "
    "same simple idea: arrange the letters once, and copy them many times.\n\ndef fibonacci(n):\n"
    "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)


@pytest.fixture(scope="module")
def fp8_params(smollm):
    return quantize_params(dict(smollm.params, layers=dict(smollm.params["layers"])))


def test_smollm2_fp8_agrees_with_float32_teacher_forced(smollm, fp8_params):
    ids = smollm.tokenizer.encode(TEXT)
    ref = reference_logits(smollm.params, smollm.config, ids)
    got = reference_logits(fp8_params, smollm.config, ids)
    agree = float(np.mean(ref.argmax(-1) == got.argmax(-1)))

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p_ref, p_got = log_softmax(ref), log_softmax(got)
    kl = float(np.mean(np.sum(np.exp(p_ref) * (p_ref - p_got), axis=-1)))
    print(
        f"fp8 vs float32 over {len(ids)} positions: top-1 agreement {agree:.3f}, mean KL {kl:.4f}"
    )
    assert agree >= 0.9 and kl < 0.05  # measured: 0.925 and 0.016
    assert weight_dtype(fp8_params) == "fp8_e4m3" and weight_dtype(smollm.params) == "float32"
    layer = fp8_params["layers"]
    assert isinstance(layer["w_down"], Fp8Weight) and not isinstance(layer["attn_norm"], Fp8Weight)


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_engine_with_fp8_weights_matches_its_oracle(smollm, fp8_params, layer_loop):
    llm = LLM(
        quantization="fp8",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[16, 32],
        seq_buckets=[4],
        show_progress=False,
        layer_loop=layer_loop,
        attention_backend="reference",
    )
    assert llm.engine.info.weight_dtype == "fp8_e4m3"
    prompts = PROMPTS[:3] + ["word " * 40]  # the last one is prefilled in two chunks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = smollm.tokenizer.encode(p)
        want = reference_generate(fp8_params, smollm.config, ids, 8, smollm.eos_token_ids)
        assert o.outputs[0].token_ids == want, p


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="'int4' is not supported"):
        LLM(quantization="int4", show_progress=False)
