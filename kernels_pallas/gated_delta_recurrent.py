"""The token-by-token kernel of the gated delta rule (f32 state in registers), launched by
`gated_delta.gated_delta_rule(impl="recurrent")` and, with the causal conv fused in front, by
`gated_delta.gated_delta_decode`; that module's docstring has the method and the measurements."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.gated_delta_blocks import l2norm, load_state, store_state


def recurrent_kernel(
    *refs,
    conv,
    m,
    G,
    Hk,
    Hv,
    dk,
    dv,
    block_v,
    K,
    C_ch,
    N,
    P,
    scale,
    use_qk_l2norm,
    x_dtype,
    aliased_out,
    snapshot=False,
    gating=False,
):
    f32 = jnp.float32
    refs = list(refs)
    qsl_ref = None if m else refs.pop(0)
    slot_ref = refs.pop(0)
    pos_ref = refs.pop(0) if P else None
    if conv:
        x_ref, w_ref, cb_ref = refs[:3]
        refs = refs[3:]
    else:
        q_ref, k_ref, v_ref = refs[:3]
        refs = refs[3:]
    if conv:
        cs_ref = refs.pop(0)
    g_ref, b_ref = refs[:2]
    n_in = 2
    if gating:  # g_ref / b_ref hold the raw projections a, b; per-head A_log and dt_bias
        al_ref, dt_ref = refs[2:4]
        n_in = 4
    refs = refs[n_in + aliased_out + 1 :]  # past the aliased inputs
    o_ref, st_ref = refs[:2]
    cw_ref = refs[2] if conv else None

    s, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // G
    if m:
        start, n = s * m, m
    else:
        start = qsl_ref[s]
        n = qsl_ref[s + 1] - start
    slot_in = slot_ref[s, 0]
    slot_out = slot_ref[s, 1]
    st = load_state(st_ref, slot_in, h, vb, Hv=Hv, dk=dk, block_v=block_v)
    v_col = h * dv + vb * block_v

    if conv:
        K1 = K - 1
        cq = hk * dk + jnp.arange(dk, dtype=jnp.int32)
        ck = Hk * dk + cq
        cv = 2 * Hk * dk + v_col + jnp.arange(block_v, dtype=jnp.int32)
        chans = (cq, ck, cv)
        # taps [K][channels] of the weight [C K] (flat), the bias
        wts = [[w_ref[c * K + j].astype(f32) for j in range(K)] for c in chans]
        bias = [cb_ref[c].astype(f32) for c in chans]
        # The conv pool is only read: its q / k channels are read by all the G value heads and
        # dv blocks of a key head, so no program may overwrite them in place. The new windows
        # go to cw [S, 1 + P, C, K-1] (after the last token, after each of the first P), for the
        # wrapper's row copies (slot_rows.py); q / k channels from one program of the key head.
        qk_writer = (h % G == 0) & (vb == 0)
        writers = (qk_writer, qk_writer, True)
        end_idx = cw_ref.shape[0]  # past the end: a masked lane that is never touched

        win0 = tuple(
            tuple(
                plt.load(
                    cs_ref.at[(jnp.maximum(slot_in, 0) * C_ch + c) * K1 + j],
                    mask=jnp.broadcast_to(slot_in >= 0, c.shape),
                    other=0.0,
                ).astype(f32)
                for j in range(K1)
            )
            for c in chans
        )

        def store_windows(win, p, ok):
            for c, wn, wr in zip(chans, win, writers):
                good = ok & wr
                for j in range(K1):
                    idx = ((s * (1 + P) + p) * C_ch + c) * K1 + j
                    plt.store(
                        cw_ref.at[jnp.where(good, idx, end_idx)],
                        wn[j].astype(cw_ref.dtype),
                        mask=jnp.broadcast_to(good, c.shape),
                    )

    else:
        win0 = ()

    def token(i, carry):
        st, win = carry
        t = start + i
        if conv:
            cols = (hk * dk, Hk * dk + hk * dk, 2 * Hk * dk + v_col)
            widths = (dk, dk, block_v)
            outs, new_win = [], []
            for col, wd, wt, bs, wn in zip(cols, widths, wts, bias, win):
                xt = x_ref[t, pl.ds(col, wd)].astype(f32)
                y = bs + wt[K1] * xt
                for j in range(K1):
                    y = y + wt[j] * wn[j]
                y = y / (1.0 + jnp.exp(-y))  # SiLU
                outs.append(y.astype(x_dtype).astype(f32))  # the unfused conv's rounding
                new_win.append(wn[1:] + (xt,))
            q, k, v = outs
            win = tuple(new_win)
        else:
            q = q_ref[t, pl.ds(hk * dk, dk)].astype(f32)
            k = k_ref[t, pl.ds(hk * dk, dk)].astype(f32)
            v = v_ref[t, pl.ds(v_col, block_v)].astype(f32)
        g_t = g_ref[t, h].astype(f32)
        b_t = b_ref[t, h].astype(f32)
        if gating:  # gated_delta_ref.gdn_gating: g = -exp(A_log) softplus(a + dt), sigmoid(b)
            a_t = g_t + dt_ref[h].astype(f32)
            softplus = jnp.maximum(a_t, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(a_t)))
            g_t = -jnp.exp(al_ref[h].astype(f32)) * softplus
            b_t = 1.0 / (1.0 + jnp.exp(-b_t))
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        q = q * scale
        st = st * jnp.exp(g_t)
        kv_mem = jnp.sum(st * k[:, None], axis=0)
        st = st + k[:, None] * ((v - kv_mem) * b_t)[None, :]
        o = jnp.sum(st * q[:, None], axis=0)
        o_ref[t, pl.ds(v_col, block_v)] = o.astype(o_ref.dtype)
        if P:
            ps = pos_ref[s * P + jnp.minimum(i, P - 1)]
            store_state(st_ref, ps, h, vb, st, i < P, Hv=Hv, dk=dk, block_v=block_v)
            if conv:
                store_windows(win, 1 + jnp.minimum(i, P - 1), i < P)
        return st, win

    if m:
        st, win = lax.fori_loop(0, m, token, (st, win0))
    else:
        st, win = lax.fori_loop(0, n, token, (st, win0))
    store_state(st_ref, slot_out, h, vb, st, n > 0, Hv=Hv, dk=dk, block_v=block_v)
    if snapshot:  # the prefix cache's copy (its conv window: the wrapper's row copies)
        store_state(st_ref, slot_ref[s, 2], h, vb, st, n > 0, Hv=Hv, dk=dk, block_v=block_v)
    if conv:
        store_windows(win, 0, n > 0)
