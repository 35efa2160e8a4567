"""Where a step's device time goes, kernel by kernel: runs engine steps under `jax.profiler.trace`,
reads the Perfetto trace it writes, and sums the device's kernel time per step by kind (matmul,
our attention, KV write, other fusions, sampling sorts) and by kernel name.

  [PROFILE_QUANT=fp8] python -m benchmarks.profile.trace [PRESET]
      (GPU: llama-3.1-8b; CPU: tiny, host ops only; PROFILE_QUANT=fp8: FP8 weights and KV, and a
      1-token bucket for the batch-1 step as the engine has)

Three steps are traced: an 8,192-token prefill (8 prompts of 1,024), a 256-row decode at ~1k
context (where the offline and serving benchmarks spend their time) and a batch-1 decode at ~140
tokens of context (the ITL shape, where fixed per-kernel costs show). Prints a table
and writes profile_trace.json to $OUT when set.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import defaultdict

import jax

from benchmarks.device_trace import kernel_times, span_of, trace_device
from benchmarks.profile.engine_steps import step_until_decoding
from benchmarks.record import write_to_out

KINDS = [  # first match wins
    ("attention", re.compile(r"ragged_paged_attention|mosaic_gpu|merge_splits")),
    ("kv_write", re.compile(r"write_kv")),
    ("matmul", re.compile(r"gemm|cublas|nvjet|cutlass|xmma|matmul|dot|triton_gemm", re.I)),
    ("sort/top-k", re.compile(r"sort|topk|top_k", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset", re.I)),
    ("fusion", re.compile(r"fusion|reduce|loop_|input_", re.I)),
]


def kind_of(name: str) -> str:
    return next((k for k, rx in KINDS if rx.search(name)), "other")


def trace_steps(step, n: int) -> dict:
    """n calls of step() under the tracer: device time per step by kind and by kernel, the
    launches, and the wall clock, device span and idle time per step."""
    step()  # outside the trace: nothing compiles in it
    wall = 0.0

    def run():
        nonlocal wall
        t = time.perf_counter()
        for _ in range(n):
            step()
        wall = time.perf_counter() - t

    events = trace_device(run)
    times, counts = kernel_times(events)
    span, idle = span_of(events)
    by_kind: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    for name, us in times.items():
        by_kind[kind_of(name)] += us / n
        launches[kind_of(name)] += counts[name] / n
    top = sorted(times.items(), key=lambda kv: -kv[1])[:40]
    return {
        "per_step_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "launches_per_step": dict(launches),
        "total_ms": sum(by_kind.values()) / 1e3,
        # per step: wall clock (under the tracer), the device's span (first kernel start to
        # last kernel end) and its idle time inside the span
        "wall_ms": wall / n * 1e3,
        "device_span_ms": span / n / 1e3,
        "device_idle_ms": idle / n / 1e3,
        "top_kernels_ms_per_step": [
            (name, us / n / 1e3, kind_of(name), counts[name] / n) for name, us in top
        ],
    }


def main() -> int:
    from paxengine import LLM, SamplingParams

    on_gpu = jax.default_backend() == "gpu"
    preset = sys.argv[1] if len(sys.argv) > 1 else ("llama-3.1-8b" if on_gpu else "tiny")
    prompt_len, rows, chunk = (1024, 256, 8192) if on_gpu else (64, 8, 256)
    quant = os.environ.get("PROFILE_QUANT") or None
    extra = {"quantization": quant, "kv_cache_dtype": quant} if quant else {}
    llm = LLM(
        model=f"dummy:{preset}",
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=2 * prompt_len + 64,
        max_num_seqs=rows,
        max_num_batched_tokens=chunk,
        token_buckets=[1, 16, rows, chunk] if quant else [16, rows, chunk],
        seq_buckets=[8, rows],
        num_kv_blocks=rows * (2 * prompt_len + 64) // 16,
        show_progress=False,
        **extra,
    )
    eng = llm.engine
    res = {"preset": preset, "backend": jax.default_backend(), "jax": jax.__version__}
    res["quantization"] = quant
    k = 0

    def prompt(i: int) -> list[int]:  # a distinct prompt per request: no prefix-cache hits
        return [1 + (j * 7 + i * 13) % 499 for j in range(prompt_len)]

    def prefill_step():
        nonlocal k
        for _ in range(chunk // prompt_len):
            eng.add_request(
                f"p{k}",
                {"prompt_token_ids": prompt(k)},
                SamplingParams(max_tokens=1, ignore_eos=True),
            )
            k += 1
        while eng.has_unfinished():
            eng.step()

    res["prefill"] = trace_steps(prefill_step, 3)
    for i in range(rows):
        eng.add_request(
            f"d{i}",
            {"prompt_token_ids": prompt(10_000 + i)},
            SamplingParams(max_tokens=prompt_len, ignore_eos=True),
        )
    step_until_decoding(eng)
    res["decode"] = trace_steps(eng.step, 10)
    for r in list(eng.groups):
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    eng.add_request(
        "one",
        {"prompt_token_ids": prompt(99_999)[:128]},
        SamplingParams(max_tokens=prompt_len, ignore_eos=True),
    )
    for _ in range(5):
        eng.step()
    res["decode_b1"] = trace_steps(eng.step, 10)  # the batch-1 ITL shape: ~140 tokens of context
    res["decode_rows"], res["prefill_tokens"] = rows, chunk
    for name in ("prefill", "decode", "decode_b1"):
        r = res[name]
        print(
            f"\n{name}: {r['total_ms']:.2f} ms of kernels per step; wall {r['wall_ms']:.2f} ms, "
            f"device span {r['device_span_ms']:.2f} ms with {r['device_idle_ms']:.2f} ms idle"
        )
        for kind, ms in r["per_step_ms"].items():
            print(f"  {kind:12s} {ms:8.2f} ms  {r['launches_per_step'][kind]:6.0f} launches")
        for kname, ms, kind, cnt in r["top_kernels_ms_per_step"][:20]:
            print(f"    {ms:8.3f} ms  x{cnt:<5.0f} {kind:10s} {kname[:80]}")
    write_to_out(res, f"profile_trace_{quant}" if quant else "profile_trace", quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
