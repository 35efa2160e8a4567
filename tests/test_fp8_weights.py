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
from paxengine.models import quant
from paxengine.models.quant import (
    FP8_MAX,
    GEMV_MAX_ROWS,
    W8A8_MIN_ROWS,
    Fp8Weight,
    concat_out,
    dequantize,
    fp8_path,
    fp8_units,
    linear,
    matmul_fp8,
    quantize_fp8,
    quantize_rows,
    weight_dtype,
)
from paxengine.reference import reference_generate, reference_logits


@pytest.mark.parametrize("shape", [(64, 48), (3, 40, 24), (1, 7, 5)])
def test_quantize_error_is_e4m3_rounding_per_channel(shape):
    key = jax.random.PRNGKey(sum(shape))
    # channels of very different magnitudes: a per-tensor scale would flush the small ones
    w = jax.random.normal(key, shape) * jnp.logspace(-3, 2, shape[-1])
    q = quantize_fp8(w)
    lead, (n_in, n_out) = shape[:-2], shape[-2:]
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == (*lead, n_out, n_in)
    assert q.scales.shape == (*lead, n_out) and q.shape == shape
    dq, wn = np.asarray(dequantize(q)), np.asarray(w)
    scales = np.asarray(q.scales)[..., None, :]
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
    joined = concat_out([qa, qb])  # fusing weights that are already FP8 gives the same
    np.testing.assert_array_equal(joined.scales, fused.scales)
    np.testing.assert_array_equal(
        joined.values.astype(jnp.float32), fused.values.astype(jnp.float32)
    )


def test_w8a16_is_the_product_with_the_dequantized_weight():
    w = quantize_fp8(jax.random.normal(jax.random.PRNGKey(2), (32, 24)))
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 32))
    np.testing.assert_allclose(matmul_fp8(x, w, "w8a16"), x @ dequantize(w), rtol=1e-5, atol=1e-5)
    y = jax.jit(linear)(x.astype(jnp.bfloat16), w)  # a pytree through jit, bf16 activations
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), x @ dequantize(w), rtol=0.03, atol=0.05)


