"""A restart with the same configuration loads every step executable (forwards and samplers) from
the persistent compilation cache: the second process misses the cache nowhere, model loading's
small eager computations included. (`runner.compile_count` counts cache loads too: jax times
them as compiles.)"""

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys
import jax
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
from paxengine import LLM
llm = LLM(model="dummy:tiny", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
          token_buckets=[16], seq_buckets=[4], layer_loop="unroll", show_progress=False,
          compilation_cache_dir=sys.argv[1])
r = llm.engine.runner
print(json.dumps({"executables": len(r.compiled) + len(r.samplers),
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _start(cache: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_start_compiles_nothing(tmp_path):
    first = _start(tmp_path / "cache")
    assert first["executables"] == 9  # 1 forward + 8 samplers
    assert first["misses"] >= first["executables"] and first["hits"] == 0
    second = _start(tmp_path / "cache")
    assert second["misses"] == 0
    assert second["hits"] == first["misses"]
