"""Where does a prefill step's time go? The compiled 8192-token step (8 prompts of 1024) vs the
same forward without attention vs the matmul FLOPs at the measured rate (GPU).

  python -m benchmarks.profile.prefill [PRESET]
"""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.profile.decode import report, timed


def main() -> int:
    from paxengine import LLM, SamplingParams
    from paxengine.batch import build_step
    from paxengine.models.llama import compute_logits, forward_hidden
    from paxengine.sampling import build_sampling_tensors
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    T, n = (8192, 8) if jax.default_backend() == "gpu" else (64, 2)
    t0 = time.perf_counter()
    llm = LLM(model=f"dummy:{preset}", dtype="bfloat16", max_model_len=2048, max_num_seqs=n,
              max_num_batched_tokens=T, token_buckets=[T], seq_buckets=[n], num_kv_blocks=2048,
              show_progress=False)
    eng = llm.engine
    res = {"preset": preset, "tokens": T, "startup_s": time.perf_counter() - t0}
    for i in range(n):
        eng.add_request(f"p{i}", {"prompt_token_ids": list(range(1, T // n + 1))},
                        SamplingParams(max_tokens=4, ignore_eos=True))
    out = eng.scheduler.schedule()
    arr = build_step(out, eng.kv.block_size, T, n, eng.runner.max_blocks_per_seq, None)
    st = build_sampling_tensors(out.requests, n, eng.runner.history_len, eng.eos_token_ids)
    res["prefill_step_ms"] = timed(lambda: eng.runner.execute(arr, st), n=10)
    cfg, params = eng.model_config, eng.runner.params

    def noattn(q, k, v, c, l):
        return q, c
    fwd = jax.jit(lambda p, t: compute_logits(p, cfg, forward_hidden(p, cfg, t, t, None, noattn)[0][:n]))
    tok = jnp.zeros(T, jnp.int32)
    res["forward_no_attention_ms"] = timed(lambda: fwd(params, tok), n=10)
    a = jnp.ones((T, cfg.hidden_size), jnp.bfloat16)
    b = jnp.ones((cfg.hidden_size, cfg.intermediate_size), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    ms = timed(lambda: mm(a, b), n=20)
    res["matmul_TFLOPs"] = 2 * T * cfg.hidden_size * cfg.intermediate_size / ms / 1e9
    layer_params = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                    + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                    + 3 * cfg.hidden_size * cfg.intermediate_size)
    res["matmul_floor_ms"] = 2 * T * layer_params * cfg.num_layers / (res["matmul_TFLOPs"] * 1e9)
    report(res, "profile_prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
