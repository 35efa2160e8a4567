"""Gated DeltaNet kernels for Qwen3.5's linear-attention layers (issue #54, item 4): Pallas
(Triton lowering) versions of the oracles in `gated_delta_ref.py`, whose docstring has the math,
the ragged batch and the state pools (slots) they share.

    gated_delta_rule(q, k, v, g, beta, state, query_start_loc, initial_slots,
                     final_slots=None, position_slots=None, *, snapshot_slots=None,
                     impl="chunk") -> (o, state)
        prefill / mixed steps: impl="chunk" (WY form, chunks of 16 tokens by default, bf16
        dot operands, the kernel in gated_delta_chunk.py; a sequence of fewer than its
        TOKEN_BY_TOKEN_BELOW tokens token by token in f32; snapshot_slots: a second copy of
        each final state, for the prefix cache; no position_slots) or impl="recurrent"
        (token by token, f32; position_slots allowed).
    gated_delta_decode(x, conv_weight, conv_bias, g, beta, conv_state, state, initial_slots,
                       final_slots=None, position_slots=None, *, query_start_loc=None,
                       snapshot_slots=None, gating=None) -> (o, conv_state, state)
        decode / verify steps: m = T / S tokens a sequence, the conv update (SiLU) fused with
        the recurrence; with query_start_loc any ragged small step (the model's steps of up
        to gated_deltanet.FUSED_STEP_MAX_TOKENS), with gating the g / beta of the raw a, b too.
    causal_conv1d(...)  the prefill conv with its state: the jnp oracle (gathers and a K-tap
        sum that XLA fuses; no kernel of its own, not measured).

The pools are updated in place (`input_output_aliases`): under `jax.jit(...,
donate_argnums=...)` nothing is copied. Only the slots written change.

Work decomposition (all static shapes; the data decides which programs do work):

* grid = (S, Hv, dv / block_v): a program owns one sequence, one value head and block_v of its
  dv columns; its state block [dk, block_v] (f32) stays in registers for the whole sequence.
  The key head is h // (Hv / Hk). A sequence with no tokens returns at once and writes nothing.
* chunk (prefill): the sequence in chunks of C tokens (the last one masked). Per chunk:
  q, k l2-normalised in f32, the in-chunk cumulative log-decay gc (a masked row sum),
  A = strictly-lower (beta k k^T * exp(gc_i - gc_j)), T = (I + A)^-1 by forward substitution
  (C row steps on the register tile), u = T (beta v), w = T (beta exp(gc) k); then
  v' = u - w S, o = (exp(gc) q) S + tril(q k^T * exp(gc_i - gc_j)) v',
  S = exp(gc_last) S + (exp(gc_last - gc) k)^T v'. The dots take f32 operands as IEEE
  ("ieee") or TF32 ("tf32") or bf16 operands ("bf16", FLA's choice), f32 accumulation; the rest
  is f32. C = 16 (the smallest Triton dot) is fastest: the substitution and the intra-chunk
  terms grow with C, the state terms per token do not. k-side work (A, T, w) is repeated by the
  Hv / Hk value heads and the dv / block_v blocks sharing a key head (4x at Qwen3.5-9B shapes).
* recurrent / decode: token by token, S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q, as
  vector ops on the [dk, block_v] tile. With the conv (decode): the program's q, k and v
  channels, their K - 1 previous inputs carried in registers (from the conv pool at the start),
  the conv output rounded to x's dtype like the unfused path; the q / k channels' conv state is
  written by the program of the key head's first value head and first dv block only.
* Speculative verification (position_slots [S, P]): the state (and conv state) after each of
  the first P tokens of a sequence goes to its own slot, so a verify step of k + 1 tokens per
  sequence leaves every prefix's state behind; after accepting a tokens the state to continue
  from is at position_slots[s, a - 1]: the engine then reads from that slot (initial_slots of
  the next step) or copies it home. The engine reserves those P slots per sequence in the pool.
  (The chunked form keeps no per-position states: verify steps go through the decode or the
  recurrent kernel.)
* Rows a program does not own are never stored; padding tokens of a ragged call are zeros (the
  output buffer starts zeroed and is aliased in).

How a step calls them (slots as `gated_delta_ref`'s docstring says): a request's first prefill
chunk passes initial slot -1 (its slot may hold a finished request's state) and final slot = its
slot; later chunks and decode steps pass its slot for both. Padding rows: empty sequences in
`gated_delta_rule` write nothing whatever their slots; a decode call's rows always have m
tokens, so its padding rows must pass -1 as both slots. Prefill: `causal_conv1d` on the
in-projection's q | k | v, split, `gated_delta_rule`; decode / verify: `gated_delta_decode` on
the in-projection's output directly. g, beta from `gated_delta_ref.gdn_gating`.

Triton lowering like the attention kernels (`attention.py`: runs on jax 0.10 and 0.11, interpret
mode on a CPU, CUDA lowering checked on a CPU: `lowering.lower_for_cuda`). Block shapes: dk,
block_v and the chunk are powers of two (>= 16 for the chunk kernel's dots).

Measured (H100 80GB HBM3, jax 0.11.2, one run; `python -m kernels_pallas.gated_delta_bench
--sweep`; Qwen3.5-9B shapes: 16 key / 32 value heads of 128, bf16 inputs, f32 states, one layer,
microseconds a call; the error is ||out - oracle|| / ||oracle|| against the f32 chunked oracle):

    prefill               chunk bf16 c16   tf32 c16   ieee c64   recurrent   XLA (chunked oracle)
    4 x 1024 tokens             420          617       29,947      1,590        4,217
    64 x 64                     497          680       30,029      1,318        8,028
    1 x 8192                  2,622        3,658      126,356         -         8,127
    300, 17, 1000, 700          403          583       21,085      1,501        2,397
    output error             4.2e-3       1.4e-3       3.1e-5      4.2e-5

IEEE f32 dots are 50-70x slower than tensor-core ones in Triton, so the default is bf16
operands (output error 4.2e-3, about a bf16 output's own rounding; state 1e-3); "tf32" costs
1.4x for 3x less error. block_v 32 / 128 and chunks of 32 / 64 were slower (block_v 128: 412
against 497 us at 64 x 64, slower elsewhere). A lone long sequence has only Hv * dv / block_v
programs (64): 1 x 8192 runs at a third of the tokens per second of 4 x 1024.

    decode (m tokens a seq.)   kernel, block_v / warps     XLA (conv oracle + one vectorised step)
                               64 / 4    32 / 2    32 / 4
    S = 1                       64.1      47.8      96.1        68.7
    S = 8                      112.7     116.7     122.7        85.9
    S = 64                     131.9     143.7     141.9       551.6
    S = 256                    498.9     529.7     521.9     2,112.2
    S = 16, m = 4, P = 4       108.3     119.9     119.3          -

A decode step must read and write every state (4 MiB a sequence and layer in f32): 64 and 256
sequences run at ~2 TB/s of it. Up to S = 8 the harness (one jitted call a step, timed from
the host) likely measures its own dispatch more than the kernel (variants differ by up to 2x at
S = 1 with no pattern): those need measuring inside the model's step.
Defaults: block_v 64 with 4 warps from 16 sequences, else 32 with 2 (`decode_tuning`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.gated_delta_blocks import (
    PRECISIONS,
    pow2,
)
from kernels_pallas.gated_delta_chunk import chunk_kernel
from kernels_pallas.gated_delta_recurrent import recurrent_kernel
from kernels_pallas.gated_delta_ref import (
    decode_dims,
    flat_pool,
    ref_causal_conv1d,
)
from kernels_pallas.slot_rows import copy_rows

CHUNK = 16  # the chunk kernel's default chunk (the oracle's is FLA's 64: the same math)
CHUNK_BLOCK_V, CHUNK_WARPS, CHUNK_PRECISION = 64, 4, "bf16"  # measured (module docstring)


def decode_tuning(S: int) -> tuple[int, int]:
    """(block_v, num_warps) of a decode / verify call of S sequences (module docstring)."""
    return (64, 4) if S >= 16 else (32, 2)


# --- wrappers ----------------------------------------------------------------------------------


def _check_pool_size(pool):
    """The kernels address a pool (all its layers) with int32 offsets."""
    if pool.size >= 2**31:
        raise ValueError(
            f"a state pool of {pool.size} elements is over the kernels' int32 offsets: "
            "pass one layer's pool, or fewer slots"
        )


def _slots(initial_slots, final_slots, snapshot_slots=None):
    init = jnp.asarray(initial_slots, jnp.int32)
    fin = init if final_slots is None else jnp.asarray(final_slots, jnp.int32)
    cols = [init, fin] + ([] if snapshot_slots is None else [snapshot_slots])
    return jnp.stack(cols, axis=1)  # [S, 2 or 3]


def _block_v(block_v, dv, default):
    block_v = block_v or min(dv, default)
    if not pow2(block_v) or dv % block_v:
        raise ValueError(f"block_v must be a power of 2 dividing dv = {dv}, got {block_v}")
    return block_v


def gated_delta_rule(
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
    snapshot_slots=None,
    scale=None,
    use_qk_l2norm=True,
    layer=None,
    impl="chunk",
    chunk_size=CHUNK,
    block_v=None,
    num_warps=None,
    num_stages=1,
    precision=CHUNK_PRECISION,
    interpret=False,
):
    """The gated delta rule over a ragged batch (prefill, chunked prefill, mixed steps).

    q, k [T, Hk, dk]; v [T, Hv, dv] (Hv a multiple of Hk); g, beta [T, Hv] (f32 best);
    state [N, Hv, dk, dv] pool (or [L, N, ...] with `layer`); query_start_loc [S+1];
    initial_slots, final_slots [S]; position_slots [S, P] (impl="recurrent" only): see
    `gated_delta_ref`. impl "chunk" (WY, `chunk_size` tokens a step) or "recurrent".
    precision (chunk): the dots' "ieee" f32, "tf32" or "bf16" operands (f32 accumulation).
    -> (o [T, Hv, dv] in v.dtype (0 past query_start_loc[S]), state pool updated in place).
    Oracles: `ref_chunk_gated_delta_rule`, `ref_gated_delta_rule`."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or Hv % Hk:
        raise ValueError(f"q, k [T, Hk, dk] and v [T, Hv, dv], got {q.shape} {k.shape} {v.shape}")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"g and beta must be [{T}, {Hv}], got {g.shape}, {beta.shape}")
    if state.shape[-3:] != (Hv, dk, dv):
        raise ValueError(f"state must be [(L,) N, {Hv}, {dk}, {dv}], got {state.shape}")
    if impl not in ("chunk", "recurrent"):
        raise ValueError(f"impl must be 'chunk' or 'recurrent', got {impl!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if impl == "chunk" and position_slots is not None:
        raise ValueError("position_slots need impl='recurrent' (the chunked form keeps none)")
    if impl != "chunk" and snapshot_slots is not None:
        raise ValueError("snapshot_slots need impl='chunk'")
    if not pow2(dk) or (impl == "chunk" and (dk < 16 or not pow2(chunk_size) or chunk_size < 16)):
        raise ValueError(f"dk ({dk}) and chunk_size ({chunk_size}) must be powers of 2 (>= 16)")
    block_v = _block_v(block_v, dv, CHUNK_BLOCK_V if impl == "chunk" else 32)
    if impl == "chunk" and block_v < 16:
        raise ValueError(f"block_v must be >= 16 for the chunk kernel's dots, got {block_v}")
    pool, unflat, init_s, fin_s, pos_s, snap_s = flat_pool(
        state, layer, initial_slots, final_slots, position_slots, snapshot_slots, per_slot_ndim=3
    )
    _check_pool_size(pool)
    N = pool.shape[0]
    S = init_s.shape[0]
    slots = _slots(init_s, fin_s, snap_s)
    scale = float(dk**-0.5 if scale is None else scale)
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    common = dict(G=Hv // Hk, Hv=Hv, dk=dk, dv=dv, block_v=block_v, scale=scale)
    common["use_qk_l2norm"] = bool(use_qk_l2norm)
    o0 = jnp.zeros((T, Hv * dv), v.dtype)
    st2 = pool.reshape(N * Hv * dk, dv)
    grid = (S, Hv, dv // block_v)
    params = plt.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages)
    if impl == "chunk":
        kernel = functools.partial(
            chunk_kernel,
            C=chunk_size,
            precision=precision,
            snapshot=snap_s is not None,
            **common,
        )
        args = (qsl, slots)
        name = f"gated_delta_chunk_c{chunk_size}_v{block_v}_{precision}"
        params = plt.CompilerParams(num_warps=num_warps or CHUNK_WARPS, num_stages=num_stages)
    else:
        P = 0 if pos_s is None else pos_s.shape[1]
        kernel = functools.partial(
            recurrent_kernel,
            conv=False,
            m=0,
            Hk=Hk,
            K=0,
            C_ch=0,
            N=N,
            P=P,
            x_dtype=v.dtype,
            aliased_out=True,
            **common,
        )
        args = (qsl, slots) + ((pos_s.reshape(-1),) if P else ())
        name = f"gated_delta_recurrent_v{block_v}"
    args += (
        q.reshape(T, Hk * dk),
        k.reshape(T, Hk * dk),
        v.reshape(T, Hv * dv),
        g,
        beta,
        o0,
        st2,
    )
    n = len(args)
    o, st2 = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=[
            jax.ShapeDtypeStruct(o0.shape, o0.dtype),
            jax.ShapeDtypeStruct(st2.shape, st2.dtype),
        ],
        input_output_aliases={n - 2: 0, n - 1: 1},
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(*args)
    return o.reshape(T, Hv, dv), unflat(st2.reshape(pool.shape))


def gated_delta_decode(
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
    query_start_loc=None,
    snapshot_slots=None,
    gating=None,
    scale=None,
    use_qk_l2norm=True,
    layer=None,
    block_v=None,
    num_warps=None,
    num_stages=1,
    interpret=False,
):
    """A decode (m = 1) or verify (m = k + 1) step of a Gated DeltaNet layer in one kernel: the
    depthwise conv update with SiLU, then the gated delta rule, m = T / S tokens per sequence;
    or, with query_start_loc [S + 1], a ragged small step (sequences of any length, token by
    token: the model's small buckets, where a decode row may sit beside a prefill chunk).

    x [T, C] (the in-projection's q | k | v before the conv, C = 2 Hk dk + Hv dv);
    conv_weight [C, K]; conv_bias [C] or None; g, beta [T, Hv], or with gating = (A_log,
    dt_bias) ([Hv] each) the raw projections a, b that `gated_delta_ref.gdn_gating` turns into
    them (computed in the kernel); conv_state [N, C, K-1] and state [N, Hv, dk, dv] pools (or
    [L, N, ...] with `layer`) sharing initial_slots / final_slots [S], snapshot_slots [S] (a
    second copy of each final state and window, for the prefix cache; -1: none) and
    position_slots [S, P] (the states after each of the first P tokens; positions past a
    sequence's end are not written). Without query_start_loc every row has m tokens: padding
    rows pass -1 slots. -> (o [T, Hv, dv] in x.dtype (ragged: 0 past query_start_loc[S]),
    conv_state, state), pools updated in place. Oracle: `ref_gated_delta_decode`."""
    Hk, dk, Hv, dv = decode_dims(x, g, state, layer)
    T, C_ch = x.shape
    K = conv_weight.shape[1]
    if conv_weight.shape != (C_ch, K) or K < 2:
        raise ValueError(f"conv_weight must be [{C_ch}, K >= 2], got {conv_weight.shape}")
    if not pow2(dk):
        raise ValueError(f"dk must be a power of 2, got {dk}")
    S = initial_slots.shape[0]
    d_block_v, d_warps = decode_tuning(S)
    block_v = _block_v(block_v, dv, d_block_v)
    num_warps = num_warps or d_warps
    ragged = query_start_loc is not None
    if not ragged and T % S:
        raise ValueError(f"x has {T} tokens, not a multiple of the {S} sequences")
    m = 0 if ragged else T // S
    pool, unflat, init_s, fin_s, pos_s, snap_s = flat_pool(
        state, layer, initial_slots, final_slots, position_slots, snapshot_slots, per_slot_ndim=3
    )
    cpool, cunflat, *_ = flat_pool(conv_state, layer, per_slot_ndim=2)
    _check_pool_size(pool)
    _check_pool_size(cpool)
    N = pool.shape[0]
    if cpool.shape != (N, C_ch, K - 1):
        raise ValueError(f"conv_state must be [(L,) {N}, {C_ch}, {K - 1}], got {conv_state.shape}")
    P = 0 if pos_s is None else pos_s.shape[1]
    if conv_bias is None:
        conv_bias = jnp.zeros((C_ch,), conv_weight.dtype)
    kernel = functools.partial(
        recurrent_kernel,
        conv=True,
        m=m,
        G=Hv // Hk,
        Hk=Hk,
        Hv=Hv,
        dk=dk,
        dv=dv,
        block_v=block_v,
        K=K,
        C_ch=C_ch,
        N=N,
        P=P,
        scale=float(dk**-0.5 if scale is None else scale),
        use_qk_l2norm=bool(use_qk_l2norm),
        x_dtype=x.dtype,
        aliased_out=ragged,
        snapshot=snap_s is not None,
        gating=gating is not None,
    )
    st2 = pool.reshape(N * Hv * dk, dv)
    slots = _slots(init_s, fin_s, snap_s)
    if ragged:
        qsl = jnp.asarray(query_start_loc, jnp.int32)
        lens = qsl[1:] - qsl[:-1]
        args = (qsl, slots)
    else:
        lens = jnp.full((S,), m, jnp.int32)
        args = (slots,)
    args += (pos_s.reshape(-1),) if P else ()
    args += (x, conv_weight.reshape(-1), conv_bias, cpool.reshape(-1), g, beta)
    args += tuple(gating or ())
    # ragged: tokens no sequence owns are zeros (the output starts zeroed and is aliased in)
    args += (jnp.zeros((T, Hv * dv), x.dtype),) if ragged else ()
    args += (st2,)
    aliases = {len(args) - 1: 1}
    if ragged:
        aliases[len(args) - 2] = 0
    o, st2, cw = pl.pallas_call(
        kernel,
        grid=(S, Hv, dv // block_v),
        out_shape=[
            jax.ShapeDtypeStruct((T, Hv * dv), x.dtype),
            jax.ShapeDtypeStruct(st2.shape, st2.dtype),
            jax.ShapeDtypeStruct((S * (1 + P) * C_ch * (K - 1),), cpool.dtype),
        ],
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"gated_delta_decode_m{m}_v{block_v}",
    )(*args)
    # the new conv windows into the pool, after the kernel has read it: row copies that skip
    # the rows with nowhere to go (slot_rows.py: XLA's scatter walked those too)
    R = C_ch * (K - 1)
    first = jnp.arange(S, dtype=jnp.int32) * (1 + P)  # each sequence's window after its last token
    has = lens > 0
    src, dst = [first], [jnp.where(has, slots[:, 1], -1)]
    if snap_s is not None:
        src, dst = src + [first], dst + [jnp.where(has, slots[:, 2], -1)]
    if P:
        p = jnp.arange(P, dtype=jnp.int32)[None, :]
        src.append((first[:, None] + 1 + p).reshape(-1))
        dst.append(jnp.where(p < lens[:, None], pos_s, -1).reshape(-1))
    cat = functools.partial(jnp.concatenate, axis=0)
    cpool = copy_rows(
        cpool.reshape(N, R), cw.reshape(S * (1 + P), R), cat(src), cat(dst), interpret=interpret
    ).reshape(cpool.shape)
    return o.reshape(T, Hv, dv), cunflat(cpool), unflat(st2.reshape(pool.shape))


def causal_conv1d(
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
    """The prefill conv with its state over a ragged batch: `gated_delta_ref.ref_causal_conv1d`
    (XLA; same arguments). -> (y [T, C], conv_state)."""
    return ref_causal_conv1d(
        x,
        weight,
        bias,
        conv_state,
        query_start_loc,
        initial_slots,
        final_slots,
        position_slots,
        snapshot_slots=snapshot_slots,
        activation=activation,
        layer=layer,
    )
