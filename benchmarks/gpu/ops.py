"""The operations run on the H200 (issues #21 and #22), one server over two device calls: the
soak lasts ten minutes and a device call at most ten, so the server and the soak run in their own
process sessions (they outlive the first call) and the second call collects them.

    python -m benchmarks.gpu.ops start  --out DIR [--quick]   # server up, structured runs, soak begun
    python -m benchmarks.gpu.ops finish --out DIR             # soak report, drain by SIGTERM, exit code
    python -m benchmarks.gpu.ops structured --out DIR [--quick]  # the structured runs alone

`start`: `paxengine serve` on the dummy Llama-3.1-8B with a byte-level BPE tokenizer of its 128,256
tokens (grammars need a vocabulary that spells text; `dummy_model.byte_level_bpe`); then
`bench serve` at concurrency 32 and 64, unconstrained ("plain") and under a JSON schema whose
array never closes within the output ("schema", so every token runs under the grammar),
interleaved, twice each; then `benchmarks.soak` (600 s, concurrency 64, 30% of streams dropped,
5% bad requests) in the background. `finish`: waits for the soak's report, sends SIGTERM and times
the drain and the exit code. Everything lands in --out (ops_h200.json and the logs)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.bench import serve
from benchmarks.gpu import REPO_ROOT
from benchmarks.gpu.dummy_model import write_dummy_model_dir
from benchmarks.gpu.serving import _free_port, pax_serve_cmd
from benchmarks.gpu.workloads import FULL, QUICK
from benchmarks.record import environment
from benchmarks.structured import PERSON  # the schema of the CPU benchmarks

WORK = Path("/tmp/paxengine_ops")  # survives between calls on one warm machine
# 64 objects do not fit in 128 tokens: the grammar never ends early, every output token is masked
SCHEMA_BODY = {"structured_outputs": {"json": {"type": "array", "minItems": 64, "items": PERSON}}}
SETTINGS = {
    "full": {
        "input_len": 1024,
        "output_len": 128,
        "concurrency": [32, 64],
        "per_conc": 4,
        "rounds": 2,
        "soak_s": 600,
        "soak_conc": 64,
        "soak_max_tokens": 128,
    },
    "quick": {
        "input_len": 16,
        "output_len": 8,
        "concurrency": [4],
        "per_conc": 2,
        "rounds": 1,
        "soak_s": 8,
        "soak_conc": 4,
        "soak_max_tokens": 8,
    },
}


def _state() -> dict:
    return json.loads((WORK / "state.json").read_text())


def _save(out: Path, **kv) -> dict:
    f = out / "ops_h200.json"
    doc = json.loads(f.read_text()) if f.is_file() else {}
    doc.update(kv)
    f.write_text(json.dumps(doc, indent=1))
    return doc


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(spec: dict, quick: bool) -> dict:
    d = write_dummy_model_dir(spec["preset"], WORK / "dummy_model_bpe", tokenizer="bpe")
    port = _free_port()
    extra = dict(spec["serve"].get("pax_engine", {}))
    cmd = pax_serve_cmd(spec, d, port, extra)
    log = open(WORK / "server.log", "w")
    t = time.perf_counter()
    # a process session of its own, so it outlives this device call (the soak runs into the
    # next); the shell around it keeps the server's exit code, which the drain check reads
    wrapper = f'"$@" & echo $! > {WORK}/server.pid; wait $!; echo $? > {WORK}/server.rc'
    proc = subprocess.Popen(
        ["sh", "-c", wrapper, "sh", *cmd],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + (120 if quick else 420)
    while not _ready(base):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("server did not start: " + (WORK / "server.log").read_text()[-3000:])
        time.sleep(1)
    pid = int((WORK / "server.pid").read_text())
    state = {"pid": pid, "base": base, "cmd": cmd, "startup_s": time.perf_counter() - t}
    (WORK / "state.json").write_text(json.dumps(state))
    return state


def structured_runs(spec: dict, st: dict, s: dict, out: Path) -> dict:
    """plain and schema `bench serve` runs, interleaved (the machine drifts), then medians."""
    from paxengine.models.config import PRESETS

    runs: dict = {}
    for c in s["concurrency"]:
        for rnd in range(s["rounds"]):
            for mode in ("plain", "schema"):
                part = WORK / f"bench_{mode}_c{c}_{rnd}.json"
                argv = [
                    "--base-url",
                    st["base"],
                    "--dataset-name",
                    "random",
                    "--random-input-len",
                    str(s["input_len"]),
                    "--random-output-len",
                    str(s["output_len"]),
                    "--num-prompts",
                    str(max(32, s["per_conc"] * c)),
                    "--max-concurrency",
                    str(c),
                    "--ignore-eos",
                    "--temperature",
                    "0.8",
                    "--seed",
                    str(rnd),
                    "--vocab-size",
                    str(PRESETS[spec["preset"]].vocab_size),
                    "--result-file",
                    str(part),
                    "--plot-dir",
                    "none",
                    "--disable-tqdm",
                    "--num-warmups",
                    "2",
                    "--label",
                    f"{mode}_c{c}",
                ]
                if mode == "schema":
                    argv += ["--extra-body", json.dumps(SCHEMA_BODY)]
                serve.main(argv)
                r = json.loads(part.read_text())["runs"][0]
                runs[f"{mode}_c{c}_{rnd}"] = {
                    k: r.get(k)
                    for k in (
                        "completed",
                        "failed",
                        "output_throughput",
                        "mean_tpot_ms",
                        "median_tpot_ms",
                        "p99_tpot_ms",
                        "median_ttft_ms",
                        "p99_ttft_ms",
                        "total_output_tokens",
                        "output_len_mismatches",
                        "duration_s",
                    )
                }
                _save(out, structured_runs=runs)
    summary = {}
    for c in s["concurrency"]:
        med = {}
        for mode in ("plain", "schema"):
            rs = [v for k, v in runs.items() if k.startswith(f"{mode}_c{c}_")]
            med[mode] = {
                k: sorted(r[k] for r in rs)[len(rs) // 2]
                for k in ("output_throughput", "median_tpot_ms", "p99_tpot_ms")
            }
        med["schema_vs_plain"] = {
            "output_throughput": f"{100 * (med['schema']['output_throughput'] / med['plain']['output_throughput'] - 1):+.1f}%",
            "median_tpot_ms": f"{100 * (med['schema']['median_tpot_ms'] / med['plain']['median_tpot_ms'] - 1):+.1f}%",
        }
        summary[f"c{c}"] = med
    return summary


def grammar_compile_times(st: dict) -> dict:
    """Wall time of a fresh schema's first request (compile + 1 token) against a cached one."""
    import httpx

    out = {}
    with httpx.Client(base_url=st["base"], timeout=300) as c:
        for name, body in {
            "json_schema person (fresh)": {
                "structured_outputs": {"json": {**PERSON, "title": "x"}}
            },
            "json_schema person (cached)": {
                "structured_outputs": {"json": {**PERSON, "title": "x"}}
            },
            "json_object": {"response_format": {"type": "json_object"}},
            "regex": {"structured_outputs": {"regex": "[A-Z][a-z]{2,5}-[0-9]{3}"}},
            "plain (no grammar)": {},
        }.items():
            t = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **body})
            out[name] = {"status": r.status_code, "ms": round(1000 * (time.perf_counter() - t), 1)}
    return out


