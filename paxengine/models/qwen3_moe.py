"""Qwen3-MoE (HF transformers `models/qwen3_moe`: `Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B).

Qwen3's attention (the Llama family's `_attention` with QK RMSNorm); the MLP of layer i is an MoE
block (models/moe.py: E experts, top-k, `norm_topk_prob`) where `i not in mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0`, else a dense SwiGLU MLP of `intermediate_size`. The layers
differ in kind, so they run unrolled over per-layer dicts (a list), each attention layer its own
KV pair; the experts of a layer are stacked [E, in, out] at load, from the checkpoint's
per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...) or transformers 5's fused 3-D form
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]). No per-request state.
Tensor parallelism (parallel.py): attention and the dense MLPs as the Llama family's, the MoE
block's experts split by channel or, with expert parallelism, by expert.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.models.config import ModelConfig, hf_rope
from paxengine.models.llama import (  # noqa: F401 (compute_logits: the family's entry)
    _attention,
    compute_logits,
    rms_norm,
    rope_for,
)
from paxengine.models.moe import moe_mlp, real_tokens
from paxengine.models.norm import norm_into
from paxengine.models.quant import (
    LINEAR_WEIGHTS,
    Fp8Weight,
    gated_mlp,
    linear,
    linear_parts,
    row_dot,
)
from paxengine.models.weights import (
    HF_LAYER_NAMES,
    LAYER_LINEAR,
    check_per_layer_shapes,
    keys_by_layer,
    random_per_layer,
    read_outer,
    take_layers,
)


# -- config ---------------------------------------------------------------------------------------
def from_hf_config(raw: dict) -> ModelConfig:
    heads, n = raw["num_attention_heads"], raw["num_hidden_layers"]
    max_pos = int(raw.get("max_position_embeddings", 32768))
    theta, _, rope = hf_rope(raw, max_pos)
    experts = raw.get("num_experts", raw.get("num_local_experts", 0))
    step, only = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    moe = tuple(i for i in range(n) if experts and i not in only and (i + 1) % step == 0)
    return ModelConfig(
        arch="qwen3_moe",
        family="qwen3_moe",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw.get("intermediate_size") or 0,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=rope,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=True,
        max_position_embeddings=max_pos,
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window") else None,
        name=raw.get("_name_or_path", ""),
        moe_layers=moe,
        num_experts=experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
    )


# -- weights --------------------------------------------------------------------------------------
# HF name (after "model.layers.{i}.") -> (our name, a Linear [out, in] stored transposed)
_COMMON = {  # the Llama layout's attention and norms (biases: Qwen2-MoE's)
    k: (v, LAYER_LINEAR[v]) for k, v in HF_LAYER_NAMES.items() if not k.startswith("mlp.")
}
_DENSE = {k: (v, LAYER_LINEAR[v]) for k, v in HF_LAYER_NAMES.items() if k.startswith("mlp.")}
MOE_NAMES = {  # (Qwen3.5-MoE's layers name their MoE block the same: models/qwen3_5.py)
    "mlp.gate.weight": ("router", True),  # [E, H] -> [H, E]
    "mlp.shared_expert.gate_proj.weight": ("s_gate", True),
    "mlp.shared_expert.up_proj.weight": ("s_up", True),
    "mlp.shared_expert.down_proj.weight": ("s_down", True),
    "mlp.shared_expert_gate.weight": ("s_router", True),  # [1, H] -> [H, 1]
}
_EXPERT = {"gate_proj.weight": "e_gate", "up_proj.weight": "e_up", "down_proj.weight": "e_down"}
# projections one GEMM reads (weights.fuse_layers, applied by engine_setup)
FUSED = {
    "wqkv": ("wq", "wk", "wv"),
    "bqkv": ("bq", "bk", "bv"),
    "w_gate_up": ("w_gate", "w_up"),
    "s_gate_up": ("s_gate", "s_up"),
    "e_gate_up": ("e_gate", "e_up"),
}


def param_shapes(cfg: ModelConfig) -> dict:
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
    common = {
        "attn_norm": (h,),
        "mlp_norm": (h,),
        "wq": (h, qd),
        "wk": (h, kd),
        "wv": (h, kd),
        "wo": (qd, h),
    }
    if cfg.qk_norm:  # (Mixtral's attention has none)
        common.update(q_norm=(d,), k_norm=(d,))
    if cfg.attention_bias:
        common.update(bq=(qd,), bk=(kd,), bv=(kd,))
    i = cfg.intermediate_size
    dense = {"w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    mi, si = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    moe = {"router": (h, e), "e_gate": (e, h, mi), "e_up": (e, h, mi), "e_down": (e, mi, h)}
    if si:
        moe.update(s_gate=(h, si), s_up=(h, si), s_down=(si, h), s_router=(h, 1))
    layers = [
        {**common, **(moe if li in cfg.moe_layers else dense)} for li in range(cfg.num_layers)
    ]
    shapes = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def load_hf(path: Path, raw: dict, progress: bool, dtype: str = "float32", on_layer=None):
    """-> (config, params as numpy (matrices in `dtype`), per layer, meta). Each expert's
    projections are read one tensor at a time into the layer's stacked [E, in, out] arrays.
    on_layer(i, layer): each layer handed over as it is read (params["layers"] then None)."""
    return read_checkpoint(path, raw, from_hf_config(raw), progress, dtype=dtype, on_layer=on_layer)


def read_checkpoint(
    path: Path,
    raw: dict,
    cfg: ModelConfig,
    progress: bool,
    rename=None,
    dtype: str = "float32",
    on_layer=None,
):
    """load_hf of a family of this layout: `rename` maps a layer's tensor name (after
    "layers.{i}.") to the names above where its checkpoint spells them otherwise (Mixtral).
    The layers are read one after another (`weights.keys_by_layer`); with on_layer each goes
    to on_layer(i, layer) once read and is not kept (a conversion then holds one layer of the
    model in host memory at a time)."""
    from tqdm import tqdm

    from paxengine.models import fp8_checkpoint as fp8

    reader = fp8.CheckpointReader(path, raw, dtype)
    top, per_layer = keys_by_layer(reader.keys())
    bar = tqdm(desc=f"loading {path.name}", unit="tensor", disable=not progress)
    params: dict = {}
    for key in top:
        bar.update()
        read_outer(reader, key, key.removeprefix("model."), cfg, params)

    def read_layers():
        for i in range(cfg.num_layers):
            layer, experts = {}, {}
            names = {**_COMMON, **(MOE_NAMES if i in cfg.moe_layers else _DENSE)}
            for key, rest in per_layer.get(i, []):
                bar.update()
                rest = rename(rest) if rename is not None else rest
                if rest in names:
                    ours, transpose = names[rest]
                    a = reader.weight(key, ours in LINEAR_WEIGHTS)
                    layer[ours] = a.T if transpose and not isinstance(a, Fp8Weight) else a
                elif rest.startswith("mlp.experts.") and i in cfg.moe_layers:
                    a = reader.weight(key, True)  # an FP8 checkpoint's experts stay FP8
                    expert_tensor(experts, rest[len("mlp.experts.") :], a)
            stack_layer_experts(layer, experts, i, cfg)
            yield i, layer

    params["layers"] = take_layers(read_layers(), on_layer)
    bar.close()
    if on_layer is None:
        check_shapes(params, cfg)
    meta = {"kv_scales": None, "prequantized": reader.prequantized()}
    return cfg, params, meta


def stack_layer_experts(layer: dict, experts: dict, i: int, cfg: ModelConfig) -> None:
    """An MoE layer's expert slices (`expert_tensor`) stacked [E, in, out] into its dict (an
    FP8 checkpoint's: an Fp8Weight of values [E, out, in] and scales [E, out])."""
    if i not in cfg.moe_layers:
        return
    for ours, parts in experts.items():
        if isinstance(parts, dict):
            missing = set(range(cfg.num_experts)) - set(parts)
            if missing:
                raise ValueError(f"layers.{i}: no {ours} weights of experts {sorted(missing)}")
            parts = [parts[e] for e in range(cfg.num_experts)]
            fp8 = [isinstance(p, Fp8Weight) for p in parts]
            if all(fp8):
                parts = Fp8Weight(
                    np.stack([p.values for p in parts]), np.stack([p.scales for p in parts])
                )
            elif any(fp8):
                raise ValueError(
                    f"layers.{i}: experts {[e for e, f in enumerate(fp8) if not f]} of "
                    f"{ours} are not FP8 where the others are: paxengine stacks one kind"
                )
            else:
                parts = np.stack(parts)
        layer[ours] = parts


