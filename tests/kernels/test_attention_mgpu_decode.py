"""The Mosaic GPU decode kernel (attention_mgpu_decode.py) against the oracle, in GPU interpret
mode, and its CUDA lowering. Both need jax >= 0.11 (CI's second venv); the row-layout test runs
everywhere."""

from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import attention_mgpu, ragged_paged_attention
from kernels_pallas import attention_mgpu_decode as mgpu_decode
from kernels_pallas.attention_mgpu_decode import decode_block_q, rows_per_token
from kernels_pallas.testing import check_against_oracle, make_batch

needs_mosaic = pytest.mark.skipif(
    not attention_mgpu.available(), reason="Mosaic GPU interpret mode needs jax >= 0.11"
)


@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (8, 2), (12, 4), (4, 4), (32, 4), (6, 2)])
def test_row_windows_hold_every_head(Hq, Hkv):
    """Each token's G query rows fit in its W-row window, which starts on a multiple of 8."""
    G, W = Hq // Hkv, rows_per_token(Hq, Hkv)
    assert W % 8 == 0 and decode_block_q(Hq, Hkv) * W <= 64
    for token in range(5):
        for h in range(Hkv):
            row = token * Hq + h * G
            assert row % 8 + G <= W


def _check(seqs, T, S, *, dtype=jnp.bfloat16, v_dtype=None, **kw):
    shape = {k: kw.pop(k) for k in ("num_heads", "num_kv_heads", "head_dim", "block_size")}
    run = lambda q, kc, vc, md, sm_scale: ragged_paged_attention(
        q, kc, vc, jnp.int32(1), md, sm_scale=sm_scale, interpret=True, mosaic_decode=True, **kw
    )
    # The call must go through the Mosaic decode kernel (not fall back to Triton unnoticed).
    with mock.patch.object(
        mgpu_decode, "mosaic_decode_attention", wraps=mgpu_decode.mosaic_decode_attention
    ) as kernel:
        check_against_oracle(run, seqs, T, S, dtype=dtype, v_dtype=v_dtype, **shape)
    assert kernel.call_count == 1


@needs_mosaic
@pytest.mark.parametrize(
    "case",
    [
        # decodes (one 1 token long, one ending on a page edge) + a 2-token step; GQA 4, d 64;
        # split-K over 4 (most splits of these short sequences see no key)
        dict(
            seqs=[(1, 100), (1, 37), (2, 64), (1, 1)],
            T=7,
            S=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            k_splits=4,
        ),
        # GQA 3 (16-row windows), tokens of 3 in one tile, d 128, pages of 32, one compute
        # warpgroup, no split; bf16 V pages (the other cases: fp16 V under bf16, the engine's)
        dict(
            seqs=[(3, 500), (1, 70)],
            T=6,
            S=3,
            num_heads=12,
            num_kv_heads=4,
            head_dim=128,
            block_size=32,
            mosaic_block_k=128,
            mosaic_stages=2,
            mosaic_decode_wgs=1,
            k_splits=1,
            v_dtype=jnp.bfloat16,
        ),
        # persistent: 3 CTAs over uneven items (the slots and barrier phases carry over), MHA,
        # fp16, 4 stages
        dict(
            seqs=[(1, 300), (3, 130), (1, 20), (2, 900)],
            T=8,
            S=5,
            num_heads=4,
            num_kv_heads=4,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=4,
            mosaic_persistent=3,
            k_splits=1,
            dtype=jnp.float16,
        ),
        # a bucket mostly empty: 3 decodes in (16, 16), so most items have no queries at all
        # (they must still wait for the copy warpgroup, or the persistent loop could hang)
        dict(
            seqs=[(1, 200), (1, 90), (1, 33)],
            T=16,
            S=16,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            mosaic_persistent=2,
            k_splits=1,
        ),
        # persistent + split-K with two compute warpgroups: the fp32 partials leave through the
        # hand-over buffer
        dict(
            seqs=[(1, 700), (1, 260)],
            T=4,
            S=2,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            mosaic_persistent=5,
            k_splits=4,
        ),
    ],
)
def test_mosaic_decode_matches_oracle(case):
    _check(**case)


