"""The engine's host work per decode step with the device taken out: `runner.execute` and
`runner.fetch` return fixed tokens at once, so what is timed is scheduling, building the step's
arrays and sampling tensors, and processing outputs (streamed, as a server asks for them). Runs on
a CPU with the tiny dummy model; the GPU step must stay longer than this for the host to hide.

  python -m benchmarks.profile.host [ROWS] [--profile]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np

from benchmarks.profile.engine_steps import step_until_decoding


def main() -> int:
    from paxengine import SamplingParams
    from paxengine.engine import EngineCore
    from paxengine.sampling import NUM_TOP_LOGPROBS

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rows = int(args[0]) if args else 256
    eng = EngineCore(
        model="dummy:tiny",
        max_model_len=2048,
        max_num_seqs=rows,
        max_num_batched_tokens=1024,
        token_buckets=[rows, 1024],
        seq_buckets=[rows],
        num_kv_blocks=rows * 1500 // 16,
        show_progress=False,
    )
    fixed = (
        np.zeros(rows, np.int32),
        np.zeros(rows, np.float32),
        np.ones(rows, np.int32),
        np.zeros((rows, NUM_TOP_LOGPROBS), np.int32),
        np.zeros((rows, NUM_TOP_LOGPROBS), np.float32),
    )
    eng.runner.execute = lambda arrays, st: fixed
    eng.runner.fetch = lambda result: result
    prompt = [1 + j % 500 for j in range(1024)]
    for i in range(rows):
        eng.add_request(
            f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=400, ignore_eos=True)
        )
    step_until_decoding(eng)
    for _ in range(5):
        eng.step()
    n = 100
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    print(
        f"host work per decode step, {rows} streamed rows: "
        f"{(time.perf_counter() - t) / n * 1e3:.2f} ms"
    )
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            eng.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
