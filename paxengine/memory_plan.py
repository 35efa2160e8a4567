"""The device memory plan at start-up: how many KV blocks the engine's share of each device
holds beside the weights, the recurrent layers' state slots and the activation reserve (the
arrays themselves and the byte counts are kv_memory's), the same plan on every host, and the
first run of every step executable against that plan, with what it measured in the log."""

from __future__ import annotations

import logging

import jax
import numpy as np

from paxengine.config import EngineConfig
from paxengine.engine_setup import DTYPES, Checked
from paxengine.kv_memory import (
    kv_bytes_per_block,
    largest_temporaries,
    model_activation_reserve,
    plan_num_blocks,
    pool_fraction,
    pool_peak,
    prime_or_explain,
)
from paxengine.models import registry

log = logging.getLogger("paxengine")


def plan_kv_blocks(
    cfg: EngineConfig, checked: Checked, model_config, tp, draft_config, eagle, spec=None
) -> int:
    """The KV pool's blocks: kv_memory's plan for each device (the target's pages), shared with a
    draft model's pages or an EAGLE-3 head's pages and aux states unless num_kv_blocks gives the
    count by hand."""
    num_blocks = plan_num_blocks(
        tp.local_config(model_config) if tp is not None else model_config,  # per device
        checked.block_size,
        checked.kv_dtype,
        num_kv_blocks=cfg.num_kv_blocks,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        device=tp.local_device if tp is not None else None,
        step_tokens=cfg.max_num_batched_tokens,
        sample_rows=max(cfg.seq_buckets),
    )
    num_blocks = agree_across_processes(num_blocks)
    if cfg.num_kv_blocks:
        return num_blocks
    dtype = DTYPES[checked.dtype]
    running, snapshots = state_slots(cfg, model_config)
    verify = verify_slots(cfg, model_config, spec)
    slots = running + snapshots + verify
    if slots:  # the recurrent layers' state slots and snapshots come out of the same budget
        mine = tp.local_config(model_config) if tp is not None else model_config  # per device
        per_block = kv_bytes_per_block(mine, checked.block_size, checked.kv_dtype)
        state = slots * registry.family(model_config).state_bytes_per_slot(mine, dtype)
        num_blocks -= -(-state // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for KV pages beside {slots} recurrent state slots "
                f"({state / 2**20:.0f} MiB): lower max_num_seqs"
            )
        log.info(
            "%d recurrent state slots (%.1f MiB each): up to %d sequences at once, %d cached "
            "prefix states, %d for speculative verify steps",
            slots,
            state / slots / 2**20,
            running,
            snapshots,
            verify,
        )
    if draft_config is not None:  # the KV budget holds both models' pages
        from paxengine.spec_decode.draft_model import share_kv_budget

        return share_kv_budget(
            num_blocks, model_config, draft_config, checked.block_size, checked.kv_dtype, dtype
        )
    if eagle is not None:  # its KV pages and aux states too
        t = kv_bytes_per_block(model_config, checked.block_size, checked.kv_dtype)
        d = eagle.bytes_per_block(checked.block_size, dtype)
        return max(1, num_blocks * t // (t + d))
    return num_blocks


def agree_across_processes(num_blocks: int) -> int:
    """Several hosts run one program over one mesh: the KV arrays' shapes, planned from each
    host's own free memory, must be the same everywhere, so each takes the smallest plan."""
    if jax.process_count() == 1:
        return num_blocks
    from jax.experimental import multihost_utils

    plans = multihost_utils.process_allgather(np.int64(num_blocks))
    return int(np.min(plans))


def state_slots(cfg: EngineConfig, model_config) -> tuple[int, int]:
    """A model with recurrent layers: a state slot per running sequence, and with prefix
    caching as many snapshot slots for cached prefixes' states (state_snapshots.py)."""
    if not model_config.recurrent_layers:
        return 0, 0
    return cfg.max_num_seqs, cfg.max_num_seqs if cfg.enable_prefix_caching else 0


def verify_slots(cfg: EngineConfig, model_config, spec) -> int:
    """Speculative decoding on a model with recurrent layers: k more state slots per running
    sequence, where a verify step leaves the states after its first k positions, so a rejected
    draft rolls back by reading one (KVCacheManager.position_slot)."""
    if spec is None or not model_config.recurrent_layers:
        return 0
    return cfg.max_num_seqs * spec.num_speculative_tokens


def prime_and_report(runner, num_blocks: int, dev, step_tokens: int) -> None:
    """Run each step executable once before serving, then log the device memory's peak against
    the pool. Before that, the largest temporaries of each kind of executable against the
    activation reserve (the KV plan's margin), so a start-up that runs out of memory says which."""
    reserve = model_activation_reserve(runner.cfg, step_tokens, runner.max_rows)
    temps = temporaries_by_kind(runner)
    for kind, (size, key) in temps.items():
        log.info(
            "largest %s temporaries: %.2f GB (%s; activation reserve %.2f GB)",
            kind,
            size / 1e9,
            key,
            reserve / 1e9,
        )
    kind = max(temps, key=lambda k: temps[k][0], default=None)
    largest = (temps[kind][0], f"{kind} {temps[kind][1]}") if kind is not None else None
    log.info(
        "ran each step executable once in %.1f s",
        prime_or_explain(runner, num_blocks, largest, reserve),
    )
    if (peak := pool_peak(dev)) is not None:
        log.info("device memory: %s", peak)


def step_executables(runner) -> dict[str, dict]:
    """The runner's compiled executables by kind (name -> {key: compiled})."""
    return {
        "forward": runner.compiled,
        "chained verify": runner.chained,
        "prompt-logprob": runner.plp_compiled,
        "sampler": runner.samplers,
    }


def temporaries_by_kind(runner) -> dict[str, tuple[int, object]]:
    """Each kind of step executable's largest temporaries by XLA's buffer assignment, (bytes,
    key), for the kinds that report them: what the activation reserve must hold."""
    temps = {kind: largest_temporaries(exes) for kind, exes in step_executables(runner).items()}
    return {kind: t for kind, t in temps.items() if t is not None}


def log_pool_not_claimed(why: str, utilization: float) -> None:
    log.info(
        "JAX's device memory pool was not sized by gpu_memory_utilization (%s): the KV cache "
        "keeps within %.0f%% of the pool in effect",
        why,
        100 * min(1.0, utilization / pool_fraction()),
    )
