"""Is a decode step bound by the host's launch? Per batch (1, 8, 64 decoding rows), under each
XLA_FLAGS variant in a process of its own (command buffers on and off; GPU):

* the engine's own iterations (PAXENGINE_STEP_TRACE's phases): how long launching a step takes
  on the host, how long the host then waits for the device, and the step interval, with the
  launch on the engine's thread and on the dispatch thread;
* the same step's arrays launched back to back with nothing else on the host (`loop_ms`: the
  larger of launch and device time);
* one launch timed alone on an idle device (`launch_ms_idle_device`);
* ten back-to-back steps under jax.profiler: the device's kernel time per step, and the span
  (with its idle gaps) those kernels cover.

  python -m benchmarks.profile.launch [--fp8] [--variants default,off,all] [--out DIR]

Writes profile_launch[_fp8].json to --out or $OUT. Each variant compiles its few buckets anew
(XLA's flags are part of the executable store's key).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax

from benchmarks.device_trace import kernel_times, span_of, trace_device
from benchmarks.profile.engine_steps import start_decoding
from benchmarks.record import write_to_out

VARIANTS = {
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "all": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
    "--xla_gpu_graph_min_graph_size=1",
}


def _median_ms(xs) -> float:
    return round(1e3 * statistics.median(xs), 3)


def _intervals(reads: list[float]) -> list[float]:
    """Seconds between consecutive reads: one step each when the device is the bottleneck."""
    return [b - a for a, b in zip(reads, reads[1:])]


def _loop_ms(fn, n: int) -> float:
    out = fn()
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(n):
        out = fn()
    jax.block_until_ready(out)
    return round(1e3 * (time.perf_counter() - t) / n, 3)


def probe(fp8: bool, on_gpu: bool) -> dict:
    from benchmarks.profile.step_trace import load
    from paxengine import LLM
    from paxengine.step_trace import StepTrace

    batches, ctx = ((1, 8, 64), 1024) if on_gpu else ((1, 4), 32)
    extra = {"quantization": "fp8", "kv_cache_dtype": "fp8"} if fp8 else {}
    cache = tempfile.mkdtemp(prefix="launch_probe_")
    llm = LLM(
        model="dummy:llama-3.1-8b" if on_gpu else "dummy:tiny",
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=ctx + 512,
        max_num_seqs=max(batches),
        max_num_batched_tokens=2048 if on_gpu else 128,
        token_buckets=[1, 16, 64, 2048] if on_gpu else [1, 16, 128],
        seq_buckets=[8, 64] if on_gpu else [8],
        num_kv_blocks=max(batches) * (ctx + 512) // 16 + 64,
        compilation_cache_dir=cache,
        show_progress=False,
        **extra,
    )
    eng, runner = llm.engine, llm.engine.runner
    last = {}
    execute = runner.execute

    def keep(arrays, st):
        last["args"] = (arrays, st)
        return execute(arrays, st)

    runner.execute = keep
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "fp8": fp8}
    for b in batches:
        start_decoding(eng, b, ctx, max_tokens=400)
        for _ in range(5):
            eng.step()
        path = Path(cache) / f"trace_b{b}.jsonl"
        eng.trace = StepTrace(str(path))
        for _ in range(60):
            eng.step()
        eng.trace.flush()
        recs = load(str(path))[1:]
        reads = [r["read_at"] for r in recs if "read_at" in r]
        # the same iterations with the launch on the dispatch thread (config dispatch_thread)
        path_d = Path(cache) / f"trace_b{b}_dispatch.jsonl"
        eng.trace = StepTrace(str(path_d))
        eng._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="probe-dispatch")
        for _ in range(60):
            eng.step()
        eng.step()  # reads the last step the dispatcher launched (and launches one more)
        if eng.inflight is not None and isinstance(eng.inflight.result, Future):
            # that one donates the KV cache on the worker: the direct launches below must see
            # the cache it returns, not the donated one
            eng.inflight.result.result()
        eng._dispatcher = None
        eng.trace.flush()
        eng.trace = None
        reads_d = [r["read_at"] for r in load(str(path_d))[1:] if "read_at" in r]
        arrays, st = last["args"]
        T, S = arrays.tokens.shape[0], arrays.seq_lens.shape[0]
        launch_t = []
        for _ in range(30):
            t0 = time.perf_counter()
            result = execute(arrays, st)
            launch_t.append(time.perf_counter() - t0)
            jax.block_until_ready(result)  # each launch timed on an idle device
        row = {
            "bucket": [T, S],
            "engine_launch_ms": _median_ms(
                [r["launch_ms"] / 1e3 for r in recs if "launch_ms" in r]
            ),
            "engine_wait_ms": _median_ms([r["wait_ms"] / 1e3 for r in recs if "wait_ms" in r]),
            "engine_step_ms": _median_ms(_intervals(reads)),
            "engine_step_ms_dispatch_thread": _median_ms(_intervals(reads_d)),
            "loop_ms": _loop_ms(lambda: execute(arrays, st), 30),
            "launch_ms_idle_device": _median_ms(launch_t),
        }

        # the device's own time for those steps: kernels summed, and the span they cover
        def run():
            out = None
            for _ in range(10):
                out = execute(arrays, st)
            jax.block_until_ready(out)

        events = trace_device(run)
        times, counts = kernel_times(events)
        row["kernels_ms_per_step"] = round(sum(times.values()) / 1e4, 3)
        row["kernel_launches_per_step"] = sum(counts.values()) / 10
        span, idle = span_of(events)
        row["device_span_ms_per_step"] = round(span / 1e4, 3)
        row["device_idle_ms_per_step"] = round(idle / 1e4, 3)
        res[f"b{b}"] = row
        print(b, row, flush=True)
        for r in list(eng.groups):
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--variants", default="default,off,all")
    p.add_argument("--out")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(probe(args.fp8, jax.default_backend() == "gpu")), flush=True)
        return 0
    res = {"fp8": args.fp8, "variants": {}}
    for name in args.variants.split(","):
        env = {
            **os.environ,
            "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip(),
        }
        cmd = [sys.executable, "-m", "benchmarks.profile.launch", "--one"] + (
            ["--fp8"] if args.fp8 else []
        )
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        res["variants"][name] = (
            {**json.loads(lines[-1][7:]), "seconds": round(time.perf_counter() - t, 1)}
            if lines
            else {"error": (proc.stdout + proc.stderr)[-3000:]}
        )
        print(name, json.dumps(res["variants"][name]), flush=True)
        name_out = "profile_launch_fp8" if args.fp8 else "profile_launch"
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{name_out}.json").write_text(json.dumps(res, indent=1))
        else:
            write_to_out(res, name_out, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
