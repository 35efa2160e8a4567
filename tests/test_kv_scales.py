"""Scaled FP8 KV (issue #17): per-layer k/v scales folded into attention, calibrated on the real
SmolLM2, and the engine choosing, applying and reporting them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8_weights import TEXT

from paxengine import LLM, SamplingParams
from paxengine.kv_scales import calibrate, calibration_tokens
from paxengine.models.llama import compute_logits, forward_hidden, scaled_attend
from paxengine.reference import contiguous_attend


def test_scales_fold_into_attention_exactly():
    """Over a full-precision cache the scaled path is the same attention: the scales cancel."""
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    T, Hq, Hkv, D = 12, 6, 2, 16
    q = jax.random.normal(key[0], (T, Hq, D))
    k = 30 * jax.random.normal(key[1], (T, Hkv, D))
    v = 0.01 * jax.random.normal(key[2], (T, Hkv, D))
    pos = jnp.arange(T, dtype=jnp.int32)
    attend = contiguous_attend(pos, None)
    cache = (jnp.zeros((1, T, Hkv, D)), jnp.zeros((1, T, Hkv, D)))
    want, _ = attend(q, k, v, cache, 0)
    got, (kc, _) = scaled_attend(attend, q, k, v, cache, 0, jnp.asarray([0.25, 4e-5]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kc[0], k / 0.25, rtol=1e-6)  # the cache holds k / k_scale


def _teacher_forced(params, cfg, ids, cache_dtype):
    """Logits of every position with K/V stored in `cache_dtype` (the oracle's contiguous
    cache), so the FP8 rounding of K and V is what moves them."""
    tokens = jnp.asarray(ids, jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)
    shape = (cfg.num_layers, len(ids), cfg.num_kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype))
    hidden, _ = forward_hidden(params, cfg, tokens, pos, cache, contiguous_attend(pos, None))
    return np.asarray(compute_logits(params, cfg, hidden))


def _kl(ref, got):
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(got)
    return float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))


def _with_scales(params, scales):
    return dict(params, layers=dict(params["layers"], kv_scale=jnp.asarray(scales)))


def test_calibrated_scales_keep_fp8_kv_accurate_where_unit_scales_fail(smollm):
    """SmolLM2's K and V sit inside e4m3's range, so unit scales do about as well as calibrated
    ones there. The same function with K x 64 (q / 64) and V / 1000 (o x 1000), as other models'
    activations are, loses everything under unit scales (K past 448 saturates, V sinks below
    the subnormals); calibrated scales bring it back to the original's error."""
    cfg, params = smollm.config, smollm.params
    ids = smollm.tokenizer.encode(TEXT)  # not the calibration text
    full = _teacher_forced(params, cfg, ids, jnp.float32)
    w = dict(params["layers"])
    rescaled = dict(
        params, layers=dict(w, wq=w["wq"] / 64, wk=w["wk"] * 64, wv=w["wv"] / 1e3, wo=w["wo"] * 1e3)
    )
    assert _kl(full, _teacher_forced(rescaled, cfg, ids, jnp.float32)) < 1e-5  # the same model
    calib = calibration_tokens(smollm.tokenizer, cfg.vocab_size)
    kl = {}
    for name, p in (("smollm2", params), ("rescaled", rescaled)):
        scales = calibrate(p, cfg, calib)
        assert scales.shape == (cfg.num_layers, 2) and scales.dtype == np.float32
        assert np.all(scales > 0) and np.all(np.isfinite(scales))
        for mode, s in (("unit", np.ones_like(scales)), ("calibrated", scales)):
            got = _teacher_forced(_with_scales(p, s), cfg, ids, jnp.float8_e4m3fn)
            top1 = float(np.mean(full.argmax(-1) == got.argmax(-1)))
            kl[name, mode] = _kl(full, got)
            print(f"fp8 KV, {name}, {mode} scales: KL {kl[name, mode]:.4f}, top-1 {top1:.3f}")
            if mode == "calibrated":
                assert kl[name, mode] < 0.02 and top1 >= 0.9  # measured 0.0055 / 0.0058
    assert kl["smollm2", "unit"] < 0.02  # measured 0.0057
    assert kl["rescaled", "unit"] > 1.0  # measured 4.27


def _llm(**kw):
    # a small pool: XLA emulates fp8 on CPUs, so every byte of cache costs time here (an fp8
    # cache's 64-token pages: 12 blocks hold 768 tokens, 48 x 16 tokens otherwise)
    return LLM(
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[16, 32],
        seq_buckets=[4],
        num_kv_blocks=12 if kw.get("kv_cache_dtype") == "fp8" else 48,
        show_progress=False,
        **kw,
    )


