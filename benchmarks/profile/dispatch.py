"""Is the engine step host-bound? Per decode step: time spent inside the launch
(`runner.execute`: XLA:GPU launches the kernels on the calling thread), waiting for the device
(`runner.fetch`), and in all, with steps launched from the caller and from the dispatch thread.
Run it under different XLA_FLAGS (e.g. command buffers) to compare launch costs (GPU).

  python -m benchmarks.profile.dispatch [PRESET] [BATCHES, e.g. 64,256]

The largest batch's caller-mode steps also run under cProfile: the top host functions are printed
and saved (where the host time goes on that machine, not on ours).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from benchmarks.profile.engine_steps import step_until_decoding
from benchmarks.record import write_to_out


def main() -> int:
    from paxengine import LLM, SamplingParams

    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    on_gpu = jax.default_backend() == "gpu"
    batches, prompt_len = ((1, 64, 256), 1024) if on_gpu else ((1, 8), 64)
    if len(sys.argv) > 2:
        batches = tuple(int(b) for b in sys.argv[2].split(","))
    seq_buckets = sorted({max(8, b) for b in batches})
    llm = LLM(
        model=f"dummy:{preset}",
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=max(seq_buckets),
        max_num_batched_tokens=1024,
        token_buckets=sorted({max(16, b) for b in batches} | {1024}),
        seq_buckets=seq_buckets,
        num_kv_blocks=24000 if on_gpu else 512,
        show_progress=False,
    )
    eng, runner = llm.engine, llm.engine.runner
    execute, fetch = runner.execute, runner.fetch
    spent = {"execute": [], "fetch": []}

    def timed_execute(arrays, st):
        t = time.perf_counter()
        r = execute(arrays, st)
        spent["execute"].append(time.perf_counter() - t)
        return r

    def timed_fetch(result):
        t = time.perf_counter()
        r = fetch(result)
        spent["fetch"].append(time.perf_counter() - t)
        return r

    runner.execute, runner.fetch = timed_execute, timed_fetch
    res = {"preset": preset, "xla_flags": os.environ.get("XLA_FLAGS", ""), "prompt_len": prompt_len}
    for batch in batches:
        for i in range(batch):
            eng.add_request(
                f"b{batch}-{i}",
                {"prompt_token_ids": list(range(1, prompt_len + 1))},
                SamplingParams(max_tokens=300, ignore_eos=True),
            )
        step_until_decoding(eng)
        for mode in ("caller", "thread"):
            eng._dispatcher = ThreadPoolExecutor(1) if mode == "thread" else None
            for _ in range(5):
                eng.step()
            spent["execute"].clear()
            spent["fetch"].clear()
            prof = cProfile.Profile() if (mode == "caller" and batch == max(batches)) else None
            t = time.perf_counter()
            if prof:
                prof.enable()
            for _ in range(40):
                eng.step()
            if prof:
                prof.disable()
            step = (time.perf_counter() - t) / 40
            if prof:
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
                res[f"b{batch}_host_profile"] = buf.getvalue().splitlines()
                print(buf.getvalue(), flush=True)
            row = {
                "step_ms": 1e3 * step,
                "execute_ms": 1e3 * float(np.median(spent["execute"])),
                "fetch_wait_ms": 1e3 * float(np.median(spent["fetch"])),
            }
            res[f"b{batch}_{mode}"] = row
            print(batch, mode, row, flush=True)
            # a run cut short keeps what it measured
            write_to_out(res, "profile_dispatch", quiet=True)
        for r in list(eng.groups):
            eng.abort(r)
        while eng.inflight is not None or eng.scheduler.has_work():
            eng.step()
    write_to_out(res, "profile_dispatch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
