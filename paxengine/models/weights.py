"""Weight layout helpers: checkpoint tensors -> the stacked parameter pytree the model scans over."""

from __future__ import annotations

import numpy as np

from paxengine.models.config import ModelConfig
from paxengine.models.quant import Fp8Weight, array_module, concat_out

# A Llama-layout checkpoint's layer tensors (after "model.layers.{i}.") -> our names
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}

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
    """Every weight the config needs, with its shape (an Fp8Weight's `.shape` is its dense
    [..., in, out] one); names the config does not know (e.g. a per-layer "kv_scale") pass."""
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


def check_per_layer_shapes(params: dict, want: dict) -> None:
    """check_shapes for a family of its own layout: `want` its param_shapes, whose "layers" is
    a list of per-layer dicts (as the params')."""
    for k, shape in want.items():
        if k == "layers":
            for i, (got, need) in enumerate(zip(params["layers"], shape)):
                for n, s in need.items():
                    g = got.get(n)
                    if g is None or tuple(g.shape) != tuple(s):
                        raise ValueError(
                            f"weight layers.{i}.{n}: expected shape {s}, got "
                            f"{None if g is None else tuple(g.shape)}"
                        )
        elif params.get(k) is None or tuple(params[k].shape) != tuple(shape):
            raise ValueError(f"weight {k}: expected shape {shape}")


