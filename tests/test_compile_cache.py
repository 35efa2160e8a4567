"""A restart with the same configuration loads every step executable (forwards and samplers) from
the executable store: nothing is traced or compiled again, and the loaded steps give the same
tokens. JAX's own persistent cache still serves model loading's small eager computations: the
second process misses it nowhere. A stored executable that cannot be read is compiled again."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, sys
import jax
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
from paxengine import LLM, SamplingParams
from paxengine.step_build import compile_count
llm = LLM(model="dummy:tiny", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
          token_buckets=[16], seq_buckets=[4], layer_loop="unroll", show_progress=False,
          compilation_cache_dir=sys.argv[1], store_executables=sys.argv[2] == "1")
r = llm.engine.runner
compiles = compile_count()
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
store = r.store
print(json.dumps({"executables": len(r.compiled) + len(r.samplers) + len(r.plp_compiled),
                  "store_hits": store.hits if store else 0,
                  "store_misses": store.misses if store else 0,
                  "jax_hits": events.count("/jax/compilation_cache/cache_hits"),
                  "jax_misses": events.count("/jax/compilation_cache/cache_misses"),
                  "tokens": out[0].outputs[0].token_ids,
                  "compiles_while_serving": compile_count() - compiles}))
"""


def _start(cache: Path, store: bool = True) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache), "1" if store else "0"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A first start on an empty cache with the store on: its cache folder, a copy of that
    folder as the start left it, and its result. JAX's cache keys hold the cache's path, so a
    test that starts again does so in the same folder, put back from the copy (`_fresh`)."""
    return _first_start(tmp_path_factory.mktemp("stored"), store=True)


@pytest.fixture(scope="module")
def unstored(tmp_path_factory):
    """The same without the store: JAX's cache alone is filled."""
    return _first_start(tmp_path_factory.mktemp("unstored"), store=False)


def _first_start(folder: Path, store: bool):
    cache = folder / "cache"
    result = _start(cache, store=store)
    shutil.copytree(cache, folder / "as_left")
    return cache, folder / "as_left", result


def _fresh(first_start):
    """The first start's cache folder as that start left it, and its result."""
    cache, as_left, result = first_start
    shutil.rmtree(cache)
    shutil.copytree(as_left, cache)
    return cache, result


def test_restart_loads_every_step_from_the_store(stored):
    cache, first = _fresh(stored)
    # 1 forward + 8 samplers + 3 with a grammar mask + 1 prompt-logprob executable
    assert first["executables"] == 13
    assert first["store_misses"] == 13 and first["store_hits"] == 0
    assert len(list((cache / "executables").glob("*.exe"))) == 13
    second = _start(cache)
    assert second["store_hits"] == 13 and second["store_misses"] == 0
    assert second["jax_misses"] == 0  # the eager rest of start-up hits JAX's cache
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 8
    assert second["compiles_while_serving"] == first["compiles_while_serving"] == 0


def test_unreadable_entry_is_compiled_again(stored):
    cache, first = _fresh(stored)
    victim = sorted((cache / "executables").glob("*.exe"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated, as by a crash mid-write
    second = _start(cache)
    assert second["store_hits"] == 12 and second["store_misses"] == 1
    assert second["tokens"] == first["tokens"]
    assert len(victim.read_bytes()) > 100  # rewritten


def test_without_the_store_jax_cache_serves_the_restart(unstored):
    cache, first = _fresh(unstored)
    assert not (cache / "executables").exists()
    assert first["jax_misses"] >= first["executables"] and first["jax_hits"] == 0
    second = _start(cache, store=False)
    assert second["jax_misses"] == 0 and second["jax_hits"] == first["jax_misses"]
    assert second["tokens"] == first["tokens"]


def test_store_written_after_a_run_through_jax_cache_still_runs(unstored):
    """A start without the store fills JAX's cache; the next start stores its steps, which must
    be fresh compiles: an executable JAX loaded from its cache, serialized again, loaded and
    failed when run ("Function ... not found") on XLA:CPU."""
    cache, plain = _fresh(unstored)
    writes = _start(cache)
    assert writes["store_misses"] == 13
    loads = _start(cache)
    assert loads["store_hits"] == 13
    assert plain["tokens"] == writes["tokens"] == loads["tokens"]


def test_store_is_pruned_least_recently_used_first(tmp_path):
    import os

    from paxengine.executables import ExecutableStore

    d = tmp_path / "executables"
    d.mkdir()
    for i, age in enumerate((300, 200, 100)):  # a is the oldest
        p = d / f"{'abc'[i]}.exe"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - age))
    ExecutableStore(d, max_bytes=2000)
    assert sorted(p.name for p in d.glob("*.exe")) == ["b.exe", "c.exe"]
