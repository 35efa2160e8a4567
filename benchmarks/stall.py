"""How long a prefill stalls the streams already decoding (issue #53): against a running server,
`streams` completions decode; once their chunks flow, `prompts` long prompts arrive at once.
Reports the gaps between each running stream's chunks before they arrived (the baseline) and
after (while they prefill), and the ratio of the p99 gap after to the median gap before.

    python -m benchmarks.stall --base-url http://127.0.0.1:8000 [--streams 8 --prompts 3
        --prompt-tokens 1800] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np


async def _stream(client, url, model, prompt, max_tokens, times: list[float]) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())


async def measure(
    base_url: str, streams: int, prompts: int, prompt_tokens: int, decode_tokens: int
) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        model = (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        url = f"{base_url}/v1/completions"
        # ~1 token a word in SmolLM2's tokenizer and Llama's; distinct prompts: no cache hits
        long_prompts = [
            f"Story {i}: " + "once upon a time " * (prompt_tokens // 4) for i in range(prompts)
        ]
        times = [[] for _ in range(streams)]
        # long enough to decode through the whole prefill; ended by the cancel below
        runs = [
            asyncio.create_task(_stream(client, url, model, f"Count {i}:", decode_tokens, times[i]))
            for i in range(streams)
        ]
        while min(len(t) for t in times) < 20:  # each stream past its first chunks
            failed = [r for r in runs if r.done()]
            if failed:
                failed[0].result()  # its error
                raise RuntimeError("a decoding stream ended before the long prompts arrived")
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        arrive = time.perf_counter()
        long_done: list[list[float]] = [[] for _ in range(prompts)]
        await asyncio.gather(
            *(_stream(client, url, model, p, 1, long_done[i]) for i, p in enumerate(long_prompts))
        )
        done = time.perf_counter()
        await asyncio.sleep(1.0)
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
    before, during = [], []
    for ts in times:
        gaps = np.diff(ts)
        ends = np.asarray(ts[1:])
        before += list(gaps[(ends < arrive) & (ends > arrive - 2.0)])
        during += list(gaps[(ends >= arrive) & (ends <= done)])
    med, p99 = float(np.median(before)), float(np.percentile(during, 99))
    return {
        "streams": streams,
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "gap_median_before_ms": 1e3 * med,
        "gap_p99_during_ms": 1e3 * p99,
        "gap_max_during_ms": 1e3 * float(np.max(during)),
        "prefill_seconds": done - arrive,
        "ratio_p99_to_median": p99 / med,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1800)
    p.add_argument("--decode-tokens", type=int, default=1000, help="each stream's max_tokens")
    p.add_argument("--json", help="write the result here too")
    a = p.parse_args(argv)
    res = asyncio.run(measure(a.base_url, a.streams, a.prompts, a.prompt_tokens, a.decode_tokens))
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
