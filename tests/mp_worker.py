"""One of several processes of a multi-host run (test_multi_host.py): argv = coordinator,
num_processes, process_id, engine overrides (JSON). Every process runs the same generate."""

import json
import sys


def main() -> None:
    from paxengine import LLM, SamplingParams

    coord, n, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(
        coordinator_address=coord,
        num_processes=n,
        process_id=pid,
        show_progress=False,
        **json.loads(sys.argv[4]),
    )
    import jax

    prompts = ["The capital of France is", "def fib(n):", "word " * 30]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    kc = llm.engine.runner.kv_cache
    arr = kc[0] if isinstance(kc, tuple) else kc[0][0]
    res = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "processes": jax.process_count(),
        "devices": len(jax.devices()),
        "local_cache_shards": len(arr.addressable_shards),
    }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
