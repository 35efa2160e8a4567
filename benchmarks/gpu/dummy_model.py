"""A model directory with the preset's shapes and no weights, that every engine in the GPU run
loads: vLLM with load_format=dummy, paxengine as dummy:<preset> with its tokenizer, HF
transformers from its config (random init)."""

from __future__ import annotations

import json
from pathlib import Path


def write_config_dir(config: str, path: Path) -> Path:
    """A model directory holding only an HF config file (vLLM's load_format=dummy reads it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(Path(config).read_text())
    return path


def write_dummy_model_dir(preset: str, path: Path, tokenizer: str = "word") -> Path:
    """config.json with the preset's shapes (an HF LlamaForCausalLM/Qwen3 config, so vLLM can load
    it with load_format=dummy and our loader with dummy:<dir>/config.json) and a tokenizer of
    exactly vocab_size tokens: "word", the words "t0".."t{V-1}" that round-trip any id; or "bpe"
    (`byte_level_bpe`), one that spells any text, which grammars (structured output) need."""
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
    if tokenizer == "bpe" and not (path / "tokenizer.json").is_file():
        byte_level_bpe(cfg.vocab_size).save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "model_max_length": cfg.max_position_embeddings,
                    "chat_template": CHAT_TEMPLATE,
                }
            )
        )
    write_word_tokenizer(path, cfg.vocab_size, cfg.max_position_embeddings)
    return path


def stage_model_dir(spec: dict, parent: Path) -> Path:
    """The dummy model directory of a stage's spec (workloads.with_model): one of its "models"
    (config and word tokenizer), or the preset's."""
    if spec.get("model"):
        return write_model_dir(spec["config"], parent / f"dummy_{spec['model']}")
    return write_dummy_model_dir(spec["preset"], parent / "dummy_model")


def write_model_dir(config: str, path: Path) -> Path:
    """write_config_dir, and the word tokenizer of the config's vocabulary: a model of another
    architecture than the presets' (a stage's "models"), servable by both engines."""
    write_config_dir(config, path)
    raw = json.loads(Path(config).read_text())
    text = raw.get("text_config") or raw
    write_word_tokenizer(path, text["vocab_size"], text.get("max_position_embeddings", 4096))
    return path


def write_word_tokenizer(path: Path, vocab_size: int, max_len: int) -> None:
    """The words "t0".."t{V-1}", each one token: any id round-trips (unless one is there)."""
    if (path / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
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
                "model_max_length": max_len,
            }
        )
    )


# a plain template, so the chat route works on the dummy model (the soak sends chat requests)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_bpe(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens: <s> (id 0) and </s> (id 1), the
    256 bytes, then merges of random pairs of earlier tokens (short ones first, as trained merges
    grow), so every id decodes to some text and any text encodes: the shape of a real 128k
    vocabulary for grammar masks, without a model hub."""
    import random

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    # merges over printable ASCII (space is "Ġ" in byte-level form), as text-trained merges are
    tokens = [ch for ch in alphabet if ch == "Ġ" or (ch.isascii() and ch.isprintable())]
    merges = []
    while len(vocab) < vocab_size:
        # short parts more often: lengths spread like a trained vocabulary's (8 bytes on average, at most 12)
        a = tokens[min(len(tokens) - 1, int(rng.random() ** 3 * len(tokens)))]
        b = tokens[int(rng.random() ** 3 * len(tokens))]
        if a + b in vocab or len(a + b) > 12:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok
