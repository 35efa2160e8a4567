"""Gated DeltaNet kernels (kernels_pallas/gated_delta.py, oracles gated_delta_ref.py): the oracles
against a torch copy of HF transformers' Qwen3.5 functions (where torch is installed), chunked ==
recurrent, the Pallas kernels (interpret mode) against the oracles on ragged batches (lengths
crossing the chunk, empty and padding sequences, Hv = 2 Hk, non-zero initial states, new
sequences, per-position states for verification, a layer of a stacked pool), input checks, and
CUDA lowering at Qwen3.5 shapes (Triton's rules are only enforced there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta import causal_conv1d, gated_delta_decode, gated_delta_rule
from kernels_pallas.gated_delta_ref import (
    gdn_gating,
    ref_causal_conv1d,
    ref_chunk_gated_delta_rule,
    ref_gated_delta_decode,
    ref_gated_delta_rule,
    split_qkv,
)
from kernels_pallas.lowering import lower_for_cuda

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the jax 0.11 venv has no torch: those tests skip
    torch = F = None

# --- a torch copy of HF transformers 5.x models/qwen3_5/modeling_qwen3_5.py (the functions the
# kernels implement; the hub-kernel decorators and comments dropped) ---------------------------


def hf_l2norm(x, dim=-1, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def hf_causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    _, hidden_size, seq_len = hidden_states.shape
    state_len = conv_state.shape[-1]
    hidden_states_new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(hidden_states_new[:, :, -state_len:])
    out = F.conv1d(hidden_states_new, weight.unsqueeze(1), bias, padding=0, groups=hidden_size)
    out = out[:, :, -seq_len:]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype)


def hf_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None):
    _, hidden_size, seq_len = hidden_states.shape
    padding = weight.shape[-1] - 1
    out = F.conv1d(
        hidden_states.to(weight.dtype),
        weight=weight.unsqueeze(1),
        bias=bias,
        padding=padding,
        groups=hidden_size,
    )[:, :, :seq_len]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype)


def hf_chunk_gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):
    initial_dtype = query.dtype
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
    padded_output_shape = (batch_size, num_v_heads, -1, v_head_dim)
    decay = g
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, decay)
    ]
    if use_qk_l2norm_in_kernel:
        query = hf_l2norm(query, dim=-1, eps=1e-6)
        key = hf_l2norm(key, dim=-1, eps=1e-6)
    scaling = query.shape[-1] ** -0.5
    query = query * scaling
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    total_sequence_length = sequence_length + pad_size
    num_chunks = total_sequence_length // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
        for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise_decay = pairwise_decay.masked_fill(strictly_upper_mask, float("-inf"))
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, decayed_k_beta, upper=False, unitriangular=True
    )
    if initial_state is None:
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=new_values.dtype)
    else:
        last_recurrent_state = initial_state.to(new_values)
    core_attn_out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ last_recurrent_state
        inter_chunk_attn = query[:, :, i] @ last_recurrent_state
        core_attn_out[:, :, i] = inter_chunk_attn + intra_chunk_attn[:, :, i] @ v_new
        last_recurrent_state = (
            last_recurrent_state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
        )
    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.reshape(padded_output_shape)
    core_attn_out = core_attn_out[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).to(
        initial_dtype, memory_format=torch.contiguous_format
    )
    return core_attn_out, last_recurrent_state


def hf_recurrent_gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
):
    initial_dtype = query.dtype
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    decay = g
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, decay)
    ]
    if use_qk_l2norm_in_kernel:
        query = hf_l2norm(query, dim=-1, eps=1e-6)
        key = hf_l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    if initial_state is None:
        recurrent_state_shape = (batch_size, num_v_heads, k_head_dim, v_head_dim)
        last_recurrent_state = torch.zeros(recurrent_state_shape, dtype=value.dtype)
    else:
        last_recurrent_state = initial_state.to(value)
    core_attn_out = torch.zeros_like(value)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        decay_t = decay[:, :, i].exp()[..., None, None]
        last_recurrent_state = last_recurrent_state * decay_t
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
    last_recurrent_state = None if not output_final_state else last_recurrent_state
    core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
    return core_attn_out, last_recurrent_state


def hf_gating(a, b, A_log, dt_bias):  # Qwen3_5GatedDeltaNet.forward's beta and g
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


# --- random ragged batches -----------------------------------------------------------------------


def _t(x):  # (numpy in: slicing jax arrays eagerly compiles a program per shape)
    return torch.tensor(np.asarray(x, np.float32))


def _f(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _gating(rng, T, Hv):
    """g, beta [T, Hv] as the layer makes them (decays from ~1 down to ~e^-10 a token)."""
    a = rng.standard_normal((T, Hv))
    b = rng.standard_normal((T, Hv))
    A_log = np.log(rng.uniform(0.01, 4.0, Hv))
    dt_bias = rng.standard_normal(Hv)
    return gdn_gating(*(jnp.asarray(x, jnp.float32) for x in (a, b, A_log, dt_bias)))


def _slots(S_live, S, N, rng, new=(1,)):
    """Slots of S_live live sequences (then S - S_live empty padding rows with slot 0, as the
    engine pads), from 1..N-1: distinct initial slots (-1 for the `new` sequences), final slots
    = initial slots (in place), fresh ones for the new sequences."""
    perm = 1 + rng.permutation(N - 1)
    init = perm[:S_live].copy()
    fin = init.copy()
    for j, s in enumerate(new):
        init[s] = -1
        fin[s] = perm[S_live + j]
    pad = np.zeros(S - S_live, np.int64)
    return (
        jnp.asarray(np.concatenate([init, pad]), jnp.int32),
        jnp.asarray(np.concatenate([fin, pad]), jnp.int32),
    )


def _batch(lens, *, T, S, Hk=2, Hv=4, dk=16, dv=32, P=0, dtype=jnp.float32, seed=0):
    """A ragged batch: T tokens (padding past the lens), S sequence rows (empty ones past them),
    a pool of 2 S + 4 slots (+ S P for the per-position states of P tokens a sequence, past the
    others; the last position of sequence 0 not kept)."""
    rng = np.random.default_rng(seed)
    n = sum(lens)
    N0 = 2 * S + 4
    qsl = np.zeros(S + 1, np.int32)
    qsl[1 : len(lens) + 1] = np.cumsum(lens)
    qsl[len(lens) + 1 :] = n
    g, beta = _gating(rng, T, Hv)
    init, fin = _slots(len(lens), S, N0, rng)
    pos = None
    if P:
        pos = np.arange(S * P).reshape(S, P) + N0
        pos[0, -1] = -1
        pos = jnp.asarray(pos, jnp.int32)
    return dict(
        q=jnp.asarray(rng.standard_normal((T, Hk, dk)), dtype),
        k=jnp.asarray(rng.standard_normal((T, Hk, dk)), dtype),
        v=jnp.asarray(rng.standard_normal((T, Hv, dv)), dtype),
        g=g,
        beta=beta,
        state=jnp.asarray(rng.standard_normal((N0 + S * P, Hv, dk, dv)) * 0.5, jnp.float32),
        qsl=jnp.asarray(qsl),
        init=init,
        fin=fin,
        pos=pos,
        n=n,
    )


def _args(b):
    return (b["q"], b["k"], b["v"], b["g"], b["beta"], b["state"], b["qsl"], b["init"], b["fin"])


def _untouched(st, before, written):
    st, before = _f(st), _f(before)
    for slot in set(range(st.shape[0])) - set(written):
        assert (st[slot] == before[slot]).all()


LENS = [1, 63, 64, 65, 130, 0, 7]  # crossing the 64-token chunk, an empty sequence
P_RAGGED = 3


@pytest.fixture(scope="module")
def ragged():
    """LENS + 5 padding tokens + an empty padding row, Hv = 2 Hk, states after the first 3
    tokens of each sequence kept; both oracles run once (jitted: eager dispatch costs seconds)."""
    b = _batch(LENS, T=sum(LENS) + 5, S=len(LENS) + 1, P=P_RAGGED)
    return dict(
        b=b,
        rec=jax.jit(ref_gated_delta_rule)(*_args(b), b["pos"]),
        chunk=jax.jit(ref_chunk_gated_delta_rule)(*_args(b)),
    )


def _written(b, P=0):
    lens = np.diff(np.asarray(b["qsl"]))
    out = [int(b["fin"][s]) for s in range(len(lens)) if lens[s]]
    if P:
        out += [int(b["pos"][s, p]) for s in range(len(lens)) for p in range(min(lens[s], P))]
    return out


# --- the oracles against HF -----------------------------------------------------------------------


def test_gating_against_hf():
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    A_log, dt = np.log(rng.uniform(0.01, 16, 4)), rng.standard_normal(4)
    g, beta = gdn_gating(*(jnp.asarray(x, jnp.float32) for x in (a, b, A_log, dt)))
    hg, hb = hf_gating(*(torch.tensor(x, dtype=torch.float32) for x in (a, b, A_log, dt)))
    np.testing.assert_allclose(_f(g), hg.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_f(beta), hb.numpy(), rtol=1e-6)
    assert (_f(g) <= 0).all() and ((_f(beta) > 0) & (_f(beta) < 1)).all()


def test_delta_rule_oracles_against_hf(ragged):
    """Both oracles against HF's chunked and recurrent functions, sequence by sequence, from
    non-zero initial states (zeros for the new sequence); the recurrent one's states after each
    of the first tokens against HF's on those prefixes; padding and empty rows."""
    pytest.importorskip("torch")
    b = ragged["b"]
    (o_r, st_r), (o_c, st_c) = (tuple(map(_f, ragged[x])) for x in ("rec", "chunk"))
    qsl, init, fin, pos = (np.asarray(b[x]) for x in ("qsl", "init", "fin", "pos"))
    nb = {x: _f(b[x]) for x in ("q", "k", "v", "g", "beta", "state")}
    tol = dict(rtol=1e-4, atol=1e-5)
    for s, n in enumerate(LENS):
        sl = slice(qsl[s], qsl[s + 1])
        x = [_t(nb[name][sl])[None] for name in ("q", "k", "v", "g", "beta")]
        h0 = _t(nb["state"][init[s]])[None] if init[s] >= 0 else None
        kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        ho_c, hs_c = hf_chunk_gated_delta_rule(*x, **kw)
        ho_r, hs_r = hf_recurrent_gated_delta_rule(*x, **kw)
        np.testing.assert_allclose(ho_c.numpy(), ho_r.numpy(), **tol)
        for o, st in ((o_r, st_r), (o_c, st_c)):
            np.testing.assert_allclose(o[sl], ho_c[0].numpy(), **tol)
            if n:
                np.testing.assert_allclose(st[fin[s]], hs_c[0].numpy(), **tol)
        for p in range(min(n, P_RAGGED)):
            if pos[s, p] >= 0:
                _, hs_p = hf_recurrent_gated_delta_rule(*(y[:, : p + 1] for y in x), **kw)
                np.testing.assert_allclose(st_r[pos[s, p]], hs_p[0].numpy(), **tol)
    for o in (o_r, o_c):
        assert not o[b["n"] :].any()  # padding tokens
    _untouched(st_r, nb["state"], _written(b, P_RAGGED))
    _untouched(st_c, nb["state"], _written(b))


def _hf_conv_prefill(x, state, w, bias):
    """HF's prefill conv of one sequence continuing from its state (causal_conv1d_forward with a
    cache: the state prepended, causal_conv1d_fn, the last n outputs) and the new state."""
    n = x.shape[0]
    xs = torch.cat([state, x.T], dim=-1)[None]  # [1, C, K-1 + n]
    y = hf_causal_conv1d_fn(xs, w, bias, activation="silu")[0, :, -n:].T
    return y, xs[0, :, -state.shape[-1] :]


def test_conv_oracle_against_hf():
    """The ragged conv against HF's prefill conv (sequences shorter than K - 1 keep part of the
    old state) and its per-position states against HF's decode update, token by token."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    lens, C, K, P = [1, 2, 0, 7, 3], 12, 4, 3
    T, S = sum(lens) + 3, len(lens)
    N = 8 + S * P
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, K)) * 0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(C) * 0.1, jnp.float32)
    pool = jnp.asarray(rng.standard_normal((N, C, K - 1)), jnp.float32)
    init, fin = _slots(S, S, 8, rng, new=(3,))
    pos = jnp.asarray(np.arange(S * P).reshape(S, P) + 8, jnp.int32)  # slots 8..
    pos = pos.at[0, 1].set(-1)
    y, new = jax.jit(causal_conv1d)(x, w, bias, pool, qsl, init, fin, pos)  # = the oracle
    y, new, x, pool, qsl, init, fin, pos = (
        np.asarray(a) for a in (y, new, x, pool, qsl, init, fin, pos)
    )
    assert not y[sum(lens) :].any()  # padding tokens
    tw, tb = _t(w), _t(bias)
    written = []
    for s, n in enumerate(lens):
        sl = slice(int(qsl[s]), int(qsl[s + 1]))
        st0 = _t(pool[init[s]]) if init[s] >= 0 else torch.zeros(C, K - 1)
        if n:
            hy, hs = _hf_conv_prefill(_t(x[sl]), st0, tw, tb)
            np.testing.assert_allclose(y[sl], hy.numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(new[fin[s]], hs.numpy(), rtol=1e-6)
            written.append(int(fin[s]))
        state = st0[None].clone()
        for p in range(min(n, P)):  # decode steps: the update and the state after each token
            yt = hf_causal_conv1d_update(_t(x[sl][p : p + 1]).T[None], state, tw, tb, "silu")
            np.testing.assert_allclose(y[sl][p], yt[0, :, 0].numpy(), rtol=1e-5, atol=1e-6)
            if pos[s, p] >= 0:
                np.testing.assert_allclose(new[pos[s, p]], state[0].numpy(), rtol=1e-6)
                written.append(int(pos[s, p]))
    _untouched(new, pool, written)


def _decode_batch(S, m, *, Hk=2, Hv=4, dk=16, dv=32, K=4, dtype=jnp.float32, P=0, seed=2):
    rng = np.random.default_rng(seed)
    T, C, N = S * m, 2 * Hk * dk + Hv * dv, 2 * S + S * P + 2
    g, beta = _gating(rng, T, Hv)
    init, fin = _slots(S, S, 2 * S + 2, rng, new=(S - 1,))
    d = dict(
        x=jnp.asarray(rng.standard_normal((T, C)), dtype),
        w=jnp.asarray(rng.standard_normal((C, K)) * 0.5, dtype),
        bias=jnp.asarray(rng.standard_normal(C) * 0.1, dtype),
        g=g,
        beta=beta,
        conv=jnp.asarray(rng.standard_normal((N, C, K - 1)), dtype),
        state=jnp.asarray(rng.standard_normal((N, Hv, dk, dv)) * 0.5, jnp.float32),
        init=init,
        fin=fin,
        pos=None,
        dims=(Hk, dk, Hv, dv),
    )
    if P:  # slots past the others', one position not kept
        pos = np.arange(S * P).reshape(S, P) + 2 * S + 2
        pos[0, -1] = -1
        d["pos"] = jnp.asarray(pos, jnp.int32)
    return d


def _dargs(d, bias=True):
    return (d["x"], d["w"], d["bias"] if bias else None, d["g"], d["beta"], d["conv"], d["state"])


def _dslots(d):
    return (d["init"], d["fin"]) + (() if d["pos"] is None else (d["pos"],))


@pytest.fixture(scope="module")
def verify_step():
    """A verify step: 3 tokens of each of 3 sequences, the states after each kept; its oracle."""
    d = _decode_batch(3, 3, P=3)
    return d, jax.jit(ref_gated_delta_decode)(*_dargs(d), *_dslots(d))


def test_decode_oracle_against_hf(verify_step):
    """The decode step (m = 3 tokens a sequence, per-position states) against HF's decode path
    token by token: causal_conv1d_update, split, recurrent rule with the cached state."""
    pytest.importorskip("torch")
    d, out = verify_step
    o, conv, state = map(_f, out)
    d = {
        x: (_f(y) if x in ("x", "w", "bias", "g", "beta", "conv", "state") else y)
        for x, y in d.items()
    }
    S, m = 3, 3
    Hk, dk, Hv, dv = d["dims"]
    init, fin, pos = (np.asarray(d[x]) for x in ("init", "fin", "pos"))
    tw, tb = _t(d["w"]), _t(d["bias"])
    C, K = d["w"].shape
    nk = Hk * dk
    tol = dict(rtol=1e-4, atol=1e-5)
    for s in range(S):
        cs = _t(d["conv"][init[s]])[None] if init[s] >= 0 else torch.zeros(1, C, K - 1)
        h = _t(d["state"][init[s]])[None] if init[s] >= 0 else None
        for p in range(m):
            t = s * m + p
            y = hf_causal_conv1d_update(_t(d["x"][t : t + 1]).T[None], cs, tw, tb, "silu")
            y = y[0, :, 0]
            ho, h = hf_recurrent_gated_delta_rule(
                y[:nk].reshape(1, 1, Hk, dk),
                y[nk : 2 * nk].reshape(1, 1, Hk, dk),
                y[2 * nk :].reshape(1, 1, Hv, dv),
                _t(d["g"][t : t + 1])[None],
                _t(d["beta"][t : t + 1])[None],
                initial_state=h,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            np.testing.assert_allclose(o[t], ho[0, 0].numpy(), **tol)
            if pos[s, p] >= 0:
                np.testing.assert_allclose(state[pos[s, p]], h[0].numpy(), **tol)
                np.testing.assert_allclose(conv[pos[s, p]], cs[0].numpy(), rtol=1e-6)
        np.testing.assert_allclose(state[fin[s]], h[0].numpy(), **tol)
        np.testing.assert_allclose(conv[fin[s]], cs[0].numpy(), rtol=1e-6)


# --- the Pallas kernels (interpret mode) against the oracles --------------------------------------


def _close(got, want, dtype):
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2.0**-7, atol=1e-3)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(_f(got), _f(want), **tol)


def test_chunk_kernel_against_oracle(ragged):
    """Chunks of 64 (FLA's), IEEE f32 dots, dv 32 in two blocks of 16."""
    b, (o_c, st_c) = ragged["b"], ragged["chunk"]
    kw = dict(impl="chunk", chunk_size=64, precision="ieee", block_v=16, interpret=True)
    run = jax.jit(lambda *a: gated_delta_rule(*a, **kw))
    o, st = run(*_args(b))
    _close(o, o_c, jnp.float32)
    _close(st, st_c, jnp.float32)
    assert not _f(o)[b["n"] :].any()
    _untouched(st, b["state"], _written(b))


def test_snapshot_slots_copy_each_final_state():
    """snapshot_slots (the prefix cache's copies): the chunk kernel and the chunked oracle also
    write each sequence's final state there, nowhere else (sequence 0 passes -1, an empty
    sequence writes nothing); sequences of 1-3 tokens (token by token in the kernel) among
    longer ones."""
    lens = [2, 17, 1, 0, 3, 40]
    b = _batch(lens, T=sum(lens) + 3, S=len(lens) + 1, P=1)
    snap = b["pos"][:, 0]
    kw = dict(snapshot_slots=snap)
    o_c, st_c = jax.jit(lambda *a: ref_chunk_gated_delta_rule(*a, chunk_size=16, **kw))(*_args(b))
    kern = dict(precision="ieee", block_v=16, interpret=True, **kw)
    o_k, st_k = jax.jit(lambda *a: gated_delta_rule(*a, **kern))(*_args(b))
    _close(o_k, o_c, jnp.float32)
    _close(st_k, st_c, jnp.float32)
    copies = [(int(snap[s]), int(b["fin"][s])) for s, n in enumerate(lens) if n and snap[s] >= 0]
    assert len(copies) == 4
    for st in (_f(st_c), _f(st_k)):
        for dst, src in copies:
            assert (st[dst] == st[src]).all()
    _untouched(st_k, b["state"], _written(b) + [d for d, _ in copies])


def test_recurrent_kernel_against_oracle(ragged):
    """Token by token, with the states after each of the first 3 tokens (one past the end of
    the 1-token sequence: not written)."""
    b, (o_r, st_r) = ragged["b"], ragged["rec"]
    run = jax.jit(lambda *a: gated_delta_rule(*a, impl="recurrent", interpret=True))
    o, st = run(*_args(b), b["pos"])
    _close(o, o_r, jnp.float32)
    _close(st, st_r, jnp.float32)
    _untouched(st, b["state"], _written(b, P_RAGGED))


def test_bf16_stacked_pool_chunked_equals_recurrent():
    """bf16 inputs, a layer of a [L, N, ...] pool (the other layer untouched), Hv = 2 Hk = 2:
    the recurrent oracle, the chunked oracle (chunks of 32) and the chunk kernel at its
    defaults (chunks of 16, bf16 dot operands: within 1% of the f32 math) agree."""
    b = _batch([17, 1, 40, 16, 0], T=80, S=6, Hk=1, Hv=2, dk=16, dv=16, dtype=jnp.bfloat16)
    stacked = jnp.stack([b["state"], b["state"] + 1.0])
    args = _args(b)[:5] + (stacked,) + _args(b)[6:]
    o_r, st_r = jax.jit(lambda *a: ref_gated_delta_rule(*a, layer=jnp.int32(1)))(*args)
    o_c, st_c = jax.jit(lambda *a: ref_chunk_gated_delta_rule(*a, layer=1, chunk_size=32))(*args)
    kw = dict(layer=1, interpret=True)
    o_k, st_k = jax.jit(lambda *a: gated_delta_rule(*a, **kw))(*args)
    _close(o_c, o_r, jnp.bfloat16)
    _close(st_c, st_r, jnp.float32)
    n = b["n"]
    assert o_k.dtype == jnp.bfloat16 and not _f(o_k)[n:].any()
    assert np.linalg.norm(_f(o_k) - _f(o_r)) < 1e-2 * np.linalg.norm(_f(o_r))
    assert np.linalg.norm(_f(st_k) - _f(st_r)) < 1e-2 * np.linalg.norm(_f(st_r))
    for st in (st_c, st_k):
        assert (_f(st)[0] == _f(b["state"])).all()


@pytest.mark.parametrize("case", ["decode_bf16_nobias", "verify_positions"])
def test_decode_kernel_against_oracle(case, verify_step):
    if case == "verify_positions":  # 3 tokens a sequence, their states kept, 2 dv blocks
        (d, want), dtype, block_v, bias = verify_step, jnp.float32, 16, True
    else:  # plain decode, 4 sequences, no conv bias
        d, dtype, block_v, bias = (
            _decode_batch(4, 1, dtype=jnp.bfloat16, seed=5),
            jnp.bfloat16,
            None,
            False,
        )
        want = jax.jit(ref_gated_delta_decode)(*_dargs(d, bias), *_dslots(d))
    run = jax.jit(
        lambda *a: gated_delta_decode(*a, block_v=block_v, interpret=True), donate_argnums=(5, 6)
    )
    pools = (jnp.array(d["conv"]), jnp.array(d["state"]))  # copies: donated
    got = run(*_dargs(d, bias)[:5], *pools, *_dslots(d))
    _close(got[0], want[0], dtype)
    assert (_f(got[1]) == _f(want[1])).all()  # the conv states: copies of inputs
    _close(got[2], want[2], jnp.float32)


def test_ragged_fused_step_against_oracles():
    """The model's small steps (query_start_loc): rows of 1, 5, 0 and 2 tokens, an empty
    padding row and padding tokens, the gating computed in the kernel from the raw a, b, a
    snapshot copy of two rows' final states and windows (one row passes -1, the empty one has a
    slot: nothing written), a layer of a stacked bf16 pool; against the conv oracle, gdn_gating
    and the recurrent oracle."""
    rng = np.random.default_rng(11)
    lens, T, L = [1, 5, 0, 2], 10, 2
    Hk, Hv, dk, dv, K = 2, 4, 16, 32, 4
    C, N = 2 * Hk * dk + Hv * dv, 16
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [sum(lens)]]), jnp.int32)
    init = jnp.asarray([3, -1, 5, 7, 0], jnp.int32)  # row 1 new, row 4 padding
    fin = jnp.asarray([3, 9, 5, 7, 0], jnp.int32)
    snap = jnp.asarray([11, -1, 12, 13, -1], jnp.int32)
    bf = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((T, C)), bf)
    w = jnp.asarray(rng.standard_normal((C, K)) * 0.5, bf)
    a, b = (jnp.asarray(rng.standard_normal((T, Hv)), bf) for _ in range(2))
    A_log = jnp.asarray(np.log(rng.uniform(0.01, 4.0, Hv)), jnp.float32)
    dt = jnp.asarray(rng.standard_normal(Hv), jnp.float32)
    conv = jnp.asarray(rng.standard_normal((L, N, C, K - 1)), bf)
    state = jnp.asarray(rng.standard_normal((L, N, Hv, dk, dv)) * 0.5, bf)
    layer = jnp.int32(1)
    slots = dict(snapshot_slots=snap, layer=layer)

    def oracle(x, a, b, conv, state):
        y, conv = ref_causal_conv1d(x, w, None, conv, qsl, init, fin, **slots)
        q, k, v = split_qkv(y, Hk, dk, Hv, dv)
        g, beta = gdn_gating(a, b, A_log, dt)
        o, state = ref_chunk_gated_delta_rule(q, k, v, g, beta, state, qsl, init, fin, **slots)
        return o, conv, state

    def kernel(x, a, b, conv, state):
        kw = dict(query_start_loc=qsl, gating=(A_log, dt), interpret=True, **slots)
        return gated_delta_decode(x, w, None, a, b, conv, state, init, fin, **kw)

    want = jax.jit(oracle)(x, a, b, conv, state)
    got = jax.jit(kernel, donate_argnums=(3, 4))(x, a, b, jnp.array(conv), jnp.array(state))
    o, o_want = _f(got[0]), _f(want[0])
    assert got[0].dtype == bf and not o[sum(lens) :].any()
    assert np.linalg.norm(o - o_want) < 1e-2 * np.linalg.norm(o_want)
    assert (_f(got[1]) == _f(want[1])).all()  # the conv windows: copies of inputs
    np.testing.assert_allclose(_f(got[2]), _f(want[2]), rtol=2.0**-6, atol=2e-2)
    written = [3, 9, 7, 11, 13]  # final slots of rows with tokens, their snapshots
    for new, old in ((got[1], conv), (got[2], state)):
        assert (_f(new)[0] == _f(old)[0]).all()  # the other layer
        _untouched(new[1], old[1], written)
    assert (_f(got[2])[1, 11] == _f(got[2])[1, 3]).all()  # a snapshot equals its final state


def test_input_checks():
    b = _batch([3, 1], T=4, S=2)
    a = _args(b)
    with pytest.raises(ValueError, match="position_slots need"):
        gated_delta_rule(*a, jnp.zeros((1, 2), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        gated_delta_rule(*a, block_v=24, interpret=True)
    with pytest.raises(ValueError, match="powers of 2"):
        gated_delta_rule(*a, chunk_size=48, interpret=True)
    with pytest.raises(ValueError, match="precision"):
        gated_delta_rule(*a, precision="fp8", interpret=True)
    with pytest.raises(ValueError, match="impl"):
        gated_delta_rule(*a, impl="fast", interpret=True)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule(*a[:5], b["state"][:, :, :8], *a[6:], interpret=True)
    d = _decode_batch(2, 1)
    with pytest.raises(ValueError, match="channels"):
        gated_delta_decode(d["x"][:, 1:], *_dargs(d)[1:], d["init"], interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_decode(*_dargs(d), d["init"][:1].repeat(3), interpret=True)


# --- CUDA lowering at Qwen3.5 shapes --------------------------------------------------------------

QWEN35_9B = dict(Hk=16, Hv=32, dk=128, dv=128)
LOWER = {
    # prefill / mixed steps: chunked, and the recurrent form with per-position states
    "chunk_8192": dict(kind="chunk", T=8192, S=4, **QWEN35_9B),
    "chunk_512_c64_ieee_bv128": dict(
        kind="chunk", T=512, S=64, chunk_size=64, block_v=128, precision="ieee", **QWEN35_9B
    ),
    "chunk_2048_c32_tf32_bv32_w8": dict(
        kind="chunk",
        T=2048,
        S=8,
        chunk_size=32,
        block_v=32,
        precision="tf32",
        num_warps=8,
        **QWEN35_9B,
    ),
    "recurrent_pos": dict(kind="recurrent", T=256, S=64, P=4, **QWEN35_9B),
    # decode buckets, a verify step of 4 tokens a sequence, a 48-value-head model
    "decode_b1": dict(kind="decode", T=1, S=1, **QWEN35_9B),
    "decode_b256": dict(kind="decode", T=256, S=256, **QWEN35_9B),
    "verify_b16_m4": dict(kind="decode", T=64, S=16, P=4, **QWEN35_9B),
    "decode_hv48_stacked": dict(kind="decode", T=8, S=8, Hk=16, Hv=48, dk=128, dv=128, L=3),
    # the model's small ragged steps: gating in the kernel, snapshot copies, a stacked pool
    "fused_ragged_64x8": dict(kind="fused", T=64, S=8, L=24, **QWEN35_9B),
    "fused_ragged_1x8": dict(kind="fused", T=1, S=8, L=24, **QWEN35_9B),
}


@pytest.mark.parametrize("name", list(LOWER))
def test_lowers_for_cuda(name):
    c = dict(LOWER[name])
    kind, T, S, P, L = c.pop("kind"), c.pop("T"), c.pop("S"), c.pop("P", 0), c.pop("L", 0)
    Hk, Hv, dk, dv = (c.pop(x) for x in ("Hk", "Hv", "dk", "dv"))
    sd, bf16, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    N, K = 64, 4
    lead = (L,) if L else ()
    layer = dict(layer=jnp.int32(1)) if L else {}
    slots = [sd((S,), i32), sd((S,), i32)] + ([sd((S, P), i32)] if P else [])
    gb = [sd((T, Hv), f32), sd((T, Hv), f32)]
    state = sd(lead + (N, Hv, dk, dv), f32)
    if kind in ("decode", "fused"):
        C = 2 * Hk * dk + Hv * dv
        if kind == "fused":  # raw a, b (bf16), the per-head gating weights, qsl and snapshots
            gb = [sd((T, Hv), bf16), sd((T, Hv), bf16)]
            state = sd(lead + (N, Hv, dk, dv), bf16)
            heads = jnp.zeros((Hv,), f32)
            c.update(gating=(heads, heads), query_start_loc=jnp.zeros((S + 1,), i32))
            c["snapshot_slots"] = jnp.zeros((S,), i32)

        def fn(x, w, g, beta, conv, st, *sl):
            return gated_delta_decode(x, w, None, g, beta, conv, st, *sl, **layer, **c)

        args = [sd((T, C), bf16), sd((C, K), bf16), *gb, sd(lead + (N, C, K - 1), bf16), state]
        donate = (4, 5)
    else:

        def fn(q, k, v, g, beta, st, qsl, *sl):
            return gated_delta_rule(q, k, v, g, beta, st, qsl, *sl, impl=kind, **layer, **c)

        qk = sd((T, Hk, dk), bf16)
        args = [qk, qk, sd((T, Hv, dv), bf16), *gb, state, sd((S + 1,), i32)]
        donate = (5,)
    txt = lower_for_cuda(jax.jit(fn, donate_argnums=donate), *args, *slots).mlir_module()
    assert "triton" in txt
