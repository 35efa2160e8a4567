"""/metrics as vLLM 0.26's V1 engine exports it (vllm/v1/metrics/loggers.py PrometheusStatLogger):
names, types, help texts, label names and histogram buckets, and values that agree with the
requests served. The fake engine's app for the server-side metrics (fast); one real SmolLM2
server for the numbers the engine keeps (iteration tokens, prompt tokens by source, the cache
config)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from paxengine.errors import StepFailed
from serving.app import build_app
from serving.config import ServerConfig

_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
_TTFT += [10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_ITL += [20.0, 40.0, 80.0]
_LAT = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]
_LAT += [240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOK128 = [1, 2, 5, 10, 20, 50, 100]  # vLLM's build_1_2_5_buckets(max_model_len=128)

# vLLM 0.26's per-request families: name -> (help, buckets)
REQUEST_HISTOGRAMS = {
    "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", _TTFT),
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", _ITL),
    "request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request.",
        _ITL,
    ),
    "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", _LAT),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.", _LAT),
    "request_inference_time_seconds": (
        "Histogram of time spent in RUNNING phase for request.",
        _LAT,
    ),
    "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.", _LAT),
    "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.", _LAT),
    "request_prompt_tokens": ("Number of prefill tokens processed.", _TOK128),
    "request_generation_tokens": ("Number of generation tokens processed.", _TOK128),
    "request_prefill_kv_computed_tokens": (
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        _TOK128,
    ),
    "request_max_num_generation_tokens": (
        "Histogram of maximum number of requested generation tokens.",
        _TOK128,
    ),
    "request_params_n": ("Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
    "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", _TOK128),
}


def families(client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams, name, suffix="", **labels) -> float:
    """The sum of a family's samples named name + suffix whose labels include `labels`."""
    fam = fams[name]
    return sum(
        s.value
        for s in fam.samples
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


class _Engines(FakeEngine):
    """Two engines (as a data-parallel pair), every request served by replica 1."""

    def stats(self):
        one = super().stats()
        return {**one, "replicas": [dict(one, prompt_tokens=0, generation_tokens=0), one]}

    def engine_index(self, request_id):
        return 1


class _FailingStep(FakeEngine):
    """A step failure (the engine's StepFailed, a 500) after the request's first token."""

    async def _run(self, request_id, ids, params):
        async for out in super()._run(request_id, ids, params):
            yield out
            raise StepFailed("the device step failed", [request_id])


def _app(engine):
    return TestClient(build_app(engine, ServerConfig(metrics_prefix="vllm")))


def test_request_metrics_as_vllm_with_the_requests_values():
    prompts = ["hello", "a longer prompt here", "xyz"]
    with _app(FakeEngine()) as c:
        usage = []
        for i, p in enumerate(prompts):
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 3 + i})
            assert r.status_code == 200, r.text
            usage.append((r.json()["usage"], 1, 3 + i))
        r = c.post("/v1/completions", json={"prompt": "two", "max_tokens": 4, "n": 2})
        usage.append((r.json()["usage"], 2, 4))
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "st", "max_tokens": 5, "stream": True}
        ) as s:
            assert s.status_code == 200 and sum(1 for _ in s.iter_lines()) > 5
        usage.append(({"prompt_tokens": 2, "completion_tokens": 5}, 1, 5))
        fams = families(c)

    for name, (doc, buckets) in REQUEST_HISTOGRAMS.items():
        fam = fams[f"vllm:{name}"]
        assert fam.type == "histogram" and fam.documentation == doc, name
        les = [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")]
        assert les == [str(float(b)) for b in buckets] + ["+Inf"], name
        assert all(s.labels.keys() - {"le"} == {"model_name", "engine"} for s in fam.samples), name
        assert {s.labels["model_name"] for s in fam.samples} == {"fake-model"}
        assert {s.labels["engine"] for s in fam.samples} == {"0"}

    requests = len(usage)
    sequences = sum(n for _, n, _ in usage)
    # per request: the timings, n, the largest sequence
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_prefill_kv_computed_tokens",
    ):
        assert value(fams, f"vllm:{name}", "_count") == requests, name
    assert value(fams, "vllm:request_params_n", "_sum") == sequences
    assert value(fams, "vllm:request_max_num_generation_tokens", "_sum") == sum(
        mt for _, _, mt in usage
    )  # every sequence ran to its max_tokens
    # per sequence (vLLM's n child requests): the prompt, the output, max_tokens
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert value(fams, f"vllm:{name}", "_count") == sequences, name
    # usage counts a prompt once; vLLM's histogram once a sequence
    prompt_tokens = sum(u["prompt_tokens"] * n for u, n, _ in usage)
    assert value(fams, "vllm:request_prompt_tokens", "_sum") == prompt_tokens
    assert value(fams, "vllm:request_prefill_kv_computed_tokens", "_sum") == sum(
        u["prompt_tokens"] for u, _, _ in usage
    )  # the fake engine caches nothing; a request computes its prompt once
    completion = sum(u["completion_tokens"] for u, _, _ in usage)
    assert value(fams, "vllm:request_generation_tokens", "_sum") == completion
    assert value(fams, "vllm:request_params_max_tokens", "_sum") == sum(
        n * mt for _, n, mt in usage
    )
    # the phases add up: queue + inference = e2e, prefill + decode = inference; e2e >= TTFT
    e2e = value(fams, "vllm:e2e_request_latency_seconds", "_sum")
    inference = value(fams, "vllm:request_inference_time_seconds", "_sum")
    queue = value(fams, "vllm:request_queue_time_seconds", "_sum")
    prefill = value(fams, "vllm:request_prefill_time_seconds", "_sum")
    decode = value(fams, "vllm:request_decode_time_seconds", "_sum")
    assert queue + inference == pytest.approx(e2e) and prefill + decode == pytest.approx(inference)
    assert e2e >= value(fams, "vllm:time_to_first_token_seconds", "_sum") > 0
    assert inference > decode > 0
    # finished reasons: vLLM's five, each a series from the start
    succ = fams["vllm:request_success"]
    assert (
        succ.type == "counter" and succ.documentation == "Count of successfully processed requests."
    )
    by_reason = {s.labels["finished_reason"]: s.value for s in succ.samples}
    assert by_reason == {"stop": 0, "length": sequences, "abort": 0, "error": 0, "repetition": 0}
    assert all(s.labels["engine"] == "0" for s in succ.samples)
    # no sleep mode: awake
    sleep = fams["vllm:engine_sleep_state"]
    assert sleep.type == "gauge"
    assert {s.labels["sleep_state"]: s.value for s in sleep.samples} == {
        "awake": 1,
        "weights_offloaded": 0,
        "discard_all": 0,
    }
    # the fake engine keeps no iteration histogram, cache config or waiting reasons: not exported
    for name in ("iteration_tokens_total", "cache_config_info", "num_requests_waiting_by_reason"):
        assert f"vllm:{name}" not in fams, name
    assert "vllm:prompt_tokens_by_source" not in fams


