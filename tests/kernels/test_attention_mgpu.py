"""The Mosaic GPU prefill kernel (attention_mgpu.py) against the oracle, in GPU interpret mode,
and its CUDA lowering. Both need jax >= 0.11 (CI's second venv); the tile metadata test runs
everywhere."""

from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import attention_mgpu, ragged_paged_attention, ref_ragged_paged_attention
from kernels_pallas.attention_mgpu import TILE_TOKENS, mosaic_num_tiles, mosaic_tile_metadata
from kernels_pallas.testing import check_against_oracle, make_batch

needs_mosaic = pytest.mark.skipif(
    not attention_mgpu.available(), reason="Mosaic GPU interpret mode needs jax >= 0.11"
)


@pytest.mark.parametrize(
    "seqs,T,S",
    [
        ([(200, 300), (5, 5), (130, 130)], 344, 4),
        ([(1, 40), (64, 64), (300, 1000)], 372, 3),
        ([(37, 37)], 40, 1),
    ],
)
def test_tiles_cover_every_token_once(seqs, T, S):
    b = make_batch(np.random.default_rng(0), seqs, T=T, S=S, poison=False)
    md = b["md"]
    meta = np.asarray(mosaic_tile_metadata(md, T, mosaic_num_tiles(T, S)))
    qsl = np.asarray(md.query_start_loc)
    seen = np.zeros(T, int)
    n_valid = meta[0, 6]
    assert (meta[:, 6] == n_valid).all() and (meta[n_valid:, 2] == meta[n_valid:, 3]).all()
    for seq, row0, lo, hi, pos0, kv_len, *_ in meta:
        assert row0 % 8 == 0 and 0 <= lo <= hi <= TILE_TOKENS
        for r in range(lo, hi):
            t = row0 + r
            seen[t] += 1
            if t < qsl[len(seqs)]:  # a live token: its sequence, position and length
                assert qsl[seq] <= t < qsl[seq + 1]
                q_len = qsl[seq + 1] - qsl[seq]
                assert pos0 + r == seqs[seq][1] - q_len + (t - qsl[seq]) and kv_len == seqs[seq][1]
            else:  # a padding token: no keys, stores zeros
                assert kv_len == 0
    assert (seen == 1).all()


def _check(seqs, T, S, *, dtype=jnp.bfloat16, v_dtype=None, schedule=None, **tuning):
    shape = {k: tuning.pop(k) for k in ("num_heads", "num_kv_heads", "head_dim", "block_size")}

    def run(q, kc, vc, md, sm_scale):
        if schedule is None:
            with mock.patch.object(
                attention_mgpu,
                "mosaic_prefill_attention",
                wraps=attention_mgpu.mosaic_prefill_attention,
            ) as kernel:
                out = ragged_paged_attention(
                    q,
                    kc,
                    vc,
                    jnp.int32(1),
                    md,
                    sm_scale=sm_scale,
                    interpret=True,
                    mosaic=True,
                    **tuning,
                )
            assert kernel.call_count == 1  # the Mosaic kernel ran (no silent Triton fall-back)
            return out
        L, Hkv, NB, bs, D = kc.shape  # the kernel's own knobs, called directly
        nt = mosaic_num_tiles(T, S)
        return attention_mgpu.mosaic_prefill_attention(
            q,
            kc.reshape(L * Hkv * NB, bs, D),
            vc.reshape(L * Hkv * NB, bs, D),
            mosaic_tile_metadata(md, T, nt),
            md.block_tables.reshape(-1),
            jnp.array([Hkv], jnp.int32),
            num_tiles=nt,
            NB=NB,
            P=md.block_tables.shape[1],
            Hkv=Hkv,
            block_kv=tuning["mosaic_block_k"],
            stages=tuning["mosaic_stages"],
            schedule=schedule,
            persistent=tuning.get("mosaic_persistent", 0),
            interpret=True,
            sm_scale=sm_scale,
        )

    check_against_oracle(run, seqs, T, S, dtype=dtype, v_dtype=v_dtype, **shape)


