"""The KV pool's plan on a GPU: the same number of blocks on every start of the same engine (the
pool's shape keys every step executable), from the live arrays, not the allocator's count."""

from __future__ import annotations

import jax.numpy as jnp

from paxengine import kv_memory
from paxengine.models.config import PRESETS

GiB = 1 << 30


class _FakeGpu:
    platform = "gpu"

    def __init__(self, bytes_limit: int, bytes_in_use: int):
        self.stats = {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use}

    def memory_stats(self):
        return self.stats


def _plan(dev, util=0.9):
    cfg = PRESETS["llama-3.1-8b"]
    return kv_memory.plan_num_blocks(
        cfg,
        16,
        jnp.bfloat16,
        num_kv_blocks=None,
        kv_cache_memory_bytes=None,
        gpu_memory_utilization=util,
        device=dev,
    )


def test_blocks_do_not_follow_the_allocators_noise(monkeypatch):
    weights = 16 * GiB
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: weights)
    # pending frees and transients made bytes_in_use differ by up to 1.8 GB between starts
    counts = {_plan(_FakeGpu(100 * GiB, weights + noise)) for noise in (0, 104 << 20, 1_800 << 20)}
    assert len(counts) == 1
    per_block = kv_memory.kv_bytes_per_block(PRESETS["llama-3.1-8b"], 16, jnp.bfloat16)
    (n,) = counts
    free = 0.9 * 100 * GiB - weights - 4 * GiB
    assert n * per_block == free - free % GiB  # whole GiB, rounded down


def test_small_changes_of_the_weights_keep_the_count(monkeypatch):
    dev = _FakeGpu(100 * GiB, 0)
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 16 * GiB + (5 << 20))
    a = _plan(dev)
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 16 * GiB + (300 << 20))
    assert _plan(dev) == a
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 18 * GiB)
    assert _plan(dev) < a


LIVE_BYTES_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from paxengine import kv_memory

dev = jax.devices()[0]
before = kv_memory.live_bytes(dev)
x = jnp.asarray(np.ones((1024, 256), np.float32))  # 1 MiB
assert kv_memory.live_bytes(dev) - before == x.nbytes
del x


class Holder:
    pass


a, b = Holder(), Holder()
a.other, b.other, a.array = b, a, jnp.asarray(np.ones((1024, 256), np.float32))
del a, b  # only the cyclic collector frees it: live_bytes collects first
assert kv_memory.live_bytes(dev) == before


class Other:
    platform = "gpu"


assert kv_memory.live_bytes(Other()) == 0  # no array lives on another device
print("ok")
"""


def test_live_bytes_counts_live_arrays_on_the_device_only():
    """In a process of its own: a test worker's other engines and threads make arrays too."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", LIVE_BYTES_CHECK], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
