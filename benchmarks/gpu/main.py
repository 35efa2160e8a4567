"""The GPU run's driver: paxengine (and optionally vLLM and HF transformers) on Llama-3.1-8B
shapes with dummy weights, in one device call. Run through `benchmarks/gpu/gpu_run.sh` on the
lent GPU.

    python -m benchmarks.gpu.main --out DIR [--stages roofline,pax-offline,pax-serve] [--quick]
    python -m benchmarks.gpu.report DIR/gpu_bench.json     # markdown table for the README

Stages (each in its own process, so each frees the GPU's memory for the next):
  roofline      measured copy bandwidth (read + write bytes) and bf16 matmul rate, and the floors
                they put under every workload below (bytes per decode step / bandwidth, prefill
                FLOPs / matmul rate)                                            (roofline.py)
  pax-offline   paxengine `LLM`: batch-1 and batch-8 inter-token latency, 256 x (1024 in, 128
                out), 300 x (1000, 1000); XLA compilations counted during the timed part (must
                be 0)                                                            (offline.py)
  pax-serve     `paxengine serve` + `paxengine bench serve`: random 1024/128 at concurrency
                1, 16, 64                                                        (serving.py)
  vllm-offline  the same offline workloads on vLLM (when `import vllm` works; VLLM-PEER.md)
  vllm-serve    `vllm serve` + the same bench client and workload
  pax-offline-fp8, vllm-offline-fp8
                the offline workloads with FP8 weights and an FP8 KV cache (variant "fp8")
  pax-serve-fp8, vllm-serve-fp8
                the serve workload with the same FP8 settings
  pax-offline-qwen35, vllm-offline-qwen35 (-fp8), pax-offline-qwen3moe, vllm-offline-qwen3moe (-fp8)
                the offline workloads on Qwen3.5-9B shapes (the spec's "models": an HF config
                file, dummy weights; vLLM with what it needs to run it, VLLM-PEER.md)
  pax-serve-qwen35, vllm-serve-qwen35, pax-serve-qwen3moe, vllm-serve-qwen3moe
                the serve workload on those models (their config and a word tokenizer of
                their vocabulary)
  pax-offline-tp2, vllm-offline-tp2
                the offline workloads with the model split over two GPUs (variant "tp2";
                run on the nvidia-h200-x2 kind)
  pax-poisson   `paxengine serve` under Poisson arrivals at 4, 8, 16 req/s, lengths drawn
                around 1024/256 (range ratio 0.9)                                (serving.py)
  vllm-poisson  the same on `vllm serve`
  hf            HF transformers on the same shapes                               (hf.py)

Both engines run at their defaults: a stage gives either one the model, its dtype, max_model_len
and its variant's settings, nothing else (workloads.engine_args). Every stage writes
DIR/stage_<name>.json; the driver merges them into DIR/gpu_bench.json and prints the report's
table last (report.py). A failed stage is recorded and the next one still runs. The workloads
are workloads.FULL, or QUICK with --quick.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from benchmarks.gpu import REPO_ROOT, hf, offline, roofline, serving, stage
from benchmarks.gpu.report import markdown_table, merge_earlier
from benchmarks.gpu.workloads import FULL, QUICK
from benchmarks.record import environment, finite

STAGES = {
    "roofline": roofline.stage_roofline,
    "pax-offline": offline.stage_pax_offline,
    "pax-serve": serving.stage_pax_serve,
    "vllm-offline": offline.stage_vllm_offline,
    "pax-offline-fp8": partial(offline.stage_pax_offline, variant="fp8"),
    "vllm-offline-fp8": partial(offline.stage_vllm_offline, variant="fp8"),
    "pax-offline-tp2": partial(offline.stage_pax_offline, variant="tp2"),
    "vllm-offline-tp2": partial(offline.stage_vllm_offline, variant="tp2"),
    "pax-offline-qwen35": partial(offline.stage_pax_offline, model="qwen35"),
    "vllm-offline-qwen35": partial(offline.stage_vllm_offline, model="qwen35"),
    "pax-offline-qwen35-fp8": partial(offline.stage_pax_offline, variant="fp8", model="qwen35"),
    "vllm-offline-qwen35-fp8": partial(offline.stage_vllm_offline, variant="fp8", model="qwen35"),
    "pax-offline-qwen3moe": partial(offline.stage_pax_offline, model="qwen3moe"),
    "vllm-offline-qwen3moe": partial(offline.stage_vllm_offline, model="qwen3moe"),
    "pax-offline-qwen3moe-fp8": partial(offline.stage_pax_offline, variant="fp8", model="qwen3moe"),
    "vllm-offline-qwen3moe-fp8": partial(
        offline.stage_vllm_offline, variant="fp8", model="qwen3moe"
    ),
    "pax-serve-qwen35": partial(serving.stage_pax_serve, model="qwen35"),
    "vllm-serve-qwen35": partial(serving.stage_vllm_serve, model="qwen35"),
    "pax-serve-qwen3moe": partial(serving.stage_pax_serve, model="qwen3moe"),
    "vllm-serve-qwen3moe": partial(serving.stage_vllm_serve, model="qwen3moe"),
    "vllm-serve": serving.stage_vllm_serve,
    "pax-serve-fp8": partial(serving.stage_pax_serve, variant="fp8"),
    "vllm-serve-fp8": partial(serving.stage_vllm_serve, variant="fp8"),
    "pax-poisson": serving.stage_pax_poisson,
    "vllm-poisson": serving.stage_vllm_poisson,
    "hf": hf.stage_hf,
}
ALL_STAGES = tuple(STAGES)


def run_stage(name: str, spec: dict, out_dir: Path, deadline: float | None = None) -> int:
    """Inside the stage's own process: run it, write DIR/stage_<name>.json, exit."""
    out = out_dir / f"stage_{name}.json"
    stage.begin(out, deadline)
    t = time.perf_counter()
    try:
        res = STAGES[name](spec, out)
        res = {"ok": True, **stage.partial(), **res}
    except Exception as e:  # noqa: BLE001 - recorded, the driver goes on
        import traceback

        traceback.print_exc()
        res = {**stage.partial(), "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}
    res["stage_wall_s"] = time.perf_counter() - t
    out.write_text(json.dumps(finite(res), indent=1, allow_nan=False))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if res["ok"] else 1)  # no slow teardown; the driver ends what is left of the group


