"""Issue #23 on the H200 pair: one prefill + one decode engine (disaggregated prefill) against
two colocated data-parallel replicas, same two GPUs, same client.

    python3 -m benchmarks.gpu.disagg [--quick] [--out DIR]

The dummy Llama-3.1-8B (bf16, `workloads.FULL`'s engine settings, max_model_len for 8192 + 256)
served in-process behind the EngineClient each mode is (`DisaggregatedEngine`, or
`DataParallelEngine` with 2 replicas); the client sends random-token prompts at a fixed
concurrency (a semaphore) and reads the streams: TTFT and TPOT (p50/p99, TPOT per request as
vLLM's (last - first) / (tokens - 1)), output tokens/s, and for P/D the KV pages and bytes
moved. Workloads: long (8192 in / 256 out) and short (1024 / 128) at concurrency 16 and 64.

Each mode runs in a subprocess of its own (a clean device memory for the next) and leaves
disagg_<mode>.json in --out; `--modes` and `--workloads` run some of them (a device call each:
a mode's start-up and runs take minutes on the H200); runs merge into what --out holds, and the
report compares whatever both modes have. The KV
pool is sized explicitly (`num_kv_blocks`) so both modes get the same one. After the P/D runs, the
transfer of a 512-page (8192-token) prompt is timed alone (`measure_transfers`: the link copy
only) next to a raw 1 GiB `jax.device_put` from GPU 0 to GPU 1 (the link's peak this lease), so
the transfer's share of TTFT is bytes / achieved GB/s over TTFT.

--quick: the same code on the CPU at toy size (dummy:tiny, 2 simulated devices): a smoke test.
Results: disagg_h200.json (disagg_quick.json with --quick) in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "full": {
        "workloads": {"long": (8192, 256), "short": (1024, 128)},
        "concurrency": [16, 64],
        "requests": lambda c: max(32, 2 * c),
        "max_model_len": 8192 + 256 + 256,
        "num_kv_blocks": 36864,  # 72 GiB of 8B KV (2 MiB a 16-token block): 64 x 8.7k tokens
        "probe_pages": 512,
        "link_mib": 1024,
    },
    "quick": {
        "workloads": {"long": (96, 8), "short": (24, 8)},
        "concurrency": [2, 4],
        "requests": lambda c: 2 * c,
        "max_model_len": 256,
        "num_kv_blocks": 128,
        "probe_pages": 8,
        "link_mib": 16,
    },
}


MODES = ("colocated", "disaggregated")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _one(engine, rid: str, ids: list[int], out_len: int, rows: list) -> None:
    from paxengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0, first, n = time.perf_counter(), None, 0
    async for out in engine.generate(rid, ids, params):
        n = len(out.outputs[0].token_ids)
        if first is None and n:
            first = time.perf_counter()
    end = time.perf_counter()
    rows.append((first - t0, (end - first) / (n - 1) if n > 1 else 0.0, n))


async def load(engine, prompts: list[list[int]], out_len: int, concurrency: int, tag: str):
    """Every prompt through `engine` at most `concurrency` at a time -> the run's figures."""
    sem, rows = asyncio.Semaphore(concurrency), []

    async def bounded(i, ids):
        async with sem:
            await _one(engine, f"{tag}-{i}", ids, out_len, rows)

    before = engine.stats()
    t = time.perf_counter()
    await asyncio.gather(*(bounded(i, ids) for i, ids in enumerate(prompts)))
    wall = time.perf_counter() - t
    after = engine.stats()
    ttft, tpot, toks = [r[0] for r in rows], [r[1] for r in rows], sum(r[2] for r in rows)
    res = {
        "requests": len(rows),
        "wall_s": wall,
        "output_tok_s": toks / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50),
        "tpot_p99_ms": 1e3 * percentile(tpot, 99),
        "compiles_after_warmup": after.get("xla_compiles_after_warmup"),
    }
    for key in ("kv_transfer_pages", "kv_transfer_bytes", "kv_transfer_copies"):
        if key in after:
            res[key] = after[key] - before[key]
    return res


