"""Pallas ragged paged attention (interpret mode) against the jnp oracle, on CPU."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import ragged_paged_attention, ref_ragged_paged_attention
from kernels_pallas.testing import make_batch, rel_err

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-3}

# name: (seqs [(q_len, kv_len)], T pad, S pad, kwargs for make_batch, kwargs for the kernel)
CASES = {
    "decode_g4": ([(1, 37), (1, 16), (1, 70), (1, 1)], 8, 6,
                  dict(num_heads=8, num_kv_heads=2), {}),
    "prefill_g1": ([(19, 19), (16, 16), (5, 5)], 48, 4,
                   dict(num_heads=2, num_kv_heads=2, block_size=16), {}),
    "chunked_g8_bf16": ([(24, 60), (9, 41)], 40, 3,
                        dict(num_heads=16, num_kv_heads=2, dtype=jnp.bfloat16, head_dim=128,
                             block_size=32), {}),
    "mixed_g4_split": ([(1, 50), (13, 40), (1, 7), (30, 30), (1, 99)], 64, 8,
                       dict(num_heads=8, num_kv_heads=2), dict(k_splits=2, block_k=32)),
    "mixed_bf16_g4_bs64": ([(1, 130), (20, 85), (1, 3)], 32, 4,
                           dict(num_heads=8, num_kv_heads=2, dtype=jnp.bfloat16,
                                block_size=64), {}),
    "g3_nonpow2": ([(1, 33), (7, 20)], 16, 3, dict(num_heads=6, num_kv_heads=2), {}),
}


def _run(rng, seqs, T, S, bkw, kkw, **attn):
  b = make_batch(rng, seqs, T=T, S=S, **bkw)
  layer = jnp.int32(1)
  out = ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], layer, b["md"],
                               interpret=True, **attn, **kkw)
  ref = ref_ragged_paged_attention(b["q"].astype(jnp.float32), b["k_cache"], b["v_cache"],
                                   layer, b["md"], **attn)
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
  err, _ = _run(rng, seqs, 24, 4, dict(num_heads=8, num_kv_heads=2), dict(k_splits=2),
                sm_scale=0.3, sliding_window=13, soft_cap=5.0)
  assert err < 1e-5, err


def test_fp8_kv():
  rng = np.random.default_rng()
  seqs = [(1, 40), (9, 33)]
  b = make_batch(rng, seqs, T=16, S=3, num_heads=8, num_kv_heads=2, dtype=jnp.bfloat16,
                 kv_dtype=jnp.float8_e4m3fn)
  kw = dict(sm_scale=0.125, k_scale=0.5, v_scale=2.0)
  out = ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], 0, b["md"], interpret=True,
                               **kw)
  ref = ref_ragged_paged_attention(b["q"].astype(jnp.float32), b["k_cache"], b["v_cache"], 0,
                                   b["md"], **kw)
  assert rel_err(out, ref, b["num_tokens"]) < 2e-3


def test_oracle_matches_dense_attention():
  """The oracle itself against plain causal attention on one contiguous sequence."""
  rng = np.random.default_rng()
  b = make_batch(rng, [(11, 20)], num_heads=4, num_kv_heads=1, block_size=16)
  L, Hkv, NB, bs, D = b["k_cache"].shape
  md = b["md"]
  pages = np.asarray(md.block_tables[0])
  k = np.asarray(b["k_cache"][0, 0])[pages].reshape(-1, D)[:20]
  v = np.asarray(b["v_cache"][0, 0])[pages].reshape(-1, D)[:20]
  q = np.asarray(b["q"])[:11]                                   # [11, 4, D]
  logits = np.einsum("thd,kd->thk", q, k) * 0.2
  pos = np.arange(9, 20)
  logits = np.where(np.arange(20)[None, None] <= pos[:, None, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("thk,kd->thd", p / p.sum(-1, keepdims=True), v)
  got = ref_ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], 0, md, sm_scale=0.2)
  np.testing.assert_allclose(np.asarray(got)[:11], want, rtol=1e-4, atol=1e-5)