def random_per_layer(shapes: dict, dtype, seed: int, fixed: dict | None = None) -> dict:
    """Random weights of a family's per-layer param_shapes (`dummy:/path/config.json`): norms
    ones, a name in `fixed` its function of the shape, the rest N(0, 0.02) in `dtype`."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(seed)
    count = iter(range(1 << 30))
    fixed = fixed or {}

    def make(name, shape):
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        if name in fixed:
            return fixed[name](shape)
        r = jax.random.normal(jax.random.fold_in(key, next(count)), shape, dtype)
        return (r * 0.02).astype(dtype)

    params = {k: make(k, s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = [{n: make(n, s) for n, s in d.items()} for d in shapes["layers"]]
    return params


def stack_layers(per_layer: list[dict], cfg: ModelConfig) -> dict:
    """[{name: array}] * L -> {name: array[L, ...]}; Linear weights go from [out, in] to [in, out].

    An Fp8Weight entry (a pre-quantized checkpoint's projection) keeps its values [out, in]: its
    values and scales are stacked along a new leading axis. One name, one type across layers."""
    out = {}
    for name in layer_param_names(cfg):
        arrs = []
        for i, layer in enumerate(per_layer):
            if name not in layer:
                raise ValueError(f"checkpoint is missing layer {i} weight '{name}'")
            a = layer[name]
            if not isinstance(a, Fp8Weight):
                a = np.asarray(a)
                a = a.T if LAYER_LINEAR[name] else a
            arrs.append(a)
        kinds = {isinstance(a, Fp8Weight) for a in arrs}
        if kinds == {True, False}:
            raise ValueError(f"layer weight '{name}' is FP8 in some layers and dense in others")
        if kinds == {True}:
            out[name] = Fp8Weight(
                np.stack([np.asarray(a.values) for a in arrs]),
                np.stack([np.asarray(a.scales, np.float32) for a in arrs]),
            )
        else:
            out[name] = np.stack(arrs)
    return out


# Per-layer fusions: one matmul instead of three (q, k, v) or two (gate, up) per layer.
FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def is_per_layer(params: dict) -> bool:
    """True for the per-layer layout (a list of layer dicts), False for stacked arrays."""
    return isinstance(params["layers"], (list, tuple))


def _layer_slice(w, i: int):
    """Layer i of a stacked array or Fp8Weight (values [L, out, in], scales [L, out])."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.values[i], w.scales[i])
    return w[i]


def _fuse(slices: list, fp8: bool, shards: int):
    """Parts concatenated along their output channels; with shards > 1, shard by shard
    ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]) so a tensor-parallel split of the fused weight into
    `shards` contiguous blocks gives each device its own q, k and v (parallel.py)."""
    if shards > 1:
        blocks = [_split_out(a, shards, fp8) for a in slices]
        slices = [b[s] for s in range(shards) for b in blocks]
    return concat_out(slices) if fp8 else array_module(slices[0]).concatenate(slices, axis=-1)


def _split_out(a, n: int, fp8: bool) -> list:
    if fp8:
        xp = array_module(a.values)
        return [
            Fp8Weight(v, s)
            for v, s in zip(xp.split(a.values, n, axis=-2), xp.split(a.scales, n, axis=-1))
        ]
    return array_module(a).split(a, n, axis=-1)


def unstack_layers(params: dict, shards: int = 1) -> dict:
    """The stacked layout -> the per-layer one (`params["layers"]` a list of dicts), with the
    q/k/v and gate/up projections concatenated along their output axis (see FUSED; Fp8Weight
    parts with `concat_out`, their scales kept per slice), shard by shard for tensor
    parallelism (`_fuse`).

    Consumes `params`: each stacked array leaves its dict as soon as it is split, so on a device
    the peak is the model plus one stacked tensor, not two models. Names other than the model's
    weights (e.g. a stacked "kv_scale" [L, 2]) are split per layer like any array.
    """
    if is_per_layer(params):
        return params
    stacked = params["layers"]

    num_layers = next(iter(stacked.values())).shape[0]
    per_layer: list[dict] = [{} for _ in range(num_layers)]
    for fused, parts in FUSED.items():
        if not all(p in stacked for p in parts):
            continue
        kinds = {isinstance(stacked[p], Fp8Weight) for p in parts}
        if len(kinds) != 1:
            continue  # FP8 and dense parts do not fuse: they stay separate projections
        arrs = [stacked.pop(p) for p in parts]
        for i in range(num_layers):
            slices = [_layer_slice(a, i) for a in arrs]
            per_layer[i][fused] = _fuse(slices, kinds == {True}, shards)
        del arrs, slices
    for name in list(stacked):
        arr = stacked.pop(name)
        for i in range(num_layers):
            per_layer[i][name] = _layer_slice(arr, i)
        del arr
    return {**params, "layers": per_layer}


def fuse_layers(params: dict, table: dict, shards: int = 1, whole: tuple = ()) -> dict:
    """Per-layer params with each layer's projections of `table` ({fused: parts}) concatenated
    along their output channels where the layer has all the parts, of one kind (dense or
    Fp8Weight): one GEMM reads them where several would each launch (and, at decode sizes,
    each pay a launch and a partial wave). Consumes the parts. shards: fused shard by shard
    for tensor parallelism (`_fuse`), except the names in `whole` (experts kept whole on their
    device: expert parallelism)."""
    for layer in params["layers"]:
        for fused, parts in table.items():
            if fused in layer or not all(p in layer for p in parts):
                continue
            kinds = {isinstance(layer[p], Fp8Weight) for p in parts}
            if len(kinds) == 1:
                n = 1 if fused in whole else shards
                layer[fused] = _fuse([layer.pop(p) for p in parts], kinds == {True}, n)
    return params


def keys_by_layer(keys, prefixes=("model.",)) -> tuple[list, dict]:
    """(the keys of no layer, {layer index: [(key, its name after "layers.{i}.")]}), each in
    the checkpoint's order: a loader that finishes a layer before reading the next holds one
    layer at a time. A key's name is read past the first of `prefixes` it starts with."""
    top: list = []
    per: dict = {}
    for key in keys:
        name = next((key[len(p) :] for p in prefixes if key.startswith(p)), key)
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            per.setdefault(int(idx), []).append((key, rest))
        else:
            top.append(key)
    return top, per


def read_outer(reader, key: str, name: str, cfg, params: dict) -> None:
    """The weights outside the layers, by their HF names (`name`: past "model."): embed,
    final_norm and, unless tied, lm_head ([H, V]) into params; other names are left alone.
    reader: fp8_checkpoint.CheckpointReader."""
    if name == "embed_tokens.weight":
        params["embed"] = reader.weight(key, False)
    elif name == "norm.weight":
        params["final_norm"] = reader.weight(key, False)
    elif key == "lm_head.weight" and not cfg.tie_word_embeddings:
        params["lm_head"] = reader.weight(key, False).T


def take_layers(layers, on_layer):
    """The (i, layer) pairs of an iterator handed to on_layer(i, layer) one by one as they come
    (-> None: no layer kept here), or without on_layer all of them, a list."""
    if on_layer is None:
        return [layer for _, layer in layers]
    for i, layer in layers:
        on_layer(i, layer)
        del layer  # while the next one is read
    return None


def flatten(params: dict, prefix: str = "") -> dict:
    """Nested dicts (and per-layer lists: "layers.3.wq") -> {dotted name: leaf}."""
    flat = {}
    items = enumerate(params) if isinstance(params, list) else params.items()
    for k, v in items:
        if isinstance(v, (dict, list)):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def unflatten(flat: dict) -> dict:
    """flatten's inverse: a level whose names are all numbers is a list again."""
    out: dict = {}
    for k, v in flat.items():
        node = out
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return _lists(out)


def _lists(node):
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node):
        return [node[str(i)] for i in range(len(node))]
    return node
