"""ProcessEngine's pipe on the CPU: the bytes and the pickle time of a step's outputs, sent
cumulative (as before paxengine/output_delta.py) or as deltas (as now).

    python -m benchmarks.profile.wire_bytes [--requests 64] [--steps 128] [--logprobs 0,5]
        [--repeat 5]

Synthetic: `--requests` streams, each one token (~4 characters of text) a step for `--steps`
steps, their outputs built as the engine builds them (fresh token id lists and a shallow copy of
the logprob entries each step, no prompt: the child strips it). Per step: the pickled bytes of
the step's items (ForkingPickler, as Connection.send pickles); the time to pickle and unpickle
them; the child's time (the old path's dataclasses.replace or the delta's encode, and pickling)
and the front end's (unpickling, and the delta's rebuild of the cumulative outputs), the
reading thread's share of the server's GIL. The best of `--repeat` runs, each time alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from multiprocessing.reduction import ForkingPickler

from paxengine.output_delta import DeltaDecoder, DeltaEncoder
from paxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

FORMS = ("cumulative", "delta")


def synthetic_steps(num_requests: int, num_steps: int, logprobs: int, seed: int = 0):
    """Per step, the (request id, cumulative output) pairs, as the engine makes them."""
    rng = random.Random(seed)
    ids = {f"cmpl-{rng.getrandbits(64):016x}-0": [] for _ in range(num_requests)}
    text = dict.fromkeys(ids, "")
    lps = {rid: [] for rid in ids}
    cum = dict.fromkeys(ids, 0.0)
    steps = []
    for k in range(num_steps):
        items = []
        for rid in ids:
            t = rng.randrange(49152)
            ids[rid].append(t)
            text[rid] += " " + "".join(rng.choice("abcdefgh") for _ in range(3))
            if logprobs:
                entry = {t: Logprob(-rng.random(), 1, f"tok{t}")}
                for j in range(logprobs):
                    u = rng.randrange(49152)
                    entry.setdefault(u, Logprob(-1 - rng.random(), j + 1, f"tok{u}"))
                lps[rid].append(entry)
                cum[rid] += entry[t].logprob
            done = k == num_steps - 1
            c = CompletionOutput(
                0,
                text[rid],
                ids[rid][:],
                cum[rid] if logprobs else None,
                list(lps[rid]) if logprobs else None,
                "length" if done else None,
            )
            m = RequestMetrics(1000.0, 1000.1, 1000.2, 1001.0 if done else None, 1024, 512)
            out = RequestOutput(rid, None, list(range(1024)), [c], done, m, num_cached_tokens=512)
            items.append((rid, out))
        steps.append(items)
    return steps


def measure(steps) -> dict:
    """One run of both forms over the steps: bytes a step, and seconds in all of pickle + unpickle
    alone, the child's side (strip or encode, pickle) and the front end's (unpickle, rebuild)."""
    dumps, loads = ForkingPickler.dumps, ForkingPickler.loads
    r = {form: {"bytes": [], "pickle": 0.0, "child": 0.0, "front": 0.0} for form in FORMS}
    enc, dec = DeltaEncoder(), DeltaDecoder()

    def add(form, raw, t0, t1, t2, t3, t4):
        f = r[form]
        f["bytes"].append(len(raw))
        f["pickle"] += (t2 - t1) + (t3 - t2)
        f["child"] += t2 - t0
        f["front"] += t4 - t2

    for items in steps:
        # cumulative: the child strips the prompt and pickles; the front end unpickles
        t0 = time.perf_counter()
        up = [(rid, dataclasses.replace(x, prompt=None, prompt_token_ids=None)) for rid, x in items]
        t1 = time.perf_counter()
        raw = bytes(dumps(up))
        t2 = time.perf_counter()
        loads(raw)
        t3 = time.perf_counter()
        add("cumulative", raw, t0, t1, t2, t3, t3)
        # delta: the child encodes and pickles; the front end unpickles and rebuilds
        t0 = time.perf_counter()
        up = [(rid, enc.encode(rid, x), None) for rid, x in items]
        t1 = time.perf_counter()
        raw = bytes(dumps(up))
        t2 = time.perf_counter()
        got = loads(raw)
        t3 = time.perf_counter()
        for rid, d, _ in got:
            dec.decode(rid, d)
        t4 = time.perf_counter()
        add("delta", raw, t0, t1, t2, t3, t4)
    assert not enc.sent and not dec.state  # every stream finished at the last step
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--logprobs", default="0,5", help="top logprobs a token, a run each")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{args.requests} streams x {args.steps} steps, per step (best of {args.repeat} runs)")
    print(
        "logprobs  form        bytes: mean (first / last step)   pickle+unpickle"
        "  child: strip|encode+pickle  front end: unpickle+rebuild"
    )
    for k in (int(x) for x in args.logprobs.split(",")):
        steps = synthetic_steps(args.requests, args.steps, k)
        runs = [measure(steps) for _ in range(args.repeat)]
        for form in FORMS:
            b = runs[0][form]["bytes"]
            us = {
                key: min(run[form][key] for run in runs) / args.steps * 1e6
                for key in ("pickle", "child", "front")
            }
            print(
                f"{k:>8}  {form:<10} {sum(b) / len(b):>11,.0f} ({b[0]:>7,} / {b[-1]:>9,})"
                f"  {us['pickle']:>12,.0f} us  {us['child']:>23,.0f} us"
                f"  {us['front']:>22,.0f} us"
            )


if __name__ == "__main__":
    main()
