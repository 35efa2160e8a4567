"""The KV pool's plan on a GPU: the same number of blocks on every start of the same engine (the
pool's shape keys every step executable), from the live arrays, not the allocator's count."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

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
    free = (1 - kv_memory.HEADROOM) * 100 * GiB - weights - 4 * GiB
    q = kv_memory.FREE_QUANTUM
    assert n * per_block == free - free % q  # whole quanta, rounded down


def test_small_changes_of_the_weights_keep_the_count(monkeypatch):
    dev = _FakeGpu(100 * GiB, 0)
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 16 * GiB + (5 << 20))
    a = _plan(dev)
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 16 * GiB + (100 << 20))
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


def test_the_share_of_a_pool_sized_for_the_engine_or_larger(monkeypatch):
    """gpu_memory_utilization is the engine's share of the device, as in vLLM: all of a pool
    claim_device_memory sized to it, that share's part of a larger pool the user chose."""
    weights = 16 * GiB
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: weights)
    per_block = kv_memory.kv_bytes_per_block(PRESETS["llama-3.1-8b"], 16, jnp.bfloat16)

    def expect(budget):
        free = (1 - kv_memory.HEADROOM) * budget - weights - 4 * GiB
        return int((free - free % kv_memory.FREE_QUANTUM) // per_block)

    for var in kv_memory.POOL_FRACTION_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # what the engine claims
    assert _plan(_FakeGpu(72 * GiB, 0), util=0.9) == expect(72 * GiB)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the user's larger pool
    assert _plan(_FakeGpu(76 * GiB, 0), util=0.5) == expect(76 * GiB * 0.5 / 0.95)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.6")  # jaxlib's newer name
    assert _plan(_FakeGpu(60 * GiB, 0), util=0.3) == expect(30 * GiB)


def test_utilization_out_of_range_is_refused():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            kv_memory.claim_device_memory(bad)


CLAIM_CHECK = """
import os, sys
for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    os.environ.pop(var, None)
from paxengine import kv_memory
if sys.argv[1] == "engine":  # the engine claims before its config check starts JAX's backend
    from paxengine.engine import EngineCore
    try:
        EngineCore(model="dummy:tiny", gpu_memory_utilization=0.8, kv_cache_dtype="bogus")
    except ValueError as e:
        assert "kv_cache_dtype" in str(e), e
    from jax._src import xla_bridge
    assert xla_bridge.backends_are_initialized()
    print(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
elif sys.argv[1] == "fresh":
    assert kv_memory.claim_device_memory(0.8) is None
    assert kv_memory.claim_device_memory(0.8) is None  # a second engine of the process
    print(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"], kv_memory.pool_fraction())
    print(kv_memory.claim_device_memory(0.5))  # the pool was set: it stays
elif sys.argv[1] == "user":
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.6"
    print(kv_memory.claim_device_memory(0.9), os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
else:  # the backend already started: too late to size the pool
    import jax
    jax.devices()
    print(kv_memory.claim_device_memory(0.9), os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
"""


@pytest.mark.parametrize(
    "case, expected",
    [
        ("fresh", "0.8 0.8\nXLA_PYTHON_CLIENT_MEM_FRACTION=0.8 was set"),
        ("user", "XLA_CLIENT_MEM_FRACTION=0.6 was set None"),
        ("started", "JAX's backends had started before the engine None"),
        ("engine", "0.8"),
    ],
)
def test_claim_sizes_the_pool_only_before_the_backend_starts(case, expected):
    """Each in a process of its own: JAX reads the pool's fraction once, at its backend's start."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", CLAIM_CHECK, case], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == expected


def test_pool_peak_reads_the_allocators_counts():
    dev = _FakeGpu(80 * 10**9, 0)
    dev.stats["peak_bytes_in_use"] = 72_300_000_000
    assert kv_memory.pool_peak(dev) == (
        "peak 72.3 GB of the 80.0 GB pool (7,700,000,000 bytes never used)"
    )
    assert kv_memory.pool_peak(_FakeGpu(80 * 10**9, 0)) is None  # no peak count
    import jax

    assert kv_memory.pool_peak(jax.devices("cpu")[0]) is None


def test_the_activation_reserve_grows_with_the_steps_tokens(monkeypatch):
    """Larger steps need larger temporaries: 16,384-token steps keep 8 GiB free, not 4; smaller
    ones keep the 4 GiB floor; PAXENGINE_ACTIVATION_RESERVE overrides both."""
    monkeypatch.delenv("PAXENGINE_ACTIVATION_RESERVE", raising=False)
    for var in kv_memory.POOL_FRACTION_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 16 * GiB)
    per_block = kv_memory.kv_bytes_per_block(PRESETS["llama-3.1-8b"], 16, jnp.bfloat16)
    dev = _FakeGpu(100 * GiB, 0)

    def plan(tokens):
        return kv_memory.plan_num_blocks(
            PRESETS["llama-3.1-8b"], 16, jnp.bfloat16, num_kv_blocks=None,
            kv_cache_memory_bytes=None, gpu_memory_utilization=0.75, device=dev,
            step_tokens=tokens,
        )  # fmt: skip

    default = plan(8192)
    assert plan(2048) == default
    assert (default - plan(16384)) * per_block == 4 * GiB
    monkeypatch.setenv("PAXENGINE_ACTIVATION_RESERVE", str(2 * GiB))
    assert plan(16384) == plan(8192)
    assert (plan(8192) - default) * per_block == 2 * GiB


def test_reserve_holds_the_sampler_of_a_large_vocabulary(monkeypatch):
    """The sampler's temporaries grow with its rows times the vocabulary: 512 rows over
    Qwen3.5's 248,320 tokens need more than the forward's 4 GiB (the H100 start-up ran out of
    memory there), 512 over Llama's 128,256 do not, and the KV plan keeps the difference free."""
    from dataclasses import replace

    for var in kv_memory.POOL_FRACTION_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("PAXENGINE_ACTIVATION_RESERVE", raising=False)
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: 16 * GiB)
    llama = PRESETS["llama-3.1-8b"]
    big_vocab = replace(llama, vocab_size=248320)
    forward = kv_memory.activation_reserve(8192)
    assert kv_memory.activation_reserve(8192, 512, llama.vocab_size) == forward
    sampler = kv_memory.activation_reserve(8192, 512, big_vocab.vocab_size)
    assert sampler > 5.14 * GiB + 512 * 248320 * 4 and sampler > forward
    per_block = kv_memory.kv_bytes_per_block(llama, 16, jnp.bfloat16)
    dev = _FakeGpu(100 * GiB, 0)

    def plan(cfg, rows):
        return kv_memory.plan_num_blocks(
            cfg, 16, jnp.bfloat16, num_kv_blocks=None, kv_cache_memory_bytes=None,
            gpu_memory_utilization=0.75, device=dev, sample_rows=rows,
        )  # fmt: skip

    assert plan(llama, 512) == plan(llama, 0)
    kept = (plan(big_vocab, 0) - plan(big_vocab, 512)) * per_block
    q = kv_memory.FREE_QUANTUM
    assert sampler - forward - q <= kept <= sampler - forward + q  # the plan's round-down


