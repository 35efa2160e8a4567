"""Pallas ragged paged attention (interpret mode) against the jnp oracle, on CPU."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ref_ragged_paged_attention
from kernels_pallas.testing import make_batch, rel_err

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-3}

# name: (seqs [(q_len, kv_len)], T pad, S pad, kwargs for make_batch, kwargs for the kernel)
CASES = {
    "decode_g4": ([(1, 37), (1, 16), (1, 70), (1, 1)], 8, 6, dict(num_heads=8, num_kv_heads=2), {}),
    "prefill_g1": (
        [(19, 19), (16, 16), (5, 5)],
        48,
        4,
        dict(num_heads=2, num_kv_heads=2, block_size=16),
        {},
    ),
    "chunked_g8_bf16": (
        [(24, 60), (9, 41)],
        40,
        3,
        dict(num_heads=16, num_kv_heads=2, dtype=jnp.bfloat16, head_dim=128, block_size=32),
        {},
    ),
    "mixed_g4_split": (
        [(1, 50), (13, 40), (1, 7), (30, 30), (1, 99)],
        64,
        8,
        dict(num_heads=8, num_kv_heads=2),
        dict(k_splits=2, block_k=32),
    ),
    "mixed_bf16_g4_bs64": (
        [(1, 130), (20, 85), (1, 3)],
        32,
        4,
        dict(num_heads=8, num_kv_heads=2, dtype=jnp.bfloat16, block_size=64),
        {},
    ),
    "g3_nonpow2": ([(1, 33), (7, 20)], 16, 3, dict(num_heads=6, num_kv_heads=2), {}),
}


def _run(rng, seqs, T, S, bkw, kkw, **attn):
    b = make_batch(rng, seqs, T=T, S=S, **bkw)
    layer = jnp.int32(1)
    out = ragged_paged_attention(
        b["q"], b["k_cache"], b["v_cache"], layer, b["md"], interpret=True, **attn, **kkw
    )
    ref = ref_ragged_paged_attention(
        b["q"].astype(jnp.float32), b["k_cache"], b["v_cache"], layer, b["md"], **attn
    )
    assert out.shape == b["q"].shape and out.dtype == b["q"].dtype
    n = b["num_tokens"]
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32)))), "NaN/inf in output"
    assert np.all(np.asarray(out[n:].astype(jnp.float32)) == 0), "padding rows not zero"
    return rel_err(out, ref, n), b


@pytest.mark.parametrize("name", list(CASES))
def test_vs_oracle(name):
    seqs, T, S, bkw, kkw = CASES[name]
    rng = np.random.default_rng()
    err, b = _run(rng, seqs, T, S, bkw, kkw, sm_scale=bkw.get("head_dim", 64) ** -0.5)
    assert err < TOL[bkw.get("dtype", jnp.float32)], err


def test_sliding_window_soft_cap():
    rng = np.random.default_rng()
    seqs = [(1, 70), (17, 45), (3, 3)]
    err, _ = _run(
        rng,
        seqs,
        24,
        4,
        dict(num_heads=8, num_kv_heads=2),
        dict(k_splits=2),
        sm_scale=0.3,
        sliding_window=13,
        soft_cap=5.0,
    )
    assert err < 1e-5, err


@pytest.mark.parametrize(
    "seqs,T,S,bs,D",
    [
        ([(1, 40), (9, 33)], 16, 3, 16, 64),  # a prefill bucket
        # a decode bucket: fp8 pages' own decode tuning (one PV dot, mask-free interior blocks);
        # contexts end inside, at and past a 128-position KV block
        ([(1, 300), (1, 128), (1, 7), (1, 257)], 4, 4, 16, 64),
        # 64-token pages, V stored [D, bs] (layout.v_transposed), a page per KV block: decode
        # (split-K), a mixed bucket (its decode rows in a launch of their own) and prefill chunks
        ([(1, 300), (1, 128), (1, 7), (1, 257)], 4, 4, 64, 128),
        ([(1, 40), (9, 33), (1, 64), (1, 129)], 16, 4, 64, 64),
        ([(70, 200), (1, 65), (33, 33), (17, 64)], 128, 5, 64, 128),
    ],
)
def test_fp8_kv(seqs, T, S, bs, D):
    rng = np.random.default_rng()
    b = make_batch(
        rng,
        seqs,
        T=T,
        S=S,
        num_heads=8,
        num_kv_heads=2,
        head_dim=D,
        block_size=bs,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e4m3fn,
    )
    assert b["v_cache"].shape[3:] == ((D, bs) if bs == 64 else (bs, D))
    kw = dict(sm_scale=D**-0.5, k_scale=0.5, v_scale=2.0)
    out = ragged_paged_attention(
        b["q"], b["k_cache"], b["v_cache"], 0, b["md"], interpret=True, **kw
    )
    ref = ref_ragged_paged_attention(
        b["q"].astype(jnp.float32), b["k_cache"], b["v_cache"], 0, b["md"], **kw
    )
    assert rel_err(out, ref, b["num_tokens"]) < 2e-3
    if bs == 64:  # the oracle reads the [D, bs] pages as the kernel does: check it on [bs, D]
        k, v = b["k_cache"], b["v_cache"]
        v16 = v.swapaxes(-1, -2).astype(jnp.bfloat16)  # a 16-bit cache keeps [bs, D] pages
        ref16 = ref_ragged_paged_attention(
            b["q"].astype(jnp.float32), k.astype(jnp.bfloat16), v16, 0, b["md"], **kw
        )
        assert rel_err(ref, ref16, b["num_tokens"]) < 1e-5


def test_oracle_matches_dense_attention():
    """The oracle itself against plain causal attention on one contiguous sequence."""
    rng = np.random.default_rng()
    b = make_batch(rng, [(11, 20)], num_heads=4, num_kv_heads=1, block_size=16)
    L, Hkv, NB, bs, D = b["k_cache"].shape
    md = b["md"]
    pages = np.asarray(md.block_tables[0])
    k = np.asarray(b["k_cache"][0, 0])[pages].reshape(-1, D)[:20]
    v = np.asarray(b["v_cache"][0, 0])[pages].reshape(-1, D)[:20]
    q = np.asarray(b["q"])[:11]  # [11, 4, D]
    logits = np.einsum("thd,kd->thk", q, k) * 0.2
    pos = np.arange(9, 20)
    logits = np.where(np.arange(20)[None, None] <= pos[:, None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("thk,kd->thd", p / p.sum(-1, keepdims=True), v)
    got = ref_ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], 0, md, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(got)[:11], want, rtol=1e-4, atol=1e-5)


# Tuning variants (split_mask / reverse_tiles / pv_fp16, small blocks so that tiles have
# unmasked interior blocks, masked front blocks under a window, and split-K ranges that cut
# through both).
VARIANTS = {
    "interior_bk16": (dict(block_k=16, block_q=2), {}),
    "no_split_mask": (dict(block_k=16, split_mask=False, reverse_tiles=False), {}),
    "window_split_k": (dict(block_k=16, k_splits=3), dict(sliding_window=37, soft_cap=8.0)),
    "window_bq8": (dict(block_k=32, block_q=8), dict(sliding_window=20)),
    # mixed bucket in two launches: decode tiles (q_len <= 4 here, incl. a 3-token sequence),
    # then the prefill tiles + padding tiles writing into the first launch's output
    "mixed_split": (dict(mixed_split=True, block_k=16), {}),
    "mixed_split_window": (
        dict(mixed_split=True, block_q=4, split_mask=False),
        dict(sliding_window=30, soft_cap=6.0),
    ),
    # the long-prefill default's shape of tile: 256 rows (64 tokens x 4 heads), fp16 PV
    "big_tiles_fp16pv": (
        dict(block_q=64, block_k=16, num_warps=8, num_stages=3, pv_fp16=True, mixed_split=True),
        dict(sliding_window=40),
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tuning_variants(name):
    kkw, attn = VARIANTS[name]
    rng = np.random.default_rng()
    seqs = [(1, 90), (33, 80), (1, 16), (17, 17), (3, 47), (1, 5)]
    err, _ = _run(rng, seqs, 64, 7, dict(num_heads=8, num_kv_heads=2), kkw, sm_scale=0.125, **attn)
    assert err < 1e-5, err


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (16, 2)])
def test_big_prefill_tiles_gqa(heads):
    """The long-prefill default's 256-row tiles (256 / G_pad tokens each) at GQA 1, 3 and 8, with
    the decode rows of the mixed bucket in their own launch, in bf16 with the fp16 PV product."""
    hq, hkv = heads
    g_pad = 1 << (hq // hkv - 1).bit_length()
    rng = np.random.default_rng()
    seqs = [(1, 90), (70, 130), (1, 20), (40, 40)]
    err, _ = _run(
        rng,
        seqs,
        128,
        8,
        dict(num_heads=hq, num_kv_heads=hkv, head_dim=64, dtype=jnp.bfloat16),
        dict(
            block_q=256 // g_pad,
            block_k=32,
            num_warps=8,
            num_stages=3,
            pv_fp16=True,
            mixed_split=True,
        ),
        sm_scale=0.125,
    )
    assert err < 2e-3, err


@pytest.mark.parametrize(
    "kv_dtype,v_dtype", [(None, jnp.bfloat16), (None, None), (jnp.float8_e4m3fn, None)]
)
def test_pv_fp16_bf16(kv_dtype, v_dtype):
    """bf16 with the PV product in fp16 (one dot) meets the bf16 bar, like pv_split: V converted
    (and clamped) in the kernel from bf16 or fp8 pages, or read as the engine's fp16 pages."""
    rng = np.random.default_rng()
    seqs = [(40, 200), (1, 150), (60, 60)]
    b = make_batch(
        rng,
        seqs,
        T=112,
        S=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=jnp.bfloat16,
        kv_dtype=kv_dtype,
        v_dtype=v_dtype,
    )
    kw = dict(sm_scale=128**-0.5)
    if kv_dtype is not None:
        kw.update(k_scale=0.5, v_scale=2.0)
    out = ragged_paged_attention(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        1,
        b["md"],
        interpret=True,
        pv_fp16=True,
        block_k=32,
        **kw,
    )
    ref = ref_ragged_paged_attention(
        b["q"].astype(jnp.float32), b["k_cache"], b["v_cache"], 1, b["md"], **kw
    )
    n = b["num_tokens"]
    assert np.all(np.asarray(out[n:].astype(jnp.float32)) == 0)
    assert rel_err(out, ref, n) < 2e-3