def test_engine_gauges_and_counters_carry_vllms_labels_and_help():
    with _app(FakeEngine()) as c:
        fams = families(c)
    for name, kind, doc in (
        ("num_requests_running", "gauge", "Number of requests in model execution batches."),
        ("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
        ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
        (
            "prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
        ),
        ("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
        ("num_preemptions", "counter", "Cumulative number of preemption from the engine."),
        ("prompt_tokens", "counter", "Number of prefill tokens processed."),
        ("generation_tokens", "counter", "Number of generation tokens processed."),
    ):
        fam = fams[f"vllm:{name}"]
        assert (fam.type, fam.documentation) == (kind, doc), name
        assert [s.labels for s in fam.samples] == [{"model_name": "fake-model", "engine": "0"}]


def test_a_failed_step_counts_as_finished_reason_error():
    with _app(_FailingStep()) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2})
        assert r.status_code == 500, r.text
        fams = families(c)
    assert value(fams, "vllm:request_success", "_total", finished_reason="error") == 2
    assert value(fams, "vllm:request_success", "_total", finished_reason="abort") == 0


def test_each_engine_a_series_and_requests_under_the_one_serving_them():
    with _app(_Engines()) as c:
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        fams = families(c)
    e2e = "vllm:e2e_request_latency_seconds"
    assert value(fams, e2e, "_count", engine="1") == 1
    assert value(fams, e2e, "_count", engine="0") == 0  # there, at 0, as vLLM's
    assert value(fams, "vllm:request_success", "_total", engine="1", finished_reason="length") == 1
    running = fams["vllm:num_requests_running"]
    assert sorted(s.labels["engine"] for s in running.samples) == ["0", "1"]


