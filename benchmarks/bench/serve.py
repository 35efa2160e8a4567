"""`paxengine bench serve`: load-test any OpenAI-compatible server.

Streams every request (`stream: true`, `stream_options.include_usage`) to time the first token
(TTFT), the gaps between streamed chunks (ITL) and the whole request (E2E); token counts come
from the server's `usage`, never from counting chunks or re-tokenizing. `ignore_eos` and
`max_tokens` are sent so that runs with the same arguments do the same work.

    paxengine bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 128 --num-prompts 200 --max-concurrency 16 \\
        --result-file benchmarks/results/serve.json

Load: `--request-rate R` (Poisson arrivals, `--burstiness` < 1 for burstier gamma arrivals,
`--burst-size K` for groups of K arriving together; inf = all at once), capped by
`--max-concurrency`. `--sweep-concurrency 1,4,16` runs once per concurrency, `--sweep-request-rate
4,8,16` once per Poisson rate (realistic arrivals: add `--random-range-ratio 0.9` for lengths
around the means), and both plot throughput and latency against what they sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from benchmarks.bench import datasets as ds
from benchmarks.record import environment, finite

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LATENCIES = ("ttft", "tpot", "itl", "e2el")


# ----------------------------------------------------------------------------- HTTP clients


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class _AiohttpClient:
    name = "aiohttp"

    def __init__(self, headers: dict, timeout_s: float):
        import aiohttp

        self._aiohttp = aiohttp
        self._headers, self._timeout = headers, timeout_s

    async def __aenter__(self):
        a = self._aiohttp
        self.session = a.ClientSession(
            headers=self._headers,
            timeout=a.ClientTimeout(total=self._timeout),
            # idle connections dropped before the server drops them (uvicorn: after 5 s; vLLM's
            # too), so no request goes out on one the server is closing ("Can not write
            # request body" in CI between two sweep points)
            connector=a.TCPConnector(limit=0, force_close=False, keepalive_timeout=3),
            read_bufsize=1 << 20,
        )
        return self

    async def __aexit__(self, *exc):
        await self.session.close()

    async def stream_lines(self, url: str, payload: dict):
        async with self.session.post(url, json=payload) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.text())
            async for line in resp.content:
                yield line

    async def get_json(self, url: str):
        async with self.session.get(url) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.text())
            return await resp.json(content_type=None)


class _HttpxClient:
    name = "httpx"

    def __init__(self, headers: dict, timeout_s: float):
        import httpx

        self._httpx = httpx
        self._headers, self._timeout = headers, timeout_s

    async def __aenter__(self):
        h = self._httpx
        self.client = h.AsyncClient(
            headers=self._headers,
            timeout=h.Timeout(self._timeout),
            limits=h.Limits(max_connections=None, max_keepalive_connections=None),
        )
        return self

    async def __aexit__(self, *exc):
        await self.client.aclose()

    async def stream_lines(self, url: str, payload: dict):
        async with self.client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                raise HTTPStatusError(
                    resp.status_code, (await resp.aread()).decode(errors="replace")
                )
            async for line in resp.aiter_lines():
                yield line

    async def get_json(self, url: str):
        resp = await self.client.get(url)
        if resp.status_code != 200:
            raise HTTPStatusError(resp.status_code, resp.text)
        return resp.json()


def make_client(kind: str, headers: dict, timeout_s: float):
    if kind in ("auto", "aiohttp"):
        try:
            return _AiohttpClient(headers, timeout_s)
        except ImportError:
            if kind == "aiohttp":
                raise
    return _HttpxClient(headers, timeout_s)


# ----------------------------------------------------------------------------- one request


@dataclass
class RequestResult:
    prompt_len: int  # asked for (exact for token-id prompts)
    output_len: int  # max_tokens asked for
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the server's usage
    completion_tokens: int = 0  # from the server's usage
    start: float = 0.0  # seconds since the run started
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds between token-carrying chunks
    chunks: int = 0  # token-carrying chunks received
    text_chars: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.success or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def build_payload(endpoint: str, model: str, req: ds.SampleRequest, args) -> dict:
    p: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT:
        p["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        p["prompt"] = req.prompt
    if args.ignore_eos:
        p["ignore_eos"] = True
    if args.temperature is not None:
        p["temperature"] = args.temperature
    if args.top_p is not None:
        p["top_p"] = args.top_p
    if args.extra_body:
        p.update(json.loads(args.extra_body))
    return p


def _chunk_has_token(endpoint: str, choice: dict) -> bool:
    """Whether a streamed choice carries generated output. Completions: every choice chunk
    (its text may be empty while the detokenizer waits for more bytes). Chat: the role-only
    opening chunk carries none."""
    if endpoint != CHAT:
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content")) or (
        choice.get("finish_reason") is not None and not delta.get("role")
    )


async def send_request(
    client, url: str, endpoint: str, payload: dict, res: RequestResult, t0: float
) -> RequestResult:
    start = time.perf_counter()
    res.start = start - t0
    last = start
    usage = None
    try:
        async for raw in client.stream_lines(url, payload):
            line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            msg = json.loads(data)
            if "error" in msg:
                err = msg["error"]
                raise RuntimeError(
                    f"error in stream: {err.get('message', err) if isinstance(err, dict) else err}"
                )
            if msg.get("usage"):
                usage = msg["usage"]
            for choice in msg.get("choices") or []:
                if not _chunk_has_token(endpoint, choice):
                    continue
                if res.chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.chunks += 1
                text = (
                    choice.get("text")
                    if endpoint != CHAT
                    else (choice.get("delta") or {}).get("content")
                )
                res.text_chars += len(text or "")
        res.latency = time.perf_counter() - start
        if usage is None:
            raise RuntimeError(
                "the server sent no usage (stream_options.include_usage); "
                "token counts must come from the server"
            )
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        if res.completion_tokens > 0 and res.chunks == 0:
            raise RuntimeError("usage reports output tokens but no token chunk was streamed")
        res.success = True
    except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the run
        res.latency = time.perf_counter() - start
        res.error = f"{type(e).__name__}: {e}"[:1000]
    return res


# ----------------------------------------------------------------------------- load


def arrival_times(
    n: int, rate: float, burstiness: float, burst_size: int, rng: np.random.Generator
):
    """Send offsets (seconds from start) for n requests: all 0 at rate inf; else groups of
    `burst_size` whose gaps follow a gamma distribution of mean burst_size/rate (burstiness 1:
    exponential, i.e. Poisson arrivals), rescaled so the whole schedule spans n/rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0 or burst_size < 1:
        raise ValueError("request rate, burstiness and burst size must be positive")
    groups = math.ceil(n / burst_size)
    mean_gap = burst_size / rate
    gaps = rng.gamma(shape=burstiness, scale=mean_gap / burstiness, size=groups)
    gaps[0] = 0.0
    starts = np.cumsum(gaps)
    if groups > 1 and starts[-1] > 0:
        starts *= (mean_gap * (groups - 1)) / starts[-1]
    return [float(starts[i // burst_size]) for i in range(n)]


async def run_load(
    client,
    url: str,
    endpoint: str,
    model: str,
    reqs: list[ds.SampleRequest],
    args,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    desc: str = "",
) -> tuple[list[RequestResult], float, int]:
    """Send every request per the arrival schedule and concurrency cap. Returns the results (in
    dataset order), the wall time from the first send to the last completion, and the peak
    number of requests in flight."""
    offsets = arrival_times(
        len(reqs), request_rate, args.burstiness, args.burst_size, np.random.default_rng(seed)
    )
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc=desc or "requests", unit="req", leave=True)
    t0 = time.perf_counter()

    async def one(i: int):
        nonlocal in_flight, peak
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        res = RequestResult(reqs[i].prompt_len, reqs[i].output_len)
        payload = build_payload(endpoint, model, reqs[i], args)
        if sem is not None:
            await sem.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await send_request(client, url, endpoint, payload, res, t0)
        finally:
            in_flight -= 1
            if sem is not None:
                sem.release()
            if bar is not None:
                bar.update(1)
        return res

    results = await asyncio.gather(*(one(i) for i in range(len(reqs))))
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration, peak


# ----------------------------------------------------------------------------- metrics


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    out = {}
    v = np.asarray(values_s, dtype=np.float64) * 1000.0
    has = v.size > 0
    out[f"mean_{name}_ms"] = float(v.mean()) if has else None
    out[f"median_{name}_ms"] = float(np.median(v)) if has else None
    out[f"std_{name}_ms"] = float(v.std()) if has else None
    out[f"min_{name}_ms"] = float(v.min()) if has else None
    out[f"max_{name}_ms"] = float(v.max()) if has else None
    for p in percentiles:
        key = f"p{p:g}_{name}_ms"
        out[key] = float(np.percentile(v, p)) if has else None
    return out


def compute_metrics(
    reqs: list[ds.SampleRequest],
    results: list[RequestResult],
    duration: float,
    percentiles: list[float],
    ignore_eos: bool,
) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.completion_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    prompt_mismatch = sum(
        1
        for q, r in zip(reqs, results)
        if r.success and q.is_tokens and r.prompt_tokens != q.prompt_len
    )
    output_mismatch = sum(1 for r in ok if ignore_eos and r.completion_tokens != r.output_len)
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "tokens_per_chunk": total_out / chunks if chunks else None,
        "prompt_len_mismatches": prompt_mismatch,
        "output_len_mismatches": output_mismatch,
        "errors": [
            {"error": e, "count": c} for e, c in sorted(errors.items(), key=lambda x: -x[1])
        ][:10],
    }
    m.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    m.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles))
    m.update(_stats("itl", [x for r in ok for x in r.itl], percentiles))
    m.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return m