@needs_mosaic
def test_mosaic_decode_keeps_tiny_probabilities():
    """Keys 18 nats under an attention sink (p ~ 2^-26, flushed by a plain fp16 P) still count,
    through split-K and the two compute warpgroups' merge."""
    from kernels_pallas import ref_ragged_paged_attention
    from kernels_pallas.testing import rel_err, sink_batch

    b = sink_batch([(1, 2000), (1, 700)], T=2, S=2)
    with mock.patch.object(
        mgpu_decode, "mosaic_decode_attention", wraps=mgpu_decode.mosaic_decode_attention
    ) as kernel:
        out = ragged_paged_attention(
            b["q"],
            b["k_cache"],
            b["v_cache"],
            jnp.int32(1),
            b["md"],
            sm_scale=0.125,
            interpret=True,
            mosaic_decode=True,
            mosaic_block_k=128,
            mosaic_stages=2,
            k_splits=2,
        )
    assert kernel.call_count == 1
    ref = ref_ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], 1, b["md"], sm_scale=0.125)
    assert float(jnp.min(ref[:2].astype(jnp.float32))) > 5e-6
    assert rel_err(out, ref, 2) < 2e-3


@needs_mosaic
def test_mosaic_decode_launch_of_a_mixed_batch():
    # T > 2 S: the decode rows go through the Mosaic decode kernel first, the prefills through
    # the Triton kernel, which writes its rows into that output in place.
    seqs = [(1, 90), (1, 33), (150, 150), (1, 7), (70, 200)]
    _check(seqs, 240, 6, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, mixed_split=True)


@needs_mosaic
# A hang ends the run with a stack dump after 5 minutes, instead of stalling CI for 90.
@pytest.mark.timeout(300, method="thread")
def test_inconsistent_metadata_does_not_hang():
    """kv_len below the query count must not leave a warpgroup waiting for blocks nobody loads."""
    b = make_batch(
        np.random.default_rng(3),
        [(2, 300), (1, 40)],
        T=3,
        S=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=jnp.bfloat16,
        poison=False,
    )
    md = b["md"]
    md = type(md)(
        md.slot_mapping,
        md.block_tables,
        jnp.asarray([1, 0], jnp.int32),
        md.query_start_loc,
        md.num_seqs,
    )
    out = ragged_paged_attention(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        jnp.int32(0),
        md,
        sm_scale=0.125,
        interpret=True,
        mosaic_decode=True,
        mosaic_persistent=2,
    )
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


@needs_mosaic
@pytest.mark.parametrize(
    "cfg",
    [
        dict(T=64, S=64, P=128, mosaic_block_k=64, mosaic_stages=4, mosaic_persistent=132),
        dict(T=8, S=8, P=512, mosaic_block_k=128, mosaic_stages=2),  # split-K
        dict(T=8, S=8, P=512, mosaic_decode_wgs=1, mosaic_stages=3, mosaic_persistent=132),
        dict(T=2048, S=64, P=256, mosaic=False),  # a mixed bucket's decode launch
    ],
)
def test_mosaic_decode_lowers_for_cuda(cfg):
    from kernels_pallas.lowering import check_cuda_lowering

    text = check_cuda_lowering(
        num_heads=32, num_kv_heads=8, head_dim=128, mosaic_decode=True, **cfg
    )
    assert "mosaic_gpu" in text


@needs_mosaic
@pytest.mark.parametrize(
    "extra",
    [
        dict(kv_dtype=jnp.float8_e4m3fn, kv_scales=True),
        dict(sliding_window=1024),
        dict(soft_cap=30.0),
        dict(mosaic_stages=3),
    ],
)  # odd stages, 2 warpgroups
def test_ineligible_decode_falls_back_to_triton(extra):
    from kernels_pallas.lowering import check_cuda_lowering

    text = check_cuda_lowering(
        T=64, S=64, P=128, num_heads=32, num_kv_heads=8, head_dim=128, mosaic_decode=True, **extra
    )
    assert "ragged_paged_attention_q" in text and "mosaic_gpu" not in text  # the Triton kernel
