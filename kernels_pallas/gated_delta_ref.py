"""Pure-jnp oracles of Qwen3.5's Gated DeltaNet layers (issue #54): the gated delta rule
(token by token and chunked), the causal depthwise conv1d with its state, and the decode step
that fuses both. The Pallas kernels are `gated_delta.py`'s; the design and the API are there.

The math (HF transformers `models/qwen3_5/modeling_qwen3_5.py`: `torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`, `causal_conv1d_update`, `causal_conv1d_fn`), per value head,
state S [dk, dv] in f32:

    q, k = l2norm(q), l2norm(k)   (use_qk_l2norm: x * rsqrt(sum x^2 + 1e-6), in f32)
    q = q * scale                 (scale = dk ** -0.5 unless given)
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}'^T k_t))^T,  S' = exp(g_t) S_{t-1}
    o_t = S_t^T q_t

Value head h reads key head h // (Hv // Hk) (HF's repeat_interleave).

Batches are flat and ragged like the rest of the engine: tokens of S sequences concatenated,
`query_start_loc` [S+1] (rows past the live sequences repeat the last value: empty sequences),
tokens past query_start_loc[S] are padding (output 0). States live in pools indexed by slot:

    state       [N, Hv, dk, dv] (f32, or any float dtype: math in f32, stored in its dtype)
    conv_state  [N, C, K - 1]   (the last K - 1 conv inputs, oldest first; C channels)
    (or [L, N, ...] with `layer`, an int32 scalar that may be traced: slots index layer `layer`)
    initial_slots [S] int32     the slot each sequence starts from; < 0: from zeros (a new one)
    final_slots   [S] int32     where its state after its last token goes (default
                                initial_slots); < 0: not written
    position_slots [S, P] int32 optional: the state after token p (p < P) of sequence s also
                                goes to position_slots[s, p] (< 0: not written); for
                                speculative verification (see gated_delta.py)
    snapshot_slots [S] int32    optional (the chunked rule, the conv): the state after its last
                                token also goes there (< 0: not written); the prefix cache's
                                snapshots (paxengine/state_snapshots.py)

All reads of the pools happen before any write; a sequence with no tokens writes nothing. Slots
written in one call must be distinct, and distinct from every other sequence's initial slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.metadata import count_le

_HI = lax.Precision.HIGHEST
L2NORM_EPS = 1e-6  # HF's / FLA's l2norm


def gdn_gating(a, b, A_log, dt_bias):
    """(g, beta) [T, Hv] f32 of a Gated DeltaNet layer from its projections a, b [T, Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) (the log-decay, <= 0), beta = sigmoid(b)."""
    f32 = jnp.float32
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, jax.nn.sigmoid(b.astype(f32))


def l2norm(x, eps=L2NORM_EPS):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q, k, num_v_heads, *, scale=None, use_qk_l2norm=True):
    """q, k [T, Hk, dk] -> f32 [T, Hv, dk] each: normalised (if asked), q scaled, heads repeated
    for the value heads."""
    dk = q.shape[-1]
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk**-0.5 if scale is None else scale)
    G = num_v_heads // q.shape[1]
    return jnp.repeat(q, G, axis=1), jnp.repeat(k, G, axis=1)


def flat_pool(pool, layer, *slot_arrays, per_slot_ndim):
    """A pool [N, ...] as is, or [L, N, ...] with `layer` as [L * N, ...] and the slots moved to
    that layer's rows (negative slots stay negative). -> (pool, unflatten, *slots)."""
    slot_arrays = [None if s is None else jnp.asarray(s, jnp.int32) for s in slot_arrays]
    if layer is None:
        assert pool.ndim == 1 + per_slot_ndim, pool.shape
        return (pool, lambda p: p, *slot_arrays)
    assert pool.ndim == 2 + per_slot_ndim, pool.shape
    shape = pool.shape
    off = jnp.asarray(layer, jnp.int32) * shape[1]
    moved = [None if s is None else jnp.where(s >= 0, s + off, s) for s in slot_arrays]
    return (pool.reshape((-1,) + shape[2:]), lambda p: p.reshape(shape), *moved)


def seq_of_tokens(query_start_loc, T):
    """Per flat token: (sequence, index in its sequence, valid); and the lengths [S]."""
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    S = qsl.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(count_le(qsl[1:], t), S - 1)
    valid = t < qsl[S]
    return seq, t - qsl[seq], valid, qsl[1:] - qsl[:-1]


