"""Run in a subprocess by test_tensor_parallel.py, with XLA_FLAGS giving this process N CPU
devices (they must be set before jax starts). argv[1]: a JSON list of runs, each
{"engine": EngineConfig overrides, "prompts": [str | [token ids]], "max_tokens": n, "passes":
p (default 1: the same prompts again, e.g. through the prefix cache), "env": variables set
for this run's engine only (read when its steps are traced)}; prints one JSON line:
per run the greedy tokens (of each pass: "passes"), the KV cache's and two weights' shardings
(and the first layer's expert stacks', an MoE model's; a hybrid's first-layer DeltaNet
projections and state pools), the vocabulary-parallel embedding and LM head, and where the
weights were placed from."""

import json
import math
import os
import re
import sys


def describe(arr) -> dict:
    s = arr.sharding
    return {
        "spec": [a if a is None else str(a) for a in getattr(s, "spec", ())],
        "devices": len(s.device_set),
        "shard_shape": list(s.shard_shape(arr.shape)),
        "shape": list(arr.shape),
    }


def largest_all_gather(runner) -> int:
    """The most elements any all-gather of the compiled forwards produces (0: none seen)."""
    sizes = [0]
    for exe in runner.compiled.values():
        for line in exe.as_text().splitlines():
            m = re.search(r"= \w+\[([\d,]*)\]\S* all-gather\(", line)
            if m:
                dims = [int(d) for d in m.group(1).split(",") if d]
                sizes.append(math.prod(dims))
    return max(sizes)


def record_placements(calls: list) -> None:
    """Each parallel.shard_params call appends the bytes of device arrays it was handed (0: the
    weights came from the host, each device receiving only its shards)."""
    import jax

    from paxengine import parallel

    place = parallel.shard_params

    def recorded(params, tp):
        leaves = jax.tree_util.tree_leaves(params)
        calls.append(sum(x.nbytes for x in leaves if isinstance(x, jax.Array)))
        return place(params, tp)

    parallel.shard_params = recorded


def main() -> None:
    import jax

    from paxengine import LLM, SamplingParams

    out, placements = [], []
    record_placements(placements)
    for run in json.loads(sys.argv[1]):
        placements.clear()
        env = run.get("env", {})
        # restore only these: clearing the whole environment dropped what an engine sets in it,
        # which its executables' store keys name, and every later engine missed the store
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        llm = LLM(show_progress=False, **run["engine"])
        r = llm.engine.runner
        layer = (
            r.params["layers"][0] if isinstance(r.params["layers"], list) else r.params["layers"]
        )
        cache = r.kv_cache[0] if isinstance(r.kv_cache, tuple) else r.kv_cache[0][0]
        qkv = next(layer[n] for n in ("wqkv", "wq", "la_qkvz", "la_qkv") if n in layer)
        wo = next(layer[n] for n in ("wo", "la_out") if n in layer)
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in run["prompts"]]
        params = SamplingParams(temperature=0, max_tokens=run["max_tokens"], ignore_eos=True)
        passes = [llm.generate(prompts, params, use_tqdm=False)]
        for _ in range(run.get("passes", 1) - 1):
            passes.append(llm.generate(prompts, params, use_tqdm=False))
        outs = passes[0]
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        store = llm.engine.runner.store
        experts = {
            n: describe(getattr(layer[n], "values", layer[n]))
            for n in ("e_gate_up", "e_down")
            if n in layer
        }
        out.append(
            {
                "experts": experts,
                "tokens": [o.outputs[0].token_ids for o in outs],
                "cache": describe(cache),
                "qkv": describe(getattr(qkv, "values", qkv)),
                "wo": describe(getattr(wo, "values", wo)),
                "passes": [[o.outputs[0].token_ids for o in p] for p in passes],
                "prefix_hits": getattr(llm.engine.kv, "prefix_hits", None),
                "state": {k: describe(v[0]) for k, v in getattr(r, "state", {}).items()},
                "store_hits": store.hits if store is not None else None,
                "devices": jax.device_count(),
                "embed": describe(r.params["embed"]),
                "lm_head": describe(r.params["lm_head"]) if "lm_head" in r.params else None,
                "largest_all_gather": largest_all_gather(r) if r.tp is not None else None,
                "placed_from_device_bytes": placements[0] if placements else None,
                "spec": {
                    k: v
                    for k, v in llm.engine.stats().items()
                    if k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
                },
            }
        )
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