def test_engine_reported_numbers_through_the_real_server(server, http):
    """The engine's own numbers (SmolLM2): iteration tokens, prompt tokens by source, the cache
    config, the waiting requests by reason, against the requests' usage."""
    app = build_app(server.engine, ServerConfig(metrics_prefix="vllm"), manage_engine=False)
    shared = "The quick brown fox jumps over the lazy dog. " * 6  # several full 16-token blocks
    with TestClient(app) as c:
        before, served_before = families(c), families(http)  # the server's own: paxengine:
        usage = []
        for tail in ("One.", "Two.", "Three."):  # the 2nd and 3rd hit the 1st's blocks
            r = http.post(
                "/v1/completions",
                json={"prompt": shared + tail, "max_tokens": 3, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        after, served_after = families(c), families(http)

    def delta(name, suffix="", **labels):
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    prompt = sum(u["prompt_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    generated = sum(u["completion_tokens"] for u in usage)
    assert cached >= 2 * 16  # the prefix cache served the shared blocks
    src = "vllm:prompt_tokens_by_source"
    assert after[src].type == "counter"
    assert after[src].documentation == "Number of prompt tokens by source."
    assert delta(src, "_total", source="local_cache_hit") == cached
    assert delta(src, "_total", source="local_compute") == prompt - cached
    assert delta(src, "_total", source="external_kv_transfer") == 0
    assert delta("vllm:prompt_tokens_cached", "_total") == cached
    # the server's histogram of the same (observed as requests finish, not by the engine)
    kv = "paxengine:request_prefill_kv_computed_tokens"
    assert value(served_after, kv, "_sum") - value(served_before, kv, "_sum") == prompt - cached
    assert delta("vllm:generation_tokens", "_total") == generated
    it = after["vllm:iteration_tokens_total"]
    assert it.type == "histogram"
    assert it.documentation == "Histogram of number of tokens per engine_step."
    les = [s.labels["le"] for s in it.samples if s.name.endswith("_bucket")]
    bounds = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert les == [str(float(b)) for b in bounds] + ["+Inf"]
    # every iteration's tokens: the prompts' computed tokens, then one token a sequence a step
    assert delta("vllm:iteration_tokens_total", "_sum") == prompt - cached + generated
    steps = delta("vllm:iteration_tokens_total", "_count")
    assert len(usage) <= steps <= generated
    info = after["vllm:cache_config_info"].samples
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and info[0].labels["num_gpu_blocks"] == "256"
    assert info[0].labels["enable_prefix_caching"] == "True"
    assert info[0].labels["engine"] == "0" and "model_name" not in info[0].labels
    by_reason = after["vllm:num_requests_waiting_by_reason"]
    waiting = {s.labels["reason"]: s.value for s in by_reason.samples}
    assert set(waiting) == {"capacity", "deferred"}
    assert sum(waiting.values()) == value(after, "vllm:num_requests_waiting")


def test_iteration_stats_buckets_as_vllms():
    from paxengine.iteration_stats import ITERATION_TOKENS_BUCKETS, IterationStats

    st = IterationStats()
    for n in (1, 2, 8, 9, 16384, 16385):
        st.iteration(n)
    counts = st.as_dict()["iteration_tokens_buckets"]
    assert len(counts) == len(ITERATION_TOKENS_BUCKETS) + 1
    assert counts[0] == 1 and counts[1] == 2 and counts[2] == 1 and counts[12] == 1
    assert counts[13] == 1 and st.iteration_tokens_sum == 1 + 2 + 8 + 9 + 16384 + 16385
    assert st.prefilled(40, 32) == 8 and st.prefilled(10, 0) == 10
    assert (st.prompt_tokens_local_compute, st.prompt_tokens_local_cache_hit) == (18, 32)
