"""The benchmarks' shared measurements (benchmarks.measure) and the GPU report's merge, on CPU."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import pytest

from benchmarks import measure


def test_time_per_call_divides_by_calls_and_reduces_over_reps():
    waits = iter([0.02, 0.06, 0.04])

    def run():
        time.sleep(next(waits))
        return None

    t = measure.time_per_call(run, calls=2, reps=3, sync=lambda _: None, reduce=min)
    assert 0.01 <= t < 0.02  # the fastest rep, over its 2 calls


def test_chained_calls_last_output_and_sum():
    def one(q, w):
        return q * w

    q, w = jnp.ones((2, 3, 4)), jnp.full((2, 3, 4), 3.0)
    last = measure.chained_calls(one, 5)(q, w)
    assert last.shape == q.shape and float(last[0, 0, 0]) == 3.0  # q's zero dependency: q stays 1
    total = measure.chained_calls(lambda q, w: (q * w)[:1], 5, keep_last=False)(q, w)
    assert total.shape == () and float(total) == 15.0  # any output shape, summed


def test_time_loop_is_positive():
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones(8)
    assert measure.time_loop(f, (x,), reps=2, iters=1, per_sync=3) > 0


def test_rates_on_cpu():
    bw, nbytes = measure.copy_rate(1, iters=2, reps=1)
    assert nbytes == 2 * 2**20 and bw > 0  # f32 on a CPU: read + write
    assert measure.device_dtype() == jnp.float32
    assert measure.matmul_rate(32, iters=2, reps=1) > 0
    assert measure.matmul_rate(16, 32, 8, iters=2, reps=1, dtype=jnp.bfloat16) > 0


def test_compile_counter_counts_new_compiles_only():
    f = jax.jit(lambda x: x * 2 + 1)
    f(jnp.ones(3)).block_until_ready()
    counter = measure.CompileCounter()
    f(jnp.ones(3)).block_until_ready()  # cached: no compile
    assert counter.n == 0
    f(jnp.ones(5)).block_until_ready()  # a new shape compiles
    assert counter.n >= 1


@pytest.mark.parametrize("same_spec", [True, False])
def test_report_merges_an_earlier_call_with_the_same_spec(tmp_path, same_spec):
    from benchmarks.gpu.report import merge_earlier
    from benchmarks.gpu.workloads import FULL, QUICK

    earlier = tmp_path / "gpu_bench.json"
    earlier.write_text(json.dumps({"spec": QUICK, "stages": {"pax-offline": {"ok": True}}}))
    merged = {"spec": QUICK if same_spec else FULL, "stages": {"hf": {"ok": True}}}
    merge_earlier(merged, earlier)
    assert ("pax-offline" in merged["stages"]) == same_spec and "hf" in merged["stages"]