@pytest.mark.parametrize(
    "v_dtype,kw",
    [
        (jnp.float16, {}),  # the engine's layout: fp16 V pages, bf16 K
        (jnp.float16, dict(pv_split=False)),  # one fp16 PV dot, no conversion of V
        (jnp.bfloat16, {}),  # bf16 V pages: P as bf16 hi + lo
    ],
)
def test_value_page_dtypes(v_dtype, kw):
    """bf16 queries and K pages with fp16 or bf16 V pages meet the bf16 bar, decode and prefill
    rows in one call, NaN in every slot no sequence owns."""
    rng = np.random.default_rng()
    seqs = [(1, 130), (45, 100), (1, 17), (30, 30)]
    b = make_batch(
        rng,
        seqs,
        T=96,
        S=5,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        dtype=jnp.bfloat16,
        v_dtype=v_dtype,
    )
    assert b["v_cache"].dtype == v_dtype
    out = ragged_paged_attention(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        1,
        b["md"],
        interpret=True,
        sm_scale=128**-0.5,
        block_k=32,
        **kw,
    )
    ref = ref_ragged_paged_attention(
        b["q"], b["k_cache"], b["v_cache"], 1, b["md"], sm_scale=128**-0.5
    )
    n = b["num_tokens"]
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
    assert np.all(np.asarray(out[n:].astype(jnp.float32)) == 0)
    assert rel_err(out, ref, n) < 2e-3


