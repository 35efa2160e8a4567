"""Prometheus metrics named like vLLM 0.26's V1 engine (`<prefix>:num_requests_running`, ...):
names, types, help texts, label names (`model_name`, `engine`) and histogram buckets as its
`PrometheusStatLogger`'s, so its dashboards and alerts work with `--metrics-prefix vllm`.

One private CollectorRegistry per app. Gauges and counters the engine already keeps
(`engine.stats()`) are read at scrape time by a custom collector, a series per engine (`engine`
"0", or each data-parallel / disaggregated replica's index); per-request histograms and the
finished-reason counter are observed by the server as requests run, under the engine that
served the request. A family whose number an engine does not report is left out, never made up.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from paxengine.iteration_stats import ITERATION_TOKENS_BUCKETS
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
    ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
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
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # prompt_tokens_by_source
_WAITING_DOC = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
    "status). Sum of all reasons equals vllm:num_requests_waiting."
)
_SLEEP_DOC = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
# vLLM's FinishReason strings: every one a series from the start
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's buckets
# fmt: off
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0]
_TPOT = _ITL
_N = [1, 2, 5, 10, 20]
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# fmt: on


def _token_buckets(max_len: int) -> list[float]:
    """vLLM's build_1_2_5_buckets(max_model_len)."""
    out, m = [], 1
    while m <= max_len:
        out += [b * m for b in (1, 2, 5) if b * m <= max_len]
        m *= 10
    return out or [1]


def engine_rows(stats: dict) -> list[tuple[str, dict]]:
    """(engine label, its stats): "0" for one engine, each replica's index for several."""
    if "replicas" in stats:  # data-parallel replicas, disaggregated engines: a series each
        return [(str(i), s) for i, s in enumerate(stats["replicas"])]
    return [("0", stats)]


def cache_config_labels(config) -> dict[str, str]:
    """vllm:cache_config_info's labels that an engine config holds, as vLLM's CacheConfig writes
    them (str of the value); the pool's block size and block count come from the engine."""
    out = {}
    for label, field in (
        ("cache_dtype", "kv_cache_dtype"),
        ("enable_prefix_caching", "enable_prefix_caching"),
        ("gpu_memory_utilization", "gpu_memory_utilization"),
        ("kv_cache_memory_bytes", "kv_cache_memory_bytes"),
        ("num_gpu_blocks_override", "num_kv_blocks"),
    ):
        if hasattr(config, field):
            out[label] = str(getattr(config, field))
    return out


