"""The KV pool's device memory: how many blocks a budget holds, the bytes of one, and the
arrays themselves (per layer or stacked, split by KV head under tensor parallelism)."""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp

import kernels_pallas
from paxengine import parallel
from paxengine.models import registry
from paxengine.models.config import ModelConfig

# gpu_memory_utilization is, as in vLLM, the share of each GPU's memory the engine may take. JAX's
# allocator sizes its pool once, when its GPU backend starts: 75% of the card unless
# XLA_CLIENT_MEM_FRACTION (or the older XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise. Left at
# 75%, an 80 GB H100 held 17,408 KV blocks of 16 tokens where vLLM at 0.9 holds 28,123 (its 300 x
# (1000, 1000) preempted 132 times and ran at 0.89x vLLM; benchmarks/results/gpu_2026-12-05b_same_lease/).
POOL_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
JAX_DEFAULT_POOL_FRACTION = 0.75
# Of the engine's share, this part stays free beside the activation reserve: the step
# executables' temporaries and what else the plan cannot see. Measured on an H100 at 8,192-token
# steps, every executable compiled cold and run once: 4.7 GB above the weights and the KV pool at
# its peak (benchmarks/results/gpu_2026-12-05b_same_lease/kv_pool.txt); the 4 GiB reserve plus 2%
# of a 0.9 share (1.5 GB) covers it with 1.1 GB to spare before the plan's round-down (FREE_QUANTUM).
# 10% left 12 GB unused there and 368,640 KV tokens against vLLM's 449,968 (0.93x on 300 x (1000,
# 1000), 116 preemptions; benchmarks/results/gpu_2026-12-05c_kv_share/).
HEADROOM = 0.02


def headroom() -> float:
    """HEADROOM, or PAXENGINE_KV_HEADROOM (a fraction in [0, 0.5)): an A/B knob for the leases
    (Qwen3-30B-A3B's peak left 1.9 GB of its 78.2 GB pool unused, gpu_2026-12-07h/, and its
    KV holds 114,688 tokens to vLLM's 129,680: how close can the plan go, measured)."""
    raw = os.environ.get("PAXENGINE_KV_HEADROOM", "").strip()
    if not raw:
        return HEADROOM
    value = float(raw)
    if not 0 <= value < 0.5:
        raise ValueError(f"PAXENGINE_KV_HEADROOM must be a fraction in [0, 0.5), got {raw!r}")
    return value


# The step executables' temporaries grow with the step's tokens: 4 GiB holds those of 8,192-token
# steps of an 8B model (the peak above), twice that 16,384-token steps. A family whose forward
# needs more says so (`STEP_TEMP_BYTES`: an 8,192-token step's; models/registry.py).
RESERVE_STEP_TOKENS = 8192
FORWARD_TEMP_BYTES = 4 << 30
# The sampler's temporaries grow with its rows times the vocabulary: a full sort for top-k /
# top-p, the softmax, the CDF, the logprobs. On an H100 the 512-row sampler over Qwen3.5's
# 248,320-token vocabulary took 5.14 GiB (43.4 bytes a logit; XLA's analysis said 4.58 GB, the
# sort's scratch is beside it) and the start-up ran out of memory under the 4 GiB reserve
# (benchmarks/results/gpu_2026-12-07_qwen35_lease/); 48 counts it and the float32 logits it
# reads. Llama-3.1-8B's 128,256 tokens x 512 rows stay under 4 GiB.
SAMPLER_BYTES_PER_LOGIT = 48


def activation_reserve(
    step_tokens: int, sample_rows: int = 0, vocab_size: int = 0, forward_bytes: int = 0
) -> int:
    """Bytes kept free for the steps' temporaries (PAXENGINE_ACTIVATION_RESERVE overrides): the
    forward's (`forward_bytes` for an 8,192-token step, FORWARD_TEMP_BYTES by default, scaled by
    `step_tokens`), or the sampler's over `sample_rows` x `vocab_size` logits where that is more
    (they run one after the other)."""
    if os.environ.get("PAXENGINE_ACTIVATION_RESERVE"):
        return int(os.environ["PAXENGINE_ACTIVATION_RESERVE"])
    per_8k = forward_bytes or FORWARD_TEMP_BYTES
    forward = int(per_8k * max(1.0, step_tokens / RESERVE_STEP_TOKENS))
    return max(forward, SAMPLER_BYTES_PER_LOGIT * sample_rows * vocab_size)