def test_a_family_with_larger_step_temporaries_keeps_more_free(monkeypatch):
    """Qwen3.5's 8,192-token forward needs more than a Llama-sized 4 GiB (6.46 GB on an H100):
    its family's STEP_TEMP_BYTES, scaled by the step's tokens like the default."""
    import json
    from pathlib import Path

    from paxengine.models import qwen3_5
    from paxengine.models.registry import config_from_hf

    monkeypatch.delenv("PAXENGINE_ACTIVATION_RESERVE", raising=False)
    path = Path(__file__).parents[1] / "benchmarks/gpu/models/qwen35_9b.json"
    cfg = config_from_hf(json.loads(path.read_text()))
    assert cfg.family == "qwen3_5"
    assert kv_memory.model_activation_reserve(cfg, 8192, 512) == qwen3_5.STEP_TEMP_BYTES > 4 * GiB
    assert kv_memory.model_activation_reserve(cfg, 16384, 512) == 2 * qwen3_5.STEP_TEMP_BYTES
    llama = PRESETS["llama-3.1-8b"]
    assert kv_memory.model_activation_reserve(llama, 8192, 512) == 4 * GiB


def test_largest_temporaries_names_the_executable_with_the_most():
    """The start-up log's measure of what the activation reserve must hold: XLA's temporary bytes
    of each compiled step, the largest and its bucket; an executable without the analysis is
    skipped, and none at all gives None."""
    import jax

    def f(x):
        return jnp.sin(x @ x.T).sum(0)

    small = jax.jit(f).lower(jnp.ones((64, 256))).compile()
    large = jax.jit(f).lower(jnp.ones((512, 256))).compile()

    class NoAnalysis:
        def memory_analysis(self):
            raise NotImplementedError

    temp, name = kv_memory.largest_temporaries({(64, 1): small, (512, 8): large, "x": NoAnalysis()})
    assert name == (512, 8)
    assert (
        temp
        == large.memory_analysis().temp_size_in_bytes
        > small.memory_analysis().temp_size_in_bytes
    )
    assert kv_memory.largest_temporaries({"x": NoAnalysis()}) is None


def test_the_headroom_knob(monkeypatch):
    """PAXENGINE_KV_HEADROOM (a lease's A/B of the plan's margin) replaces HEADROOM's share."""
    weights = 16 * GiB
    monkeypatch.setattr(kv_memory, "live_bytes", lambda dev: weights)
    per_block = kv_memory.kv_bytes_per_block(PRESETS["llama-3.1-8b"], 16, jnp.bfloat16)
    default = _plan(_FakeGpu(100 * GiB, 0))
    monkeypatch.setenv("PAXENGINE_KV_HEADROOM", "0.005")
    free = 0.995 * 100 * GiB - weights - 4 * GiB
    assert _plan(_FakeGpu(100 * GiB, 0)) == (free - free % kv_memory.FREE_QUANTUM) // per_block
    assert _plan(_FakeGpu(100 * GiB, 0)) > default
    monkeypatch.setenv("PAXENGINE_KV_HEADROOM", "0.6")
    with pytest.raises(ValueError, match="PAXENGINE_KV_HEADROOM"):
        _plan(_FakeGpu(100 * GiB, 0))
