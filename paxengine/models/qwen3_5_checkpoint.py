"""Qwen3.5's checkpoint side (`models/qwen3_5.py` is the family; these are its config, weight
names, shapes and loader entry points): the HF config.json mapping (the multimodal checkpoint
nests the text model under `text_config`), HF tensor names to ours, the shapes per layer kind,
`load_hf` (vision and MTP tensors skipped; FP8 checkpoints kept FP8) and random weights for
benchmarks.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from paxengine.models import qwen3_moe
from paxengine.models.config import ModelConfig, hf_rope
from paxengine.models.quant import LINEAR_WEIGHTS, Fp8Weight
from paxengine.models.weights import (
    check_per_layer_shapes,
    keys_by_layer,
    random_per_layer,
    read_outer,
    take_layers,
)

log = logging.getLogger("paxengine.models.qwen3_5")


# -- config ---------------------------------------------------------------------------------------
def from_hf_config(raw: dict) -> ModelConfig:
    text = raw.get("text_config") or raw  # the multimodal checkpoint nests the text model
    max_pos = int(text.get("max_position_embeddings", 32768))
    theta, partial, rope = hf_rope(text, max_pos, partial=0.25)
    heads = text["num_attention_heads"]
    n = text["num_hidden_layers"]
    types = text.get("layer_types") or [
        "full_attention"
        if (i + 1) % text.get("full_attention_interval", 4) == 0
        else "linear_attention"
        for i in range(n)
    ]
    return ModelConfig(
        arch="qwen3_5",
        family="qwen3_5",
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text.get("intermediate_size") or 0,  # 0: Qwen3.5-MoE (no dense MLP)
        num_layers=n,
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=rope,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings"))),
        qk_norm=True,
        max_position_embeddings=max_pos,
        name=raw.get("_name_or_path", ""),
        layer_types=tuple(types[:n]),
        partial_rotary_factor=partial,
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
        **_moe_config(text, n),
    )


def _moe_config(text: dict, n: int) -> dict:
    """Qwen3.5-MoE (`Qwen3_5Moe*`): every layer's MLP is a routed block with a shared expert,
    its top-k weights always renormalised (HF's Qwen3_5MoeTopKRouter)."""
    if not text.get("num_experts"):
        return {}
    return dict(
        moe_layers=tuple(range(n)),
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        norm_topk_prob=True,
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size") or 0,
    )


def _conv_dim(cfg: ModelConfig) -> int:
    return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + _value_dim(cfg)


def _value_dim(cfg: ModelConfig) -> int:
    return cfg.linear_num_value_heads * cfg.linear_value_head_dim


# -- weights --------------------------------------------------------------------------------------
# HF name (after the layer prefix) -> (our name, a Linear [out, in] stored transposed)
_COMMON = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_ATTENTION = {
    "self_attn.q_proj.weight": ("wq", True),  # [Hq * 2D, H]: each head's query, then its gate
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
}
_LINEAR = {
    "linear_attn.in_proj_qkv.weight": ("la_qkv", True),
    "linear_attn.in_proj_z.weight": ("la_z", True),
    "linear_attn.in_proj_b.weight": ("la_b", True),
    "linear_attn.in_proj_a.weight": ("la_a", True),
    "linear_attn.conv1d.weight": ("la_conv", False),  # [C, 1, K] -> [C, K]
    "linear_attn.dt_bias": ("la_dt_bias", False),
    "linear_attn.A_log": ("la_A_log", False),
    "linear_attn.norm.weight": ("la_norm", False),  # the gated RMSNorm: not zero-centred
    "linear_attn.out_proj.weight": ("la_out", True),
}
# projections one GEMM reads, in their output order (weights.fuse_layers, which engine_setup
# applies to the runner's params; the forward takes a layer either way): at batch 1 a layer's
# four in-projections of the DeltaNet were four launches and four partial waves
FUSED = {
    "wqkv": ("wq", "wk", "wv"),
    "w_gate_up": ("w_gate", "w_up"),
    "s_gate_up": ("s_gate", "s_up"),  # Qwen3.5-MoE's shared expert and experts
    "e_gate_up": ("e_gate", "e_up"),
    "la_qkvz": ("la_qkv", "la_z"),
    "la_ba": ("la_b", "la_a"),
}
_ZERO_CENTRED = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def layer_names(cfg: ModelConfig, i: int) -> dict:
    kind = _ATTENTION if cfg.layer_types[i] == "full_attention" else _LINEAR
    if i in cfg.moe_layers:  # the norms of _COMMON, the MoE block's router and shared expert
        mlp = {k: v for k, v in _COMMON.items() if not k.startswith("mlp.")}
        return {**mlp, **qwen3_moe.MOE_NAMES, **kind}
    return {**_COMMON, **kind}


def param_shapes(cfg: ModelConfig) -> dict:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
    common = {
        "attn_norm": (h,),
        "mlp_norm": (h,),
        "w_gate": (h, i),
        "w_up": (h, i),
        "w_down": (i, h),
    }
    attn = {
        "wq": (h, 2 * qd),
        "wk": (h, kd),
        "wv": (h, kd),
        "wo": (qd, h),
        "q_norm": (d,),
        "k_norm": (d,),
    }
    hv, vd = cfg.linear_num_value_heads, _value_dim(cfg)
    lin = {
        "la_qkv": (h, _conv_dim(cfg)),
        "la_z": (h, vd),
        "la_b": (h, hv),
        "la_a": (h, hv),
        "la_conv": (_conv_dim(cfg), cfg.linear_conv_kernel_dim),
        "la_dt_bias": (hv,),
        "la_A_log": (hv,),
        "la_norm": (cfg.linear_value_head_dim,),
        "la_out": (vd, h),
    }
    layers = [{**common, **(attn if t == "full_attention" else lin)} for t in cfg.layer_types]
    if cfg.moe_layers:  # Qwen3.5-MoE: the MoE block's shapes instead of the dense MLP's
        moe = qwen3_moe.param_shapes(cfg)["layers"]
        for li in cfg.moe_layers:
            for n in ("w_gate", "w_up", "w_down"):
                del layers[li][n]
            layers[li].update({n: moe[li][n] for n in moe[li] if n not in common and n not in attn})
    shapes = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def load_hf(path: Path, raw: dict, progress: bool, dtype: str = "float32", on_layer=None):
    """-> (config, params as numpy (matrices in `dtype`, vectors float32), per layer, meta).
    Vision and MTP weights are skipped (said once in the log). An FP8 checkpoint (quant_method
    "fp8" with 128 x 128 block scales, as Qwen ships, or compressed-tensors) keeps its
    projections FP8 (Fp8Weight, per output channel: fp8_checkpoint.py); FP8 tensors of anything
    else (the per-head b / a gates, an lm_head) are dequantized; the checkpoint's KV-cache
    scales, if any, are the attention layers'. The layers are read one after another; with
    on_layer each goes to on_layer(i, layer) once read and is not kept (params["layers"] is
    then None: a conversion holds one layer in host memory at a time)."""
    from tqdm import tqdm

    from paxengine.models import fp8_checkpoint as fp8

    cfg = from_hf_config(raw)
    reader = fp8.CheckpointReader(path, raw, dtype)
    top, per_layer = keys_by_layer(reader.keys(), ("model.language_model.", "model."))
    bar = tqdm(desc=f"loading {path.name}", unit="tensor", disable=not progress)
    params: dict = {}
    kv: dict[tuple[int, int], float] = {}
    skipped = {"vision": 0, "mtp": 0}
    for key in top:
        bar.update()
        name = next(
            (key[len(p) :] for p in ("model.language_model.", "model.") if key.startswith(p)),
            key,
        )
        if key.startswith(("model.visual.", "visual.")):
            skipped["vision"] += 1
        elif key.startswith(("mtp.", "model.mtp.")):
            skipped["mtp"] += 1
        else:
            read_outer(reader, key, name, cfg, params)
    if skipped["vision"] or skipped["mtp"]:
        log.info(
            "%s: text only: %d vision and %d MTP tensors not loaded",
            path.name,
            skipped["vision"],
            skipped["mtp"],
        )
    _zero_centred(params)

    def read_layers():
        for i in range(cfg.num_layers):
            layer, experts = {}, {}  # experts: an MoE layer's expert slices
            for key, rest in per_layer.get(i, []):
                bar.update()
                if rest in fp8.KV_SCALE_NAMES:
                    v = np.asarray(reader.tensor(key), np.float32)
                    for j in fp8.KV_SCALE_NAMES[rest]:
                        kv[(i, j)] = float(v.reshape(-1)[0])
                if rest.startswith("mlp.experts.") and i in cfg.moe_layers:
                    a = reader.weight(key, True)  # an FP8 checkpoint's experts stay FP8
                    qwen3_moe.expert_tensor(experts, rest[len("mlp.experts.") :], a)
                    continue
                if rest not in layer_names(cfg, i):
                    continue
                ours, transpose = layer_names(cfg, i)[rest]
                a = reader.weight(key, ours in LINEAR_WEIGHTS)
                if not isinstance(a, Fp8Weight):  # an Fp8Weight is [out, in] already
                    a = a.T if transpose else a
                    a = a.reshape(a.shape[0], -1) if ours == "la_conv" else a
                layer[ours] = a
            qwen3_moe.stack_layer_experts(layer, experts, i, cfg)
            _zero_centred(layer)
            yield i, layer

    params["layers"] = take_layers(read_layers(), on_layer)
    bar.close()
    if on_layer is None:
        check_shapes(params, cfg)
    kv_scales = fp8.kv_scales_array(kv, cfg.num_layers, cfg.attention_layers)
    return cfg, params, {"kv_scales": kv_scales, "prequantized": reader.prequantized()}


def _zero_centred(d: dict) -> None:
    """Qwen3.5's zero-centred RMSNorm weights as scales: 1 + w."""
    for n in _ZERO_CENTRED:
        if n in d:
            d[n] = d[n] + 1.0


def check_shapes(params: dict, cfg: ModelConfig) -> None:
    check_per_layer_shapes(params, param_shapes(cfg))


def dummy_params(cfg: ModelConfig, dtype, seed: int) -> dict:
    """Random weights of the config's shapes (benchmarks: `dummy:/path/config.json`); the
    DeltaNet's A_log 0 and dt_bias 1, in f32."""
    fixed = {
        "la_A_log": lambda shape: jnp.zeros(shape, jnp.float32),
        "la_dt_bias": lambda shape: jnp.ones(shape, jnp.float32),
    }
    return random_per_layer(param_shapes(cfg), dtype, seed, fixed)