def model_activation_reserve(cfg: ModelConfig, step_tokens: int, sample_rows: int) -> int:
    """activation_reserve for a model: its family's forward temporaries, its vocabulary."""
    forward = getattr(registry.family(cfg), "STEP_TEMP_BYTES", 0)
    return activation_reserve(step_tokens, sample_rows, cfg.vocab_size, forward)


def pool_fraction() -> float:
    """The share of each GPU's memory JAX's allocator pool takes (read when its backend starts)."""
    for var in POOL_FRACTION_VARS:
        if os.environ.get(var):
            return float(os.environ[var])
    return JAX_DEFAULT_POOL_FRACTION


def claim_device_memory(utilization: float) -> str | None:
    """Before JAX's GPU backend starts, size its pool to `utilization` of each device. Returns
    None when it did, else why the pool stays as it is (a fraction the user set, or a backend
    already started): the KV plan then keeps within the engine's share of that pool."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    for var in POOL_FRACTION_VARS:
        if os.environ.get(var):  # the user's, or an earlier engine's of this process
            same = float(os.environ[var]) == utilization
            return None if same else f"{var}={os.environ[var]} was set"
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return "JAX's backends had started before the engine"
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = repr(float(utilization))
    return None


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, kv_dtype, layer_loop: str, tp=None
):
    """scan: one (k, v) pair of [L, Hkv, NB, bs, D]; unroll: a list of L pairs of [1, ...] (each
    layer writes its own donated buffer in place). V pages of a bf16 cache are fp16 (same size,
    no conversion in the attention kernels: kernels_pallas.value_cache_dtype); those of an fp8
    cache of 64+-token pages are [D, bs] (kernels_pallas.value_page_shape). Under tensor
    parallelism the KV-head axis is split over the devices (one head per device at least:
    copies of a shared head each hold its pages), each device's share allocated in place."""
    v_dtype = kernels_pallas.value_cache_dtype(kv_dtype)
    heads = cfg.num_kv_heads
    zeros = jnp.zeros
    if tp is not None:
        heads = tp.local_config(cfg).num_kv_heads * tp.size
        zeros = lambda shape, dt: jax.jit(  # noqa: E731
            lambda: jnp.zeros(shape, dt), out_shardings=tp.sharding(parallel.CACHE_SPEC)
        )()
    page = (block_size, cfg.head_dim)
    v_page = kernels_pallas.value_page_shape(kv_dtype, block_size, cfg.head_dim)
    if layer_loop == "scan":
        lead = (cfg.num_kv_layers, heads, num_blocks)
        return (zeros(lead + page, kv_dtype), zeros(lead + v_page, v_dtype))
    lead = (1, heads, num_blocks)
    return [
        (zeros(lead + page, kv_dtype), zeros(lead + v_page, v_dtype))
        for _ in range(cfg.num_kv_layers)
    ]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype) -> int:
    """K and V pages of one block over all layers (V in kernels_pallas.value_cache_dtype)."""
    itemsize = jnp.dtype(kv_dtype).itemsize + kernels_pallas.value_cache_dtype(kv_dtype).itemsize
    return cfg.num_kv_layers * cfg.num_kv_heads * block_size * cfg.head_dim * itemsize


