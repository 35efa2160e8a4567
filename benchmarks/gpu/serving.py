"""The serving stages: a server (paxengine's or vLLM's) started on the dummy model, then
`paxengine bench serve` against it at each concurrency of the spec, one run per concurrency so a
stage cut off by its time limit keeps the runs it finished. The server's /metrics compile
counters before and after tell whether serving compiled anything."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench import plots, serve
from benchmarks.gpu import REPO_ROOT
from benchmarks.gpu.dummy_model import stage_model_dir
from benchmarks.gpu.stage import log, save_partial, seconds_left
from benchmarks.gpu.workloads import engine_args, pax_model, vocab_size, with_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_runs(spec: dict, workload: str) -> list[tuple[str, int, list[str]]]:
    """(run name, requests, `bench serve` load flags) of each run of a workload: `serve`, one run
    per concurrency; `poisson`, one run per Poisson rate, lengths drawn around the means, each
    sending about `seconds` worth of requests."""
    w = spec[workload]
    if workload == "serve":
        return [
            (
                f"c{c}",
                max(w["num_prompts"], w.get("per_concurrency", 0) * c),
                ["--max-concurrency", str(c)],
            )
            for c in w["concurrency"]
        ]
    return [
        (
            f"r{rate:g}",
            max(w["min_prompts"], round(rate * w["seconds"])),
            ["--request-rate", str(rate), "--random-range-ratio", str(w["range_ratio"])],
        )
        for rate in w["rates"]
    ]


def serve_stage(
    spec: dict, out: Path, server_cmd: list[str], label: str, env: dict, workload: str = "serve"
) -> dict:
    """Start a server, wait for it, run `bench serve` against it once per load of the workload
    (`load_runs`), stop it."""
    import urllib.request

    port = int(server_cmd[server_cmd.index("--port") + 1])
    base = f"http://127.0.0.1:{port}"
    logf = open(out.parent / f"{label}_server.log", "w")
    log("starting:", shlex.join(server_cmd))
    t = time.perf_counter()
    proc = subprocess.Popen(
        server_cmd,
        stdout=logf,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO_ROOT,
        start_new_session=False,
    )
    try:
        wait = spec.get("server_start_timeout", 480)
        if seconds_left() is not None:
            wait = min(wait, seconds_left() - 60)
        deadline = time.monotonic() + wait
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode}; see {logf.name}: "
                    + Path(logf.name).read_text()[-2000:]
                )
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready in time")
            time.sleep(1)
        startup = time.perf_counter() - t
        log(f"{label} server ready in {startup:.1f} s")
        wait = 300 if seconds_left() is None else min(300, seconds_left() - 120)
        all_built = _wait_for_every_bucket(base, t, time.monotonic() + wait)
        if all_built is None or all_built > startup + 1:
            log(f"{label} every step executable built at {all_built} s (after that: timed runs)")
        sv = spec[workload]
        vocab = vocab_size(spec)
        combined_file = out.parent / f"{label}_{workload}.json"
        compiles_before = _scrape_compiles(base)
        combined, runs, rcs = None, {}, []
        loads = load_runs(spec, workload)
        # one `bench serve` per load: a stage cut off by its time limit keeps the runs done
        for k, (name, n, load_flags) in enumerate(loads):
            part = out.parent / f"{label}_{workload}_{name}.json"
            argv = [
                "--base-url",
                base,
                "--dataset-name",
                "random",
                "--random-input-len",
                str(sv["input_len"]),
                "--random-output-len",
                str(sv["output_len"]),
                "--num-prompts",
                str(n),
                *load_flags,
                "--seed",
                str(1000 * k),
                "--vocab-size",
                str(vocab),
                "--result-file",
                str(part),
                "--plot-dir",
                "none",
                "--label",
                label,
                "--disable-tqdm",
                "--num-warmups",
                "2",
            ]
            log(f"{label} {workload}: {name}, {n} requests")
            rc = serve.main(argv)
            rcs.append(rc)
            if not part.is_file():
                raise RuntimeError(
                    f"bench serve exited with {rc} and wrote no results (its "
                    f"error is in the log above)"
                )
            res = json.loads(part.read_text())
            part.unlink()
            if combined is None:
                combined = res
                combined["command"] = f"{len(loads)} runs of " + res["command"]
            else:
                combined["runs"] += res["runs"]
            combined_file.write_text(json.dumps(combined))
            r = res["runs"][0]
            runs[name] = {
                key: r.get(key)
                for key in (
                    "completed",
                    "failed",
                    "num_prompts",
                    "duration_s",
                    "request_throughput",
                    "output_throughput",
                    "total_token_throughput",
                    "mean_ttft_ms",
                    "median_ttft_ms",
                    "p99_ttft_ms",
                    "mean_tpot_ms",
                    "median_tpot_ms",
                    "p99_tpot_ms",
                    "median_itl_ms",
                    "p99_itl_ms",
                    "median_e2el_ms",
                    "tokens_per_chunk",
                )
            }
            save_partial(startup_s=startup, all_built_s=all_built, runs=dict(runs))
        compiles_after = _scrape_compiles(base)
        server_compiles = {
            k: compiles_after[k] - compiles_before.get(k, 0.0) for k in compiles_after
        }
        combined["plots"] = plots.serve_plots(combined, out.parent, f"{label}_{workload}")
        combined_file.write_text(json.dumps(combined, indent=1))
        return {
            "startup_s": startup,
            "all_built_s": all_built,  # the background's builds done (timed runs after it)
            "bench_rc": max(rcs),
            "runs": runs,
            "server_compile_metrics_delta": server_compiles or None,
            "result_file": combined_file.name,
            "server_cmd": shlex.join(server_cmd),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        save_partial(server_log_tail=Path(logf.name).read_text(errors="replace")[-3000:])


def _scrape_compiles(base: str) -> dict:
    """Prometheus samples on the server's /metrics whose name mentions compil(e/ation), when it
    exports any (the serving runs' recompile count is their change)."""
    return _scrape(base, "compil")


def _pending_executables(base: str) -> float:
    """paxengine's step executables still building in the background (0 for other servers)."""
    return sum(_scrape(base, "step_executables_pending").values())


def _wait_for_every_bucket(base: str, t0: float, deadline: float) -> float | None:
    """Until the server's background builds are done (seconds since t0, None: never built
    within the deadline): the timed runs measure the server at its full speed; the ready time
    and this one are both recorded."""
    while _pending_executables(base) > 0:
        if time.monotonic() > deadline:
            return None
        time.sleep(1)
    return time.perf_counter() - t0


def _scrape(base: str, part: str) -> dict:
    """The samples on the server's /metrics whose name holds `part` (none when it has none)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if line.startswith("#") or part not in line.split("{")[0].split(" ")[0]:
            continue
        name, _, value = line.rpartition(" ")
        try:
            found[name] = float(value)
        except ValueError:
            pass
    return found


def stage_pax_serve(
    spec: dict,
    out: Path,
    workload: str = "serve",
    variant: str | None = None,
    model: str | None = None,
) -> dict:
    """`paxengine serve` (serving.cli) at its defaults; variant: one of the spec's "variants";
    model: one of its "models" ("qwen35") instead of the preset."""
    spec = with_model(spec, model)
    d = stage_model_dir(spec, out.parent)
    cmd = pax_serve_cmd(spec, d, _free_port(), engine_args(spec, variant))
    return serve_stage(spec, out, cmd, _label("pax", variant, model), dict(os.environ), workload)


def _label(engine: str, variant: str | None, model: str | None = None) -> str:
    return "_".join(x for x in (engine, model, variant) if x)


def _flags(args: dict) -> list[str]:
    """Engine settings as a server's flags: True as the bare flag (vLLM's booleans), a dict as
    JSON (vLLM's --additional-config)."""
    out = []
    for key, value in args.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            out.append(flag)
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def pax_serve_cmd(spec: dict, model_dir: Path, port: int, args: dict) -> list[str]:
    """The `paxengine serve` command on the dummy model (its tokenizer from `model_dir`) with
    `args` (engine_args) as flags."""
    exe = [sys.executable, "-m", "serving.cli"]
    return [
        *(*exe, "--model", pax_model(spec), "--tokenizer", str(model_dir)),
        *("--dtype", spec["dtype"], "--served-model-name", "dummy", "--log-level", "warning"),
        *("--port", str(port), "--host", "127.0.0.1", *_flags(args)),
    ]


def stage_vllm_serve(
    spec: dict,
    out: Path,
    workload: str = "serve",
    variant: str | None = None,
    model: str | None = None,
) -> dict:
    """`vllm serve` on the dummy model directory at its defaults, given what paxengine is (and,
    for a model, what vLLM needs to run it at all: its "vllm_required")."""
    spec = with_model(spec, model)
    d = stage_model_dir(spec, out.parent)
    exe = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(d)]
    args = {**engine_args(spec, variant), **spec.get("vllm_required", {})}
    cmd = [
        *(*exe, "--load-format", "dummy", "--dtype", spec["dtype"], "--served-model-name", "dummy"),
        *("--port", str(_free_port()), "--host", "127.0.0.1", *_flags(args)),
    ]
    return serve_stage(spec, out, cmd, _label("vllm", variant, model), dict(os.environ), workload)


def stage_pax_poisson(spec: dict, out: Path) -> dict:
    return stage_pax_serve(spec, out, "poisson")


def stage_vllm_poisson(spec: dict, out: Path) -> dict:
    return stage_vllm_serve(spec, out, "poisson")
