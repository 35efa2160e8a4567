"""Benchmark of the paxengine Pallas attention kernels (Llama-3.1-8B attention shapes).

  python -m benchmarks.kernels.attention [--quick] [--sweep full|small|none] [--out DIR]

Per shape: median time (20 calls per sync, median of reps), effective KV bandwidth (bytes of KV
pages the step must read / time), % of the copy bandwidth measured in the same run; the same
inputs through upstream `jax.experimental.pallas.ops.gpu.paged_attention` (small tuning sweep)
and through an XLA gather + `jax.nn.dot_product_attention`. Correctness against the jnp oracle
first. Writes kernels_h200.json (or kernels_<device>.json) under --out (default $OUT or .).
On a CPU it runs a tiny smoke version in interpret mode.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.harness import (
    BS,
    DT,
    HKV,
    HQ,
    INTERP,
    ON_GPU,
    QUICK_SHAPES,
    SHAPES,
    D,
    attn_flops,
    build,
    kv_bytes,
    log,
    ours_fn,
    run_record,
    save,
)
from benchmarks.measure import chained_calls, copy_rate, time_loop, time_per_call
from kernels_pallas import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
    ref_write_kv,
    value_cache_dtype,
    write_kv,
)
from kernels_pallas.testing import make_batch, rel_err

TIMING = "calls"


def timeit(fn, *args, iters=20, reps=5):
    """Median seconds per call: `iters` async calls per sync, or (TIMING == "loop") one jitted
    lax.fori_loop of `iters` chained calls (XLA does not hoist the tile metadata out of the loop
    either, so every call rebuilds it, which an engine step does once for all layers)."""
    if TIMING == "loop" and args and getattr(args[0], "ndim", 0) == 3:
        many = chained_calls(fn, iters, keep_last=False)
        jax.block_until_ready(many(*args))
        return time_loop(many, args, reps, iters)
    jax.block_until_ready(fn(*args))
    return time_loop(fn, args, reps, 1, per_sync=iters)


def copy_bandwidth():
    """Bytes read + written per second by an elementwise pass over bf16 data (512 MiB on a GPU)."""
    return copy_rate(512 if ON_GPU else 2, dtype=DT)[0]


def upstream_fn(B, P, **tun):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    def f(q, kc, vc, md):
        q3 = q * jnp.asarray(D**-0.5, q.dtype)
        return paged_attention(
            q3, kc[0], vc[0], md.block_tables[:B], md.seq_lens[:B], interpret=INTERP, **tun
        )

    return jax.jit(f)


def xla_fn(B, P):
    def f(q, kc, vc, md):
        bt = md.block_tables[:B]
        k = kc[0][:, bt].reshape(HKV, B, P * BS, D).transpose(1, 2, 0, 3)
        v = vc[0][:, bt].reshape(HKV, B, P * BS, D).transpose(1, 2, 0, 3)
        return jax.nn.dot_product_attention(
            q[:B, None],
            k,
            v,
            scale=D**-0.5,
            key_value_seq_lengths=md.seq_lens[:B],
            implementation="xla",
        )[:, 0]

    return jax.jit(f)


def sweep_ours(q, kc, vc, md, configs):
    best = None
    rows = []
    for tun in configs:
        try:
            t = timeit(ours_fn(**tun), q, kc, vc, md)
        except Exception as e:  # a config that does not compile is skipped, and logged
            log("  config failed", tun, type(e).__name__, str(e)[:200])
            continue
        rows.append(dict(tun, us=t * 1e6))
        if best is None or t < best[0]:
            best = (t, tun)
    return best, rows


def check(q, kc, vc, md, n, tol, **kw):
    out = ours_fn(**kw)(q, kc, vc, md)
    ref = jax.jit(
        lambda q, kc, vc, md: ref_ragged_paged_attention(
            q.astype(jnp.float32),
            kc,
            vc,
            0,
            md,
            sm_scale=D**-0.5,
            **{
                k: v
                for k, v in kw.items()
                if k in ("sliding_window", "soft_cap", "k_scale", "v_scale")
            },
        )
    )(q, kc, vc, md)
    finite = bool(jnp.all(jnp.isfinite(out[:n].astype(jnp.float32))))
    err = rel_err(out, ref, n)
    return dict(rel_err=err, finite=finite, ok=finite and err < tol)


def correctness_suite():
    """Oracle checks on the device with fresh random ragged batches (NaN-poisoned caches)."""
    rng = np.random.default_rng()
    res = {}
    cases = {
        "mixed_bf16": (
            dict(dtype=DT),
            [(1, 300), (37, 100), (1, 17), (64, 64), (1, 1000)],
            128,
            8,
            {},
            2e-3,
        ),
        "decode_bf16_split": (
            dict(dtype=DT),
            [(1, int(x)) for x in rng.integers(1, 900, 16)],
            16,
            16,
            {},
            2e-3,
        ),
        "prefill_bf16_nosplitpv": (
            dict(dtype=DT),
            [(200, 300), (77, 77)],
            320,
            4,
            dict(pv_split=False),
            4e-3,
        ),
        "fp32": (dict(dtype=jnp.float32), [(1, 100), (20, 70)], 32, 4, {}, 1e-5),
        "window_softcap": (
            dict(dtype=DT),
            [(1, 500), (40, 300)],
            64,
            4,
            dict(sliding_window=128, soft_cap=30.0),
            2e-3,
        ),
        "fp8_kv": (
            dict(dtype=DT, kv_dtype=jnp.float8_e4m3fn),
            [(1, 400), (30, 90)],
            32,
            4,
            dict(k_scale=0.5, v_scale=0.25),
            2e-3,
        ),
        "smollm_d64_bs32": (
            dict(dtype=DT, num_heads=9, num_kv_heads=3, head_dim=64, block_size=32),
            [(1, 200), (50, 120)],
            64,
            4,
            {},
            2e-3,
        ),
    }
    for name, (bkw, seqs, T, S, kw, tol) in cases.items():
        b = make_batch(
            rng,
            seqs,
            T=T,
            S=S,
            num_layers=2,
            **{"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D, **bkw},
        )
        hd = b["q"].shape[-1]
        f = jax.jit(
            lambda q, kc, vc, md: ragged_paged_attention(
                q, kc, vc, jnp.int32(1), md, sm_scale=hd**-0.5, interpret=INTERP, **kw
            )
        )
        out = f(b["q"], b["k_cache"], b["v_cache"], b["md"])
        akw = {k: v for k, v in kw.items() if k != "pv_split"}
        ref = ref_ragged_paged_attention(
            b["q"].astype(jnp.float32),
            b["k_cache"],
            b["v_cache"],
            1,
            b["md"],
            sm_scale=hd**-0.5,
            **akw,
        )
        n = b["num_tokens"]
        err = rel_err(out, ref, n)
        fin = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        res[name] = dict(rel_err=err, finite=fin, ok=fin and err < tol, tol=tol)
        log(
            f"  correctness {name:24s} rel_err={err:.2e} tol={tol:.0e} "
            f"{'OK' if fin and err < tol else 'FAIL'}"
        )
    # write_kv (Pallas) vs reference scatter, slot -1 untouched
    b = make_batch(
        rng,
        [(3, 40), (1, 9), (20, 20)],
        T=32,
        S=4,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=DT,
        poison=False,
    )
    args = (b["k_cache"], b["v_cache"], jnp.int32(1), b["k_new"], b["v_new"], b["md"].slot_mapping)
    got = jax.jit(functools.partial(write_kv, interpret=INTERP, impl="pallas"))(*args)
    want = ref_write_kv(*args)
    same = all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))
    res["write_kv"] = dict(ok=same)
    log(f"  correctness write_kv exact={same}")
    return res


def bench_write(T, L=4, NB=8192):
    """write_kv (Pallas, aliased) vs XLA scatter, in a jitted loop carrying donated caches."""
    shape = (L, HKV, NB, BS, D)
    kc = jnp.zeros(shape, DT) + 1
    vc = jnp.zeros(shape, value_cache_dtype(DT)) + 1
    k = jax.random.normal(jax.random.key(1), (T, HKV, D), jnp.float32).astype(DT)
    v = k * 2
    slots = jnp.asarray(np.random.default_rng(0).permutation(NB * BS)[:T].astype(np.int32))
    res = {}
    for name, w in (
        ("pallas", functools.partial(write_kv, interpret=INTERP, impl="pallas")),
        ("xla_scatter", ref_write_kv),
    ):
        n_iter = 50

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def loop(kc, vc, k, v, slots, w=w):
            def body(i, c):
                return w(c[0], c[1], i % L, k, v, slots)

            return jax.lax.fori_loop(0, n_iter, body, (kc, vc))

        kc, vc = loop(kc, vc, k, v, slots)
        jax.block_until_ready(kc)

        def run(loop=loop):
            nonlocal kc, vc  # donated: each run takes the last run's caches
            kc, vc = loop(kc, vc, k, v, slots)
            return kc

        res[name] = time_per_call(run, n_iter, reps=5) * 1e6
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--sweep", default="full", choices=["full", "small", "none"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma list of shape names to run")
    ap.add_argument("--timing", default="calls", choices=["calls", "loop"])
    ap.add_argument("--upstream", default="sweep", choices=["sweep", "best"])
    args = ap.parse_args()
    global TIMING
    TIMING = args.timing
    t_start = time.time()
    result = run_record(args.timing)
    result["correctness"] = correctness_suite()
    bw = copy_bandwidth()
    result["copy_bw_TBps"] = bw / 1e12
    log(f"copy bandwidth (bf16 elementwise pass, read+write): {bw / 1e12:.2f} TB/s")

    if args.quick:
        batches, ctxs = [1, 4], [64]
    else:
        batches, ctxs = [1, 8, 64, 256], [512, 2048, 8192]
    rows = []
    key = 0
    # ---- decode
    base = [
        dict(block_k=bk, num_warps=w, num_stages=st, k_splits=1)
        for bk, w, st in itertools.product([32, 64, 128], [4, 8], [2, 3, 4])
        if bk * st <= 256
    ]
    best_base = dict(block_k=128, num_warps=4, num_stages=2)
    order = [(64, 2048)] + [(b, c) for b in batches for c in ctxs if (b, c) != (64, 2048)]
    for B, ctx in order:
        if args.quick and (B, ctx) == (64, 2048):
            continue
        name = f"decode_b{B}_ctx{ctx}"
        if args.only and name not in args.only.split(","):
            continue
        key += 1
        seqs = [(1, ctx)] * B
        q, kc, vc, md = build(seqs, B, B, key)
        vc_bf16 = vc.astype(DT)  # the baselines' V pages: bf16, as their engines keep them
        P = md.block_tables.shape[1]
        byts = kv_bytes(seqs)
        row = dict(name=name, kind="decode", B=B, ctx=ctx, kv_bytes=byts)
        # ours: default, then sweep
        t_def = timeit(ours_fn(), q, kc, vc, md)
        row["ours_default_us"] = t_def * 1e6
        if args.sweep == "full" and (B, ctx) == (64, 2048):
            (t_b, tun_b), sw = sweep_ours(q, kc, vc, md, base)
            best_base = {k: tun_b[k] for k in ("block_k", "num_warps", "num_stages")}
            row["sweep"] = sw
            cands = [dict(best_base, k_splits=ks) for ks in (2, 4)]
            cands += [dict(best_base, k_splits=1, pv_split=False)]
        else:
            cands = []
        ks_list = {1: [8, 16, 32], 8: [2, 4, 8]}.get(B, [1, 2] if B <= 64 else [1])
        if args.quick:
            ks_list = [1, 2]
        if args.sweep != "none":
            cands += [dict(best_base, k_splits=ks) for ks in ks_list]
        (t_o, tun_o), sw2 = sweep_ours(q, kc, vc, md, cands) if cands else ((t_def, {}), [])
        row.setdefault("sweep", [])
        row["sweep"] += sw2
        if t_def < t_o:
            t_o, tun_o = t_def, {"default": True}
        row.update(
            ours_us=t_o * 1e6,
            ours_cfg=tun_o,
            ours_TBps=byts / t_o / 1e12,
            ours_pct_copy=100 * byts / t_o / bw,
        )
        # upstream Pallas paged_attention
        ups = []
        ups_grid = list(itertools.product([4, 8], {1: [8, 16], 8: [4, 8]}.get(B, [1]), [4], [3]))
        if args.upstream == "best":  # the best of run 2's sweep for each batch size
            ups_grid = [(4, {1: 8, 8: 8}.get(B, 1), 4, 3)]
        for ppcb, ks, w, st in ups_grid:
            if P % ks or (P // ks) % min(ppcb, P // ks):
                continue
            try:
                t = timeit(
                    upstream_fn(
                        B, P, pages_per_compute_block=ppcb, k_splits=ks, num_warps=w, num_stages=st
                    ),
                    q,
                    kc,
                    vc_bf16,
                    md,
                )
                ups.append(
                    (t, dict(pages_per_compute_block=ppcb, k_splits=ks, num_warps=w, num_stages=st))
                )
            except Exception as e:
                log("  upstream failed", ppcb, ks, type(e).__name__, str(e)[:120])
        if ups:
            t_u, cfg_u = min(ups, key=lambda x: x[0])
            row.update(upstream_us=t_u * 1e6, upstream_cfg=cfg_u, upstream_TBps=byts / t_u / 1e12)
        # XLA gather + dot_product_attention
        if B * ctx <= 64 * 8192:
            try:
                t_x = timeit(xla_fn(B, P), q, kc, vc_bf16, md, iters=10, reps=3)
                row.update(xla_us=t_x * 1e6, xla_TBps=byts / t_x / 1e12)
            except Exception as e:
                log("  xla failed", type(e).__name__, str(e)[:120])
        if B * ctx <= 8 * 8192:
            row["check"] = check(
                q, kc, vc, md, B, 2e-3, **{k: v for k, v in tun_o.items() if k != "default"}
            )
        rows.append(row)
        save(result, rows, args.out)
        log(
            f"{name:24s} ours {row['ours_us']:8.1f} us {row['ours_TBps']:5.2f} TB/s "
            f"({row['ours_pct_copy']:5.1f}% copy) cfg={tun_o} | upstream "
            f"{row.get('upstream_us', float('nan')):8.1f} us {row.get('upstream_TBps', float('nan')):5.2f}"
            f" TB/s | xla {row.get('xla_us', float('nan')):8.1f} us  [{time.time() - t_start:.0f}s]"
        )
        del q, kc, vc
    # ---- prefill and mixed
    pf = {
        n: SHAPES[n]
        for n in (
            "prefill_512",
            "prefill_2048",
            "chunk_512_ctx4096",
            "prefill_8192",
            "prefill_4x2048",
            "mixed_60dec2048_448pf",
        )
    }
    if args.quick:
        pf = {n: QUICK_SHAPES[n] for n in ("prefill_64", "mixed_q")}
    for name, (seqs, T, S) in pf.items():
        if args.only and name not in args.only.split(","):
            continue
        key += 1
        q, kc, vc, md = build(seqs, T, S, key)
        byts = kv_bytes(seqs)
        fl = attn_flops(seqs)
        row = dict(
            name=name,
            kind="mixed" if any(ql == 1 for ql, _ in seqs) else "prefill",
            T=T,
            S=S,
            kv_bytes=byts,
            flops=fl,
        )
        cands = [{}]
        if args.sweep != "none" and not args.quick:
            grid = [(16, 64, 4), (16, 32, 4), (32, 64, 8), (32, 32, 4), (32, 128, 8), (16, 128, 4)]
            if args.sweep == "small":
                grid = grid[:3]
            for (bq, bk, w), st in itertools.product(grid, [2, 3]):
                cands.append(dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st))
            cands += [dict(c, pv_split=False) for c in cands[1:4]]
        (t_o, tun_o), sw = sweep_ours(q, kc, vc, md, cands)
        row.update(
            ours_us=t_o * 1e6,
            ours_cfg=tun_o,
            ours_TBps=byts / t_o / 1e12,
            ours_TFLOPs=fl / t_o / 1e12,
            sweep=sw,
        )
        row["ours_default_us"] = sw[0]["us"] if sw and not sw[0].get("block_q") else None
        if S == 1:
            try:  # XLA reference attention on the contiguous sequence, causal
                P = md.block_tables.shape[1]

                def xf(q, kc, vc, md, T=T, P=P, kv=seqs[0][1]):
                    k = (
                        kc[0][:, md.block_tables[0]]
                        .reshape(HKV, P * BS, D)[:, :kv]
                        .transpose(1, 0, 2)
                    )
                    v = (
                        vc[0][:, md.block_tables[0]]
                        .reshape(HKV, P * BS, D)[:, :kv]
                        .transpose(1, 0, 2)
                    )
                    mask = jnp.arange(kv)[None] <= (kv - T + jnp.arange(T))[:, None]
                    return jax.nn.dot_product_attention(
                        q[None],
                        k[None],
                        v[None],
                        mask=mask[None, None],
                        scale=D**-0.5,
                        implementation="xla",
                    )[0]

                t_x = timeit(jax.jit(xf), q, kc, vc.astype(DT), md, iters=10, reps=3)
                row.update(xla_us=t_x * 1e6, xla_TFLOPs=fl / t_x / 1e12)
            except Exception as e:
                log("  xla failed", type(e).__name__, str(e)[:160])
        n = sum(ql for ql, _ in seqs)
        row["check"] = check(
            q, kc, vc, md, n, 2e-3 if tun_o.get("pv_split", True) else 4e-3, **tun_o
        )
        rows.append(row)
        save(result, rows, args.out)
        log(
            f"{name:24s} ours {row['ours_us']:8.1f} us {row['ours_TFLOPs']:6.1f} TFLOP/s "
            f"{row['ours_TBps']:5.2f} TB/s cfg={tun_o} | xla {row.get('xla_us', float('nan')):8.1f} us"
            f" check={row['check']}  [{time.time() - t_start:.0f}s]"
        )
        del q, kc, vc
    # ---- KV write
    for T in [16] if args.quick else [64, 2048]:
        w = bench_write(T, NB=256 if args.quick else 8192)
        rows.append(
            dict(name=f"write_kv_T{T}", kind="write", **{f"{k}_us": v for k, v in w.items()})
        )
        log(f"write_kv T={T}: " + " ".join(f"{k} {v:.1f} us" for k, v in w.items()))
    result["wall_s"] = time.time() - t_start

    # ---- table
    log("\n| shape | ours us | ours TB/s | % copy | upstream us (TB/s) | XLA us | ours cfg |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode":
            log(
                f"| {r['name']} | {r['ours_us']:.1f} | {r['ours_TBps']:.2f} | {r['ours_pct_copy']:.0f}% |"
                f" {r.get('upstream_us', float('nan')):.1f} ({r.get('upstream_TBps', float('nan')):.2f}) |"
                f" {r.get('xla_us', float('nan')):.1f} | {r['ours_cfg']} |"
            )
        elif r["kind"] in ("prefill", "mixed"):
            log(
                f"| {r['name']} | {r['ours_us']:.1f} | {r['ours_TBps']:.2f} | - | - |"
                f" {r.get('xla_us', float('nan')):.1f} | {r['ours_cfg']} ({r['ours_TFLOPs']:.0f} TFLOP/s) |"
            )
    save(result, rows, args.out)


if __name__ == "__main__":
    main()