def link_peak(mib: int) -> dict:
    """A raw device_put of `mib` MiB from device 0 to device 1, best of 5."""
    import jax
    import jax.numpy as jnp

    d0, d1 = jax.devices()[:2]
    x = jax.device_put(jnp.zeros((mib << 20) // 2, jnp.bfloat16), d0)
    jax.block_until_ready(jax.device_put(x, d1))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(x, d1))
        best = min(best, time.perf_counter() - t)
    return {"bytes": x.nbytes, "seconds": best, "gb_per_s": x.nbytes / best / 1e9}


def transfer_probe(engine, pages: int) -> dict:
    """One transfer of `pages` pages with the copy timed alone (the engines idle)."""
    tr = engine.transfer
    tr.measure = True
    s0, b0 = tr.stats.seconds, tr.stats.bytes
    for _ in range(3):
        tr.send(list(range(pages)))
    tr.measure = False
    secs, nbytes = (tr.stats.seconds - s0) / 3, (tr.stats.bytes - b0) // 3
    return {"pages": pages, "bytes": nbytes, "seconds": secs, "gb_per_s": nbytes / secs / 1e9}


def run_mode(mode: str, quick: bool, workloads: list[str] | None = None) -> dict:
    """One engine mode: every workload at every concurrency. In its own process."""
    from benchmarks.bench.datasets import random_dataset
    from benchmarks.gpu.workloads import FULL, QUICK
    from paxengine.config import EngineConfig
    from paxengine.models.config import PRESETS

    spec, s = (QUICK, SETTINGS["quick"]) if quick else (FULL, SETTINGS["full"])
    engine_keys = {k: v for k, v in spec["engine"].items() if k != "gpu_memory_utilization"}
    engine_keys.update(max_model_len=s["max_model_len"], num_kv_blocks=s["num_kv_blocks"])
    cfg = EngineConfig(
        model=f"dummy:{spec['preset']}", dtype=spec["dtype"], show_progress=False, **engine_keys
    )
    t = time.perf_counter()
    if mode == "disaggregated":
        from paxengine.disagg.front import DisaggregatedEngine

        engine = DisaggregatedEngine(cfg.replace(kv_transfer_config={"kv_role": "kv_both"}))
    else:
        from paxengine.data_parallel import DataParallelEngine

        engine = DataParallelEngine(cfg.replace(data_parallel_size=2))
    res = {"mode": mode, "startup_s": time.perf_counter() - t, "runs": {}}
    vocab = PRESETS[spec["preset"]].vocab_size

    async def main():
        await engine.start()
        warm = random_dataset(4, 32, 4, vocab_size=vocab, seed=99)
        await load(engine, [list(r.prompt) for r in warm], 4, 4, "warm")
        for name, (inp, out) in s["workloads"].items():
            if workloads and name not in workloads:
                continue
            for c in s["concurrency"]:
                n = s["requests"](c)
                reqs = random_dataset(n, inp, out, vocab_size=vocab, seed=c)
                run = await load(engine, [list(r.prompt) for r in reqs], out, c, f"{name}{c}")
                res["runs"][f"{name}_c{c}"] = run
                print(mode, name, c, json.dumps(run), flush=True)
        if mode == "disaggregated":
            res["transfer_probe"] = transfer_probe(engine, s["probe_pages"])
            res["link_peak"] = link_peak(s["link_mib"])
        await engine.shutdown()

    asyncio.run(main())
    return res


def summarize(results: dict) -> dict:
    """P/D over colocated per run, and the transfer's share of TTFT."""
    pd, co = results["disaggregated"], results["colocated"]
    out = {}
    for run, p in pd["runs"].items():
        c = co["runs"].get(run)
        if c is None:
            continue
        row = {
            "tpot_p99_gain": c["tpot_p99_ms"] / p["tpot_p99_ms"],  # > 1: P/D better
            "ttft_p99_ratio": p["ttft_p99_ms"] / c["ttft_p99_ms"],
            "output_tok_s_ratio": p["output_tok_s"] / c["output_tok_s"],
        }
        probe = pd.get("transfer_probe")
        if probe and p.get("kv_transfer_bytes") and p["requests"]:
            per_request = p["kv_transfer_bytes"] / p["requests"]
            ms = 1e3 * per_request / (probe["gb_per_s"] * 1e9)
            row["transfer_ms_per_request"] = ms
            row["transfer_share_of_ttft_p50"] = ms / p["ttft_p50_ms"]
        out[run] = row
    # the goal on the long workload: TPOT p99 >= 1.4x better, output tok/s >= colocated
    out["goal_met"] = {
        run: row["tpot_p99_gain"] >= 1.4 and row["output_tok_s_ratio"] >= 1.0
        for run, row in out.items()
        if run.startswith("long")
    }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run, 2 simulated devices")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/disagg"))
    p.add_argument(
        "--modes",
        default="colocated,disaggregated",
        help="the modes to run now (comma-separated); the others are read from --out",
    )
    p.add_argument(
        "--workloads",
        help="long and/or short (comma-separated; default both); runs merge into --out's files",
    )
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.mode:  # the child: one mode, its JSON on the last line
        wl = a.workloads.split(",") if a.workloads else None
        print("RESULT " + json.dumps(run_mode(a.mode, a.quick, wl)), flush=True)
        return 0
    env = dict(os.environ)
    if a.quick:  # XLA_FLAGS must be set before jax starts: another reason for a child each
        flag = "--xla_force_host_platform_device_count=2"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}"
        env.setdefault("JAX_PLATFORMS", "cpu")
    results = {}
    suffix = "_quick" if a.quick else ""
    for mode in a.modes.split(","):
        if mode not in MODES:
            p.error(f"--modes: {mode!r} is not one of {MODES}")
        cmd = [sys.executable, "-m", "benchmarks.gpu.disagg", "--mode", mode, "--out", str(out)]
        if a.workloads:
            cmd += ["--workloads", a.workloads]
        proc = subprocess.run(
            cmd + (["--quick"] if a.quick else []), env=env, capture_output=True, text=True
        )
        sys.stdout.write(proc.stdout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stderr[-5000:])
            return 1
        results[mode] = json.loads(lines[-1][len("RESULT ") :])
        f = out / f"disagg_{mode}{suffix}.json"
        if f.exists():  # an earlier call's runs (other workloads) are kept
            results[mode]["runs"] = {**json.loads(f.read_text())["runs"], **results[mode]["runs"]}
        f.write_text(json.dumps(results[mode], indent=1))
    for mode in MODES:
        f = out / f"disagg_{mode}{suffix}.json"
        if mode not in results and f.exists():
            results[mode] = json.loads(f.read_text())
    if len(results) < len(MODES):
        print(f"modes so far: {sorted(results)}; run the others for the comparison")
        return 0
    from benchmarks.record import environment

    report = {"environment": environment(), **results, "summary": summarize(results)}
    name = "disagg_quick.json" if a.quick else "disagg_h200.json"
    (out / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
