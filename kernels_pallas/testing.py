"""Random ragged batches for tests and benchmarks (numpy; fresh data on every call)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels_pallas.layout import v_transposed, value_cache_dtype
from kernels_pallas.metadata import AttentionMetadata


def make_batch(
    rng: np.random.Generator,
    seqs,
    *,
    T=None,
    S=None,
    P=None,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    num_blocks=None,
    dtype=jnp.float32,
    kv_dtype=None,
    v_dtype=None,
    poison=True,
):
    """seqs: list of (q_len, kv_len) with q_len <= kv_len. Pads to T tokens / S sequence rows.

    kv_dtype: the K pages' dtype (default dtype); v_dtype: the V pages' (default the engine's
    choice, layout.value_cache_dtype(kv_dtype): fp16 under bf16). V pages are laid out as the
    engine's ([D, bs] where layout.v_transposed says so; `v_rows` undoes it).
    Returns dict(q, k_cache, v_cache, k_new, v_new, md, num_tokens). Block tables are random
    permutations of physical blocks; the cache is random, and (poison=True) every slot that no
    sequence owns up to its length holds NaN, so a kernel that reads past a length shows it.
    """
    n_tok = sum(q for q, _ in seqs)
    T = T or n_tok
    S = S or len(seqs)
    pages = [-(-kv // block_size) for _, kv in seqs]
    P = P or max(pages + [1])
    num_blocks = num_blocks or (sum(pages) + 4)
    assert n_tok <= T and len(seqs) <= S and max(pages + [0]) <= P and sum(pages) <= num_blocks
    perm = rng.permutation(num_blocks)
    bt = np.zeros((S, P), np.int32)
    seq_lens = np.zeros(S, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    slot = np.full(T, -1, np.int32)
    c = 0
    for i, (ql, kv) in enumerate(seqs):
        bt[i, : pages[i]] = perm[c : c + pages[i]]
        c += pages[i]
        seq_lens[i] = kv
        qsl[i + 1] = qsl[i] + ql
        for j in range(ql):
            pos = kv - ql + j
            slot[qsl[i] + j] = bt[i, pos // block_size] * block_size + pos % block_size
    qsl[len(seqs) + 1 :] = qsl[len(seqs)]
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    kv_dtype = kv_dtype or dtype
    v_dtype = v_dtype or value_cache_dtype(kv_dtype)
    kc = rng.standard_normal(shape, np.float32)
    vc = rng.standard_normal(shape, np.float32)
    if poison:
        owned = np.zeros((num_blocks, block_size), bool)
        for i, (_, kv) in enumerate(seqs):
            for pos in range(kv):
                owned[bt[i, pos // block_size], pos % block_size] = True
        kc[:, :, ~owned] = np.nan
        vc[:, :, ~owned] = np.nan
    if v_transposed(kv_dtype, block_size):
        vc = np.ascontiguousarray(vc.swapaxes(-1, -2))
    md = AttentionMetadata(
        jnp.asarray(slot),
        jnp.asarray(bt),
        jnp.asarray(seq_lens),
        jnp.asarray(qsl),
        jnp.asarray([len(seqs)], jnp.int32),
    )
    q = rng.standard_normal((T, num_heads, head_dim), np.float32)
    kn = rng.standard_normal((T, num_kv_heads, head_dim), np.float32)
    vn = rng.standard_normal((T, num_kv_heads, head_dim), np.float32)
    return dict(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(kc, kv_dtype),
        v_cache=jnp.asarray(vc, v_dtype),
        k_new=jnp.asarray(kn, dtype),
        v_new=jnp.asarray(vn, dtype),
        md=md,
        num_tokens=n_tok,
    )


def v_rows(k_cache, v_cache):
    """The V cache as [L, Hkv, NB, bs, D] (its pages transposed back where layout.v_transposed
    stores them [D, bs]), for comparisons position by position."""
    if v_transposed(k_cache.dtype, k_cache.shape[3]):
        return v_cache.swapaxes(-1, -2)
    return v_cache


def sink_batch(
    seqs,
    *,
    T=None,
    S=None,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    dtype=jnp.float16,
):
    """make_batch's layout with an attention sink: every query sees its sequence's position 0
    18 nats above all its other keys (q = 8 e0, k = 18 e0 there and 0 elsewhere, sm_scale 1/8),
    whose V rows are 1 (the sink's: 0). So each of them has p = e^-18 ~ 2^-26 after the max,
    under fp16's smallest subnormal, and the output, their share N e^-18 / (1 + N e^-18), is
    what a kernel loses if it flushes them."""
    assert head_dim == 64, "sm_scale 1/8"
    b = make_batch(
        np.random.default_rng(0),
        seqs,
        T=T,
        S=S,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        poison=False,
    )
    q = jnp.zeros_like(b["q"]).at[:, :, 0].set(8.0)
    kc = jnp.zeros_like(b["k_cache"])
    vc = jnp.ones_like(b["v_cache"])
    for i in range(len(seqs)):
        page = int(b["md"].block_tables[i, 0])
        kc = kc.at[:, :, page, 0, 0].set(18.0)
        vc = vc.at[:, :, page, 0, :].set(0.0)
    return dict(b, q=q, k_cache=kc, v_cache=vc)


def rel_err(out, ref, n):
    """||out - ref|| / ||ref|| over the first n (valid) tokens, in float64."""
    o = np.asarray(jnp.asarray(out[:n], jnp.float32), np.float64)
    r = np.asarray(jnp.asarray(ref[:n], jnp.float32), np.float64)
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def check_against_oracle(
    run,
    seqs,
    T,
    S,
    *,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    v_dtype=None,
    seed=0,
    tol=2e-3,
):
    """A random batch through `run(q, k_cache, v_cache, md, sm_scale)` (layer 1 of 2) against
    the oracle: same shape and dtype, finite, relative error < tol, padding tokens zero."""
    from kernels_pallas.reference import ref_ragged_paged_attention

    b = make_batch(
        np.random.default_rng(seed),
        seqs,
        T=T,
        S=S,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        v_dtype=v_dtype,
    )
    q, kc, vc, md, n = b["q"], b["k_cache"], b["v_cache"], b["md"], b["num_tokens"]
    out = run(q, kc, vc, md, head_dim**-0.5)
    ref = ref_ragged_paged_attention(q, kc, vc, 1, md, sm_scale=head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert rel_err(out, ref, n) < tol
    assert bool(jnp.all(out[n:] == 0))  # padding tokens
