"""Several hosts (issue #19), as three processes with one CPU device each on loopback (gloo
collectives): one mesh over the three, TP=3, every process running the same LLM script
(SPMD) gets the tokens one process gets alone."""

import json
import os
import socket
import subprocess
import sys

import pytest
from devices import SMALL, truncated_smollm2

from paxengine import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
# one token bucket: the 32-token forward runs every step, one compile less in each process.
# No num_kv_blocks: each process plans its KV pool as a single process does (kv_memory), on the
# mesh's devices it owns; a plan that read another host's device broke multi-host once.
ENGINE = {k: v for k, v in SMALL.items() if k != "num_kv_blocks"}
ENGINE.update(layer_loop="unroll", token_buckets=[32])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_processes_tp3_generate_what_one_process_does():
    engine = dict(ENGINE, model=truncated_smollm2())  # four of SmolLM2's layers
    # also makes sure the weights cache the others read is filled (this process's, as every
    # test's: converting SmolLM2 into a fresh one cost ~8 s here)
    one = LLM(show_progress=False, **engine)
    prompts = ["The capital of France is", "def fib(n):", "word " * 30]
    params = SamplingParams(temperature=0, max_tokens=10)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    coord = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    args = json.dumps(dict(engine, tensor_parallel_size=3))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "mp_worker.py"), coord, "3", str(i), args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, err[-3000:]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in results:
        assert (r["processes"], r["devices"], r["local_cache_shards"]) == (3, 3, 1)
        assert r["tokens"] == want


def test_bad_multi_host_settings_are_named():
    with pytest.raises(ValueError, match="needs coordinator_address"):
        LLM(num_processes=2, show_progress=False)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\)"):
        LLM(num_processes=2, process_id=2, coordinator_address="127.0.0.1:1", show_progress=False)