def request_records(results: list[RequestResult]) -> list[dict]:
    recs = []
    for r in results:
        d = asdict(r)
        d["itl"] = [round(x * 1000.0, 4) for x in r.itl]  # ms
        d["ttft"] = round(r.ttft * 1000.0, 4)
        d["latency"] = round(r.latency * 1000.0, 4)
        d["start"] = round(r.start, 6)
        t = r.tpot
        d["tpot"] = round(t * 1000.0, 4) if t is not None else None
        recs.append(d)
    return recs


# ----------------------------------------------------------------------------- output


def format_table(m: dict, title: str, percentiles: list[float]) -> str:
    w = 52
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(k, v):
        if v is None:
            v = "n/a"
        elif isinstance(v, float):
            v = f"{v:.2f}"
        lines.append(f"{k:<38}{v:>{w - 38}}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("max_concurrency"):
        row("Maximum request concurrency:", m["max_concurrency"])
    row(
        "Request rate (configured, req/s):",
        m["request_rate"] if not math.isinf(m["request_rate"]) else "inf",
    )
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    for name, label in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"{' ' + label + ' ':-^{w}}")
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            if p != 50:
                row(f"P{p:g} {name.upper()} (ms):", m[f"p{p:g}_{name}_ms"])
    if m["prompt_len_mismatches"] or m["output_len_mismatches"]:
        lines.append(f"{' Consistency ':-^{w}}")
        row("Prompt length != usage.prompt_tokens:", m["prompt_len_mismatches"])
        row("max_tokens != usage.completion_tokens:", m["output_len_mismatches"])
    for e in m["errors"][:3]:
        lines.append(f"error x{e['count']}: {e['error'][:200]}")
    lines.append("=" * w)
    return "\n".join(lines)


