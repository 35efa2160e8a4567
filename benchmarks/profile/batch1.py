"""Batch-1 decode, the ITL shape: the engine's step time in its smallest bucket (16 tokens,
8 rows) and what XLA made of that step (the forward's optimized HLO, and its kernels per
layer by kind). Run it once per variant (XLA_FLAGS, code) in separate processes and compare.

  [PROFILE_TAG=name] [PROFILE_QUANT=fp8] python -m benchmarks.profile.batch1 [PRESET]
      (GPU: llama-3.1-8b; PROFILE_QUANT=fp8: FP8 weights and KV, stepping in the engine's 1-token
      bucket, where the projections take the Pallas FP8 GEMV)

Writes $OUT/profile_b1_<tag>.json and $OUT/b1_forward_<tag>.hlo.txt when $OUT is set.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter

import jax

from benchmarks.record import write_to_out


def fusion_kinds(hlo: str) -> Counter:
    """Kernels the optimized HLO's entry launches (fusions and custom calls), by instruction
    name without its numeric suffix (the names the profiler shows, e.g. loop_add_fusion)."""
    entry = hlo[hlo.index("\nENTRY") :]
    kinds: Counter = Counter()
    for line in entry.splitlines()[1:]:
        if " fusion(" not in line and " custom-call(" not in line:
            continue
        name = line.split("=", 1)[0].strip().lstrip("%").removeprefix("ROOT ").strip()
        m = re.search(r'custom_call_target="([^"]+)"', line)
        kinds[re.sub(r"[._]?[0-9]+$", "", name) + (f" ({m.group(1)})" if m else "")] += 1
    return kinds


def main() -> int:
    from paxengine import LLM, SamplingParams

    on_gpu = jax.default_backend() == "gpu"
    preset = sys.argv[1] if len(sys.argv) > 1 else ("llama-3.1-8b" if on_gpu else "tiny")
    tag = os.environ.get("PROFILE_TAG", "default")
    quant = os.environ.get("PROFILE_QUANT") or None
    extra = {"quantization": quant, "kv_cache_dtype": quant} if quant else {}
    t0 = time.perf_counter()
    llm = LLM(
        model=f"dummy:{preset}",
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        token_buckets=[1, 16] if quant else [16],
        seq_buckets=[8],
        num_kv_blocks=512,
        show_progress=False,
        **extra,
    )
    eng = llm.engine
    res = {
        "tag": tag,
        "preset": preset,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "quantization": quant,
        "jax": jax.__version__,
        "startup_s": time.perf_counter() - t0,
    }
    eng.add_request(
        "one",
        {"prompt_token_ids": [1 + (7 * j) % 499 for j in range(128)]},
        SamplingParams(max_tokens=600, ignore_eos=True),
    )
    for _ in range(8 + 10):  # 8 prefill chunks of 16, then warm decode steps
        eng.step()
    n = 200 if on_gpu else 10
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    res["itl_ms"] = (time.perf_counter() - t) / n * 1e3
    hlo = eng.runner.compiled[(1, 8) if quant else (16, 8)].as_text()
    kinds = fusion_kinds(hlo)
    layers = eng.model_config.num_layers
    res["kernels_per_step"] = sum(kinds.values())
    # kernels XLA launches as CUDA graphs (its command buffers) vs one by one
    res["command_buffer_calls"] = hlo.count("command_buffer")
    res["kernels_by_kind"] = dict(kinds.most_common())
    res["kernels_per_layer"] = {k: v / layers for k, v in kinds.most_common() if v >= layers}
    print(
        f"[{tag}] ITL {res['itl_ms']:.3f} ms, {res['kernels_per_step']} kernels a step", flush=True
    )
    for k, v in res["kernels_per_layer"].items():
        print(f"   {v:5.1f} / layer  {k}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"b1_forward_{tag}.hlo.txt"), "w") as f:
            f.write(hlo)
    write_to_out(res, f"profile_b1_{tag}", quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
