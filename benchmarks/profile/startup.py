"""Start-up of the engine, cold and restarted, each in a fresh process on one cache folder:

  cold       empty cache: load, trace and compile every step executable (the store is written)
  store      a restart: every step executable loaded from the executable store
  jax-cache  a restart without the store: traced again, XLA's compile served by JAX's cache

Each start then generates the same greedy tokens, which must agree across the three. The engine
configuration is the GPU run's (`benchmarks/gpu/workloads.py` FULL) on the model given.

  python -m benchmarks.profile.startup [MODEL [STARTS]]
      MODEL: default dummy:llama-3.1-8b; `tiny` on a CPU; STARTS: e.g. cold,store
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.gpu.workloads import FULL
from benchmarks.record import environment, write_to_out

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from paxengine import LLM, SamplingParams
model, cache, store, engine_kw = sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4])
t1 = time.perf_counter()
llm = LLM(model=model, compilation_cache_dir=cache, store_executables=store, show_progress=False,
          **engine_kw)
t2 = time.perf_counter()
eng = llm.engine
r = eng.runner
prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(24)]} for i in range(8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({
    "import_s": t1 - t0, "engine_s": t2 - t1, "load_s": eng.load_seconds,
    "executables_s": r.builder.compile_seconds, "trace_s": r.builder.trace_seconds,
    "executables": len(r.compiled) + len(r.samplers),
    "from_store": r.store.hits if r.store else 0,
    "store_load_s": r.store.load_seconds if r.store else 0.0,
    "unstored": r.store.unstored if r.store else [],
    "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def start(model: str, cache: str, store: bool, engine_kw: dict) -> dict:
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, cache, "1" if store else "0", json.dumps(engine_kw)],
        capture_output=True,
        text=True,
        env=os.environ,  # keeps whatever the device sets (NCCL and XLA variables)
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["store_warnings"] = [ln[-300:] for ln in out.stderr.splitlines() if "executable" in ln]
    res["process_s"] = time.perf_counter() - t
    return res


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "dummy:llama-3.1-8b"
    if model == "tiny":
        model = "dummy:tiny"
    engine_kw = dict(FULL["engine"], dtype=FULL["dtype"]) if "8b" in model else {}
    res = {"model": model, "engine": engine_kw, "environment": environment(), "starts": {}}
    with tempfile.TemporaryDirectory() as cache:
        names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["cold", "store", "jax-cache"]
        for name in names:
            store = name != "jax-cache"
            r = start(model, cache, store, engine_kw)
            res["starts"][name] = r
            print(
                f"{name:10s} process {r['process_s']:6.1f} s  engine {r['engine_s']:6.1f} s  "
                f"load {r['load_s']:5.1f} s  executables {r['executables_s']:6.1f} s "
                f"(traced {r['trace_s']:5.1f} s; {r['from_store']}/{r['executables']} from the "
                "store)",
                flush=True,
            )
    starts = res["starts"]
    first = next(iter(starts.values()))["tokens"]
    res["same_tokens"] = all(s["tokens"] == first for s in starts.values())
    print("same greedy tokens in every start:", res["same_tokens"])
    for name, s in starts.items():
        for w in s["store_warnings"]:
            print(f"{name}: {w}")
    for s in starts.values():
        s.pop("tokens")
    write_to_out(res, "startup", quiet=True)
    return 0 if res["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