def _copy_out(work: Path, out_dir: Path) -> None:
    """The files worth bringing back (the device returns at most 8)."""
    import shutil

    if work == out_dir:
        return
    names = ["gpu_bench.json"] + [
        f"{lab}_{w}{suf}"
        for suf in (".json", "_sweep.png", "_latency_cdf.png")  # results before plots
        for w in ("serve", "poisson")
        for lab in ("pax", "vllm")
    ]
    present = [n for n in names if (work / n).is_file()]
    for n in present[:7]:  # the device returns 8 files; gpu_run.sh's log is the 8th
        shutil.copy2(work / n, out_dir / n)


def _kill_group(proc: subprocess.Popen) -> None:
    """End the process group the stage leads (a stage started with start_new_session)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            if proc.poll() is None:
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.5)
        else:
            continue
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        return


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.main", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "benchmarks/results/gpu",
        help="where the results are copied (at most 8 files: the device's limit)",
    )
    p.add_argument(
        "--work",
        default="/tmp/paxengine_gpu_bench",
        help="scratch: stage results, server logs, the dummy model dir; kept between "
        "calls on a warm machine, so a later call's stages merge with earlier ones",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget for all stages (each stage's limit shrinks to fit)",
    )
    p.add_argument(
        "--stages",
        default="roofline,pax-offline,pax-serve",
        help=f"comma-separated, from {','.join(ALL_STAGES)}; 'all' = every one, vLLM "
        f"stages skipped when vllm is not importable",
    )
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized workloads (smoke test)")
    p.add_argument("--stage-timeout", type=float, default=540.0, help="seconds per stage")
    p.add_argument(
        "--vllm-pythonpath",
        default=os.environ.get("VLLM_PYTHONPATH", "/tmp/vsite"),
        help="PYTHONPATH for the vLLM stages (vLLM pins its own fastapi/pydantic)",
    )
    p.add_argument("--_stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--reserve-s",
        type=float,
        default=150.0,
        help="with --budget-s: seconds kept back for each stage still to run",
    )
    return p, p.parse_args(argv)


def vllm_env(pythonpath: str) -> dict | None:
    """The environment of a vLLM stage (vLLM's own site first), None when vllm does not import
    there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (pythonpath, str(REPO_ROOT)) if x)
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True)
    return env if probe.returncode == 0 else None


