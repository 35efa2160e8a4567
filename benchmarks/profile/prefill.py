"""Where does a prefill step's time go? The compiled 8192-token step (8 prompts of 1024) vs the
same forward without attention vs the matmul FLOPs at the measured rate (GPU).

  python -m benchmarks.profile.prefill [PRESET]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.measure import matmul_rate, time_calls
from benchmarks.profile.no_attention import forward_without_attention
from benchmarks.record import write_to_out


def main() -> int:
    from paxengine import LLM, SamplingParams
    from paxengine.batch import build_step
    from paxengine.sampling import build_sampling_tensors

    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    T, n = (8192, 8) if jax.default_backend() == "gpu" else (64, 2)
    t0 = time.perf_counter()
    llm = LLM(
        model=f"dummy:{preset}",
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=n,
        max_num_batched_tokens=T,
        token_buckets=[T],
        seq_buckets=[n],
        num_kv_blocks=2048,
        show_progress=False,
    )
    eng = llm.engine
    res = {"preset": preset, "tokens": T, "startup_s": time.perf_counter() - t0}
    for i in range(n):
        eng.add_request(
            f"p{i}",
            {"prompt_token_ids": list(range(1, T // n + 1))},
            SamplingParams(max_tokens=4, ignore_eos=True),
        )
    out = eng.scheduler.schedule()
    arr = build_step(out, eng.kv.block_size, T, n, eng.runner.max_blocks_per_seq, None)
    st = build_sampling_tensors(out.requests, n, eng.runner.history_len, eng.eos_token_ids)
    res["prefill_step_ms"] = 1e3 * time_calls(lambda: eng.runner.execute(arr, st), n=10)
    cfg, params = eng.model_config, eng.runner.params

    fwd = forward_without_attention(cfg, rows=n)
    tok = jnp.zeros(T, jnp.int32)
    res["forward_no_attention_ms"] = 1e3 * time_calls(lambda: fwd(params, tok), n=10)
    # the rate of the step's largest matmul shape (tokens x hidden x MLP width), bf16
    rate = matmul_rate(T, cfg.hidden_size, cfg.intermediate_size, dtype=jnp.bfloat16)
    res["matmul_TFLOPs"] = rate / 1e12
    layer_params = (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    res["matmul_floor_ms"] = 2 * T * layer_params * cfg.num_layers / (res["matmul_TFLOPs"] * 1e9)
    write_to_out(res, "profile_prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