def load_points(args) -> list[tuple[int | None, float]]:
    """(max concurrency, request rate) of each run: one run, or a sweep over either."""
    if args.sweep_concurrency and args.sweep_request_rate:
        raise ValueError("give --sweep-concurrency or --sweep-request-rate, not both")
    if args.sweep_concurrency:
        return [(int(c), args.request_rate) for c in args.sweep_concurrency.split(",") if c.strip()]
    if args.sweep_request_rate:
        rates = [float(r) for r in args.sweep_request_rate.split(",") if r.strip()]
        if not all(r > 0 for r in rates):
            raise ValueError(f"--sweep-request-rate: rates must be > 0, got {rates}")
        return [(args.max_concurrency, r) for r in rates]
    return [(args.max_concurrency, args.request_rate)]


def _load_title(conc: int | None, rate: float) -> str:
    parts = ([f"concurrency {conc}"] if conc else []) + (
        [f"{rate:g} req/s"] if math.isfinite(rate) else []
    )
    return f" ({', '.join(parts)})" if parts else ""


def format_sweep(runs: list[dict]) -> str:
    hdr = (
        f"{'conc':>5} {'rate':>6} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'E2E p50':>9} {'fail':>5}"
    )
    lines = ["Sweep (latencies in ms)", hdr, "-" * len(hdr)]

    def f(v, w, d=1):
        return f"{'n/a':>{w}}" if v is None else f"{v:>{w}.{d}f}"

    for r in runs:
        lines.append(
            f"{str(r['max_concurrency'] or 'inf'):>5} {_rate(r['request_rate']):>6} "
            f"{f(r['request_throughput'], 8, 2)} "
            f"{f(r['output_throughput'], 10)} {f(r['total_token_throughput'], 10)} "
            f"{f(r['median_ttft_ms'], 9)} {f(r.get('p99_ttft_ms'), 9)} "
            f"{f(r['median_tpot_ms'], 9, 2)} {f(r.get('p99_tpot_ms'), 9, 2)} "
            f"{f(r['median_itl_ms'], 8, 2)} {f(r['median_e2el_ms'], 9)} {r['failed']:>5}"
        )
    return "\n".join(lines)