def cmd_start(out: Path, quick: bool, hold_until: float | None, soak_too: bool = True) -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    spec, s = (QUICK if quick else FULL), SETTINGS["quick" if quick else "full"]
    _save(out, environment=environment(), settings=s, schema_body=SCHEMA_BODY)
    st = start_server(spec, quick)
    _save(out, server_cmd=" ".join(st["cmd"]), startup_s=st["startup_s"])
    _save(out, grammar_first_request=grammar_compile_times(st))
    _save(out, structured=structured_runs(spec, st, s, out))
    if not soak_too:
        drain_s, code = _stop(st)
        _save(out, sigterm_to_exit_s=round(drain_s, 2), exit_code=code)
        shutil.copy(WORK / "server.log", out / "server.log")
        return 0 if code == 0 else 1
    soak = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        "--url",
        st["base"],
        "--seconds",
        str(s["soak_s"]),
        "--concurrency",
        str(s["soak_conc"]),
        "--max-tokens",
        str(s["soak_max_tokens"]),
        "--drop",
        "0.3",
        "--bad",
        "0.05",
        "--server-pid",
        str(st["pid"]),
        "--out",
        str(WORK / "soak.json"),
    ]
    with open(WORK / "soak.log", "w") as log:
        subprocess.Popen(
            soak, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
    _save(out, soak_cmd=" ".join(soak), soak_started=time.time())
    shutil.copy(WORK / "server.log", out / "server.log")
    # the soak outlasts this call: spend the rest of it waiting, so that `finish` (the next
    # call) has less than its ten minutes left to wait
    if hold_until:
        time.sleep(max(0.0, hold_until - time.time()))
    return 0


def _stop(st: dict) -> tuple[float, int | str]:
    """The drain, on an idle server: SIGTERM, then how long it took and the exit code."""
    t = time.perf_counter()
    os.kill(st["pid"], signal.SIGTERM)
    rc_file = WORK / "server.rc"
    while not rc_file.is_file() and time.perf_counter() - t < 60:
        time.sleep(0.1)
    drain_s = time.perf_counter() - t
    return drain_s, int(rc_file.read_text()) if rc_file.is_file() else "still running after 60 s"


def cmd_finish(out: Path, timeout_s: float) -> int:
    st = _state()
    deadline = time.monotonic() + timeout_s
    while not (WORK / "soak.json").is_file() and time.monotonic() < deadline:
        time.sleep(2)
    report = (
        json.loads((WORK / "soak.json").read_text()) if (WORK / "soak.json").is_file() else None
    )
    drain_s, code = _stop(st)
    log_tail = (WORK / "server.log").read_text(errors="replace")[-4000:]
    for name in ("server.log", "soak.log"):
        if (WORK / name).is_file():
            shutil.copy(WORK / name, out / name)
    doc = {
        "soak": report,
        "sigterm_to_exit_s": round(drain_s, 2),
        "exit_code": code,
        "server_log_tail": log_tail,
    }
    (out / "soak_h200.json").write_text(json.dumps(doc, indent=1))
    print(
        json.dumps(
            {
                "problems": report and report.get("problems"),
                "exit_code": code,
                "sigterm_to_exit_s": drain_s,
            }
        )
    )
    return 0 if report is not None and not report.get("problems") and code == 0 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("start", "finish", "structured"))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/ops_out"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout-s", type=float, default=560, help="finish: how long to wait")
    p.add_argument("--hold-until", type=float, help="start: return at this epoch time, not before")
    p.add_argument("--concurrency", help="the structured runs' concurrencies, e.g. 32,64")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.phase == "finish":
        return cmd_finish(out, a.timeout_s)
    if a.concurrency:
        for s in SETTINGS.values():
            s["concurrency"] = [int(c) for c in a.concurrency.split(",")]
    return cmd_start(out, a.quick, a.hold_until, soak_too=a.phase == "start")


if __name__ == "__main__":
    sys.exit(main())
