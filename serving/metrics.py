"""Prometheus metrics named like vLLM's (`<prefix>:num_requests_running`, ...).

One private CollectorRegistry per app. Gauges and counters the engine already keeps
(`engine.stats()`) are read at scrape time by a custom collector; per-request histograms and the
finished-reason counter are observed by the server as requests run.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paxengine.outputs import RequestMetrics

disable_created_metrics()  # no `_created` series (as vLLM): they double every counter's output

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name (without prefix), engine.stats() key, help
_GAUGES = [
    (
        "num_requests_running",
        "num_requests_running",
        "Number of requests in model execution batches.",
    ),
    ("num_requests_waiting", "num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    (
        "step_executables_pending",
        "step_executables_pending",
        "Step executables the background has still to build or run once (--background-compile); "
        "until 0 some steps run padded into larger buckets.",
    ),
]
_COUNTERS = [
    (
        "prefix_cache_queries",
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        "prefix_cache_hits",
        "prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
    ("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    (
        "failed_steps",
        "failed_steps",
        "Engine steps that failed on the device: their requests ended with an error, the others "
        "were recomputed.",
    ),
    (
        "xla_compiles_after_warmup",
        "xla_compiles_after_warmup",
        "XLA compiles since the step buckets were compiled at start-up (must stay 0).",
    ),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    (
        "spec_decode_num_draft_tokens",
        "spec_decode_num_draft_tokens",
        "Number of draft tokens.",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
    ),
]
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # a list in stats: one series a position

# vLLM's buckets
# fmt: off
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0]
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# fmt: on


def _token_buckets(max_len: int) -> list[float]:
    out, m = [], 1
    while m <= max_len:
        out += [b * m for b in (1, 2, 5) if b * m <= max_len]
        m *= 10
    return out or [1]


class _EngineStatsCollector:
    def __init__(self, prefix: str, labels: dict[str, str], stats_fn: Callable[[], dict]):
        self.prefix, self.labels, self.stats_fn = prefix, labels, stats_fn

    def describe(self):  # no samples at registration time (the engine may not run yet)
        return []

    def collect(self):
        try:
            stats = self.stats_fn() or {}
        except Exception:  # a scrape must never fail because the engine is unwell
            stats = {}
        names, values = list(self.labels), list(self.labels.values())
        rows = [(values, stats)]
        if "replicas" in stats:  # data-parallel replicas: a series each, labelled as vLLM does
            names = names + ["engine"]
            rows = [(values + [str(i)], s) for i, s in enumerate(stats["replicas"])]
        for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, key, doc in specs:
                m = family(f"{self.prefix}:{name}", doc, labels=names)
                for vals, st in rows:
                    m.add_metric(vals, float(st.get(key, 0) or 0))
                yield m
        m = CounterMetricFamily(
            f"{self.prefix}:{_PER_POS}",
            "Accepted draft tokens, by their position in the draft.",
            labels=names + ["position"],
        )
        for vals, st in rows:
            for pos, count in enumerate(st.get(_PER_POS) or []):
                m.add_metric(vals + [str(pos)], float(count))
        yield m


class ServerMetrics:
    def __init__(
        self, prefix: str, model_name: str, stats_fn: Callable[[], dict], max_model_len: int = 8192
    ):
        self.registry = CollectorRegistry(auto_describe=False)
        p, lab = prefix, {"model_name": model_name}
        self.registry.register(_EngineStatsCollector(p, lab, stats_fn))
        ln = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(
                f"{p}:{name}", doc, ln, buckets=buckets, registry=self.registry
            ).labels(**lab)

        self.ttft = hist(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY
        )
        self.queue = hist(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase.", _LATENCY
        )
        self.prefill = hist(
            "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase.", _LATENCY
        )
        self.decode = hist(
            "request_decode_time_seconds", "Histogram of time spent in DECODE phase.", _LATENCY
        )
        tokens = _token_buckets(max_model_len)
        self.prompt_len = hist(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.gen_len = hist(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self._success = Counter(
            f"{p}:request_success",
            "Count of successfully processed requests.",
            ln + ["finished_reason"],
            registry=self.registry,
        )
        self._rejected = Counter(
            f"{p}:request_rejected",
            "Requests refused by the server (4xx/5xx before reaching the engine), by reason.",
            ln + ["reason"],
            registry=self.registry,
        )
        self._model = model_name

    def finished(self, reason: Optional[str]) -> None:
        self._success.labels(model_name=self._model, finished_reason=reason or "abort").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self._model, reason=reason).inc()

    def observe_request(
        self, m: RequestMetrics, num_prompt_tokens: int, num_generated: int
    ) -> None:
        """Histograms of one finished request from its RequestOutput.metrics."""
        for h, a, b in (
            (self.e2e, m.arrival_time, m.finished_time),
            (self.queue, m.arrival_time, m.first_scheduled_time),
            (self.prefill, m.first_scheduled_time, m.first_token_time),
            (self.decode, m.first_token_time, m.finished_time),
        ):
            if a is not None and b is not None and b >= a:
                h.observe(b - a)
        self.prompt_len.observe(num_prompt_tokens)
        self.gen_len.observe(num_generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