def test_w8a8_quantizes_each_token_on_its_own():
    w = quantize_fp8(jax.random.normal(jax.random.PRNGKey(4), (64, 40)))
    # tokens of very different magnitudes: a per-tensor activation scale would flush the small
    x = jax.random.normal(jax.random.PRNGKey(5), (7, 64)) * jnp.logspace(-3, 3, 7)[:, None]
    xq, xs = quantize_rows(x)
    assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (7,)
    np.testing.assert_allclose(np.abs(np.asarray(xq, np.float32)).max(-1), FP8_MAX)
    exact = np.asarray(x @ dequantize(w), np.float64)
    got = np.asarray(matmul_fp8(x, w, "w8a8"), np.float64)
    # each row's error is relative to that row: e4m3 rounding of the activations (2^-4 per
    # element, random signs) summed over 64 inputs
    rel = np.linalg.norm(got - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
    assert rel.max() < 0.05, rel
    zero = matmul_fp8(jnp.zeros((2, 64)), w, "w8a8")  # an all-zero row (padding) stays zero
    assert float(jnp.abs(zero).max()) == 0.0


def test_each_bucket_size_takes_the_measured_path():
    assert fp8_path(W8A8_MIN_ROWS, on_gpu=True) == "w8a8"
    assert fp8_path(W8A8_MIN_ROWS, on_gpu=False) == "w8a8"
    assert fp8_path(1, on_gpu=True) == "gemv" and fp8_path(GEMV_MAX_ROWS, on_gpu=True) == "gemv"
    assert fp8_path(GEMV_MAX_ROWS + 1, on_gpu=True) == "w8a16"  # XLA's upcast wins there
    assert fp8_path(W8A8_MIN_ROWS - 1, on_gpu=True) == "w8a16"
    assert fp8_path(1, on_gpu=False) == "w8a16"  # the Pallas GEMV is for GPUs
    # a GPU without FP8 units (an A100) upcasts every matmul; the CPU keeps the FP8 math
    assert {fp8_path(m, True, has_fp8_units=False) for m in (1, 16, 64, 512)} == {"w8a16"}
    assert not fp8_units()  # this CPU
    with pytest.raises(ValueError, match="unknown fp8 matmul path"):
        matmul_fp8(jnp.ones((1, 4)), quantize_fp8(jnp.ones((4, 4))), "w4a4")


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


@pytest.fixture
def pin_path(monkeypatch):
    """Every matmul of an Fp8Weight through one path, whatever its row count."""

    def pin(path: str):
        monkeypatch.setattr(quant, "fp8_path", lambda *args: path)
        jax.clear_caches()  # executables traced under another path must not be reused

    yield pin
    jax.clear_caches()


# w8a8_gemv: the W8A8 GEMV kernel (e4m3 rows, fp8 x fp8 dots; interpret mode) for every matmul
@pytest.mark.parametrize("path", ["w8a16", "w8a8", "w8a8_gemv"])
def test_smollm2_fp8_agrees_with_float32_teacher_forced(smollm, fp8_params, pin_path, path):
    pin_path(path)
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
        f"fp8 ({path}) vs float32 over {len(ids)} positions: top-1 agreement {agree:.3f}, "
        f"mean KL {kl:.4f}"
    )
    # measured: w8a16 0.925 / 0.016 on two CPUs; w8a8 0.913 / 0.024 and w8a8_gemv 0.896 / 0.028
    # on one (Intel), 0.896 / 0.027 and 0.913 / 0.025 on another (AMD EPYC, 2026-12-05). The
    # GEMV and the GEMMs quantize the same rows the same way (the kernel's tests hold each
    # product to f32 rounding); a last-bit difference (summation order, the CPU's vector width)
    # flips an e4m3 rounding of an activation now and then and 30 layers amplify it: the
    # embeddings nudged by 2^-22 move the W8A8 GEMMs' own top-1 on 5.8% of these positions
    # (logits 9.4%). So both W8A8 paths' bar is that spread below weight-only quantization's.
    bar = 0.9 if path == "w8a16" else 0.88
    assert agree >= bar and kl < 0.05
    assert weight_dtype(fp8_params) == "fp8_e4m3" and weight_dtype(smollm.params) == "float32"
    layer = fp8_params["layers"]
    assert isinstance(layer["w_down"], Fp8Weight) and not isinstance(layer["attn_norm"], Fp8Weight)


@pytest.fixture(scope="module")
def short_fp8(short_smollm):
    """Four of SmolLM2's layers (conftest.short_smollm) quantized to FP8, for the w8a16 engines
    against their oracle, token for token on the same weights: each layer runs the same
    matmuls. The comparisons within a margin (W8A8: e4m3 activations) and the teacher-forced bars
    stay on the whole model: four layers out of 30 are not its robustness to rounding."""
    from paxengine.models.quant import quantize_params

    m = short_smollm
    return m.source, m, quantize_params(dict(m.params, layers=dict(m.params["layers"])))


