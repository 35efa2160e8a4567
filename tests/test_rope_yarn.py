"""YaRN RoPE scaling and --hf-overrides' merge, against transformers' own numbers: the inverse
frequencies and attention factor of `ROPE_INIT_FUNCTIONS["yarn"]`, the cos / sin tables of the
models' rotary embeddings (full rotary: Llama; partial: Qwen3.5's quarter of each head, its
mrope keys on text positions), the configs of every family with RoPE, the rope types paxengine
lacks refused by name, and the converted-weights cache keyed by the overrides. The greedy
parity of whole models: tests/test_yarn_parity.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from paxengine.models import llama, qwen3_moe, registry, weights_cache  # noqa: E402
from paxengine.models.config import apply_hf_overrides, from_hf_config  # noqa: E402

LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
)  # fmt: skip
QWEN3_5 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=128,
)  # fmt: skip
YARN = [
    dict(factor=4.0, original_max_position_embeddings=32),
    # another ramp: its own betas, not truncated, a larger theta
    dict(
        factor=8.0,
        original_max_position_embeddings=16,
        beta_fast=16,
        beta_slow=2,
        truncate=False,
        rope_theta=1e6,
    ),  # fmt: skip
    dict(factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5),
    dict(factor=2.0, original_max_position_embeddings=32, attention_factor=1.5),
    dict(factor=None, original_max_position_embeddings=32),  # max_position_embeddings / original
    dict(factor=4.0),  # original: max_position_embeddings
]
POSITIONS = np.array([0, 1, 7, 31, 32, 33, 100, 127, 500])


def _hf_tables(rotary, positions):
    x = torch.zeros(1, len(positions), 4, dtype=torch.float32)
    cos, sin = rotary(x, torch.tensor([positions.tolist()]))
    return cos[0].numpy(), sin[0].numpy()


@pytest.mark.parametrize("yarn", YARN)
def test_llama_yarn_equals_transformers(yarn):
    hf = transformers.LlamaConfig(**LLAMA, rope_parameters={"rope_type": "yarn", **yarn})
    cfg = from_hf_config(hf.to_dict())
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    np.testing.assert_array_equal(np.asarray(llama.rope_inv_freq(cfg)), inv.numpy())
    assert llama.rope_attention_factor(cfg) == factor
    assert factor != 1.0  # the factor is exercised, not 1.0 by default
    cos, sin = llama.rope_for(cfg, jnp.asarray(POSITIONS))
    want_cos, want_sin = _hf_tables(
        transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf), POSITIONS
    )
    np.testing.assert_allclose(np.asarray(cos), want_cos, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin), want_sin, rtol=0, atol=2e-6)


@pytest.mark.parametrize("yarn", YARN[:3])
def test_qwen3_5_partial_rotary_yarn_equals_transformers(yarn):
    """YaRN's dim is the rotary one (a quarter of head_dim 32: 8); the recipe's
    mrope_interleaved / mrope_section are taken (text positions: plain RoPE)."""
    rope = {"rope_type": "yarn", "partial_rotary_factor": 0.25, "mrope_interleaved": True,
            "mrope_section": [2, 1, 1], **yarn}  # fmt: skip
    hf = transformers.Qwen3_5TextConfig(**QWEN3_5, rope_parameters=rope)
    cfg = registry.config_from_hf(hf.to_dict())
    assert cfg.family == "qwen3_5" and llama.rotary_dim(cfg) == 8
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert inv.shape == (4,)
    np.testing.assert_array_equal(np.asarray(llama.rope_inv_freq(cfg)), inv.numpy())
    rotary = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(hf)
    want_cos, want_sin = _hf_tables(rotary, POSITIONS)
    cos, sin = llama.rope_for(cfg, jnp.asarray(POSITIONS))  # what qwen3_5 calls
    assert cos.shape == want_cos.shape == (len(POSITIONS), 8)
    np.testing.assert_allclose(np.asarray(cos), want_cos, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin), want_sin, rtol=0, atol=2e-6)


def test_every_family_with_rope_reads_yarn_alike():
    """rope_scaling (transformers 4's name, theta at the top level) or rope_parameters (5's):
    the same scaling in the Llama layout, Qwen3-MoE and Mixtral."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    v4 = dict(LLAMA, architectures=["Qwen3ForCausalLM"], rope_scaling=yarn, rope_theta=1e6)
    v5 = dict(
        LLAMA, architectures=["Qwen3ForCausalLM"], rope_parameters={**yarn, "rope_theta": 1e6}
    )
    want = from_hf_config(v4)
    assert want.rope_theta == 1e6 and want.rope_scaling_dict["attention_factor"] > 1
    assert from_hf_config(v5).rope_scaling == want.rope_scaling
    moe = dict(v5, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2)
    assert qwen3_moe.from_hf_config(moe).rope_scaling == want.rope_scaling
    mixtral = dict(v4, architectures=["MixtralForCausalLM"], num_local_experts=4,
                   num_experts_per_tok=2)  # fmt: skip
    assert registry.config_from_hf(mixtral).rope_scaling == want.rope_scaling
    # vLLM's derived length: original x factor (here past max_position_embeddings' 128)
    assert (
        want.derived_max_model_len == 128
        and from_hf_config(dict(v4, rope_scaling=None)).derived_max_model_len == 128
    )
    assert (
        from_hf_config(dict(v4, rope_scaling={**yarn, "factor": 8.0})).derived_max_model_len == 256
    )


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "linear"])
def test_a_rope_type_paxengine_lacks_is_refused_by_name(kind):
    rope = {"rope_type": kind, "factor": 2.0}
    configs = [
        dict(LLAMA, architectures=["LlamaForCausalLM"], rope_scaling=rope),
        dict(
            LLAMA,
            architectures=["Qwen3MoeForCausalLM"],
            rope_parameters=rope,
            num_experts=4,
            num_experts_per_tok=2,
        ),  # fmt: skip
        {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": dict(QWEN3_5, rope_parameters=rope),
        },  # fmt: skip
    ]
    for raw in configs:
        with pytest.raises(ValueError, match=f"unsupported rope_type '{kind}'"):
            registry.config_from_hf(raw)


