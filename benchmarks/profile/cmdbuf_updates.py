"""Does XLA re-record the step's CUDA graphs every step? (GPU; issue #20's verify cost.)

XLA:GPU replays a step's kernels from command buffers (CUDA graphs). Before each replay it
compares the device addresses of the buffers the commands use with those it recorded; if any
changed, it re-records ("Update command buffer ... updated_allocs=N" in its VLOG 3) before the
graph runs. A step whose input arrays are fresh every step (the packed host inputs, the previous
step's samples) may pay that on the host before any kernel starts: hidden while the engine
overlaps steps, the whole of it when a step is read before the next is built (speculation,
penalties, grammars).

Per variant (a process of its own, XLA's command-buffer thunk logging at VLOG 3), 1 and then 64
requests of 1,024 tokens on the dummy Llama-3.1-8B decode 30 steps overlapped and 30 steps read
one by one:
per step, the command-buffer updates XLA logged and their microseconds, the launch's host time,
the wait and the step interval (the engine's step trace).

  python -m benchmarks.profile.cmdbuf_updates [--variants default,stable] [--out DIR]

"stable" sets PAXENGINE_STABLE_INPUTS=1 (runner.py: the step's inputs copied into device
buffers kept across steps); "color" XLA's --xla_gpu_temp_buffer_use_separate_color (each
executable's temp buffer at one address); "stable_color" both; "no_custom" XLA's command types
without CUSTOM_CALL. Writes cmdbuf_updates.json to --out or $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_COLOR = "--xla_gpu_temp_buffer_use_separate_color=true"  # temp buffers at a fixed address
VARIANTS = {
    "default": {},
    "stable": {"PAXENGINE_STABLE_INPUTS": "1"},
    "color": {"XLA_FLAGS": _COLOR},
    "stable_color": {"PAXENGINE_STABLE_INPUTS": "1", "XLA_FLAGS": _COLOR},
    # XLA's default command types but CUSTOM_CALL: if the Pallas kernels are custom calls, the
    # step's one graph breaks at each of them, and the device starts after the first piece
    "no_custom": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN"},
}
MARK = "@@cmdbuf-phase "
_UPDATED = re.compile(r"Updated command buffer in (\d+) .s; num_commands=(\d+)")
_ALLOCS = re.compile(r"updated_allocs=(\d+)")


def child(on_gpu: bool) -> None:
    from benchmarks.profile.engine_steps import start_decoding
    from benchmarks.profile.step_trace import load
    from paxengine import LLM
    from paxengine.step_trace import StepTrace

    ctx = 1024 if on_gpu else 32
    batches = (1, 64) if on_gpu else (1, 4)
    llm = LLM(
        model="dummy:llama-3.1-8b" if on_gpu else "dummy:tiny",
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=ctx + 512,
        max_num_seqs=max(batches),
        max_num_batched_tokens=ctx,
        token_buckets=[1, 16, 64, ctx],
        seq_buckets=[8, 64],
        num_kv_blocks=max(batches) * (ctx + 512) // 16 + 64,
        show_progress=False,
    )
    eng = llm.engine
    res = {}
    sync = eng._needs_sync
    for b in batches:
        start_decoding(eng, b, ctx, max_tokens=300)
        for mode in ("overlapped", "synced"):
            eng._needs_sync = (lambda: True) if mode == "synced" else sync
            for _ in range(3):
                eng.step()
            path = tempfile.mktemp(suffix=".jsonl")
            eng.trace = StepTrace(path)
            sys.stderr.write(f"{MARK}b{b}_{mode}\n")
            sys.stderr.flush()
            for _ in range(30):
                eng.step()
            sys.stderr.write(f"{MARK}end\n")
            sys.stderr.flush()
            eng.trace.flush()
            eng.trace = None
            recs = load(path)[1:]
            reads = [r["read_at"] for r in recs if "read_at" in r]
            med = lambda k: round(statistics.median(r.get(k, 0.0) for r in recs), 3)  # noqa: E731
            res[f"b{b}_{mode}"] = {
                "launch_ms": med("launch_ms"),
                "wait_ms": med("wait_ms"),
                "step_ms": round(
                    1e3 * statistics.median(y - x for x, y in zip(reads, reads[1:])), 3
                ),
            }
        if b == 1:
            # where a read-first step's launch goes on the host: XLA's and PJRT's own trace
            # scopes (command buffers stay on: --xla_enable_command_buffers_during_profiling)
            eng._needs_sync = lambda: True
            run = lambda: [eng.step() for _ in range(10)]  # noqa: E731
            res["host_scopes_ms_per_step"] = host_scopes(run, 10)

        eng._needs_sync = sync
        for r in list(eng.groups):
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()

    # the host's cost of handing the step's argument list (weights, KV pages) to an executable
    # that does almost nothing with it: per-argument dispatch work, apart from any kernel
    import time

    import jax

    runner = eng.runner
    touch = jax.jit(lambda params, caches, x: x + 1)
    x = jax.numpy.zeros(8, jax.numpy.int32)
    jax.block_until_ready(touch(runner.params, runner._caches(), x))
    ts = []
    for _ in range(50):
        t = time.perf_counter()
        y = touch(runner.params, runner._caches(), x)
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(y)
    res["args"] = {
        "num_arguments": len(jax.tree_util.tree_leaves((runner.params, runner._caches()))),
        "dispatch_ms": round(1e3 * statistics.median(ts), 3),
    }
    print("@@result " + json.dumps(res), flush=True)


def host_scopes(run, steps: int, top: int = 30) -> dict:
    """Host trace events (not Python's, not the device's) under jax.profiler: name -> ms a step."""
    from collections import defaultdict

    import jax

    from benchmarks.device_trace import trace_events

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        events, device = trace_events(d)
    tot = defaultdict(float)
    for e in events:
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and e.get("pid") not in device and not name.startswith("$"):
            tot[name[:80]] += float(e.get("dur", 0.0))
    best = sorted(tot.items(), key=lambda kv: -kv[1])[:top]
    return {k: round(v / steps / 1e3, 4) for k, v in best}


def run_variant(name: str, on_gpu: bool) -> dict:
    env = {
        **os.environ,  # keeps the machine's own settings (e.g. NVLink multicast off)
        **VARIANTS[name],
        "TF_CPP_MIN_LOG_LEVEL": "0",
        "TF_CPP_VMODULE": "command_buffer_thunk=3",
        "XLA_FLAGS": " ".join(
            (
                os.environ.get("XLA_FLAGS", ""),
                VARIANTS[name].get("XLA_FLAGS", ""),
                "--xla_enable_command_buffers_during_profiling=true",
            )
        ).strip(),
    }
    cmd = [sys.executable, "-m", "benchmarks.profile.cmdbuf_updates", "--child"]
    cmd += [] if on_gpu else ["--cpu"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    result = next(
        (json.loads(ln[9:]) for ln in p.stdout.splitlines() if ln.startswith("@@result ")), None
    )
    if result is None:
        raise RuntimeError(f"{name}: child failed\n{p.stderr[-3000:]}")
    phase, updates = None, {}
    for line in p.stderr.splitlines():
        if line.startswith(MARK):
            phase = line[len(MARK) :].strip()
            phase = None if phase == "end" else phase
            continue
        if phase is None:
            continue
        u = updates.setdefault(phase, {"updates": 0, "us": 0, "commands": 0, "allocs": []})
        if m := _UPDATED.search(line):
            u["updates"] += 1
            u["us"] += int(m.group(1))
            u["commands"] += int(m.group(2))
        elif m := _ALLOCS.search(line):
            u["allocs"].append(int(m.group(1)))
    for mode, row in result.items():
        if mode in ("args", "host_scopes_ms_per_step"):
            continue
        u = updates.get(mode, {"updates": 0, "us": 0, "commands": 0, "allocs": []})
        row["cmdbuf_updates_per_step"] = round(u["updates"] / 30, 2)
        row["cmdbuf_update_ms_per_step"] = round(u["us"] / 30 / 1e3, 3)
        row["commands_rerecorded_per_step"] = round(u["commands"] / 30, 1)
        row["updated_allocs_p50"] = statistics.median(u["allocs"]) if u["allocs"] else 0
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="default,stable,color,stable_color")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/cmdbuf"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cpu", action="store_true", help="a CPU smoke run (no command buffers)")
    a = p.parse_args(argv)
    if a.child:
        child(on_gpu=not a.cpu)
        return 0
    # not jax here: its GPU client would take the memory the children need
    on_gpu = not a.cpu and shutil.which("nvidia-smi") is not None
    res = {}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.variants.split(","):
        res[name] = run_variant(name, on_gpu)
        print(name, json.dumps(res[name]), flush=True)
        (out / "cmdbuf_updates.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
