"""Where does a decode step's time go? Engine ITL vs the bare compiled step vs a forward without
attention, on dummy weights of a real model (GPU). `python -m benchmarks.profile_decode`."""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp


def timed(fn, n=20):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        r = fn()
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3


def main() -> int:
    from paxengine import LLM, SamplingParams
    from paxengine.batch import build_step
    from paxengine.models.llama import compute_logits, forward_hidden
    from paxengine.sampling import build_sampling_tensors
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    llm = LLM(model=f"dummy:{preset}", dtype="bfloat16", max_model_len=2048, max_num_seqs=8,
              max_num_batched_tokens=256, token_buckets=[16, 256], seq_buckets=[8],
              num_kv_blocks=2048, show_progress=False)
    eng = llm.engine
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "preset": preset}
    for batch in (1, 8):
        for i in range(batch):
            eng.add_request(f"b{batch}-{i}", {"prompt_token_ids": list(range(1, 129))},
                            SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(10):
            eng.step()
        t = time.perf_counter()
        for _ in range(50):
            eng.step()
        res[f"engine_step_ms_b{batch}"] = (time.perf_counter() - t) / 50 * 1e3
        out = eng.scheduler.schedule()
        T, S = eng.runner.bucket_for(out.total_tokens, len(out.requests))
        arr = build_step(out, eng.kv.block_size, T, S, eng.runner.max_blocks_per_seq,
                         {r.request_id: i for i, r in enumerate(out.requests)})
        st = build_sampling_tensors(out.requests, S, eng.runner.history_len, eng.eos_token_ids)
        res[f"device_step_ms_b{batch}"] = timed(lambda: eng.runner.execute(arr, st))
        for r in list(eng.groups):
            eng.abort(r)
        eng.inflight = None
    cfg, params = eng.model_config, eng.runner.params

    def noattn(q, k, v, c, l):
        return q, c
    fwd = jax.jit(lambda p, t: compute_logits(p, cfg, forward_hidden(p, cfg, t, t, None, noattn)[0][:1]))
    tok = jnp.zeros(16, jnp.int32)
    res["forward_no_attention_ms_T16"] = timed(lambda: fwd(params, tok))
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    res["weight_bytes_GB"] = nbytes / 1e9
    print(json.dumps(res, indent=1))
    out_dir = os.environ.get("OUT")
    if out_dir:
        tag = "dsfusion" if "dynamic_slice" in res["xla_flags"] else "default"
        with open(os.path.join(out_dir, f"profile_decode_{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
