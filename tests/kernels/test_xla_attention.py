"""The XLA tiled attention (the engine's CPU path) against the oracle on random ragged batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import AttentionMetadata, ref_ragged_paged_attention
from kernels_pallas.xla_attention import xla_ragged_paged_attention


def batch(rng, q_lens, kv_lens, Hq=8, Hkv=2, D=32, bs=16, NB=64, T=None, S=None, L=2):
    S = S or len(q_lens) + 1
    T = T or sum(q_lens) + 5
    P = max(-(-k // bs) for k in kv_lens) + 1
    perm = rng.permutation(NB)
    tables = np.zeros((S, P), np.int32)
    used = 0
    for s, k in enumerate(kv_lens):
        n = -(-k // bs)
        tables[s, :n] = perm[used:used + n]
        used += n
    qsl = np.zeros(S + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    seq_lens = np.zeros(S, np.int32)
    seq_lens[:len(kv_lens)] = kv_lens
    md = AttentionMetadata(jnp.full(T, -1, jnp.int32), jnp.asarray(tables), jnp.asarray(seq_lens),
                           jnp.asarray(qsl), jnp.asarray([len(q_lens)], jnp.int32))
    kc = jnp.asarray(rng.standard_normal((L, Hkv, NB, bs, D)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((L, Hkv, NB, bs, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((T, Hq, D)), jnp.float32)
    return q, kc, vc, md, int(qsl[len(q_lens)])


@pytest.mark.parametrize("case", [
    dict(q_lens=[1, 1, 1], kv_lens=[5, 40, 17]),                      # decode
    dict(q_lens=[37], kv_lens=[37]),                                  # prefill
    dict(q_lens=[20, 1, 9], kv_lens=[50, 70, 9]),                     # chunk with context + mixed
    dict(q_lens=[3, 33], kv_lens=[3, 100], window=24, cap=30.0),
    dict(q_lens=[5, 1], kv_lens=[21, 64], Hq=8, Hkv=8),
])
def test_xla_attention_matches_oracle(case):
    rng = np.random.default_rng(len(str(case)))
    Hq, Hkv = case.get("Hq", 8), case.get("Hkv", 2)
    q, kc, vc, md, n = batch(rng, case["q_lens"], case["kv_lens"], Hq=Hq, Hkv=Hkv)
    kw = dict(sm_scale=0.2, sliding_window=case.get("window"), soft_cap=case.get("cap"))
    layer = jnp.int32(1)
    ref = ref_ragged_paged_attention(q, kc, vc, layer, md, **kw)[:n]
    out = jax.jit(lambda *a: xla_ragged_paged_attention(*a, **kw, pages_per_chunk=2))(
        q, kc, vc, layer, md)[:n]
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < 1e-5, err
