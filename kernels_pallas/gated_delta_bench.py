"""On a GPU: the Gated DeltaNet kernels (gated_delta.py) checked against their jnp oracles and timed
against XLA, at Qwen3.5-9B shapes (16 key heads, 32 value heads of 128, conv kernel 4), bf16
activations, f32 states (decode's pools: --pool-dtype, bf16 as the engine keeps a bf16 model's).

    python -m kernels_pallas.gated_delta_bench [--quick] [--json FILE]
    python -m kernels_pallas.gated_delta_bench --sweep --decode-seqs 256 512   (decode only)

Rows: prefill (the chunk kernel, the recurrent kernel, the chunked oracle under XLA) over ragged
batches; decode and verify steps (the fused kernel, and XLA: the conv oracle plus one vectorised
delta-rule step for all sequences, which is what XLA does best for m = 1). Each check is
||out - ref|| / ||ref|| on fresh random data (outputs and the states written); each time the
median over `--reps` rounds of a jitted call repeated `--iters` times with the pools donated and
fed back (one sync a round). Not part of CI (it needs a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta import gated_delta_decode, gated_delta_rule
from kernels_pallas.gated_delta_ref import (
    gather_slots,
    gdn_gating,
    prepare_qk,
    ref_causal_conv1d,
    ref_chunk_gated_delta_rule,
    ref_gated_delta_decode,
    scatter_slots,
    split_qkv,
)

Hk, Hv, dk, dv, K = 16, 32, 128, 128, 4
C = 2 * Hk * dk + Hv * dv
BF16, F32 = jnp.bfloat16, jnp.float32


def rel(a, b):
    a = np.asarray(jnp.asarray(a, F32), np.float64)
    b = np.asarray(jnp.asarray(b, F32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def timed(fn, args, n_pools, iters, reps):
    """Median seconds per call of jit(fn) (its last n_pools arguments donated and fed back)."""
    n = len(args)
    f = jax.jit(fn, donate_argnums=tuple(range(n - n_pools, n)))
    args = list(args[: n - n_pools]) + [jnp.array(a) for a in args[n - n_pools :]]  # copies
    out = f(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        args[n - n_pools :] = out[-n_pools:]
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
            args[n - n_pools :] = out[-n_pools:]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def gating(rng, T):
    a, b = rng.standard_normal((T, Hv)), rng.standard_normal((T, Hv))
    A_log, dt = np.log(rng.uniform(0.01, 16, Hv)), rng.standard_normal(Hv)
    return gdn_gating(*(jnp.asarray(x, F32) for x in (a, b, A_log, dt)))


def prefill_batch(rng, lens, pool_dtype=F32):
    T, S = sum(lens), len(lens)
    N = 2 * S + 2
    g, beta = gating(rng, T)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    init = jnp.asarray(rng.permutation(N)[:S], jnp.int32)
    return dict(
        q=jnp.asarray(rng.standard_normal((T, Hk, dk)), BF16),
        k=jnp.asarray(rng.standard_normal((T, Hk, dk)), BF16),
        v=jnp.asarray(rng.standard_normal((T, Hv, dv)), BF16),
        g=g,
        beta=beta,
        qsl=qsl,
        init=init,
        state=jnp.asarray(rng.standard_normal((N, Hv, dk, dv)) * 0.1, pool_dtype),
    )


def xla_decode(x, w, g, beta, conv, state, init):
    """XLA's best m = 1 decode: the conv oracle, then one delta-rule step for all sequences at
    once (states gathered, updated, scattered)."""
    S = init.shape[0]
    qsl = jnp.arange(S + 1, dtype=jnp.int32)
    y, conv = ref_causal_conv1d(x, w, None, conv, qsl, init)
    q, k, v = split_qkv(y, Hk, dk, Hv, dv)
    q, k = prepare_qk(q, k, Hv)
    h = gather_slots(state, init) * jnp.exp(g)[:, :, None, None]
    kv = jnp.einsum("shkv,shk->shv", h, k)
    h = h + k[..., None] * ((v.astype(F32) - kv) * beta[..., None])[:, :, None, :]
    o = jnp.einsum("shkv,shk->shv", h, q).astype(x.dtype)
    return o, conv, scatter_slots(state, init, h, jnp.ones((S,), bool))


def decode_batch(rng, S, m, P, pool_dtype=F32):
    T = S * m
    N = 2 * S + S * P + 2
    g, beta = gating(rng, T)
    init = jnp.asarray(rng.permutation(2 * S + 2)[:S], jnp.int32)
    pos = None
    if P:
        pos = jnp.asarray(np.arange(S * P).reshape(S, P) + 2 * S + 2, jnp.int32)
    return dict(
        x=jnp.asarray(rng.standard_normal((T, C)), BF16),
        w=jnp.asarray(rng.standard_normal((C, K)) * 0.5, BF16),
        g=g,
        beta=beta,
        conv=jnp.asarray(rng.standard_normal((N, C, K - 1)), BF16),
        state=jnp.asarray(rng.standard_normal((N, Hv, dk, dv)) * 0.1, pool_dtype),
        init=init,
        pos=pos,
    )


# (precision, chunk, block_v, num_warps) of the chunk kernel, (block_v, num_warps) of decode's;
# the first of each: the defaults. The H100 sweep behind them: gated_delta.py's docstring.
CHUNK_SWEEP = [
    ("bf16", 16, 64, 4),
    ("tf32", 16, 64, 4),
    ("bf16", 16, 128, 4),
    ("bf16", 32, 64, 4),
    ("ieee", 32, 64, 4),
]
DECODE_SWEEP = [(None, None), (64, 4), (32, 2), (32, 4), (16, 1), (128, 8)]


def run(quick=False, iters=10, reps=5, sweep=False, decode_seqs=None, pool_dtype=BF16):
    """decode_seqs: only decode steps of these many sequences (one token each), no prefill;
    pool_dtype: the decode rows' state pools (the engine's: the model's dtype)."""
    rng = np.random.default_rng(0)
    kw = dict(interpret=jax.default_backend() == "cpu")  # (a CPU smoke run)
    rows = []

    def row(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    prefills = [[1024] * 4, [64] * 64]
    if not quick:
        prefills += [[8192], [300, 17, 1000, 700]]
    if decode_seqs:
        prefills = []
    for lens in prefills:
        b = prefill_batch(rng, lens)
        ins = (b["q"], b["k"], b["v"], b["g"], b["beta"])
        slots = (b["qsl"], b["init"])
        want = jax.jit(ref_chunk_gated_delta_rule)(*ins, b["state"], *slots)
        name = f"prefill {len(lens)}x{lens[0]}" if len(set(lens)) == 1 else f"prefill {lens}"
        variants = {}
        for prec, ch, bv, nw in CHUNK_SWEEP if sweep else CHUNK_SWEEP[:1]:
            ckw = dict(precision=prec, chunk_size=ch, block_v=bv, num_warps=nw, **kw)
            variants[f"chunk {prec} c{ch} v{bv} w{nw}"] = functools.partial(
                lambda *a, ckw: gated_delta_rule(*a[:5], a[7], a[5], a[6], **ckw), ckw=ckw
            )
        if max(lens) <= 1024:
            variants["recurrent"] = lambda *a: gated_delta_rule(
                *a[:5], a[7], a[5], a[6], impl="recurrent", **kw
            )
        variants["xla_chunk_oracle"] = lambda *a: ref_chunk_gated_delta_rule(
            *a[:5], a[7], a[5], a[6]
        )
        for vname, fn in variants.items():
            got = jax.jit(fn)(*ins, *slots, b["state"])
            err = (rel(got[0], want[0]), rel(got[1], want[1]))
            t = timed(fn, (*ins, *slots, b["state"]), 1, iters, reps)
            row(case=name, impl=vname, us=round(t * 1e6, 1), err_o=err[0], err_state=err[1])

    decodes = [(1, 1, 0), (64, 1, 0)]
    if not quick:
        decodes += [(8, 1, 0), (256, 1, 0), (16, 4, 4)]
    if decode_seqs:
        decodes = [(S, 1, 0) for S in decode_seqs]
    for S, m, P in decodes:
        d = decode_batch(rng, S, m, P, pool_dtype)
        # the states each step reads and writes back (what bounds a large decode step)
        state_bytes = S * (1 + max(P, 1)) * Hv * dk * dv * jnp.dtype(pool_dtype).itemsize
        pos = () if d["pos"] is None else (d["pos"],)
        ins = (d["x"], d["w"], d["g"], d["beta"])
        want = jax.jit(lambda *a: ref_gated_delta_decode(*a[:2], None, *a[2:]))(
            *ins, d["conv"], d["state"], d["init"], None, *pos
        )
        args = (*ins, d["init"], *pos, d["conv"], d["state"])
        name = f"decode S={S} m={m}" + (f" P={P}" if P else "")
        for bv, nw in DECODE_SWEEP if sweep else DECODE_SWEEP[:1]:

            def kern(x, w, g, beta, init, *rest, bv=bv, nw=nw):
                *pos, conv, state = rest
                return gated_delta_decode(
                    x,
                    w,
                    None,
                    g,
                    beta,
                    conv,
                    state,
                    init,
                    None,
                    *pos,
                    block_v=bv,
                    num_warps=nw,
                    **kw,
                )

            got = jax.jit(kern)(*args)
            err = [rel(a, b) for a, b in zip(got, want)]
            t = timed(kern, args, 2, iters * 5, reps)
            impl = "kernel (defaults)" if bv is None else f"kernel v{bv} w{nw}"
            tbs = round(state_bytes / t / 1e12, 2)
            row(
                case=name,
                impl=impl,
                us=round(t * 1e6, 1),
                err_o=err[0],
                err_state=err[2],
                state_tb_s=tbs,
            )
        if m == 1:

            def xla(x, w, g, beta, init, conv, state):
                return xla_decode(x, w, g, beta, conv, state, init)

            got = jax.jit(xla)(*args)
            err = [rel(a, b) for a, b in zip(got, want)]
            t = timed(xla, args, 2, iters * 5, reps)
            tbs = round(state_bytes / t / 1e12, 2)
            row(
                case=name,
                impl="xla",
                us=round(t * 1e6, 1),
                err_o=err[0],
                err_state=err[2],
                state_tb_s=tbs,
            )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="kernel variants (CHUNK/DECODE_SWEEP)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--decode-seqs", type=int, nargs="+", help="decode steps of these sizes only")
    ap.add_argument("--pool-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = ap.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    rows = run(a.quick, a.iters, a.reps, a.sweep, a.decode_seqs, jnp.dtype(a.pool_dtype))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'case':32} {'impl':22} {'us':>10} {'err_o':>9} {'err_state':>9}")
    for r in rows:
        print(
            f"{r['case']:32} {r['impl']:22} {r['us']:10.1f} {r['err_o']:9.2e} {r['err_state']:9.2e}"
        )


if __name__ == "__main__":
    main()