@pytest.mark.parametrize("kw", [{}, dict(pv_split=False), dict(pv_fp16=True, k_splits=1)])
def test_tiny_probabilities_are_not_flushed(kw):
    """Keys 18 nats under an attention sink (p ~ 2^-26, below fp16's subnormals) still count in
    the fp16 PV product: decode and prefill rows, fp16 model."""
    from kernels_pallas.testing import sink_batch

    b = sink_batch([(1, 2000), (40, 1500)], T=48, S=3)
    out = ragged_paged_attention(
        b["q"], b["k_cache"], b["v_cache"], 1, b["md"], interpret=True, sm_scale=0.125, **kw
    )
    ref = ref_ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], 1, b["md"], sm_scale=0.125)
    n = b["num_tokens"]
    assert float(jnp.min(ref[:n].astype(jnp.float32))) > 5e-6  # the keys' share is there
    assert rel_err(out, ref, n) < 2e-3


def test_padding_tiles_cover_all_tokens():
    """Every output row is written by the kernel: padding tokens (past the live sequences,
    including a bucket with num_seqs = 0) come out as exact zeros, with NaN in the q padding."""
    from kernels_pallas.tiles import tile_count, tile_metadata

    rng = np.random.default_rng()
    for seqs, T, S, bq in [
        ([(5, 9), (1, 3)], 40, 6, 4),
        ([(3, 3)] * 4, 12, 4, 8),
        ([(1, 4)], 7, 3, 1),
    ]:
        b = make_batch(rng, seqs, T=T, S=S)
        n_tiles = tile_count(T, S, bq)
        meta = np.asarray(tile_metadata(b["md"], T, bq, n_tiles, pad_tiles=True))
        covered = np.zeros(T, int)
        for _, q0, ql, *_ in meta:
            covered[q0 : q0 + ql] += 1
        assert np.all(covered == 1), (seqs, T, covered)
        q = b["q"].at[b["num_tokens"] :].set(jnp.nan)
        out = ragged_paged_attention(
            q, b["k_cache"], b["v_cache"], 0, b["md"], sm_scale=0.125, interpret=True, block_q=bq
        )
        assert np.all(np.asarray(out[b["num_tokens"] :]) == 0)
    md = b["md"]
    md0 = type(md)(
        md.slot_mapping, md.block_tables, md.seq_lens * 0, md.query_start_loc * 0, md.num_seqs * 0
    )
    out = ragged_paged_attention(
        b["q"], b["k_cache"], b["v_cache"], 0, md0, sm_scale=0.125, interpret=True, k_splits=2
    )
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("rows", [None, 1])
def test_merge_splits_is_softmax_over_all_keys(rows):
    """The split-K merge kernel gives softmax(s) @ v over every key, whatever the split
    boundaries: empty splits, maxima far apart (2^-150 underflows to 0 in fp32), rows with no keys
    at all (zeros). Both tilings: interpret mode's (whole rows) and the GPU's (a program per row
    and 32 columns)."""
    from kernels_pallas.attention import merge_splits
    from kernels_pallas.softmax import MASK_VALUE

    rng = np.random.default_rng(3)
    R, N, D = 6, 40, 64
    s = rng.normal(size=(R, N)).astype(np.float32) * 4
    s[1, 30:] += 150.0  # split 3 of row 1 dominates by 2^150
    v = rng.normal(size=(N, D)).astype(np.float32)
    bounds = [0, 0, 17, 30, 40, 40]  # splits 0 and 4 are empty
    acc, m, l = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            acc.append(np.zeros((R, D), np.float32))
            m.append(np.full(R, MASK_VALUE, np.float32))
            l.append(np.zeros(R, np.float32))
            continue
        mk = s[:, a:b].max(axis=1)
        p = np.exp2(s[:, a:b] - mk[:, None])
        acc.append(p @ v[a:b])
        m.append(mk)
        l.append(p.sum(axis=1))
    acc, m, l = (np.stack(x) for x in (acc, m, l))
    acc[:, 5], m[:, 5], l[:, 5] = 0.0, MASK_VALUE, 0.0  # row 5: no keys in any split
    out = np.asarray(
        merge_splits(
            jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), jnp.float32, interpret=True, rows=rows
        )
    )
    p = np.exp2(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ v
    np.testing.assert_allclose(out[:5], want[:5], rtol=2e-5, atol=2e-6)
    assert np.all(out[5] == 0)


def test_fp8_decode_takes_two_warps_from_many_programs():
    """fp8 64-token pages ([D, bs] V): decode buckets of >= FP8_DECODE_TWO_WARP_PROGRAMS
    (KV head, sequence) programs take 2 warps (measured faster at B=300 on the H200, slower at
    B=256); smaller ones, 16-bit pages and prefill buckets keep 4."""
    from kernels_pallas import tuning as tu

    def warps(T, S, fp8=True):
        return tu.default_tuning(
            T, S, 32, 8, 128, 64 if fp8 else 16, kv_itemsize=1 if fp8 else 2, v_t=fp8
        ).num_warps

    n = tu.FP8_DECODE_TWO_WARP_PROGRAMS // 8
    assert warps(n, n) == 2 and warps(512, 512) == 2
    assert warps(n - 1, n - 1) == 4 and warps(256, 256) == 4
    assert warps(512, 512, fp8=False) == 4
    assert warps(4096, 512) != 2  # a prefill bucket: its own tuning
    # a mixed bucket's decode launch takes the decode defaults of its sequence slots
    main, dec = tu.plan_launches(2048, 512, 32, 8, 128, 64, kv_itemsize=1, v_t=True)
    assert dec is not None and dec.num_warps == 2


def test_head_dim_256_keeps_the_64_row_prefill_tiles():
    """Long prefills take 256-row tiles at head_dim <= 128; at Qwen3.5's 256 those asked for
    262,400 bytes of shared memory (the H100 has 232,448) and the engine did not start, so
    head_dim 256 keeps the 64-row tiles at every bucket size."""
    from kernels_pallas import tuning as tu

    for T in (2048, 4096, 8192):
        big = tu.default_tuning(T, 8, 16, 4, 128, 16)
        qwen35 = tu.default_tuning(T, 8, 16, 4, 256, 16)
        assert qwen35.block_q * 4 == 64 and qwen35.num_stages == 2
        if T >= 4096:  # (Hkv x tiles >= the SMs: where the big tiles start at head_dim 128)
            assert big.block_q * 4 == 256
