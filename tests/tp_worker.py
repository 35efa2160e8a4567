"""Run in a subprocess by test_tensor_parallel.py, with XLA_FLAGS giving this process N CPU
devices (they must be set before jax starts). argv[1]: a JSON list of runs, each
{"engine": EngineConfig overrides, "prompts": [str | [token ids]], "max_tokens": n}; prints one
JSON line: per run the greedy tokens, the KV cache's and two weights' shardings (and the first
layer's expert stacks', an MoE model's)."""

import json
import sys


def describe(arr) -> dict:
    s = arr.sharding
    return {
        "spec": [a if a is None else str(a) for a in getattr(s, "spec", ())],
        "devices": len(s.device_set),
        "shard_shape": list(s.shard_shape(arr.shape)),
        "shape": list(arr.shape),
    }


def main() -> None:
    import jax

    from paxengine import LLM, SamplingParams

    out = []
    for run in json.loads(sys.argv[1]):
        llm = LLM(show_progress=False, **run["engine"])
        r = llm.engine.runner
        layer = (
            r.params["layers"][0] if isinstance(r.params["layers"], list) else r.params["layers"]
        )
        cache = r.kv_cache[0] if isinstance(r.kv_cache, tuple) else r.kv_cache[0][0]
        qkv = layer.get("wqkv", layer.get("wq"))
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in run["prompts"]]
        params = SamplingParams(temperature=0, max_tokens=run["max_tokens"], ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
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
                "wo": describe(getattr(layer["wo"], "values", layer["wo"])),
                "store_hits": store.hits if store is not None else None,
                "devices": jax.device_count(),
            }
        )
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