def _rate(rate) -> str:
    return f"{rate:g}" if isinstance(rate, (int, float)) and math.isfinite(rate) else "inf"


# ----------------------------------------------------------------------------- driver


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="paxengine bench serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url",
        default=None,
        help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)",
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=COMPLETIONS, help=f"{COMPLETIONS} or {CHAT}")
    g.add_argument(
        "--model", default=None, help="model name sent; default: the first of GET /v1/models"
    )
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=0.0,
        help="wait up to this many seconds for GET /health (or /v1/models) to answer 200",
    )
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0)
    g.add_argument("--http-client", choices=("auto", "aiohttp", "httpx"), default="auto")
    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name", choices=("random", "shared-prefix", "sharegpt"), default="random"
    )
    g.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON (for --dataset-name sharegpt)"
    )
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)]",
    )
    g.add_argument("--shared-prefix-num-prefixes", type=int, default=4)
    g.add_argument("--shared-prefix-len", type=int, default=1024)
    g.add_argument("--shared-prefix-suffix-len", type=int, default=64)
    g.add_argument("--shared-prefix-output-len", type=int, default=128)
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="fix every ShareGPT request's output length (default: the reply's length)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"random token ids are drawn below this (default: the tokenizer's, else "
        f"{ds.DEFAULT_VOCAB_SIZE})",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer (name or path) to decode "
        "random ids into text for the chat endpoint and to measure ShareGPT lengths",
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (Poisson arrivals); inf sends all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier",
    )
    g.add_argument("--burst-size", type=int, default=1, help="requests arriving together")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument(
        "--sweep-concurrency",
        default=None,
        help="comma-separated concurrencies, one run each, e.g. 1,4,16",
    )
    g.add_argument(
        "--sweep-request-rate",
        default=None,
        help="comma-separated Poisson request rates (req/s), one run each, e.g. 4,8,16",
    )
    g.add_argument(
        "--num-prompts-per-concurrency",
        type=int,
        default=None,
        help="in a sweep, send max(num_prompts, K x concurrency) requests per run",
    )
    g.add_argument("--num-warmups", type=int, default=1, help="untimed requests before each run")
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens per request so runs compare",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g = p.add_argument_group("output")
    g.add_argument("--result-file", default=None, help="write the JSON here")
    g.add_argument(
        "--plot-dir",
        default=None,
        help="write PNG plots here (default: beside --result-file; 'none' = no plots)",
    )
    g.add_argument("--label", default=None, help="a name for this run in the JSON and plots")
    g.add_argument("--percentiles", default="50,90,99")
    g.add_argument(
        "--no-detailed", action="store_true", help="leave per-request records out of the JSON"
    )
    g.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def _load_tokenizer(name):
    if not name:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def make_requests(args, n: int, seed: int, tokenizer) -> list[ds.SampleRequest]:
    vocab = args.vocab_size or (len(tokenizer) if tokenizer is not None else ds.DEFAULT_VOCAB_SIZE)
    if args.dataset_name == "random":
        reqs = ds.random_dataset(
            n,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocab_size=vocab,
            seed=seed,
        )
    elif args.dataset_name == "shared-prefix":
        reqs = ds.shared_prefix_dataset(
            n,
            args.shared_prefix_num_prefixes,
            args.shared_prefix_len,
            args.shared_prefix_suffix_len,
            args.shared_prefix_output_len,
            vocab_size=vocab,
            seed=seed,
        )
    else:
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        reqs = ds.sharegpt_dataset(args.dataset_path, n, args.sharegpt_output_len, tokenizer, seed)
    if args.endpoint == CHAT:
        reqs = [ds.to_text(r, tokenizer, seed) for r in reqs]
    return reqs


async def _wait_ready(client, base: str, timeout: float):
    deadline = time.monotonic() + timeout
    last = None
    while True:
        for path in ("/health", "/v1/models"):
            try:
                await client.get_json(base + path)
                return
            except Exception as e:  # noqa: BLE001
                last = e
        if time.monotonic() > deadline:
            raise RuntimeError(f"server at {base} not ready after {timeout:.0f}s: {last}")
        await asyncio.sleep(0.5)


