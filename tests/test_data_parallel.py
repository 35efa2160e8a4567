"""Data-parallel replicas (issue #19) on 2 simulated CPU devices: each replica on its own device,
both serve, a shared prefix stays on the replica that cached it, and per-replica metrics."""

import json

import pytest
from devices import SMALL, run_worker, truncated_smollm2

from paxengine import LLM

SMALL_DP = dict(SMALL, max_model_len=256, max_num_batched_tokens=64, token_buckets=[16, 64])


@pytest.fixture(scope="module")
def dp(two_device_cache):
    small = dict(SMALL_DP, model=truncated_smollm2(), compilation_cache_dir=two_device_cache)
    return run_worker("dp_worker.py", [json.dumps(small)], 2)


def test_each_replica_runs_on_its_own_device(dp):
    assert dp["devices"] == [[0], [1]]


def test_a_shared_prefix_stays_on_the_replica_that_cached_it(dp):
    # the first request went to one replica; the three sharing its prefix followed it
    assert dp["routed_prefix"] == [2, 3, 4] and dp["by_prefix"] == 3


def test_both_replicas_serve_and_answer_as_one_engine(dp):
    assert all(n > 0 for n in dp["routed"]) and sum(dp["routed"]) == 8
    assert dp["texts"] == dp["single"]


def test_no_replica_counts_another_replicas_warm_up_as_a_recompile(dp):
    assert dp["compiles_after_warmup"] == [0, 0]


def test_metrics_per_replica(dp):
    engines = sorted(ln.split('engine="')[1].split('"')[0] for ln in dp["metrics"])
    assert engines == ["0", "1"]


def test_one_engine_core_refuses_data_parallel():
    with pytest.raises(ValueError, match="runs one replica"):
        LLM(data_parallel_size=2, show_progress=False)
