"""Server variants side by side in one lease, each with its engine's step trace: where a served
step's time goes, and which scheduling or process setting moves the serve rows of issue #18.

    python3 -m benchmarks.gpu.serve_variants --out DIR [--variants base,nobacklog] \
        [--concurrency 16,64] [--offline] [--quick] [--fp8]

Every variant starts `paxengine serve` on the dummy model of the GPU run's spec
(workloads.FULL; --quick: the CPU-sized QUICK), runs `bench serve` at each concurrency
(`serving.serve_stage`) with PAXENGINE_STEP_TRACE set, then summarises the trace
(benchmarks.profile.step_trace). --offline adds the spec's first offline workload through `LLM`
with its own trace, last (its engine holds the GPU until the process ends). Results: DIR/serve_variants.json, the traces DIR/trace_<variant>.jsonl.
The variants after the first start from the executable store the first one filled.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.gpu import stage
from benchmarks.gpu.serving import _free_port, pax_serve_cmd, serve_stage
from benchmarks.gpu.workloads import FULL, QUICK
from benchmarks.profile import step_trace
from benchmarks.record import environment
from paxengine.step_trace import ENV as STEP_TRACE_ENV

# name -> (engine flags over the spec's serve flags (None: the flag dropped; "" a bare switch),
# Python run in the server's process before it starts (None: nothing))
VARIANTS = {
    # the spec's serve flags: budget 512, 4,096 while a backlog waits; the engine in a process
    # of its own (serve's default)
    "base": ({}, None),
    "nobacklog": ({"backlog_step_token_budget": None}, None),  # 512 always
    # the backlog rule before 2026-12-03: 512, or 4,096 once 8,192 prompt tokens wait (base:
    # doubling 512 -> 4,096 as the backlog reaches twice each); the engine's process inherits it
    "jump": ({}, "import os; os.environ['PAXENGINE_BACKLOG_STEPS'] = 'jump'"),
    # the step loop on a thread of the server's process (sharing its GIL), as before 2026-12-03
    "thread": ({"no_engine_process": ""}, None),
    "nobacklog_thread": ({"backlog_step_token_budget": None, "no_engine_process": ""}, None),
    "b2048": ({"decode_step_token_budget": 2048, "backlog_step_token_budget": None}, None),
    "b1024": ({"decode_step_token_budget": 1024, "backlog_step_token_budget": None}, None),
    "backlog2048": ({"backlog_step_token_budget": 2048}, None),
    "nobudget": ({"decode_step_token_budget": None, "backlog_step_token_budget": None}, None),
    # the interpreter's GIL switch interval 0.5 ms (Python's default: 5 ms)
    "switch": ({}, "import sys; sys.setswitchinterval(5e-4)"),
    "dispatch": ({"dispatch_thread": ""}, None),
    # every bucket built before the server is ready (serve's default until 2026-12-03: since,
    # ready once the first buckets are built, the rest building behind)
    "foreground": ({"no_background_compile": ""}, None),
    "background": ({"background_compile": "", "log_level": "info"}, None),  # base, logging more
    # a 128-row sequence bucket: 64 decodes beside a prompt or two run in 128 rows, not 256
    "seq128": ({"seq_buckets": "8,64,128,256,512"}, None),
    # probe: the backlog budget once the prompt tokens waiting reach 1x it (the engine: 2x); the
    # boot code runs in the server's process, so the engine's loop must run there too
    "thr1": (
        {"no_engine_process": ""},
        "import paxengine.scheduler as s; s.BACKLOG_TRIGGER = 1",
    ),
}


def variant_flags(spec: dict, name: str) -> tuple[dict, str | None]:
    """name: a key of VARIANTS, or one with a suffix "#N" (a repeat of it)."""
    more, boot = VARIANTS[name.split("#")[0]]
    flags = {**spec["serve"].get("pax_engine", {}), **more}
    return {k: v for k, v in flags.items() if v is not None}, boot


def server_cmd(spec: dict, model_dir: Path, flags: dict, boot: str | None) -> list[str]:
    cmd = pax_serve_cmd(spec, model_dir, _free_port(), {k: v for k, v in flags.items() if v != ""})
    cmd += [f"--{k.replace('_', '-')}" for k, v in flags.items() if v == ""]  # bare switches
    if boot is not None:  # the same server, with `boot` run first
        i = cmd.index("-m")
        code = f"{boot}\nimport sys\nfrom serving.cli import main\nsys.exit(main(sys.argv[1:]))"
        cmd = cmd[:i] + ["-c", code] + cmd[i + 2 :]
    return cmd


def _store_files() -> dict:
    """The executable store the servers share (the default cache folder): files and bytes."""
    files = list((Path.home() / ".cache/paxengine/jax/executables").glob("*.exe"))
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def run_offline(spec: dict, trace: Path) -> dict:
    from benchmarks.bench.datasets import random_dataset
    from benchmarks.bench.throughput import greedy_params, token_prompts
    from paxengine import LLM
    from paxengine.config import EngineConfig
    from paxengine.models.config import PRESETS

    w = spec["offline"][0]
    vocab = PRESETS[spec["preset"]].vocab_size
    os.environ[STEP_TRACE_ENV] = str(trace)
    try:
        llm = LLM(
            config=EngineConfig(
                model=f"dummy:{spec['preset']}", dtype=spec["dtype"], **spec["engine"]
            )
        )
    finally:
        del os.environ[STEP_TRACE_ENV]
    warm = random_dataset(4, 64, 8, vocab_size=vocab, seed=7)
    llm.generate(token_prompts(warm), greedy_params(warm), use_tqdm=False)
    llm.engine.trace.flush()
    trace.unlink(missing_ok=True)  # the timed run's steps only
    reqs = random_dataset(
        w["num_prompts"], w["input_len"], w["output_len"], vocab_size=vocab, seed=11
    )
    t = time.perf_counter()
    outs = llm.generate(token_prompts(reqs), greedy_params(reqs), use_tqdm=False)
    dt = time.perf_counter() - t
    llm.engine.trace.flush()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"workload": w["name"], "output_tok_s": n / dt, "seconds": dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="base,nobacklog,b2048")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--workload", default="serve", choices=["serve", "poisson"])
    p.add_argument("--offline", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-level", default=None, help="the servers' log level (info: store hits)")
    p.add_argument("--fp8", action="store_true", help="FP8 weights and KV (the spec's fp8 keys)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = copy.deepcopy(QUICK if args.quick else FULL)
    base["serve"]["concurrency"] = [int(c) for c in args.concurrency.split(",")]
    if args.workload == "poisson":
        base["serve"]["pax_engine"] = base["poisson"]["pax_engine"]
    from benchmarks.gpu.dummy_model import write_dummy_model_dir

    model_dir = write_dummy_model_dir(base["preset"], out / "dummy_model")
    result = {"environment": environment(), "command": " ".join(sys.argv), "variants": {}}
    result_file = out / "serve_variants.json"
    for name in args.variants.split(","):
        flags, boot = variant_flags(base, name)
        if args.fp8:
            flags = {**flags, **base["fp8"]["pax_engine"]}
        if args.log_level:
            flags["log_level"] = args.log_level
        store = _store_files()
        trace = out / f"trace_{name}.jsonl"
        trace.unlink(missing_ok=True)
        env = {**os.environ, STEP_TRACE_ENV: str(trace)}
        cmd = server_cmd(base, model_dir, flags, boot)
        stage.begin(out / f"partial_{name}.json", None)
        res = serve_stage(base, out / f"stage_{name}.json", cmd, name, env, args.workload)
        # one summary per benchmark run (the trace cut where the server sat idle between them)
        res["trace"] = (
            [step_trace.summarise(seg) for seg in step_trace.segments(step_trace.load(str(trace)))]
            if trace.exists()
            else None
        )
        res["store_before"], res["store_after"] = store, _store_files()
        result["variants"][name] = res
        for c, r in res["runs"].items():
            stage.log(
                f"{name} {c}: {r['output_throughput']:.0f} tok/s, TTFT p99 {r['p99_ttft_ms']:.0f} "
                f"ms, TPOT p50 {r['median_tpot_ms']:.1f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms"
            )
        result_file.write_text(json.dumps(result, indent=1))
    if args.offline:
        trace = out / "trace_offline.jsonl"
        res = run_offline(base, trace)
        res["trace"] = step_trace.summarise(step_trace.load(str(trace)))
        result["offline"] = res
        stage.log(f"offline {res['workload']}: {res['output_tok_s']:.0f} tok/s")
        result_file.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
