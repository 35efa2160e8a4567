"""EngineCore refuses a setting it cannot run by name, before it loads anything: the model
named here does not exist, so each error below can only come from the config check."""

import pytest

from paxengine.engine import EngineCore

MISSING = "/nonexistent/model-dir"


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(dtype="int8"), "dtype must be auto, float32, bfloat16 or float16"),
        (dict(dtype="fp8"), "dtype must be auto"),
        (dict(quantization="awq"), "quantization 'awq' is not supported"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be auto"),
        (
            dict(max_num_batched_tokens=8, max_num_seqs=16),
            r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)",
        ),
        (dict(decode_step_token_budget=0), r"decode_step_token_budget \(0\) must be in \[1"),
        (
            dict(max_num_batched_tokens=64, max_num_seqs=4, decode_step_token_budget=65),
            r"decode_step_token_budget \(65\) must be in \[1, max_num_batched_tokens \(64\)\]",
        ),
        (dict(backlog_step_token_budget=64), "backlog_step_token_budget .* needs decode_step"),
        (
            dict(decode_step_token_budget=32, backlog_step_token_budget=16),
            r"backlog_step_token_budget \(16\) .* in \[decode_step_token_budget \(32\)",
        ),
        (dict(scheduling_policy="lottery"), "lottery"),
        (dict(data_parallel_size=2), "runs one replica"),
        (dict(block_size=-16), "block_size must be a positive number of tokens"),
    ],
)
def test_bad_settings_are_named_before_the_model_loads(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineCore(model=MISSING, show_progress=False, **settings)


def test_a_good_config_gets_as_far_as_the_model():
    """The same path with valid settings fails on the model, not on a setting."""
    with pytest.raises(Exception) as e:
        EngineCore(model=MISSING, show_progress=False, kv_cache_dtype="fp8", quantization="fp8")
    assert "must be" not in str(e.value) and "not supported" not in str(e.value)


def test_block_size_defaults_to_the_kv_caches_page():
    """fp8 caches take 64-token pages (V stored [D, 64]: kernels_pallas.layout.v_transposed),
    others vLLM's 16; a block_size given is kept."""
    from paxengine.config import EngineConfig
    from paxengine.engine_setup import check_config

    assert check_config(EngineConfig(kv_cache_dtype="fp8"), on_gpu=True).block_size == 64
    assert check_config(EngineConfig(), on_gpu=True).block_size == 16
    assert check_config(EngineConfig(kv_cache_dtype="bfloat16"), on_gpu=False).block_size == 16
    fp8_16 = EngineConfig(kv_cache_dtype="fp8", block_size=16)
    assert check_config(fp8_16, on_gpu=True).block_size == 16
