"""The XLA tiled attention (the engine's CPU path) against the oracle on random ragged batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ref_ragged_paged_attention
from kernels_pallas.testing import make_batch, rel_err
from kernels_pallas.xla_attention import xla_ragged_paged_attention


@pytest.mark.parametrize(
    "case",
    [
        dict(seqs=[(1, 5), (1, 40), (1, 17)]),  # decode
        dict(seqs=[(37, 37)]),  # prefill
        dict(seqs=[(20, 50), (1, 70), (9, 9)]),  # chunk with context + mixed
        dict(seqs=[(3, 3), (33, 100)], window=24, cap=30.0),
        dict(seqs=[(5, 21), (1, 64)], num_heads=8, num_kv_heads=8),
        # fp8 pages of 64 tokens: V stored [D, bs] (layout.v_transposed)
        dict(seqs=[(20, 150), (1, 70), (9, 9)], kv_dtype=jnp.float8_e4m3fn, block_size=64),
    ],
)
def test_xla_attention_matches_oracle(case):
    rng = np.random.default_rng(len(str(case)))
    b = make_batch(
        rng,
        case["seqs"],
        T=sum(q for q, _ in case["seqs"]) + 5,
        S=len(case["seqs"]) + 1,
        head_dim=32,
        num_heads=case.get("num_heads", 8),
        num_kv_heads=case.get("num_kv_heads", 2),
        kv_dtype=case.get("kv_dtype"),
        block_size=case.get("block_size", 16),
        poison=False,
    )
    kw = dict(sm_scale=0.2, sliding_window=case.get("window"), soft_cap=case.get("cap"))
    args = (b["q"], b["k_cache"], b["v_cache"], jnp.int32(1), b["md"])
    ref = ref_ragged_paged_attention(*args, **kw)
    out = jax.jit(lambda *a: xla_ragged_paged_attention(*a, **kw, pages_per_chunk=2))(*args)
    assert rel_err(out, ref, b["num_tokens"]) < 1e-5