def plan_num_blocks(
    cfg: ModelConfig,
    block_size: int,
    kv_dtype,
    *,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    device=None,
    step_tokens: int = RESERVE_STEP_TOKENS,
    sample_rows: int = 0,
) -> int:
    """The pool size: explicit, from a byte budget, or from free memory of `device` (default
    the first). `step_tokens` (max_num_batched_tokens) and `sample_rows` (the sampler's most
    rows) size the activation reserve."""
    if num_kv_blocks:
        return int(num_kv_blocks)
    per_block = kv_bytes_per_block(cfg, block_size, kv_dtype)
    if kv_cache_memory_bytes:
        return max(1, int(kv_cache_memory_bytes // per_block))
    dev = device if device is not None else jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if dev.platform == "gpu" and stats and "bytes_limit" in stats:
        reserve = model_activation_reserve(cfg, step_tokens, sample_rows)
        # the engine's share of the device: the pool (claim_device_memory made it that share),
        # or the share's part of a larger pool someone else chose
        budget = stats["bytes_limit"] * min(1.0, gpu_memory_utilization / pool_fraction())
        free = (1 - headroom()) * budget - live_bytes(dev) - reserve
        free -= free % FREE_QUANTUM
        if free < per_block:
            raise ValueError(
                f"no device memory left for the KV cache (gpu_memory_utilization="
                f"{gpu_memory_utilization}): lower max_num_batched_tokens or raise it"
            )
        return int(free // per_block)
    return max(1, (512 << 20) // per_block)  # CPU default: 512 MiB of KV


# XLA's analysis undercounts what a step allocates (an H100's sampler: 5.14 GiB against 4.58
# GB analysed, the sort's scratch); the reserve an out-of-memory start-up suggests allows this
ALLOCATION_MARGIN = 1.25


def prime_or_explain(runner, num_blocks: int, largest: tuple | None, reserve: int) -> float:
    """Runs every step executable once (StepBuilder.prime); returns the seconds. If the device
    runs out of memory there, the KV plan left too little for the steps' temporaries: say so, and
    what to change, instead of XLA's allocator message alone. largest: (bytes, which) of the
    executables' temporaries (None where none reports them), reserve: the plan's activation
    reserve, for a reserve to set."""
    try:
        return runner.builder.prime()[1]
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        measured = ""
        if largest is not None:
            suggest = max(int(ALLOCATION_MARGIN * largest[0]), reserve + (1 << 30))
            measured = (
                f"; the largest temporaries are {largest[0] / 1e9:.2f} GB ({largest[1]}) against "
                f"an activation reserve of {reserve / 1e9:.2f} GB: try "
                f"PAXENGINE_ACTIVATION_RESERVE={suggest}"
            )
        raise RuntimeError(
            f"out of device memory running each step once at start-up, with {num_blocks} KV "
            "blocks: lower gpu_memory_utilization or max_num_batched_tokens, set num_kv_blocks, "
            "or raise PAXENGINE_ACTIVATION_RESERVE (bytes kept free for the steps' temporaries)"
            + measured
        ) from e


def pool_peak(dev) -> str | None:
    """The allocator's peak against its pool, for the log once every step has run; None where
    the device keeps no such count (the CPU)."""
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats or "bytes_limit" not in stats or "peak_bytes_in_use" not in stats:
        return None
    peak, pool = stats["peak_bytes_in_use"], stats["bytes_limit"]
    return f"peak {peak / 1e9:.1f} GB of the {pool / 1e9:.1f} GB pool ({pool - peak:,} bytes never used)"


def largest_temporaries(executables: dict) -> tuple[int, object] | None:
    """The most temporary bytes XLA assigned one of `executables` (name -> compiled), and which:
    what the activation reserve must hold. None where no executable reports its memory."""
    best = None
    for name, exe in executables.items():
        try:
            temp = exe.memory_analysis().temp_size_in_bytes
        except Exception:  # a backend or a loaded executable without the analysis
            continue
        if best is None or temp > best[0]:
            best = (int(temp), name)
    return best


# The pool's size is in every step executable's key (the KV arrays' shapes): it must come out
# the same on every start of the same engine, or a restart misses the executable store. The
# allocator's bytes_in_use did not (H200, one machine, six starts: 37,580 to 38,492 blocks, so
# two of them compiled 33 forward executables again), so the plan counts the arrays alive
# (after a collection) and rounds what is left down to whole quarters of a GiB. The count is
# the same from start to start as the live arrays are; a whole GiB (the quantum until
# 2026-12-07) threw away half a GiB on average, ~5% of Qwen3-30B-A3B's 10 GiB pool on an H100.
FREE_QUANTUM = 1 << 28


def live_bytes(dev) -> int:
    """Bytes of the live JAX arrays' shards on `dev`: the weights and what else the engine put
    there so far (freed and pending buffers, which the allocator still counts, are not)."""
    gc.collect()  # arrays only a dropped reference cycle still held
    total = 0
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            if shard.device == dev:
                total += shard.data.nbytes
    return total
