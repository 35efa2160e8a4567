"""Soak a running server: mixed requests for a while, a share of streams dropped by the client,
bad requests mixed in; then check that nothing leaked and every request is accounted for.

    python -m benchmarks.soak --url http://127.0.0.1:8000 --seconds 600 --concurrency 64 \
        [--drop 0.3] [--bad 0.05] [--max-tokens 128] [--api-key K] [--server-pid PID] [--out F]

Reports (JSON): requests by outcome; TTFT / TPOT p50 and p99 of the first and the last minute
(or fifth of the run), and of every such window in order; the server's RSS (with --server-pid,
read from /proc) and the GPU's used memory (nvidia-smi, when there is one) at the start and the
end; the server's own counters
(`/metrics`) before and after: finished requests by reason, running and waiting requests, KV
cache usage. `check(report)` lists what is wrong (the CI test and the GPU run use the same).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Summarize: The quick brown fox jumps over the lazy dog. " * 8,
    "Translate to French: good morning, how are you today?",
]
BAD = [  # (body, expected status): the server must refuse these and carry on
    ({"prompt": "x", "max_tokens": -3}, 400),
    ({"prompt": "x", "temperature": "hot"}, 400),
    ({"prompt": [10**9]}, 400),
    ({"messages": "not a list"}, 400),
]


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _gpu_mib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return float(out.split()[0]) if out.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _server_counters(client: httpx.Client) -> dict:
    """finished requests by reason, and the engine's gauges, from /metrics."""
    out: dict = {"finished": {}}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if ":request_success_total" in name:
            reason = name.split('finished_reason="')[1].split('"')[0]
            out["finished"][reason] = out["finished"].get(reason, 0) + float(value)
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if f":{gauge}{{" in name:
                out[gauge] = out.get(gauge, 0) + float(value)
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _one(client, rng, args, records):
    t0 = time.monotonic()
    rec = {"t": t0 - args.start}
    if rng.random() < args.bad:
        body, want = rng.choice(BAD)
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = await client.post(route, json=body)
        rec.update(kind="bad", ok=r.status_code == want, status=r.status_code)
        records.append(rec)
        return
    chat = rng.random() < 0.5
    body = {"max_tokens": rng.randint(1, args.max_tokens), "temperature": rng.choice([0, 0.8])}
    if chat:
        route, body["messages"] = (
            "/v1/chat/completions",
            [{"role": "user", "content": rng.choice(PROMPTS)}],
        )
    else:
        route, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
    if rng.random() < 0.3:  # non-streamed
        r = await client.post(route, json=body)
        rec.update(kind="full", ok=r.status_code == 200, status=r.status_code)
        rec["e2e"] = time.monotonic() - t0
        records.append(rec)
        return
    body["stream"] = True
    drop = rng.random() < args.drop
    rec.update(kind="dropped" if drop else "stream", ok=False)
    chunks, first = 0, None
    async with client.stream("POST", route, json=body) as r:
        rec["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":  # (a short one may end before it could be dropped)
                rec["ok"] = r.status_code == 200
                break
            if '"error"' in line[:20]:
                break
            chunks += 1
            if first is None:
                first = time.monotonic()
            if drop and chunks >= 2:  # the client walks away mid-stream
                rec["ok"] = r.status_code == 200
                break
    end = time.monotonic()
    if first is not None:
        rec["ttft"] = first - t0
        if chunks > 2 and not drop:
            rec["tpot"] = (end - first) / (chunks - 1)
    records.append(rec)


async def _worker(client, seed, args, records, deadline):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await _one(client, rng, args, records)
        except httpx.HTTPError as e:  # a broken connection is a finding, not a crash
            records.append(
                {"t": time.monotonic() - args.start, "kind": "error", "ok": False, "error": repr(e)}
            )


def soak(
    url: str,
    seconds: float,
    concurrency: int,
    drop: float = 0.3,
    bad: float = 0.05,
    max_tokens: int = 32,
    api_key: str | None = None,
    server_pid: int | None = None,
    seed: int = 0,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    args = argparse.Namespace(drop=drop, bad=bad, max_tokens=max_tokens, start=time.monotonic())
    with httpx.Client(base_url=url, headers=headers, timeout=120) as sync:
        before = _server_counters(sync)
        start = {"rss_mib": _rss_mib(server_pid), "gpu_mib": _gpu_mib()}
        records: list = []

        async def main():
            limits = httpx.Limits(max_connections=concurrency + 4)
            async with httpx.AsyncClient(
                base_url=url, headers=headers, timeout=120, limits=limits
            ) as client:
                deadline = time.monotonic() + seconds
                await asyncio.gather(
                    *(
                        _worker(client, seed * 1000 + i, args, records, deadline)
                        for i in range(concurrency)
                    )
                )

        asyncio.run(main())
        # the server finishes its aborts and bookkeeping: wait until it is idle and has counted
        # every request (a dropped stream is counted when the server sees the disconnect)
        sent = sum(1 for r in records if r["kind"] != "bad")
        for _ in range(200):
            after = _server_counters(sync)
            counted = sum(after["finished"].values()) - sum(before["finished"].values())
            idle = not after.get("num_requests_running") and not after.get("num_requests_waiting")
            if idle and counted >= sent:
                break
            time.sleep(0.05)
        end = {"rss_mib": _rss_mib(server_pid), "gpu_mib": _gpu_mib()}
    window = min(60.0, seconds / 5)
    first = [r for r in records if r["t"] < window]
    last = [r for r in records if r["t"] >= seconds - window]
    kinds: dict = {}
    for r in records:
        k = kinds.setdefault(r["kind"], {"n": 0, "ok": 0})
        k["n"] += 1
        k["ok"] += bool(r["ok"])

    def lat(rs, key):
        xs = [r[key] for r in rs if key in r]
        return {"n": len(xs), "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99)}

    finished = {
        k: after["finished"].get(k, 0) - before["finished"].get(k, 0) for k in after["finished"]
    }
    return {
        "url": url,
        "seconds": seconds,
        "concurrency": concurrency,
        "drop": drop,
        "bad": bad,
        "requests": kinds,
        "errors": [r["error"] for r in records if r["kind"] == "error"][:10],
        "first_window": {"ttft": lat(first, "ttft"), "tpot": lat(first, "tpot")},
        "last_window": {"ttft": lat(last, "ttft"), "tpot": lat(last, "tpot")},
        # every window in order: a slow trend shows as a series, noise as scatter
        "windows": [
            {"start_s": round(w0, 1), "ttft": lat(rs, "ttft"), "tpot": lat(rs, "tpot")}
            for w0 in _window_starts(seconds, window)
            for rs in [[r for r in records if w0 <= r["t"] < w0 + window]]
        ],
        "start": start,
        "end": end,
        "server_finished": finished,
        "server_after": {k: v for k, v in after.items() if k != "finished"},
        "engine_requests": sum(k["n"] for name, k in kinds.items() if name != "bad"),
    }


def _window_starts(seconds: float, window: float) -> list[float]:
    n = max(1, int(seconds // window))
    return [i * window for i in range(n)]


def check(report: dict) -> list[str]:
    """What the soak found wrong (empty: nothing)."""
    problems = []
    req = report["requests"]
    for kind, k in req.items():
        if k["ok"] != k["n"]:
            problems.append(f"{kind}: {k['n'] - k['ok']} of {k['n']} did not end as expected")
    after = report["server_after"]
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        if after.get(gauge):
            problems.append(f"after the soak {gauge} = {after[gauge]} (leaked)")
    accounted = sum(report["server_finished"].values())
    if accounted != report["engine_requests"]:
        problems.append(
            f"the server counted {accounted} finished requests, the client sent "
            f"{report['engine_requests']}"
        )
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--drop", type=float, default=0.3)
    p.add_argument("--bad", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--api-key")
    p.add_argument("--server-pid", type=int)
    p.add_argument("--out")
    a = p.parse_args()
    report = soak(
        a.url, a.seconds, a.concurrency, a.drop, a.bad, a.max_tokens, a.api_key, a.server_pid
    )
    report["problems"] = check(report)
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