def expert_tensor(into: dict, rest: str, a: np.ndarray) -> None:
    """One expert tensor ("{e}.gate_proj.weight" [I, H], ...) as the [in, out] slice of its
    stack (an Fp8Weight: as it is), or a fused 3-D one ("gate_up_proj" [E, 2I, H], "down_proj"
    [E, H, I]) whole."""
    if rest == "gate_up_proj":
        gate, up = np.split(a, 2, axis=1)
        into["e_gate"], into["e_up"] = gate.swapaxes(1, 2), up.swapaxes(1, 2)
    elif rest == "down_proj":
        into["e_down"] = a.swapaxes(1, 2)
    else:
        e, proj = rest.split(".", 1)
        if proj in _EXPERT:  # an Fp8Weight is [out, in] already
            into.setdefault(_EXPERT[proj], {})[int(e)] = a if isinstance(a, Fp8Weight) else a.T


def check_shapes(params: dict, cfg: ModelConfig) -> None:
    check_per_layer_shapes(params, param_shapes(cfg))


def dummy_params(cfg: ModelConfig, dtype, seed: int) -> dict:
    """Random weights of the config's shapes (benchmarks: `dummy:/path/config.json`)."""
    return random_per_layer(param_shapes(cfg), dtype, seed)


# -- per-request state: none (the experts are weights) -------------------------------------------
def allocate_state(cfg: ModelConfig, num_slots: int, dtype) -> dict:
    return {}