def gather_slots(pool, slots):
    """pool[slots] in f32, zeros where slot < 0."""
    n = pool.shape[0]
    got = pool[jnp.clip(slots, 0, n - 1)].astype(jnp.float32)
    mask = (slots >= 0).reshape(slots.shape + (1,) * (pool.ndim - 1))
    return jnp.where(mask, got, 0.0)


def scatter_slots(pool, slots, values, write):
    """pool[slots] = values where `write` (and slot >= 0); others dropped."""
    dst = jnp.where(write & (slots >= 0), slots, pool.shape[0])
    return pool.at[dst].set(values.astype(pool.dtype), mode="drop")


def _write_slot(pool, slot, value, write):
    """One dynamic slot write inside a scan (in place): pool[slot] = value if write."""
    n = pool.shape[0]
    sc = jnp.clip(slot, 0, n - 1)
    keep = lax.dynamic_index_in_dim(pool, sc, keepdims=False)
    new = jnp.where(write & (slot >= 0), value.astype(pool.dtype), keep)
    return lax.dynamic_update_index_in_dim(pool, new, sc, 0)


def _check(q, k, v, g, beta, state, layer):
    T, Hk, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must be {q.shape} like q, got {k.shape}")
    if v.ndim != 3 or v.shape[0] != T or v.shape[1] % Hk:
        raise ValueError(f"v must be [{T}, a multiple of {Hk}, dv], got {v.shape}")
    Hv, dv = v.shape[1:]
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"g and beta must be [{T}, {Hv}], got {g.shape}, {beta.shape}")
    want = (Hv, dk, dv)
    if state.shape[(1 if layer is None else 2) :] != want:
        raise ValueError(f"state must be [(L,) N, {Hv}, {dk}, {dv}], got {state.shape}")
    return T, Hk, dk, Hv, dv


def ref_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    state,
    query_start_loc,
    initial_slots,
    final_slots=None,
    position_slots=None,
    *,
    scale=None,
    use_qk_l2norm=True,
    layer=None,
):
    """The recurrent gated delta rule over a ragged batch, token by token (one `lax.scan` over
    the T flat tokens carrying one state; obviously right, O(T) sequential steps).

    q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv] (log-decay <= 0, beta in (0, 1));
    state pool and slots as the module docstring says.
    -> (o [T, Hv, dv] in v.dtype, the state pool updated)."""
    T, _, _, Hv, _ = _check(q, k, v, g, beta, state, layer)
    pool, unflat, init_s, fin_s, pos_s = flat_pool(
        state, layer, initial_slots, final_slots, position_slots, per_slot_ndim=3
    )
    fin_s = init_s if fin_s is None else fin_s
    qf, kf = prepare_qk(q, k, Hv, scale=scale, use_qk_l2norm=use_qk_l2norm)
    seq, idx, valid, lens = seq_of_tokens(query_start_loc, T)
    init = gather_slots(pool, init_s)  # every read before any write
    P = 0 if pos_s is None else pos_s.shape[1]

    def step(carry, xs):
        pool, h = carry
        qt, kt, vt, gt, bt, s, i, ok = xs
        h = jnp.where(i == 0, init[s], h)
        h = h * jnp.exp(gt)[:, None, None]
        kv_mem = jnp.einsum("hkv,hk->hv", h, kt, precision=_HI)
        delta = (vt - kv_mem) * bt[:, None]
        h = h + kt[:, :, None] * delta[:, None, :]
        o = jnp.einsum("hkv,hk->hv", h, qt, precision=_HI)
        if P:
            ps = pos_s[s, jnp.minimum(i, P - 1)]
            pool = _write_slot(pool, ps, h, ok & (i < P))
        pool = _write_slot(pool, fin_s[s], h, ok & (i == lens[s] - 1))
        return (pool, h), jnp.where(ok, o, 0.0)

    xs = (
        qf,
        kf,
        v.astype(jnp.float32),
        g.astype(jnp.float32),
        beta.astype(jnp.float32),
        seq,
        idx,
        valid,
    )
    h0 = jnp.zeros(state.shape[-3:], jnp.float32)
    (pool, _), o = lax.scan(step, (pool, h0), xs)
    return o.astype(v.dtype), unflat(pool)