def test_hf_overrides_merge_as_vllm_sets_them():
    qwen = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"max_position_embeddings": 262144, "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}},
    }  # fmt: skip
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
    got = apply_hf_overrides(qwen, {"text_config": {"rope_parameters": yarn}})
    assert got["text_config"]["rope_parameters"] == {
        **qwen["text_config"]["rope_parameters"], **yarn
    }  # fmt: skip
    assert got["text_config"]["max_position_embeddings"] == 262144  # the rest as it was
    assert qwen["text_config"]["rope_parameters"]["rope_type"] == "default"  # not changed
    assert apply_hf_overrides({"a": {"b": 1}}, {"a": 2, "c": [1]}) == {"a": 2, "c": [1]}
    # one attribute under two names (transformers 5): the override reaches the one in use
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    raw = dict(LLAMA, architectures=["LlamaForCausalLM"], rope_scaling=llama3)
    got = from_hf_config(apply_hf_overrides(raw, {"rope_parameters": dict(yarn, factor=2.0)}))
    assert got.rope_scaling_dict["rope_type"] == "yarn" and got.rope_scaling_dict["factor"] == 2.0
    raw = dict(LLAMA, architectures=["LlamaForCausalLM"], rope_scaling=None, rope_theta=5e5)
    got = from_hf_config(apply_hf_overrides(raw, {"rope_scaling": yarn}))
    assert got.rope_scaling_dict["rope_type"] == "yarn" and got.rope_theta == 5e5


def test_the_weights_cache_entry_is_keyed_by_the_overrides(tmp_path):
    """An entry stores the config built with the overrides: another override (or none) must
    not read it back; no override keeps the key it always had."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    key = lambda o: weights_cache.entry(tmp_path, "float32", str(tmp_path), None, o)  # noqa: E731
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert key(None) == key({}) == weights_cache.entry(tmp_path, "float32", str(tmp_path))
    assert (
        len({key(None), key(yarn), key({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})})
        == 3
    )
    assert key(yarn) == key({"rope_scaling": {"factor": 4.0, "rope_type": "yarn"}})  # key order
