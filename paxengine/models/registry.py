"""Model families by Hugging Face architecture name (vLLM's model registry): one line each.

A family is a module of `paxengine/models/` that provides
- `from_hf_config(raw: dict) -> ModelConfig` (its `family` field names the module),
- `load_hf(path, raw, progress, dtype, on_layer=None) -> (ModelConfig, params, meta)`
  (matrices as numpy in the model dtype, layers per layer) where its weights need a map of
  their own (else the loader's Llama-layout path reads them); with on_layer(i, layer) it hands
  each layer over as read and keeps none (params["layers"] None: the loader streams them into
  the weights cache),
- `forward_step(params, cfg, tokens, positions, caches, attend, step, tp) -> (hidden, caches)`
  and `compute_logits(params, cfg, hidden)`,
- `allocate_state(cfg, num_slots, dtype)` and `state_bytes_per_slot(cfg, dtype)`: what its
  recurrent layers keep per request (an empty dict and 0 for a family without any);
- optionally `CUBLAS_MAX_TOKENS`: its steps of up to that many tokens compile with cuBLAS's
  GEMMs, not XLA's Triton ones (quant.dense_xla_options; where measured faster);
- optionally `STEP_TEMP_BYTES`: the temporaries of its 8,192-token step where they exceed the
  4 GiB kv_memory keeps free for a Llama-sized one (the KV plan's activation reserve).
The runner, the scheduler and the KV manager never branch on a family's name: they ask the
config (`attention_layers`, `recurrent_layers`) and call the module this table names.
"""

from __future__ import annotations

import importlib

from paxengine.models.config import SUPPORTED_ARCHS, ModelConfig

# the Llama layout's architectures and model types are config.py's (its config mapping reads them)
ARCHITECTURES = {
    **{arch: "llama" for arch in SUPPORTED_ARCHS},
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",  # the hybrid with MoE blocks (its `num_experts`)
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# config.json's model_type where `architectures` is missing
MODEL_TYPES = {
    **{model_type: "llama" for model_type in SUPPORTED_ARCHS.values()},
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


def family_name(raw: dict) -> str:
    """The family of a config.json dict; unknown architectures fail clearly."""
    archs = raw.get("architectures") or []
    name = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if name is None:
        name = MODEL_TYPES.get(raw.get("model_type"))
    if name is None:
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r}: paxengine supports "
            f"{sorted(ARCHITECTURES)}"
        )
    return name


def family(cfg_or_name: ModelConfig | str):
    """The family module of a config (or a family name)."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.family
    return importlib.import_module(f"paxengine.models.{name}")


def config_from_hf(raw: dict) -> ModelConfig:
    return family(family_name(raw)).from_hf_config(raw)