def state_bytes_per_slot(cfg: ModelConfig, dtype) -> int:
    return 0


# -- forward --------------------------------------------------------------------------------------
def _mlp(cfg: ModelConfig, w: dict, x, first_expert, real=None):
    if "router" in w:
        return moe_mlp(x, w, cfg.num_experts_per_tok, cfg.norm_topk_prob, first_expert, real)
    if "w_gate_up" in w:
        return gated_mlp(x, w["w_gate_up"], w["w_down"])
    return linear(jax.nn.silu(linear(x, w["w_gate"])) * linear(x, w["w_up"]), w["w_down"])


def _layer(cfg: ModelConfig, attend, rope, h, w, kv, reduce=None, first_expert=None):
    """One decoder layer; under tensor parallelism `reduce` all-reduces the o projection's and
    the MLP's partial products (parallel.py), `first_expert` is this device's first expert."""
    eps = cfg.rms_norm_eps
    qkv = [w["wqkv"]] if "wqkv" in w else [w["wq"], w["wk"], w["wv"]]
    _, x = norm_into(h, None, w["attn_norm"], eps, qkv)
    o, kv = _attention(cfg, attend, rope, w, x, kv, jnp.int32(0))
    o, wo = o.astype(h.dtype), w["wo"]
    if isinstance(wo, Fp8Weight):  # one device: the W8A8 product goes unscaled into the add + norm
        delta = linear_parts(o, wo) if reduce is None else reduce(linear(o, wo))
    else:  # a batch-1 step's out projection a GEMM, not XLA's multiply + reduce (quant.row_dot)
        delta = row_dot(o, wo) if reduce is None else reduce(row_dot(o, wo))
    # an MoE layer's rows go to the (dense) router first: plain rows, never FP8 ones
    if "router" in w:
        into = [w["router"]]
    else:
        into = [w["w_gate_up"]] if "w_gate_up" in w else [w["w_gate"], w["w_up"]]
    h, x = norm_into(h, delta, w["mlp_norm"], eps, into)
    mlp = _mlp(cfg, w, x, first_expert, real_tokens(attend))
    return h + (mlp if reduce is None else reduce(mlp)).astype(h.dtype), kv


def _run_layers(cfg: ModelConfig, attend, rope, h, layers, kv, tp=None):
    """The layers, unrolled (they may differ in kind: dense or MoE MLP); `cfg` the device's
    own under tp. One jitted function, traced and lowered once per kind of layer, not once per
    layer (XLA inlines the calls: the compiled step is the same)."""
    kv = list(kv)
    reduce = tp.psum if tp is not None else None
    first = tp.first_expert(cfg) if tp is not None else None
    layer = jax.jit(lambda h, w, kv: _layer(cfg, attend, rope, h, w, kv, reduce, first))
    for i, w in enumerate(layers):
        h, kv[i] = layer(h, w, kv[i])
    return h, kv


def forward_step(params, cfg: ModelConfig, tokens, positions, caches, attend, step, tp=None):
    """-> (final hidden states [T, H] (normed), the per-layer KV pairs). tp: the layers run
    under one shard_map (parallel.run_sharded) on each device's heads and expert shards."""
    h = params["embed"][tokens]
    rope = rope_for(cfg, positions)
    if tp is None:
        h, kv = _run_layers(cfg, attend, rope, h, params["layers"], caches)
    else:
        from paxengine.parallel import run_sharded

        local = tp.local_config(cfg)
        h, kv = run_sharded(
            tp,
            lambda rope, h, layers, kv: _run_layers(local, attend, rope, h, layers, kv, tp),
            rope,
            h,
            params["layers"],
            caches,
        )
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), kv