def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by forward substitution: row i is
    e_i - sum_{j < i} A[i, j] row_j. (What torch.linalg.solve_triangular(..., unitriangular=True)
    gives HF; XLA's batched triangular solve on the CPU took seconds at some batch sizes.)"""
    C = A.shape[-1]

    def row(i, X):
        a_i = lax.dynamic_index_in_dim(A, i, axis=-2, keepdims=False)  # [..., C]
        x_i = lax.dynamic_index_in_dim(X, i, axis=-2, keepdims=False)
        x_i = x_i - jnp.einsum("...j,...jc->...c", a_i, X, precision=_HI)
        return lax.dynamic_update_index_in_dim(X, x_i, i, axis=-2)

    return lax.fori_loop(1, C, row, jnp.broadcast_to(jnp.eye(C, dtype=A.dtype), A.shape))


def chunk_count_bound(T: int, S: int, chunk_size: int) -> int:
    """Static bound on the chunks of a ragged batch: sum_s ceil(len_s / C) <= (T + S (C-1)) / C."""
    return max(1, min(T, -(-(T + S * (chunk_size - 1)) // chunk_size)))


def chunk_table(query_start_loc, T: int, chunk_size: int):
    """The batch's chunks in order, each inside one sequence: (seq, index of the chunk in its
    sequence, first token, valid tokens (0 for padding chunks), is its sequence's last chunk),
    each [NC] for NC = chunk_count_bound."""
    C = chunk_size
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    S = qsl.shape[0] - 1
    lens = qsl[1:] - qsl[:-1]
    nch = (lens + C - 1) // C
    cc = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch, dtype=jnp.int32)])
    j = jnp.arange(chunk_count_bound(T, S, C), dtype=jnp.int32)
    seq = jnp.minimum(count_le(cc[1:], j), S - 1)
    c = j - cc[seq]
    live = j < cc[S]
    n = jnp.where(live, jnp.clip(lens[seq] - c * C, 0, C), 0)
    last = live & (c == nch[seq] - 1)
    return seq, c, qsl[seq] + c * C, n, last


def ref_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    state,
    query_start_loc,
    initial_slots,
    final_slots=None,
    *,
    snapshot_slots=None,
    scale=None,
    use_qk_l2norm=True,
    layer=None,
    chunk_size=64,
):
    """The chunked gated delta rule (WY representation, flash-linear-attention's
    `chunk_gated_delta_rule` / HF's `torch_chunk_gated_delta_rule`) over a ragged batch: every
    sequence is cut into chunks of `chunk_size` tokens (its last one partial), the intra-chunk
    terms of all chunks are computed at once, then one scan over the chunks carries the state.
    Same arguments and result as `ref_gated_delta_rule` (no position_slots: per-position
    states come from the recurrent form)."""
    T, _, dk, Hv, dv = _check(q, k, v, g, beta, state, layer)
    C = chunk_size
    f32 = jnp.float32
    pool, unflat, init_s, fin_s, snap_s = flat_pool(
        state, layer, initial_slots, final_slots, snapshot_slots, per_slot_ndim=3
    )
    fin_s = init_s if fin_s is None else fin_s
    qf, kf = prepare_qk(q, k, Hv, scale=scale, use_qk_l2norm=use_qk_l2norm)
    seq, cidx, start, n, last = chunk_table(query_start_loc, T, C)
    rows = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]  # [NC, C]
    ok = jnp.arange(C)[None, :] < n[:, None]
    src = jnp.where(ok, rows, 0)

    def gather(x):  # [T, Hv, ...] -> [NC, Hv, C, ...], zeros past each chunk's tokens
        x = x.astype(f32)[src]
        x = jnp.where(ok.reshape(ok.shape + (1,) * (x.ndim - 2)), x, 0.0)
        return jnp.moveaxis(x, 2, 1)

    qc, kc, vc, gc, bc = (gather(x) for x in (qf, kf, v, g, beta))
    gcum = jnp.cumsum(gc, axis=-1)  # [NC, Hv, C]
    i_ = jnp.arange(C)
    strict = i_[None, :] < i_[:, None]  # [i, j]: j < i
    incl = i_[None, :] <= i_[:, None]
    diff = gcum[..., :, None] - gcum[..., None, :]
    decay_strict = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
    decay_incl = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    kb = kc * bc[..., None]
    mm = lambda a, b: jnp.matmul(a, b, precision=_HI)  # noqa: E731
    A = mm(kb, jnp.swapaxes(kc, -1, -2)) * decay_strict
    Tinv = unit_lower_inverse(A)  # (I + A)^-1
    u = mm(Tinv, vc * bc[..., None])
    w = mm(Tinv, kb * jnp.exp(gcum)[..., None])
    attn = mm(qc, jnp.swapaxes(kc, -1, -2)) * decay_incl
    g_last = gcum[..., -1]  # [NC, Hv]
    qg = qc * jnp.exp(gcum)[..., None]
    kd = kc * jnp.exp(g_last[..., None] - gcum)[..., None]
    init = gather_slots(pool, init_s)

    def step(carry, xs):
        pool, h = carry
        u_j, w_j, attn_j, qg_j, kd_j, gl_j, s, c, is_last = xs
        h = jnp.where(c == 0, init[s], h)
        v_new = u_j - mm(w_j, h)  # [Hv, C, dv]
        o = mm(qg_j, h) + mm(attn_j, v_new)
        h = h * jnp.exp(gl_j)[:, None, None] + mm(jnp.swapaxes(kd_j, -1, -2), v_new)
        pool = _write_slot(pool, fin_s[s], h, is_last)
        if snap_s is not None:
            pool = _write_slot(pool, snap_s[s], h, is_last)
        return (pool, h), o

    h0 = jnp.zeros((Hv, dk, dv), f32)
    xs = (u, w, attn, qg, kd, g_last, seq, cidx, last)
    (pool, _), o = lax.scan(step, (pool, h0), xs)  # o [NC, Hv, C, dv]
    dst = jnp.where(ok, rows, T)
    out = jnp.zeros((T, Hv, dv), f32).at[dst].set(jnp.moveaxis(o, 1, 2), mode="drop")
    return out.astype(v.dtype), unflat(pool)