@needs_mosaic
# A barrier-phase bug hangs: the run stops with a stack dump after 5 minutes, not 90.
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize(
    "case",
    [
        # one prefill with cached context, GQA 4, d 64, 4 pages per KV block, partial last page
        # (bf16 caches hold fp16 V pages unless v_dtype says: the engine's layout)
        dict(
            seqs=[(200, 300)],
            T=200,
            S=1,
            num_heads=4,
            num_kv_heads=1,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
        ),
        # the same with bf16 V pages: the convert warpgroup rewrites each block as fp16
        dict(
            seqs=[(200, 300)],
            T=200,
            S=1,
            num_heads=4,
            num_kv_heads=1,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            v_dtype=jnp.bfloat16,
        ),
        # a chunk at long context next to a fresh prompt starting off the 8-row grid; GQA 4, d 128
        dict(
            seqs=[(64, 600), (100, 100)],
            T=200,
            S=3,
            num_heads=8,
            num_kv_heads=2,
            head_dim=128,
            block_size=32,
            mosaic_block_k=128,
            mosaic_stages=2,
        ),
        # MHA, one page per KV block, 3 pipeline stages, fp16; a CTA per (head, tile), not the
        # default persistent grid
        dict(
            seqs=[(300, 300)],
            T=320,
            S=2,
            num_heads=2,
            num_kv_heads=2,
            head_dim=64,
            block_size=64,
            mosaic_block_k=64,
            mosaic_stages=3,
            dtype=jnp.float16,
            mosaic_persistent=0,
        ),
        # the ping-pong schedule barrier on every item, with a warpgroup that has no rows
        dict(
            seqs=[(40, 300), (150, 150)],
            T=200,
            S=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            schedule=1,
        ),
        # the schedule barrier in a persistent loop (its phases carry over from item to item) on
        # items of 3+ KV blocks only: items with and without it follow each other
        dict(
            seqs=[(200, 330), (5, 5), (130, 130)],
            T=344,
            S=4,
            num_heads=2,
            num_kv_heads=1,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            mosaic_persistent=3,
            schedule=3,
        ),
        # persistent: 3 CTAs loop over 2 heads x 5 tiles (odd and even KV step counts, so the
        # pipeline slots and barrier phases carry over unevenly from item to item)
        dict(
            seqs=[(200, 330), (5, 5), (130, 130)],
            T=344,
            S=4,
            num_heads=2,
            num_kv_heads=1,
            head_dim=64,
            block_size=16,
            mosaic_block_k=64,
            mosaic_stages=2,
            mosaic_persistent=3,
        ),
    ],
)
def test_mosaic_prefill_matches_oracle(case):
    _check(**case)


@needs_mosaic
def test_mosaic_prefill_keeps_tiny_probabilities():
    """Keys 18 nats under an attention sink (p ~ 2^-26, flushed by a plain fp16 P) still count."""
    from kernels_pallas.testing import rel_err, sink_batch

    b = sink_batch([(100, 1500), (60, 60)], T=160, S=2)
    with mock.patch.object(
        attention_mgpu, "mosaic_prefill_attention", wraps=attention_mgpu.mosaic_prefill_attention
    ) as kernel:
        out = ragged_paged_attention(
            b["q"],
            b["k_cache"],
            b["v_cache"],
            jnp.int32(1),
            b["md"],
            sm_scale=0.125,
            interpret=True,
            mosaic=True,
            mosaic_block_k=128,
            mosaic_stages=2,
        )
    assert kernel.call_count == 1
    ref = ref_ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], 1, b["md"], sm_scale=0.125)
    assert float(jnp.min(ref[:100].astype(jnp.float32))) > 5e-6
    assert rel_err(out, ref, b["num_tokens"]) < 2e-3


