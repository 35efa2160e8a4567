"""Run in a subprocess by test_disagg.py (its data-parallel tests) with XLA_FLAGS giving it 2
CPU devices: a DP=2 SmolLM2 server (TestClient) under a shared-prefix workload and unrelated
prompts. Prints one JSON line of what the test checks."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    from fastapi.testclient import TestClient

    from paxengine import LLM, SamplingParams
    from paxengine.config import EngineConfig
    from paxengine.data_parallel import DataParallelEngine
    from serving.app import build_app
    from serving.config import ServerConfig

    small = json.loads(sys.argv[1])
    shared = "You are a careful assistant. " * 12  # ~70 tokens: four full 16-token blocks
    engine = DataParallelEngine(EngineConfig(data_parallel_size=2, show_progress=False, **small))
    res = {"devices": [], "routed_prefix": [], "texts": {}}
    for rep in engine.replicas:
        kc = rep.core.runner.kv_cache
        arr = kc[0] if isinstance(kc, tuple) else kc[0][0]
        res["devices"].append(sorted(d.id for d in arr.sharding.device_set))
    body = {"model": engine.model_info().name, "max_tokens": 6, "temperature": 0}
    with TestClient(build_app(engine, ServerConfig())) as c:
        first = c.post("/v1/completions", json={**body, "prompt": shared + "Say hi."})
        assert first.status_code == 200, first.text
        home = [i for i, n in enumerate(engine.routed) if n][0]
        for q in ("Name a colour.", "Count to three.", "What is 2 + 2?"):
            r = c.post("/v1/completions", json={**body, "prompt": shared + q})
            assert r.status_code == 200, r.text
            res["routed_prefix"].append(engine.routed[home])
        res["home"], res["by_prefix"] = home, engine.routed_by_prefix
        prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,"]
        with ThreadPoolExecutor(4) as pool:  # at once: the least loaded replica takes each
            outs = list(
                pool.map(
                    lambda p: c.post("/v1/completions", json={**body, "prompt": p}).json(),
                    prompts,
                )
            )
        bad = [o for o in outs if "choices" not in o]
        assert not bad, bad
        res["texts"] = {p: o["choices"][0]["text"] for p, o in zip(prompts, outs)}
        res["routed"] = list(engine.routed)
        res["compiles_after_warmup"] = [
            r["xla_compiles_after_warmup"] for r in engine.stats()["replicas"]
        ]
        res["metrics"] = [
            ln for ln in c.get("/metrics").text.splitlines() if "num_requests_running{" in ln
        ]
    single = LLM(show_progress=False, **small)
    want = single.generate(list(res["texts"]), SamplingParams(temperature=0, max_tokens=6))
    res["single"] = {o.prompt: o.outputs[0].text for o in want}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