def _conv_taps(x, init, t, s, i, offsets):
    """Conv inputs at index i + off of sequence s (token t + off), for each off in `offsets`
    (<= 0): from x where i + off >= 0, else column K-1 + i + off of the sequence's initial
    state init [S, C, K-1]. t, s, i: [...] int32 -> [..., len(offsets), C] f32."""
    T = x.shape[0]
    K1 = init.shape[-1]
    out = []
    for off in offsets:
        src = i + off
        from_x = x[jnp.clip(t + off, 0, T - 1)].astype(jnp.float32)
        col = jnp.clip(K1 + src, 0, K1 - 1)
        from_state = jnp.take_along_axis(init[s], col[..., None, None], axis=-1)[..., 0]
        out.append(jnp.where((src >= 0)[..., None], from_x, from_state))
    return jnp.stack(out, axis=-2)


def ref_causal_conv1d(
    x,
    weight,
    bias,
    conv_state,
    query_start_loc,
    initial_slots,
    final_slots=None,
    position_slots=None,
    *,
    snapshot_slots=None,
    activation="silu",
    layer=None,
):
    """The causal depthwise conv1d of a Gated DeltaNet layer over a ragged batch, each sequence
    continuing from its conv state (HF: the state prepended, `causal_conv1d_fn`, the last
    len outputs; zeros for a new sequence).

    x [T, C]; weight [C, K] (HF's conv1d.weight [C, 1, K] squeezed); bias [C] or None;
    conv_state pool [N, C, K-1] (or [L, N, C, K-1] with layer) and slots as the module docstring
    says: the state after a token is the last K-1 inputs up to it (older ones from the state
    where the sequence is shorter). activation "silu" or None. Math in f32.
    -> (y [T, C] in x.dtype (0 for padding tokens), the conv state pool updated)."""
    T, C = x.shape
    K = weight.shape[1]
    K1 = K - 1
    if weight.shape != (C, K) or K < 2:
        raise ValueError(f"weight must be [{C}, K >= 2], got {weight.shape}")
    pool, unflat, init_s, fin_s, pos_s, snap_s = flat_pool(
        conv_state,
        layer,
        initial_slots,
        final_slots,
        position_slots,
        snapshot_slots,
        per_slot_ndim=2,
    )
    if pool.shape[1:] != (C, K1):
        raise ValueError(f"conv_state must be [(L,) N, {C}, {K1}], got {conv_state.shape}")
    fin_s = init_s if fin_s is None else fin_s
    # [S, C, K1], materialised: fused into the scatters below (their updates read it), the
    # pool's read made XLA on the GPU copy the whole pool before each layer's scatter
    init = lax.optimization_barrier(gather_slots(pool, init_s))
    seq, idx, valid, lens = seq_of_tokens(query_start_loc, T)
    t = jnp.arange(T, dtype=jnp.int32)
    taps = _conv_taps(x, init, t, seq, idx, range(-K1, 1))  # [T, K, C]
    y = jnp.einsum("tjc,cj->tc", taps, weight.astype(jnp.float32), precision=_HI)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation == "silu":
        y = jax.nn.silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    y = jnp.where(valid[:, None], y, 0.0).astype(x.dtype)

    qsl = jnp.asarray(query_start_loc, jnp.int32)
    S = lens.shape[0]
    s_all = jnp.arange(S, dtype=jnp.int32)

    def window_after(s, i):  # [..] -> [.., C, K1]: the state after token i of sequence s
        w = _conv_taps(x, init, qsl[s] + i, s, i, range(-K1 + 1, 1))
        return jnp.swapaxes(w, -1, -2)

    if pos_s is not None:
        P = pos_s.shape[1]
        p = jnp.arange(P, dtype=jnp.int32)[None, :]
        ss = jnp.broadcast_to(s_all[:, None], (S, P))
        w = window_after(ss, jnp.broadcast_to(p, (S, P)))
        pool = scatter_slots(
            pool, pos_s.reshape(-1), w.reshape(S * P, C, K1), (p < lens[:, None]).reshape(-1)
        )
    w = window_after(s_all, jnp.maximum(lens - 1, 0))
    pool = scatter_slots(pool, fin_s, w, lens > 0)
    if snap_s is not None:
        pool = scatter_slots(pool, snap_s, w, lens > 0)
    return y, unflat(pool)