@needs_mosaic
def test_mosaic_mixed_batch_decodes_through_triton():
    # T > 2 S: the default plan splits the decode rows into a Triton launch; the prefills (one
    # of them with GQA 3, off the 8-row grid) go through the Mosaic kernel.
    seqs = [(1, 90), (1, 33), (150, 150), (1, 7), (70, 200)]
    _check(
        seqs,
        240,
        6,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        mosaic_block_k=64,
        mosaic_stages=2,
        mixed_split=True,
    )
    _check(
        seqs,
        240,
        6,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        mosaic_block_k=64,
        mosaic_stages=2,
        mixed_split=True,
        mosaic_persistent=4,
    )


@needs_mosaic
@pytest.mark.parametrize(
    "cfg",
    [
        dict(T=2048, S=1, P=128, mosaic_block_k=128, mosaic_stages=2),  # Llama-3.1-8B prefill
        dict(T=8192, S=8, P=512, mosaic_block_k=64, mosaic_stages=3),
        dict(T=2048, S=64, P=256, mosaic_block_k=128, mosaic_stages=2, mixed_split=True),
        dict(T=8192, S=256, P=512, mosaic_persistent=132),  # an engine bucket
        dict(T=2048, S=1, P=128, v_dtype=jnp.bfloat16),  # bf16 V: converted in SMEM
    ],
)
def test_mosaic_lowers_for_cuda(cfg):
    from kernels_pallas.lowering import check_cuda_lowering

    text = check_cuda_lowering(num_heads=32, num_kv_heads=8, head_dim=128, mosaic=True, **cfg)
    assert "mosaic_gpu" in text


@needs_mosaic
# A hang ends the run with a stack dump after 5 minutes, instead of stalling CI for 90.
@pytest.mark.timeout(300, method="thread")
def test_inconsistent_metadata_does_not_hang():
    """kv_len below the query count (a caller's bug) must not leave a warpgroup waiting for KV
    blocks that are never loaded: the kernel finishes, rows stay finite."""
    b = make_batch(
        np.random.default_rng(3),
        [(200, 300)],
        T=200,
        S=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        dtype=jnp.bfloat16,
        poison=False,
    )
    md = b["md"]
    md = type(md)(
        md.slot_mapping,
        md.block_tables,
        jnp.asarray([5], jnp.int32),
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
        mosaic=True,
        mosaic_block_k=64,
        mosaic_stages=2,
    )
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def test_mosaic_default_buckets():
    """Prefill and mixed buckets of 512+ tokens take the Mosaic kernel with a persistent grid
    (where jax has it), whatever their sequence slots; shorter buckets and decode buckets stay
    on Triton, and the decode kernel is opt-in."""
    from kernels_pallas.tuning import default_tuning

    has = attention_mgpu.available()
    tun = lambda T, S: default_tuning(T, S, 32, 8, 128, 16)
    for T, S in [(8192, 1), (8192, 256), (2048, 64), (512, 1), (512, 64)]:
        assert tun(T, S).mosaic == has and tun(T, S).mosaic_persistent == 264
        assert tun(T, S).mosaic_schedule > 1  # ping-pong on long items only
    assert not tun(256, 8).mosaic and not tun(64, 64).mosaic and not tun(64, 64).mosaic_decode


@needs_mosaic
@pytest.mark.parametrize(
    "extra",
    [
        dict(kv_dtype=jnp.float8_e4m3fn, kv_scales=True),
        dict(sliding_window=1024),
        dict(soft_cap=30.0),
    ],
)
def test_ineligible_calls_fall_back_to_triton(extra):
    """A Mosaic-default bucket with fp8 KV, a window or a soft cap runs the Triton kernel."""
    from kernels_pallas.lowering import check_cuda_lowering

    text = check_cuda_lowering(
        T=8192, S=4, P=512, num_heads=32, num_kv_heads=8, head_dim=128, **extra
    )
    assert "ragged_paged_attention_q" in text and "mosaic_gpu" not in text  # the Triton kernel
