"""Weight layout helpers: checkpoint tensors -> the stacked parameter pytree the model scans over."""

from __future__ import annotations

import numpy as np

from paxengine.models.config import ModelConfig

# Per-layer parameter name -> whether it is a Linear weight stored [out, in] (transposed on load).
LAYER_LINEAR = {
    "wq": True,
    "wk": True,
    "wv": True,
    "wo": True,
    "w_gate": True,
    "w_up": True,
    "w_down": True,
    "bq": False,
    "bk": False,
    "bv": False,
    "attn_norm": False,
    "mlp_norm": False,
    "q_norm": False,
    "k_norm": False,
}


def layer_param_names(cfg: ModelConfig) -> list[str]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if cfg.attention_bias:
        names += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    return names


def param_shapes(cfg: ModelConfig) -> dict:
    h, i, d, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
    layer = {
        "attn_norm": (L, h),
        "wq": (L, h, qd),
        "wk": (L, h, kd),
        "wv": (L, h, kd),
        "wo": (L, qd, h),
        "mlp_norm": (L, h),
        "w_gate": (L, h, i),
        "w_up": (L, h, i),
        "w_down": (L, i, h),
        "bq": (L, qd),
        "bk": (L, kd),
        "bv": (L, kd),
        "q_norm": (L, d),
        "k_norm": (L, d),
    }
    shapes = {
        "embed": (cfg.vocab_size, h),
        "final_norm": (h,),
        "layers": {n: layer[n] for n in layer_param_names(cfg)},
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def check_shapes(params: dict, cfg: ModelConfig) -> None:
    want = param_shapes(cfg)
    for k, shape in want.items():
        if k == "layers":
            for n, s in shape.items():
                got = params["layers"].get(n)
                if got is None or tuple(got.shape) != tuple(s):
                    raise ValueError(
                        f"weight layers.{n}: expected shape {s}, got "
                        f"{None if got is None else tuple(got.shape)}"
                    )
        elif params.get(k) is None or tuple(params[k].shape) != tuple(shape):
            got = params.get(k)
            raise ValueError(
                f"weight {k}: expected shape {shape}, got "
                f"{None if got is None else tuple(got.shape)}"
            )


def stack_layers(per_layer: list[dict], cfg: ModelConfig) -> dict:
    """[{name: array}] * L -> {name: array[L, ...]}; Linear weights go from [out, in] to [in, out]."""
    out = {}
    for name in layer_param_names(cfg):
        arrs = []
        for i, layer in enumerate(per_layer):
            if name not in layer:
                raise ValueError(f"checkpoint is missing layer {i} weight '{name}'")
            a = np.asarray(layer[name])
            arrs.append(a.T if LAYER_LINEAR[name] else a)
        out[name] = np.stack(arrs)
    return out


# Per-layer fusions: one matmul instead of three (q, k, v) or two (gate, up) per layer.
FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def is_per_layer(params: dict) -> bool:
    """True for the per-layer layout (a list of layer dicts), False for stacked arrays."""
    return isinstance(params["layers"], (list, tuple))


def unstack_layers(params: dict) -> dict:
    """The stacked layout -> the per-layer one (`params["layers"]` a list of dicts), with the
    q/k/v and gate/up projections concatenated along their output axis (see FUSED).

    Consumes `params`: each stacked array leaves its dict as soon as it is split, so on a device
    the peak is the model plus one stacked tensor, not two models.
    """
    if is_per_layer(params):
        return params
    stacked = params["layers"]
    import jax.numpy as jnp

    num_layers = next(iter(stacked.values())).shape[0]
    per_layer: list[dict] = [{} for _ in range(num_layers)]
    for fused, parts in FUSED.items():
        if all(p in stacked for p in parts):
            arrs = [stacked.pop(p) for p in parts]
            for i in range(num_layers):
                per_layer[i][fused] = jnp.concatenate([a[i] for a in arrs], axis=-1)
            del arrs
    for name in list(stacked):
        arr = stacked.pop(name)
        for i in range(num_layers):
            per_layer[i][name] = arr[i]
        del arr
    return {**params, "layers": per_layer}


def flatten(params: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in params.items():
        if isinstance(v, dict):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        node = out
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out
