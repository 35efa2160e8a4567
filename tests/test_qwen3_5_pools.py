"""Qwen3.5's recurrent-state pools at the real model's size: the kernels address a pool with
int32 offsets, and a pool stacked over the 9B's 24 DeltaNet layers at the GPU defaults' 1,024
slots (512 sequences + their prefix snapshots) held 12.9 G elements: the engine did not start on
the GPU (benchmarks/results/gpu_2026-12-06b_qwen35_gemm/). Shapes only: nothing is allocated."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from paxengine import device_defaults
from paxengine.models import qwen3_5

CONFIG = Path(__file__).parent.parent / "benchmarks/gpu/models/qwen35_9b.json"


def test_the_9b_pools_fit_the_kernels_offsets_at_the_gpu_defaults():
    cfg = qwen3_5.from_hf_config(json.loads(CONFIG.read_text()))
    slots = 2 * device_defaults.GPU["max_num_seqs"]
    pools = jax.eval_shape(lambda: qwen3_5.allocate_state(cfg, slots, jnp.bfloat16))
    assert len(pools["ssm"]) == len(cfg.recurrent_layers) == 24
    assert pools["ssm"][0].shape == (slots, 32, 128, 128)
    assert all(a.size < 2**31 for a in jax.tree.leaves(pools))
    per_slot = qwen3_5.state_bytes_per_slot(cfg, jnp.bfloat16)
    assert per_slot * slots == sum(a.size * 2 for a in jax.tree.leaves(pools))