async def _server_info(client, base: str) -> dict:
    info = {}
    for path in ("/version",):
        try:
            info[path.strip("/")] = await client.get_json(base + path)
        except Exception:  # noqa: BLE001 - optional
            pass
    return info


async def benchmark(args) -> dict:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint if args.endpoint.startswith("/") else "/" + args.endpoint
    url = base + endpoint
    percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tokenizer = _load_tokenizer(args.tokenizer)
    loads = load_points(args)

    client = make_client(args.http_client, headers, args.request_timeout)
    async with client:
        if args.ready_timeout > 0:
            await _wait_ready(client, base, args.ready_timeout)
        model = args.model
        if model is None:
            models = await client.get_json(base + "/v1/models")
            model = models["data"][0]["id"]
        server = await _server_info(client, base)

        runs = []
        for k, (conc, rate) in enumerate(loads):
            n = args.num_prompts
            if args.num_prompts_per_concurrency and conc:
                n = max(n, args.num_prompts_per_concurrency * conc)
            seed = args.seed + 1000 * k  # fresh prompts per run: no prefix-cache carry-over
            reqs = make_requests(args, n, seed, tokenizer)
            if args.num_warmups > 0:
                warm = make_requests(args, args.num_warmups, seed + 999_983, tokenizer)
                wres = await asyncio.gather(
                    *(
                        send_request(
                            client,
                            url,
                            endpoint,
                            build_payload(endpoint, model, w, args),
                            RequestResult(w.prompt_len, w.output_len),
                            time.perf_counter(),
                        )
                        for w in warm
                    )
                )
                bad = [w.error for w in wres if not w.success]
                if bad:
                    raise RuntimeError(f"warm-up request failed: {bad[0]}")
            gc.collect()
            gc.freeze()
            desc = f"concurrency {conc}" if conc else "requests"
            if math.isfinite(rate):
                desc += f" at {rate:g} req/s"
            results, duration, peak = await run_load(
                client, url, endpoint, model, reqs, args, conc, rate, seed, desc
            )
            gc.unfreeze()
            m = compute_metrics(reqs, results, duration, percentiles, args.ignore_eos)
            m = {
                "max_concurrency": conc,
                "request_rate": rate,
                "burstiness": args.burstiness,
                "burst_size": args.burst_size,
                "num_prompts": n,
                "max_concurrent_requests": peak,
                **m,
            }
            if not args.no_detailed:
                m["requests"] = request_records(results)
            runs.append(m)
            print(
                format_table(m, f"Serving Benchmark Result{_load_title(conc, rate)}", percentiles),
                flush=True,
            )
    if len(runs) > 1:
        print(format_sweep(runs), flush=True)
    return {
        "benchmark": "serve",
        "label": args.label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "paxengine bench serve " + shlex.join(args.argv),
        "environment": environment({"http_client": client.name}),
        "server": {"base_url": base, "endpoint": endpoint, "model": model, **server},
        "dataset": {
            "name": args.dataset_name,
            "path": args.dataset_path,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "shared_prefix_num_prefixes": args.shared_prefix_num_prefixes,
            "shared_prefix_len": args.shared_prefix_len,
            "shared_prefix_suffix_len": args.shared_prefix_suffix_len,
            "shared_prefix_output_len": args.shared_prefix_output_len,
            "vocab_size": args.vocab_size,
            "tokenizer": args.tokenizer,
            "seed": args.seed,
        },
        "sampling": {
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "extra_body": args.extra_body,
        },
        "percentiles": percentiles,
        "runs": runs,
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    try:
        result = asyncio.run(benchmark(args))
    except (RuntimeError, ValueError, FileNotFoundError, HTTPStatusError, OSError) as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    plots = []
    plot_dir = args.plot_dir
    if plot_dir is None and args.result_file:
        plot_dir = str(Path(args.result_file).parent)
    if plot_dir and plot_dir != "none":
        from benchmarks.bench import plots as pl

        stem = Path(args.result_file).stem if args.result_file else "serve"
        plots = pl.serve_plots(result, plot_dir, stem)
        result["plots"] = plots
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite(result), indent=1, allow_nan=False))
        print(f"results: {path}")
    for p in plots:
        print(f"plot: {p}")
    failed = sum(r["failed"] for r in result["runs"])
    if failed:
        print(f"bench serve: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