@pytest.fixture(scope="module")
def w8a16_oracle(short_fp8):
    """The dense oracle's greedy tokens on the FP8 weights, each prompt's computed once for the
    module (both w8a16 engines compare to it, under the same pinned path)."""
    _, m, fp8 = short_fp8
    memo = {}

    def want(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            memo[tuple(ids)] = reference_generate(fp8, m.config, ids, 8, m.eos_token_ids)
        return memo[tuple(ids)]

    return want


@pytest.mark.parametrize(
    "layer_loop,path",
    # gemv: the Pallas FP8 GEMV (interpret mode here) for every matmul, the down projection
    # with silu(gate) * up formed in the kernel (PAXENGINE_KERNEL_FP8_GLU=1; the unrolled
    # layout's fused w_gate_up)
    [("scan", "w8a16"), ("unroll", "w8a16"), ("unroll", "w8a8"), ("unroll", "gemv")],
)
def test_engine_with_fp8_weights_matches_its_oracle(
    smollm, fp8_params, short_fp8, w8a16_oracle, pin_path, layer_loop, path, monkeypatch
):
    model = None  # the embedded SmolLM2
    if path == "w8a16":  # token for token: four of its layers (short_fp8)
        model, smollm, fp8_params = short_fp8
    if path == "gemv":  # the kernel's gated-input option (off by default: slower on the H200)
        monkeypatch.setenv("PAXENGINE_KERNEL_FP8_GLU", "1")
    pin_path(path)  # the oracle's one dense forward and the engine's buckets: the same matmuls
    llm = LLM(
        model=model,
        quantization="fp8",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[16, 32],
        seq_buckets=[4],
        show_progress=False,
        layer_loop=layer_loop,
        attention_backend="reference",
        store_executables=False,  # the store's key does not know about the pinned path
    )
    assert llm.engine.info.weight_dtype == "fp8_e4m3"
    prompts = PROMPTS[:3] + ["word " * 40]  # the last one is prefilled in two chunks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids, got = smollm.tokenizer.encode(p), o.outputs[0].token_ids
        if path == "w8a16":
            assert got == w8a16_oracle(ids), p
            continue
        # Per-token activation quantization turns the last-bit differences between the paged
        # engine and the dense oracle into e4m3 steps now and then (gemv: the kernel's exp in
        # silu against XLA's), enough to flip a near tie:
        # each greedy token must be the oracle's top token on the engine's own prefix, or within
        # a small margin of it.
        logits = reference_logits(fp8_params, smollm.config, ids + got)
        steps = logits[len(ids) - 1 : len(ids) - 1 + len(got)]
        gaps = steps.max(-1) - steps[np.arange(len(got)), got]
        assert gaps.max() < 0.25, (p, gaps)
        assert np.mean(gaps == 0) >= 0.75, (p, gaps)


def test_w8a8_gemv_rows_come_from_their_switch(monkeypatch):
    """PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=n: GPU steps of <= n rows take the W8A8 GEMV
    (quantized rows from the norm kernel included); 0, the default, leaves the measured paths."""
    monkeypatch.setenv("PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS", "16")
    assert fp8_path(1, on_gpu=True) == "w8a8_gemv" and fp8_path(16, on_gpu=True) == "w8a8_gemv"
    assert fp8_path(17, on_gpu=True) == "w8a16" and fp8_path(W8A8_MIN_ROWS, True) == "w8a8"
    assert fp8_path(1, on_gpu=False) == "w8a16"  # a GPU kernel
    assert fp8_path(1, True, has_fp8_units=False) == "w8a16"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(quant, "fp8_units", lambda *a: True)
    w = quantize_fp8(jnp.ones((8, 8)))
    assert quant.takes_fp8_rows(8, [w]) and not quant.takes_fp8_rows(17, [w])
    monkeypatch.delenv("PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS")
    assert fp8_path(1, on_gpu=True) == "gemv" and not quant.takes_fp8_rows(8, [w])


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="'int4' is not supported"):
        LLM(quantization="int4", show_progress=False)


def test_fp8_weights_and_kv_survive_preemption_and_prefix_hits(short_smollm):
    """FP8 weights and KV with a pool too small for the batch (preemption and recompute) and
    prefix caching on: the same greedy tokens as a roomy engine, and cached prefixes reused."""
    kw = dict(
        model=short_smollm.source,
        quantization="fp8",
        kv_cache_dtype="fp8",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[16, 32],
        seq_buckets=[4],
        show_progress=False,
        attention_backend="xla",
        block_size=16,  # (fp8 KV defaults to 64: the block arithmetic below is in 16s)
    )
    # a shared preamble of one full 16-token block: the second run hits the cache
    preamble = "You are a helpful assistant. Answer in one short sentence and be precise. "
    prompts = [preamble + p for p in PROMPTS[:4]]  # 20 to 30 tokens: 2 blocks each
    # 16 tokens: 3 blocks each at the end, 12 > 9, so the tight pool preempts (asserted below);
    # every step upcasts the FP8 weights on this CPU, so steps are what this test costs
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(num_kv_blocks=24, **kw)  # 12 blocks at the end: no preemption
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(num_kv_blocks=9, **kw)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    hits = roomy.engine.kv.prefix_hits  # (the tight pool has evicted them by now)
    # greedy: the first tokens again, over the cached prefix (4 steps, not 16)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    again = [o.outputs[0].token_ids for o in roomy.generate(prompts[:1], short, use_tqdm=False)]
    assert again == [want[0][:4]] and roomy.engine.kv.prefix_hits > hits
