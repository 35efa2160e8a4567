"""Concurrency and disconnects against the real engine, then /metrics: nothing leaks, counts add up."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

N_STREAMS = 32
MAX_TOKENS = 12


def scrape(http) -> dict[tuple, float]:
    """{(sample name, frozenset(labels)): value} of the server's /metrics (parsed by prometheus_client)."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def val(m, name, **labels) -> float:
    return m.get((f"paxengine:{name}", frozenset(labels.items())), 0.0)


async def _stream(client: httpx.AsyncClient, i: int, drop: bool, model: str):
    body = {
        "model": model,
        "prompt": f"Write a story about the number {i}.",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.9,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return "done", text
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"] if chunk["choices"] else ""
            chunks += 1
            if drop and chunks >= 2:
                return "dropped", text  # leaving the block closes the connection mid-stream
    return "eof", text


async def _nonstream_dropped(base: str, headers: dict, model: str):
    """A non-streaming request whose client gives up (read timeout) long before it would finish
    (400 tokens: hundreds of CPU steps). Not sooner than 1.5 s: under the 34 connections of this
    load a 2-core machine once took over 0.3 s to read the request's body, so the client left
    before there was a request to abort (starlette's ClientDisconnect in parse_body)."""
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=httpx.Timeout(30, read=1.5)
    ) as c:
        try:
            await c.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": "Tell me everything.",
                    "max_tokens": 400,
                    "ignore_eos": True,
                },
            )
        except httpx.ReadTimeout:
            return "dropped"
    return "finished"


async def _load(server):
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=server.base, headers=server.headers, timeout=120, limits=limits
    ) as client:
        streams = [_stream(client, i, i % 2 == 1, server.model) for i in range(N_STREAMS)]
        dropped = [_nonstream_dropped(server.base, server.headers, server.model) for _ in range(2)]
        return await asyncio.gather(*streams, *dropped)


def test_concurrent_streams_with_drops_then_metrics(server, http):
    before = scrape(http)
    t0 = time.monotonic()
    results = asyncio.run(_load(server))
    streams, nonstream = results[:N_STREAMS], results[N_STREAMS:]
    assert [s for s, _ in streams[0::2]] == ["done"] * (N_STREAMS // 2)
    assert [s for s, _ in streams[1::2]] == ["dropped"] * (N_STREAMS // 2)
    assert all(text for _, text in streams[0::2])
    assert nonstream == ["dropped", "dropped"]

    # every aborted request freed its blocks: the engine is idle and the KV pool empty
    deadline, m = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        m = scrape(http)
        if (
            val(m, "num_requests_running"),
            val(m, "num_requests_waiting"),
            val(m, "kv_cache_usage_perc"),
        ) == (0, 0, 0):
            break
        time.sleep(0.2)
    assert val(m, "num_requests_running") == 0
    assert val(m, "num_requests_waiting") == 0
    assert val(m, "kv_cache_usage_perc") == 0
    print(f"load: {N_STREAMS} streams + 2 dropped non-streaming in {time.monotonic() - t0:.1f}s")

    def delta(name, **labels):
        return val(m, name, **labels) - val(before, name, **labels)

    finished = N_STREAMS // 2
    assert delta("request_success_total", finished_reason="length") == finished
    assert delta("request_success_total", finished_reason="abort") == N_STREAMS // 2 + 2
    assert delta("generation_tokens_total") >= finished * MAX_TOKENS + N_STREAMS // 2 * 2
    assert delta("prompt_tokens_total") >= N_STREAMS * 5
    assert delta("time_to_first_token_seconds_count") >= N_STREAMS
    assert delta("e2e_request_latency_seconds_count") == finished
    assert delta("request_queue_time_seconds_count") == finished
    assert delta("inter_token_latency_seconds_count") >= finished * (MAX_TOKENS - 1)
    assert delta("request_generation_tokens_sum") == finished * MAX_TOKENS
    assert val(m, "prefix_cache_queries_total") >= val(m, "prefix_cache_hits_total") >= 0
    assert ("paxengine:xla_compiles_after_warmup_total", frozenset()) in m  # exported, and
    # no compile during this load (the counter is per process: other tests' engines count too)
    assert delta("xla_compiles_after_warmup_total") == 0

    # and the server still answers
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_metrics_prefix_vllm(server):
    """--metrics-prefix vllm: the same metrics under vLLM's names (a second app, same engine)."""
    from fastapi.testclient import TestClient

    from serving.app import build_app
    from serving.config import ServerConfig

    app = build_app(server.engine, ServerConfig(metrics_prefix="vllm"), manage_engine=False)
    with TestClient(app) as c:
        names = {f.name for f in text_string_to_metric_families(c.get("/metrics").text)}
    for n in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert f"vllm:{n}" in names, n
