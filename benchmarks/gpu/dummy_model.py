"""A model directory with the preset's shapes and no weights, that every engine in the GPU run
loads: vLLM with load_format=dummy, paxengine as dummy:<preset> with its tokenizer, HF
transformers from its config (random init)."""

from __future__ import annotations

import json
from pathlib import Path


def write_dummy_model_dir(preset: str, path: Path) -> Path:
    """config.json with the preset's shapes (an HF LlamaForCausalLM/Qwen3 config, so vLLM can load
    it with load_format=dummy and our loader with dummy:<dir>/config.json) and a word-level
    tokenizer of exactly vocab_size tokens "t0".."t{V-1}" that round-trips any id."""
    from paxengine.models.config import PRESETS

    cfg = PRESETS[preset]
    path.mkdir(parents=True, exist_ok=True)
    arch = {
        "llama": "LlamaForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }[cfg.arch]
    hf = {
        "architectures": [arch],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(cfg.rope_scaling)
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "t0",
                    "eos_token": "t1",
                    "model_max_length": cfg.max_position_embeddings,
                }
            )
        )
    return path