def split_qkv(y, num_k_heads, head_k_dim, num_v_heads, head_v_dim):
    """The conv output [T, 2 Hk dk + Hv dv] (HF's order: q | k | v) as q, k [T, Hk, dk] and
    v [T, Hv, dv]."""
    T = y.shape[0]
    nk = num_k_heads * head_k_dim
    q = y[:, :nk].reshape(T, num_k_heads, head_k_dim)
    k = y[:, nk : 2 * nk].reshape(T, num_k_heads, head_k_dim)
    v = y[:, 2 * nk :].reshape(T, num_v_heads, head_v_dim)
    return q, k, v


def decode_dims(x, g, state, layer=None):
    """(S-independent) head dims of a decode call: (Hk, dk, Hv, dv) from x [T, C], g [T, Hv] and
    the state pool [(L,) N, Hv, dk, dv]; C must be 2 Hk dk + Hv dv."""
    Hv, dk, dv = state.shape[-3:]
    C = x.shape[1]
    if g.shape != (x.shape[0], Hv):
        raise ValueError(f"g must be [{x.shape[0]}, {Hv}], got {g.shape}")
    nk2 = C - Hv * dv
    if nk2 <= 0 or nk2 % (2 * dk):
        raise ValueError(f"x has {C} channels, not 2 Hk {dk} + {Hv} * {dv}")
    return nk2 // (2 * dk), dk, Hv, dv


def ref_gated_delta_decode(
    x,
    conv_weight,
    conv_bias,
    g,
    beta,
    conv_state,
    state,
    initial_slots,
    final_slots=None,
    position_slots=None,
    *,
    scale=None,
    use_qk_l2norm=True,
    layer=None,
):
    """A decode step of a Gated DeltaNet layer: the conv update (SiLU) then the gated delta rule,
    for m = T / S tokens of each of S sequences (m = 1: plain decode; m = k + 1: a speculative
    verify step, with position_slots for the states after each token).

    x [S * m, C] the in-projection's q | k | v before the conv (C = 2 Hk dk + Hv dv); conv_weight
    [C, K]; conv_bias [C] or None; g, beta [S * m, Hv]; conv_state [N, C, K-1] and state
    [N, Hv, dk, dv] pools (or [L, N, ...] with layer) sharing the slots.
    -> (o [S * m, Hv, dv] in x.dtype, conv_state, state)."""
    Hk, dk, Hv, dv = decode_dims(x, g, state, layer)
    S = initial_slots.shape[0]
    T = x.shape[0]
    if T % S:
        raise ValueError(f"x has {T} tokens, not a multiple of the {S} sequences")
    qsl = jnp.arange(S + 1, dtype=jnp.int32) * (T // S)
    y, conv_state = ref_causal_conv1d(
        x,
        conv_weight,
        conv_bias,
        conv_state,
        qsl,
        initial_slots,
        final_slots,
        position_slots,
        layer=layer,
    )
    q, k, v = split_qkv(y, Hk, dk, Hv, dv)
    o, state = ref_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        state,
        qsl,
        initial_slots,
        final_slots,
        position_slots,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        layer=layer,
    )
    return o, conv_state, state