class _EngineStatsCollector:
    def __init__(
        self,
        prefix: str,
        labels: dict[str, str],
        stats_fn: Callable[[], dict],
        cache_info: Optional[dict[str, str]] = None,
    ):
        self.prefix, self.labels, self.stats_fn = prefix, labels, stats_fn
        self.cache_info = cache_info or {}

    def describe(self):  # no samples at registration time (the engine may not run yet)
        return []

    def collect(self):
        try:
            stats = self.stats_fn() or {}
        except Exception:  # a scrape must never fail because the engine is unwell
            stats = {}
        p = self.prefix
        names = list(self.labels) + ["engine"]
        rows = [(list(self.labels.values()) + [e], st) for e, st in engine_rows(stats)]
        for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, key, doc in specs:
                m = family(f"{p}:{name}", doc, labels=names)
                for vals, st in rows:
                    m.add_metric(vals, float(st.get(key, 0) or 0))
                yield m
        m = CounterMetricFamily(
            f"{p}:{_PER_POS}", "Accepted tokens per draft position.", labels=names + ["position"]
        )
        for vals, st in rows:
            for pos, count in enumerate(st.get(_PER_POS) or []):
                m.add_metric(vals + [str(pos)], float(count))
        yield m
        # paxengine has no sleep mode: every engine is awake
        m = GaugeMetricFamily(f"{p}:engine_sleep_state", _SLEEP_DOC, labels=names + ["sleep_state"])
        for vals, _ in rows:
            for state, v in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
                m.add_metric(vals + [state], v)
        yield m
        yield from self._reported(rows, names)

    def _reported(self, rows, names):
        """The families of numbers an engine reports (absent from a row: no series there)."""
        p, fams = self.prefix, []
        m = GaugeMetricFamily(
            f"{p}:num_requests_waiting_by_reason", _WAITING_DOC, labels=names + ["reason"]
        )
        for vals, st in rows:
            if "num_requests_waiting_deferred" in st:
                deferred = st["num_requests_waiting_deferred"]
                m.add_metric(vals + ["capacity"], st["num_requests_waiting"] - deferred)
                m.add_metric(vals + ["deferred"], deferred)
        fams.append(m)
        m = CounterMetricFamily(
            f"{p}:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=names + ["source"],
        )
        for vals, st in rows:
            for source in _SOURCES:
                if f"prompt_tokens_{source}" in st:
                    m.add_metric(vals + [source], st[f"prompt_tokens_{source}"])
        fams.append(m)
        m = CounterMetricFamily(
            f"{p}:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels=names,
        )
        for vals, st in rows:  # no KV connector: the local prefix cache's hits alone
            if "prompt_tokens_local_cache_hit" in st:
                m.add_metric(vals, st["prompt_tokens_local_cache_hit"])
        fams.append(m)
        m = HistogramMetricFamily(
            f"{p}:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels=names,
        )
        bounds = [floatToGoString(b) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        for vals, st in rows:
            counts = st.get("iteration_tokens_buckets")
            if counts is None or len(counts) != len(bounds):
                continue
            cumulative, total = [], 0
            for le, c in zip(bounds, counts):
                total += c
                cumulative.append((le, total))
            m.add_metric(vals, cumulative, st.get("iteration_tokens_sum", 0))
        fams.append(m)
        # an info metric as vLLM's: a gauge at 1, the config in its labels (no model_name)
        info_names = sorted(self.cache_info) + ["block_size", "num_gpu_blocks", "engine"]
        m = GaugeMetricFamily(
            f"{p}:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_names
        )
        for vals, st in rows:
            if "block_size" in st and "num_gpu_blocks" in st:
                info = {**self.cache_info, "engine": vals[-1]}
                info.update(
                    block_size=str(st["block_size"]), num_gpu_blocks=str(st["num_gpu_blocks"])
                )
                m.add_metric([info[k] for k in info_names], 1)
        fams.append(m)
        return [f for f in fams if f.samples]


class _RequestMetrics:
    """One engine's per-request histograms and counters (children labelled with its index)."""

    def __init__(self, parent: "ServerMetrics", engine: str):
        lab = (parent.model_name, engine)
        for attr in parent.histograms:
            setattr(self, attr, getattr(parent, attr).labels(*lab))
        self.success = {r: parent._success.labels(*lab, r) for r in FINISH_REASONS}


class ServerMetrics:
    def __init__(
        self,
        prefix: str,
        model_name: str,
        stats_fn: Callable[[], dict],
        max_model_len: int = 8192,
        cache_info: Optional[dict[str, str]] = None,
    ):
        self.registry = CollectorRegistry(auto_describe=False)
        p, lab = prefix, {"model_name": model_name}
        self.registry.register(_EngineStatsCollector(p, lab, stats_fn, cache_info))
        self.model_name = model_name
        ln = ["model_name", "engine"]
        self.histograms: list[str] = []

        def hist(attr, name, doc, buckets):
            self.histograms.append(attr)
            h = Histogram(f"{p}:{name}", doc, ln, buckets=buckets, registry=self.registry)
            setattr(self, attr, h)

        hist(
            "ttft",
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT,
        )
        hist(
            "itl",
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL,
        )
        hist(
            "tpot",
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TPOT,
        )
        hist(
            "e2e",
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY,
        )
        for attr, name, phase in (
            ("queue", "request_queue_time_seconds", "WAITING"),
            ("inference", "request_inference_time_seconds", "RUNNING"),
            ("prefill", "request_prefill_time_seconds", "PREFILL"),
            ("decode", "request_decode_time_seconds", "DECODE"),
        ):
            hist(attr, name, f"Histogram of time spent in {phase} phase for request.", _LATENCY)
        tokens = _token_buckets(max_model_len)
        hist("prompt_len", "request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        hist(
            "gen_len", "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        hist(
            "prefill_kv_computed",
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        hist(
            "max_gen_len",
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        hist("params_n", "request_params_n", "Histogram of the n request parameter.", _N)
        hist(
            "params_max_tokens",
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens,
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
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._engines: dict[str, _RequestMetrics] = {}
        try:  # every engine's series from the start, at 0 (as vLLM's)
            engines = [e for e, _ in engine_rows(stats_fn() or {})]
        except Exception:
            engines = ["0"]
        for e in engines:
            self.engine(e)

    def engine(self, engine: str = "0") -> _RequestMetrics:
        """The per-request metrics of the engine labelled `engine`."""
        m = self._engines.get(engine)
        if m is None:
            m = self._engines[engine] = _RequestMetrics(self, engine)
        return m

    def finished(self, reason: Optional[str], engine: str = "0") -> None:
        r = reason or "abort"
        m = self.engine(engine)
        (m.success[r] if r in m.success else self._success.labels(self.model_name, engine, r)).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self.model_name, reason=reason).inc()

    def observe_request(
        self,
        m: RequestMetrics,
        num_prompt_tokens: int,
        num_generated: Sequence[int],
        max_tokens: Optional[int] = None,
        engine: str = "0",
    ) -> None:
        """The histograms of one finished request from its RequestOutput.metrics, as vLLM's
        `FinishedRequestStats`. `num_generated`: each sequence's output tokens. Token counts are
        observed per sequence (vLLM's n child requests); timings, the computed prefill, the
        largest sequence and n once per request (its sequences share the prompt's steps)."""
        e = self.engine(engine)
        for h, a, b in (
            (e.e2e, m.arrival_time, m.finished_time),
            (e.queue, m.arrival_time, m.first_scheduled_time),
            (e.inference, m.first_scheduled_time, m.finished_time),
            (e.prefill, m.first_scheduled_time, m.first_token_time),
            (e.decode, m.first_token_time, m.finished_time),
        ):
            if a is not None and b is not None and b >= a:
                h.observe(b - a)
        longest = max(num_generated, default=0)
        if m.first_token_time is not None and m.finished_time is not None:
            decode = max(m.finished_time - m.first_token_time, 0.0)
            e.tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)  # 0: vLLM's too
        if m.first_token_time is not None:  # its prompt was computed
            e.prefill_kv_computed.observe(num_prompt_tokens - max(m.num_cached_tokens, 0))
        e.max_gen_len.observe(longest)
        e.params_n.observe(len(num_generated))
        for g in num_generated:
            e.prompt_len.observe(num_prompt_tokens)
            e.gen_len.observe(g)
            if max_tokens:
                e.params_max_tokens.observe(max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
