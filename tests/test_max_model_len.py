"""max_model_len as vLLM takes it: 128k / 128K forms, and auto (or -1): the model's whole
length, cut to what the KV pool holds."""

import json

import pytest

from paxengine import LLM, SamplingParams
from paxengine.config import max_model_len_option, token_count
from paxengine.models.config import PRESETS

ENGINE = dict(
    model="dummy:tiny",
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=[16, 64],
    seq_buckets=[4],
    structured_outputs=False,
    store_executables=False,
    show_progress=False,
)

LONG = {  # a tiny Llama of 16,384 positions
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16_384,
}


def test_token_counts_in_vllms_forms():
    assert [token_count(v, "x") for v in ("4096", "32k", "25.6k", "32K", "1M", 77, None)] == [
        4096,
        32_000,
        25_600,
        32_768,
        1 << 20,
        77,
        None,
    ]
    assert [max_model_len_option(v) for v in ("auto", "AUTO", -1, "-1", "8k")] == [
        "auto",
        "auto",
        "auto",
        "auto",
        8000,
    ]
    for bad in ("1.5K", "lots", "0", -2):
        with pytest.raises(ValueError, match="max_model_len"):
            max_model_len_option(bad)


def test_auto_is_the_models_length_or_what_the_pool_holds():
    model_len = PRESETS["tiny"].max_position_embeddings
    held = LLM(**ENGINE, max_model_len="auto", num_kv_blocks=8, block_size=16)
    assert held.engine.max_model_len == 8 * 16 < model_len  # the pool's 128 tokens
    (out,) = held.generate([list(range(1, 100))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="max_model_len"):  # a prompt past it: a clear error
        held.generate([list(range(1, 200))], SamplingParams(max_tokens=4), use_tqdm=False)
    # a YAML's strings: the same parser
    small = LLM(**dict(ENGINE, max_num_batched_tokens="64"), max_model_len="64", num_kv_blocks=64)
    assert small.engine.max_model_len == 64 and small.engine.config.max_num_batched_tokens == 64


def test_auto_takes_a_long_models_whole_length(tmp_path):
    """The default stops at 8,192 tokens; auto (-1) serves all 16,384 of this model's."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LONG))
    engine = dict(ENGINE, model=f"dummy:{config}", num_kv_blocks=1024, block_size=16)
    assert LLM(**engine, max_model_len=-1).engine.max_model_len == 16_384
    model = engine.pop("model")  # vLLM's LLM("path"): the model as the first argument
    assert LLM(model, **engine).engine.max_model_len == 8_192


def test_past_the_models_length_is_refused_unless_allowed(tmp_path, monkeypatch):
    """vLLM's rule: a max_model_len past the model's is an error naming the way round it;
    with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 it is served (RoPE takes any position)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(LONG, max_position_embeddings=64)))
    engine = dict(ENGINE, model=f"dummy:{config}", num_kv_blocks=64, block_size=16)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match="past the model's 64.*VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        LLM(**engine, max_model_len=128)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    long = LLM(**engine, max_model_len=128)
    assert long.engine.max_model_len == 128
    (out,) = long.generate([list(range(1, 90))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4  # a prompt past position 64