def launch_stage(name: str, spec: dict, work: Path, env: dict, limit: float) -> dict:
    """Run one stage in its own process (and process group), ended after `limit` seconds; its
    result, or what it saved before it was cut off, or a failure record."""
    t = time.perf_counter()
    f = work / f"stage_{name}.json"
    f.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.main",
        "--work",
        str(work),
        "--_stage",
        name,
        "--_spec",
        json.dumps(spec),
        "--_deadline",
        str(time.time() + limit),
    ]
    # its own process group: on a timeout the stage's server goes down with it
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    _kill_group(proc)  # the stage, or what it left behind (a server, vLLM's engine process)
    stage.log(f"stage {name} done in {time.perf_counter() - t:.0f} s (rc {rc})")
    if not f.is_file():
        return {"ok": False, "error": f"stage process ended with {rc} and no result"}
    res = json.loads(f.read_text())
    if rc == "timeout":
        res.update(ok=False, error=f"stage cut off after {limit:.0f} s")
    return res


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p, args = parse_args(argv)
    # the engine's start-up lines (its KV plan, state slots, temporaries) in the stage's log
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[paxengine %(asctime)s] %(message)s", "%H:%M:%S"))
    logging.getLogger("paxengine").addHandler(handler)
    logging.getLogger("paxengine").setLevel(logging.INFO)
    t_start = time.perf_counter()
    out_dir = Path(args.out).resolve()
    work = Path(args.work).resolve()
    spec = QUICK if args.quick else FULL
    if args._stage:
        work.mkdir(parents=True, exist_ok=True)
        return run_stage(
            args._stage, json.loads(args._spec) if args._spec else spec, work, args._deadline
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    stages = (
        list(ALL_STAGES)
        if args.stages == "all"
        else [s.strip() for s in args.stages.split(",") if s.strip()]
    )
    bad = [s for s in stages if s not in STAGES]
    if bad:
        p.error(f"unknown stages {bad}; choose from {ALL_STAGES}")
    merged = {
        "benchmark": "gpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.gpu.main " + shlex.join(argv),
        "spec": spec,
        "stages": {},
        "environment": environment(),
    }
    merged_file = work / "gpu_bench.json"
    merge_earlier(merged, merged_file)
    for idx, name in enumerate(stages):
        env = dict(os.environ)
        if name.startswith("vllm"):
            env = vllm_env(args.vllm_pythonpath)
            if env is None:
                stage.log(f"skip {name}: vllm is not importable with {args.vllm_pythonpath}")
                merged["stages"][name] = {
                    "ok": False,
                    "skipped": True,
                    "error": "vllm not importable",
                }
                continue
        limit = args.stage_timeout
        if args.budget_s:
            later = len(stages) - idx - 1
            spent = time.perf_counter() - t_start
            limit = min(limit, args.budget_s - spent - 10 - args.reserve_s * later)
            if limit < 30:
                stage.log(f"skip {name}: the budget is spent")
                merged["stages"][name] = {
                    "ok": False,
                    "skipped": True,
                    "error": "no time left in the budget",
                }
                continue
        stage.log(f"stage {name} ...")
        merged["stages"][name] = launch_stage(name, spec, work, env, limit)
        merged_file.write_text(json.dumps(finite(merged), indent=1, allow_nan=False))
        _copy_out(work, out_dir)
    print(markdown_table(merged), flush=True)
    return 0 if all(v.get("ok") or v.get("skipped") for v in merged["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
