"""GGUF checkpoints: metadata -> ModelConfig, tensors dequantized with the `gguf` package and put
back into HF layout (llama.cpp permutes the Q/K rows of Llama models for its interleaved rope)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from paxengine.models.config import ModelConfig
from paxengine.models.weights import stack_layers

GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"}

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
}
_BIAS_NAMES = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}


def read_fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # odd metadata types we do not use
            continue
    return out


def config_from_fields(fields: dict, tensor_names: set[str]) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: paxengine supports {sorted(GGUF_ARCHS)}"
        )

    def f(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    vocab = f("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    return ModelConfig(
        arch=GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_layers=int(f("block_count")),
        num_heads=heads,
        num_kv_heads=int(f("attention.head_count_kv", heads)),
        head_dim=int(f("attention.key_length", hidden // heads)),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        max_position_embeddings=int(f("context_length", 4096)),
        name=str(fields.get("general.name", "")),
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows ([out, in] or bias [out])."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize as gg_dequant

    name = tensor.tensor_type.name
    if name not in SUPPORTED_QUANTS:
        raise ValueError(
            f"GGUF tensor {tensor.name}: quantization {name} is not supported "
            f"(supported: {sorted(SUPPORTED_QUANTS)})"
        )
    return np.asarray(gg_dequant(tensor.data, tensor.tensor_type), dtype=np.float32)


def load_gguf(path: Path, progress: bool = True):
    """-> (ModelConfig, params as float32 numpy arrays, metadata fields)."""
    import gguf
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    fields = read_fields(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_fields(fields, set(tensors))
    permute = cfg.arch in ("llama", "mistral")
    per_layer = [dict() for _ in range(cfg.num_layers)]
    params: dict = {}
    for name, t in tqdm(
        tensors.items(), desc=f"dequantizing {path.name}", disable=not progress, unit="tensor"
    ):
        w = dequantize(t)
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if m:
            i, base, kind = int(m[1]), m[2], m[3]
            if permute and base in ("attn_q", "attn_k"):
                w = unpermute_qk(w, cfg.num_heads if base == "attn_q" else cfg.num_kv_heads)
            key = _LAYER_NAMES.get(base) if kind == "weight" else _BIAS_NAMES.get(base)
            if key is None:
                raise ValueError(f"{path}: unexpected GGUF tensor {name}")
            per_layer[i][key] = w
        elif name == "token_embd.weight":
            params["embed"] = w
        elif name == "output_norm.weight":
            params["final_norm"] = w
        elif name == "output.weight":
            params["lm_head"] = w.T
        elif name == "rope_freqs.weight":
            continue  # llama3 rope factors; we compute them from the config
        else:
            raise ValueError(f"{path}: unexpected GGUF tensor {name}")
    params["layers"] = stack_layers(per_layer, cfg)
    return cfg, params, fields
