"""Where does a decode step's time go? Engine ITL vs the bare compiled step vs a forward without
attention vs sampling alone, on dummy weights of a real model (GPU).

  python -m benchmarks.profile.decode [PRESET] [LAYER_LOOP]     (defaults: llama-3.1-8b auto)
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.measure import time_calls
from benchmarks.profile.engine_steps import step_until_decoding
from benchmarks.profile.no_attention import forward_without_attention
from benchmarks.record import write_to_out


def main() -> int:
    from paxengine import LLM, SamplingParams
    from paxengine.batch import build_step
    from paxengine.sampling import build_sampling_tensors, sample

    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    loop = sys.argv[2] if len(sys.argv) > 2 else "auto"
    on_gpu = jax.default_backend() == "gpu"
    batches, prompt_len = ((1, 64, 256), 1024) if on_gpu else ((1, 8), 64)
    t0 = time.perf_counter()
    llm = LLM(
        model=f"dummy:{preset}",
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        token_buckets=[16, 64, 256, 1024],
        seq_buckets=[8, 64, 256],
        num_kv_blocks=24000 if on_gpu else 512,
        show_progress=False,
        layer_loop=loop,
    )
    eng = llm.engine
    res = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "preset": preset,
        "layer_loop": eng.runner.layer_loop,
        "buckets": len(eng.runner.compiled),
        "compile_s": eng.runner.builder.compile_seconds,
        "startup_s": time.perf_counter() - t0,
    }
    print(res, flush=True)
    for batch in batches:
        for i in range(batch):
            eng.add_request(
                f"b{batch}-{i}",
                {"prompt_token_ids": list(range(1, prompt_len + 1))},
                SamplingParams(max_tokens=400, ignore_eos=True),
            )
        step_until_decoding(eng)
        for _ in range(5):
            eng.step()
        t = time.perf_counter()
        for _ in range(50):
            eng.step()
        res[f"engine_step_ms_b{batch}"] = (time.perf_counter() - t) / 50 * 1e3
        res[f"context_b{batch}"] = prompt_len + 55
        print(batch, res[f"engine_step_ms_b{batch}"], flush=True)
        out = eng.scheduler.schedule()
        T, S = eng.runner.bucket_for(out.total_tokens, len(out.requests))
        arr = build_step(
            out,
            eng.kv.block_size,
            T,
            S,
            eng.runner.max_blocks_per_seq,
            {r.request_id: i for i, r in enumerate(out.requests)},
        )
        st = build_sampling_tensors(out.requests, S, eng.runner.history_len, eng.eos_token_ids)
        res[f"device_step_ms_b{batch}"] = 1e3 * time_calls(lambda: eng.runner.execute(arr, st))
        for r in list(eng.groups):
            eng.abort(r)
        eng.inflight = None
    cfg, params = eng.model_config, eng.runner.params
    for S in (8, 64, 256) if on_gpu else (8,):
        logits = jax.random.normal(jax.random.PRNGKey(0), (S, cfg.vocab_size), jnp.float32)
        reqs = [
            type(
                "R",
                (),
                {
                    "params": SamplingParams(temperature=0),
                    "seed": 0,
                    "num_output_tokens": 1,
                    "all_token_ids": [1],
                    "num_prompt_tokens": 1,
                },
            )()
            for _ in range(S)
        ]
        st = build_sampling_tensors(reqs, S, 16, [])
        st = jax.tree_util.tree_map(jnp.asarray, st)
        f = jax.jit(sample)
        res[f"sample_greedy_ms_S{S}"] = 1e3 * time_calls(lambda: f(logits, st))

    fwd = forward_without_attention(cfg, rows=1)
    tok = jnp.zeros(16, jnp.int32)
    res["forward_no_attention_ms_T16"] = 1e3 * time_calls(lambda: fwd(params, tok))
    tok = jnp.zeros(256, jnp.int32)
    res["forward_no_attention_ms_T256"] = 1e3 * time_calls(lambda: fwd(params, tok))
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    res["weight_bytes_GB"] = nbytes / 1e9
    tag = res["layer_loop"] + ("_dsfusion" if "dynamic_slice" in res["xla_flags"] else "")
    write_to_out(res, f"profile_decode_{tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
