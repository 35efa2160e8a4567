"""The chunked prefill kernel of the gated delta rule (WY form), launched by
`gated_delta.gated_delta_rule(impl="chunk")`, whose module docstring has the method and the
measurements."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.gated_delta_blocks import l2norm, load_state, mixed_dot, store_state

# a sequence of fewer tokens runs token by token (f32) in the same program. The recurrent
# kernel took ~1.6 us a token and the chunk one ~6.5 us a 16-token chunk at 4 x 1024
# (gated_delta's docstring), so a decode row's single token skips the chunk's solve.
TOKEN_BY_TOKEN_BELOW = 4


def chunk_kernel(
    qsl_ref,
    slot_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    b_ref,
    o_in,
    st_in,
    o_ref,
    st_ref,
    *,
    G,
    Hv,
    dk,
    dv,
    block_v,
    C,
    scale,
    use_qk_l2norm,
    precision,
    snapshot,
):
    del o_in, st_in  # aliased to o_ref / st_ref
    f32 = jnp.float32
    s, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // G
    start = qsl_ref[s]
    end = qsl_ref[s + 1]
    slot_in = slot_ref[s, 0]
    slot_out = slot_ref[s, 1]
    st = load_state(st_ref, slot_in, h, vb, Hv=Hv, dk=dk, block_v=block_v)

    r = jnp.arange(C, dtype=jnp.int32)
    strict = r[None, :] < r[:, None]  # [i, j]: j < i
    incl = r[None, :] <= r[:, None]
    eye = (r[None, :] == r[:, None]).astype(f32)
    v_col = h * dv + vb * block_v

    def chunk(c, st):
        r0 = start + c * C
        ok = r0 + r < end
        mk = jnp.broadcast_to(ok[:, None], (C, dk))
        mv = jnp.broadcast_to(ok[:, None], (C, block_v))
        q = plt.load(q_ref.at[pl.ds(r0, C), pl.ds(hk * dk, dk)], mask=mk, other=0.0).astype(f32)
        k = plt.load(k_ref.at[pl.ds(r0, C), pl.ds(hk * dk, dk)], mask=mk, other=0.0).astype(f32)
        v = plt.load(v_ref.at[pl.ds(r0, C), pl.ds(v_col, block_v)], mask=mv, other=0.0)
        v = v.astype(f32)
        g = plt.load(g_ref.at[pl.ds(r0, C), h], mask=ok, other=0.0).astype(f32)
        beta = plt.load(b_ref.at[pl.ds(r0, C), h], mask=ok, other=0.0).astype(f32)
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * scale
        gc = jnp.sum(jnp.where(incl, g[None, :], 0.0), axis=1)  # in-chunk cumulative decay
        diff = gc[:, None] - gc[None, :]
        kb = k * beta[:, None]
        A = mixed_dot(kb, k.T, precision) * jnp.where(
            strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0
        )

        def subst(i, X):  # row i of (I + A)^-1: e_i - sum_{j < i} A[i, j] X[j, :]
            a_i = jnp.sum(jnp.where(r[:, None] == i, A, 0.0), axis=0)
            x_i = jnp.sum(a_i[:, None] * X, axis=0)
            return jnp.where(r[:, None] == i, X - x_i[None, :], X)

        Tm = lax.fori_loop(1, C, subst, eye)
        u = mixed_dot(Tm, v * beta[:, None], precision)  # [C, block_v]
        w = mixed_dot(Tm, kb * jnp.exp(gc)[:, None], precision)  # [C, dk]
        v_new = u - mixed_dot(w, st, precision)
        attn = mixed_dot(q, k.T, precision) * jnp.where(
            incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0
        )
        o = mixed_dot(q * jnp.exp(gc)[:, None], st, precision) + mixed_dot(attn, v_new, precision)
        plt.store(o_ref.at[pl.ds(r0, C), pl.ds(v_col, block_v)], o.astype(o_ref.dtype), mask=mv)
        g_last = jnp.sum(g)
        kd = k * jnp.exp(g_last - gc)[:, None]
        return st * jnp.exp(g_last) + mixed_dot(kd.T, v_new, precision)

    def token(i, st):  # the recurrent form, f32: S = e^g S; S += k (beta (v - S^T k))^T
        t = start + i
        q = q_ref[t, pl.ds(hk * dk, dk)].astype(f32)
        k = k_ref[t, pl.ds(hk * dk, dk)].astype(f32)
        v = v_ref[t, pl.ds(v_col, block_v)].astype(f32)
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        st = st * jnp.exp(g_ref[t, h].astype(f32))
        kv_mem = jnp.sum(st * k[:, None], axis=0)
        st = st + k[:, None] * ((v - kv_mem) * b_ref[t, h].astype(f32))[None, :]
        o = jnp.sum(st * (q * scale)[:, None], axis=0)
        o_ref[t, pl.ds(v_col, block_v)] = o.astype(o_ref.dtype)
        return st

    # A sequence of a few tokens (a decode row) runs token by token: one chunk would pay the
    # in-chunk solve of C tokens for them (module docstring: TOKEN_BY_TOKEN_BELOW).
    n = end - start
    few = n < TOKEN_BY_TOKEN_BELOW
    st = lax.fori_loop(0, jnp.where(few, 0, (n + C - 1) // C), chunk, st)
    st = lax.fori_loop(0, jnp.where(few, n, 0), token, st)
    store_state(st_ref, slot_out, h, vb, st, n > 0, Hv=Hv, dk=dk, block_v=block_v)
    if snapshot:  # the prefix cache's copy of the same state
        store_state(st_ref, slot_ref[s, 2], h, vb, st, n > 0, Hv=Hv, dk=dk, block_v=block_v)


# --- the recurrent kernel (ragged, or decode with the conv fused) ------------------------------
