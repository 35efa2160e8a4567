"""The serving benchmark's client, datasets and metrics against a fake OpenAI-compatible server."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench import datasets as ds
from benchmarks.bench import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fake_openai import ServerThread, make_app  # noqa: E402

LATENCY_KEYS = [
    f"{s}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "median", "std", "p50", "p90", "p99")
]
RUN_KEYS = [
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrency",
    "max_concurrent_requests",
    "prompt_len_mismatches",
    "output_len_mismatches",
    "errors",
    "requests",
] + LATENCY_KEYS


@pytest.fixture(scope="module")
def fake():
    app = make_app(token_delay=0.002, max_prompt_len=40)
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


def test_random_dataset_lengths_and_range():
    reqs = ds.random_dataset(50, 20, 10, range_ratio=0.5, vocab_size=500, seed=1)
    assert all(10 <= r.prompt_len <= 30 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(5 <= r.output_len <= 15 for r in reqs)
    assert all(0 <= t < 500 for r in reqs for t in r.prompt)
    assert (
        ds.random_dataset(3, 8, 4, seed=7)[0].prompt == ds.random_dataset(3, 8, 4, seed=7)[0].prompt
    )
    fixed = ds.random_dataset(4, 16, 8)
    assert {r.prompt_len for r in fixed} == {16} and {r.output_len for r in fixed} == {8}


def test_shared_prefix_dataset():
    reqs = ds.shared_prefix_dataset(12, 3, 32, 4, 8, vocab_size=1000, seed=0)
    assert len(reqs) == 12 and all(r.prompt_len == 36 for r in reqs)
    assert len({tuple(r.prompt[:32]) for r in reqs}) == 3
    assert len({tuple(r.prompt) for r in reqs}) == 12


def test_sharegpt_dataset(tmp_path):
    conv = [
        {
            "conversations": [
                {"from": "human", "value": "word " * (10 + i)},
                {"from": "gpt", "value": "x" * (40 + 4 * i)},
            ]
        }
        for i in range(6)
    ]
    conv.append({"conversations": [{"from": "human", "value": "only one turn"}]})
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(conv))
    reqs = ds.sharegpt_dataset(p, 5, seed=0)
    assert len(reqs) == 5 and all(isinstance(r.prompt, str) for r in reqs)
    assert all(r.output_len >= 10 for r in reqs)
    assert {r.output_len for r in ds.sharegpt_dataset(p, 3, output_len=7)} == {7}
    with pytest.raises(ValueError):
        ds.sharegpt_dataset(p, 50)


def test_arrival_times():
    rng = np.random.default_rng(0)
    assert serve.arrival_times(5, math.inf, 1.0, 1, rng) == [0.0] * 5
    t = serve.arrival_times(100, 10.0, 1.0, 1, rng)
    assert t == sorted(t) and abs(t[-1] - 9.9) < 1e-6  # spans n/rate
    b = serve.arrival_times(12, 4.0, 1.0, 4, rng)
    assert b[0] == b[3] == 0.0 and b[4] == b[7] > 0  # groups of 4 arrive together


def _run(fake, tmp_path, *extra):
    out = tmp_path / "r.json"
    rc = serve.main(
        [
            "--base-url",
            fake.base_url,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--result-file",
            str(out),
            "--disable-tqdm",
            "--vocab-size",
            "1000",
            *extra,
        ]
    )
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_serve_random_completions(fake, tmp_path, client):
    pytest.importorskip(client)
    rc, res = _run(fake, tmp_path, "--max-concurrency", "4", "--http-client", client)
    assert rc == 0
    assert res["environment"]["http_client"] == client
    assert res["server"]["model"] == "fake-model"
    (run,) = res["runs"]
    for k in RUN_KEYS:
        assert k in run, k
    assert run["completed"] == 8 and run["failed"] == 0
    assert run["total_input_tokens"] == 8 * 16 and run["total_output_tokens"] == 8 * 8
    assert run["prompt_len_mismatches"] == 0 and run["output_len_mismatches"] == 0
    assert run["max_concurrent_requests"] <= 4
    assert run["tokens_per_chunk"] == 1.0
    for q in run["requests"]:
        assert q["completion_tokens"] == 8 and len(q["itl"]) == 7
        assert 0 < q["ttft"] <= q["latency"]
    assert abs(run["output_throughput"] - 64 / run["duration_s"]) < 1e-6
    assert 1.0 < run["median_itl_ms"] < 200
    body = fake.app.state.requests[-1]
    assert body["ignore_eos"] is True and body["max_tokens"] == 8 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and isinstance(body["prompt"], list)
    assert any(p.endswith("latency_cdf.png") for p in res["plots"])


def test_serve_chat_sweep_and_plots(fake, tmp_path):
    rc, res = _run(
        fake,
        tmp_path,
        "--endpoint",
        "/v1/chat/completions",
        "--sweep-concurrency",
        "1,2,4",
        "--num-warmups",
        "0",
    )
    assert rc == 0
    assert [r["max_concurrency"] for r in res["runs"]] == [1, 2, 4]
    assert [r["max_concurrent_requests"] for r in res["runs"]] == [1, 2, 4]
    for r in res["runs"]:
        assert r["completed"] == 8 and r["total_output_tokens"] == 64
        # the role-only opening chunk is not a token: 8 token chunks, 7 gaps
        assert all(len(q["itl"]) == 7 for q in r["requests"])
    assert isinstance(fake.app.state.requests[-1]["messages"][0]["content"], str)
    names = sorted(p.rsplit("/", 1)[1] for p in res["plots"])
    assert names == ["r_latency_cdf.png", "r_sweep.png"]
    for p in res["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_serve_request_rate_sweep(fake, tmp_path):
    """Poisson arrivals at each rate, lengths drawn around the means: one run per rate, each
    lasting about num_prompts / rate, plotted against the rate."""
    rc, res = _run(
        fake,
        tmp_path,
        "--sweep-request-rate",
        "20,80",
        "--random-range-ratio",
        "0.5",
        "--num-warmups",
        "0",
    )
    assert rc == 0
    runs = res["runs"]
    assert [r["request_rate"] for r in runs] == [20.0, 80.0]
    assert all(r["completed"] == 8 and r["max_concurrency"] is None for r in runs)
    # 7 exponential gaps of mean 1/rate: the slower rate takes longer to send its requests
    assert runs[0]["duration_s"] > runs[1]["duration_s"]
    lens = {q["prompt_len"] for q in runs[0]["requests"]}
    assert len(lens) > 1 and all(8 <= n <= 24 for n in lens)
    assert any(p.endswith("r_sweep.png") for p in res["plots"])
    both = ["--sweep-request-rate", "4", "--sweep-concurrency", "2"]
    assert serve.main(["--base-url", fake.base_url, *both]) == 2


def test_serve_failures_are_counted(fake, tmp_path):
    # prompts of 30..50 tokens; the fake refuses prompts over 40
    rc, res = _run(
        fake,
        tmp_path,
        "--random-input-len",
        "40",
        "--random-range-ratio",
        "0.25",
        "--num-prompts",
        "16",
        "--num-warmups",
        "0",
        "--request-rate",
        "200",
        "--plot-dir",
        "none",
    )
    (run,) = res["runs"]
    assert run["failed"] > 0 and run["completed"] > 0 and rc == 1
    assert run["completed"] + run["failed"] == 16
    assert "HTTP 400" in run["errors"][0]["error"]
    assert "plots" not in res
    assert res["runs"][0]["request_rate"] == 200


def test_missing_usage_is_a_failure(tmp_path):
    with ServerThread(make_app(usage=False)) as srv:
        rc = serve.main(
            [
                "--base-url",
                srv.base_url,
                "--num-prompts",
                "2",
                "--random-input-len",
                "4",
                "--random-output-len",
                "3",
                "--num-warmups",
                "0",
                "--disable-tqdm",
                "--result-file",
                str(tmp_path / "r.json"),
                "--plot-dir",
                "none",
            ]
        )
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert rc == 1 and run["failed"] == 2 and "no usage" in run["errors"][0]["error"]


def test_unreachable_server_fails_cleanly(capsys):
    rc = serve.main(
        [
            "--base-url",
            "http://127.0.0.1:9",
            "--num-prompts",
            "1",
            "--disable-tqdm",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
        ]
    )
    assert rc == 2
    assert "bench serve:" in capsys.readouterr().err


def test_serve_shared_prefix_and_sharegpt(fake, tmp_path):
    rc, res = _run(
        fake,
        tmp_path,
        "--dataset-name",
        "shared-prefix",
        "--shared-prefix-num-prefixes",
        "2",
        "--shared-prefix-len",
        "24",
        "--shared-prefix-suffix-len",
        "4",
        "--shared-prefix-output-len",
        "5",
        "--num-warmups",
        "0",
        "--plot-dir",
        "none",
    )
    assert rc == 0
    (run,) = res["runs"]
    assert run["total_input_tokens"] == 8 * 28 and run["total_output_tokens"] == 8 * 5
    conv = [
        {
            "conversations": [
                {"from": "human", "value": "hello there " * 5},
                {"from": "gpt", "value": "x" * 40},
            ]
        }
        for _ in range(8)
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(conv))
    rc, res = _run(
        fake,
        tmp_path,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(p),
        "--sharegpt-output-len",
        "6",
        "--num-warmups",
        "0",
        "--plot-dir",
        "none",
    )
    (run,) = res["runs"]
    assert rc == 0 and run["completed"] == 8 and run["total_output_tokens"] == 48
    assert fake.app.state.requests[-1]["prompt"].startswith("hello there")