@pytest.mark.parametrize(
    # unroll: the fused projection's 16-token buckets write K/V by the RoPE + KV-write kernel
    "backend,layer_loop",
    [("xla", "scan"), ("pallas", "scan"), ("pallas", "unroll")],
)
def test_engine_calibrates_fp8_kv_and_matches_the_oracle_on_the_same_scales(
    short_smollm, backend, layer_loop
):
    """The engine calibrates its layers' scales and runs its fp8 cache as the oracle does with
    them: four of SmolLM2's real layers (conftest.short_smollm; each layer calibrates and reads
    its pages alike), where the 30 cost the Pallas kernels' interpret mode ~7x."""
    smollm = short_smollm
    llm = _llm(
        model=smollm.source, kv_cache_dtype="fp8", attention_backend=backend, layer_loop=layer_loop
    )
    info = llm.engine.info
    assert info.kv_cache_dtype == "fp8_e4m3" and info.kv_cache_scales == "calibrated"
    scales = llm.engine.kv_scales
    cfg = smollm.config
    assert scales.shape == (cfg.num_layers, 2) and not np.allclose(scales, 1.0)
    prompts = ["The capital of France is", "def fib(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    params = _with_scales(smollm.params, scales)
    for p, o in zip(prompts, outs):
        ids, got = smollm.tokenizer.encode(p), o.outputs[0].token_ids
        # the oracle with an fp8 cache and the same scales: the engine's greedy picks are its
        # top tokens (a near tie may flip on last-bit differences between the two paths)
        logits = _teacher_forced(params, cfg, ids + got, jnp.float8_e4m3fn)
        steps = logits[len(ids) - 1 : len(ids) - 1 + len(got)]
        gaps = steps.max(-1) - steps[np.arange(len(got)), got]
        assert gaps.max() < 0.25 and np.mean(gaps == 0) >= 0.75, (p, gaps)


def test_unit_scales_and_bad_modes():
    llm = _llm(kv_cache_dtype="fp8", attention_backend="xla", kv_cache_scales="unit")
    assert llm.engine.info.kv_cache_scales == "unit"
    np.testing.assert_array_equal(llm.engine.kv_scales, 1.0)
    with pytest.raises(ValueError, match="kv_cache_scales must be one of"):
        _llm(kv_cache_dtype="fp8", kv_cache_scales="magic")
    full = _llm()  # not an fp8 cache: no scales at all
    assert full.engine.kv_scales is None and full.engine.info.kv_cache_scales == "none"


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas"])
def test_paged_attention_applies_the_scales_in_its_kernels(backend):
    """The engine's attend takes an FP8 cache's scales into the write and attention kernels
    (`takes_kv_scale`) instead of folding them into q, k, v and o: the same attention and the
    same stored pages as the folded path, for every backend."""
    from kernels_pallas import AttentionMetadata
    from paxengine.attention import PagedAttend
    from paxengine.models.config import ModelConfig

    cfg = ModelConfig("llama", 32, 64, 128, 1, num_heads=4, num_kv_heads=2, head_dim=16)
    lens, bs, nb = [5, 3], 4, 8
    T = sum(lens)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray([4, 5, 6, 7, 8, 20, 21, 22], jnp.int32),  # blocks 1, 2 and 5
        block_tables=jnp.asarray([[1, 2], [5, 0]], jnp.int32),
        seq_lens=jnp.asarray(lens, jnp.int32),
        query_start_loc=jnp.asarray([0, 5, 8], jnp.int32),
        num_seqs=jnp.asarray([2], jnp.int32),
    )
    key = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(key[0], (T, 4, 16))
    k = 40 * jax.random.normal(key[1], (T, 2, 16))  # past e4m3's 448 unless scaled
    v = 0.003 * jax.random.normal(key[2], (T, 2, 16))  # near its subnormals unless scaled
    cache = tuple(jnp.zeros((1, 2, nb, bs, 16), jnp.float8_e4m3fn) for _ in range(2))
    scale = jnp.asarray([0.5, 1e-4], jnp.float32)
    attend = PagedAttend(md, backend, cfg)
    assert attend.takes_kv_scale
    got, (kc, vc) = attend(q, k, v, cache, 0, kv_scale=scale)
    folded, (kc2, vc2) = scaled_attend(lambda *a: attend(*a), q, k, v, cache, 0, scale)
    np.testing.assert_allclose(got, folded, rtol=2e-3, atol=1e-6)
    for a, b in ((kc, kc2), (vc, vc2)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # and the scales matter: unscaled, K saturates and the output moves
    plain, _ = attend(q, k, v, cache, 0)
    assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 1e-3
