"""Mixtral (HF transformers `models/mixtral`: `MixtralForCausalLM`, e.g. Mixtral-8x7B).

Mistral's attention (no QK norm, no biases) and an MoE block in every layer: the router
`block_sparse_moe.gate` [E, H], the experts `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up)
and `w2` (down), softmax top-k always renormalised, no shared expert. That is Qwen3-MoE's layout
without its QK norm, so its forward, shapes and loader run it (qwen3_moe.py, models/moe.py),
tensor and expert parallelism included; this module maps the config and the tensor names.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from paxengine.models.config import ModelConfig
from paxengine.models.config import from_hf_config as llama_config
from paxengine.models.qwen3_moe import (  # noqa: F401 (the family's entry points)
    FUSED,
    allocate_state,
    check_shapes,
    compute_logits,
    dummy_params,
    forward_step,
    read_checkpoint,
    state_bytes_per_slot,
)


def from_hf_config(raw: dict) -> ModelConfig:
    """Mistral's attention config (sliding window where the config sets one) with every layer
    an MoE block of `intermediate_size` per expert."""
    experts = raw.get("num_local_experts", 0)
    if experts < 1:
        raise ValueError(f"a Mixtral config needs num_local_experts >= 1, got {experts}")
    base = llama_config({**raw, "architectures": ["MistralForCausalLM"]})
    return dataclasses.replace(
        base,
        arch="mixtral",
        family="mixtral",
        intermediate_size=0,  # no dense MLP
        moe_layers=tuple(range(base.num_layers)),
        num_experts=experts,
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["intermediate_size"],
        norm_topk_prob=True,
    )


_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _rename(rest: str) -> str:
    """A layer tensor's Mixtral name -> Qwen3-MoE's (transformers 5 in memory names the block
    `mlp` already)."""
    m = _EXPERT.fullmatch(rest)
    if m:
        return f"mlp.experts.{m[1]}.{_PROJ[m[2]]}.weight"
    return rest.replace("block_sparse_moe.", "mlp.", 1)


def load_hf(path: Path, raw: dict, progress: bool, dtype: str = "float32", on_layer=None):
    return read_checkpoint(
        path, raw, from_hf_config(raw), progress, rename=_rename, dtype=dtype, on_layer=on_layer
    )
