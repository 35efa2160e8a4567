"""`paxengine bench serve` against a real paxengine server (SmolLM2, CPU, 127.0.0.1 only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.bench import serve

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fake_openai import free_port  # noqa: E402

from tests.devices import truncated_smollm2  # noqa: E402

# Small buckets so that a cold start compiles quickly on two CPU cores.
SERVER_FLAGS = [
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "64",
    "--max-model-len",
    "128",
    "--served-model-name",
    "smollm2",
    "--log-level",
    "warning",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "serving.cli",
                # four of SmolLM2's layers and its tokenizer (devices.truncated_smollm2): the
                # client's counts, timings and report are the point, not the text; each step
                # of the 30-layer model cost ~5x
                "--model",
                truncated_smollm2(),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *SERVER_FLAGS,
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


RUN_FIELDS = [
    "max_concurrency",
    "request_rate",
    "num_prompts",
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "tokens_per_chunk",
    "max_concurrent_requests",
    "prompt_len_mismatches",
    "output_len_mismatches",
    "errors",
    "requests",
] + [
    f"{s}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "median", "std", "min", "max", "p50", "p90", "p99")
]
TOP_FIELDS = [
    "benchmark",
    "date",
    "command",
    "environment",
    "server",
    "dataset",
    "sampling",
    "percentiles",
    "runs",
    "plots",
]


def test_bench_serve_real_server(server, tmp_path):
    out = tmp_path / "serve.json"
    rc = serve.main(
        [
            "--base-url",
            server,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--sweep-concurrency",
            "2,8",
            "--vocab-size",
            "49152",
            "--result-file",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    for k in TOP_FIELDS:
        assert k in res, k
    assert res["server"]["model"] == "smollm2"
    env = res["environment"]
    assert env["device"] and env["jax_version"] and "commit" in env
    assert [r["max_concurrency"] for r in res["runs"]] == [2, 8]
    for run in res["runs"]:
        for k in RUN_FIELDS:
            assert k in run, k
        assert run["completed"] == 8 and run["failed"] == 0 and not run["errors"]
        reqs = run["requests"]
        # token counts are the server's usage, and match what was asked (token-id prompts, ignore_eos)
        assert [q["prompt_tokens"] for q in reqs] == [16] * 8
        assert [q["completion_tokens"] for q in reqs] == [8] * 8
        assert run["total_input_tokens"] == sum(q["prompt_tokens"] for q in reqs) == 128
        assert run["total_output_tokens"] == sum(q["completion_tokens"] for q in reqs) == 64
        assert run["prompt_len_mismatches"] == 0 and run["output_len_mismatches"] == 0
        assert run["output_throughput"] == pytest.approx(64 / run["duration_s"])
        assert run["total_token_throughput"] == pytest.approx(192 / run["duration_s"])
        assert run["request_throughput"] == pytest.approx(8 / run["duration_s"])
        assert 1 <= run["max_concurrent_requests"] <= run["max_concurrency"]
        for q in reqs:
            assert q["success"] and 1 <= q["chunks"] <= 8 and len(q["itl"]) == q["chunks"] - 1
            assert 0 < q["ttft"] <= q["latency"]
            assert q["tpot"] == pytest.approx((q["latency"] - q["ttft"]) / 7, rel=1e-3, abs=1e-3)
        assert run["median_ttft_ms"] <= run["p99_ttft_ms"] <= run["max_ttft_ms"]
        assert run["mean_e2el_ms"] >= run["mean_ttft_ms"]
    names = sorted(Path(p).name for p in res["plots"])
    assert names == ["serve_latency_cdf.png", "serve_sweep.png"]
    for p in res["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(p).stat().st_size > 10_000


def test_bench_serve_real_server_chat(server, tmp_path):
    out = tmp_path / "chat.json"
    rc = serve.main(
        [
            "--base-url",
            server,
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "4",
            "--random-input-len",
            "12",
            "--random-output-len",
            "6",
            "--max-concurrency",
            "4",
            "--num-warmups",
            "0",
            "--result-file",
            str(out),
            "--plot-dir",
            "none",
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] == 4 and run["total_output_tokens"] == 24
    assert run["total_input_tokens"] >= 4 * 12  # the chat template adds tokens
    assert all(q["completion_tokens"] == 6 and q["ttft"] > 0 for q in run["requests"])
