"""The settings an engine fills in per device class (paxengine/device_defaults.py): what the
benchmarks measured best, so the benchmarks (which pass no tuning flags) and a user who types
the README's command run the same configuration."""

import pytest

from paxengine.config import AUTO, EngineConfig
from paxengine.device_defaults import resolve


def test_gpu_defaults_are_the_measured_configuration():
    cfg = resolve(EngineConfig(), on_gpu=True)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (512, 8192)
    assert cfg.token_buckets == [1, 16, 64, 256, 320, 384, 512, 1024, 2048, 4096, 8192]
    assert cfg.seq_buckets == [8, 64, 256, 512]
    # offline (LLM): full steps; serving: the measured budgets
    assert (cfg.decode_step_token_budget, cfg.backlog_step_token_budget) == (None, None)
    served = resolve(
        EngineConfig(decode_step_token_budget=AUTO, backlog_step_token_budget=AUTO), True
    )
    assert (served.decode_step_token_budget, served.backlog_step_token_budget) == (512, 4096)


def test_cpu_defaults():
    cfg = resolve(
        EngineConfig(decode_step_token_budget=AUTO, backlog_step_token_budget=AUTO), False
    )
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (64, 2048)
    assert cfg.token_buckets == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert cfg.seq_buckets == [4, 16, 64]
    assert (cfg.decode_step_token_budget, cfg.backlog_step_token_budget) == (16, None)


def test_given_settings_win_and_budgets_fit_the_step():
    cfg = resolve(
        EngineConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            decode_step_token_budget=AUTO,
            backlog_step_token_budget=AUTO,
        ),
        on_gpu=True,
    )
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (16, 256)
    assert cfg.token_buckets == [1, 16, 64, 256] and cfg.seq_buckets == [8, 16]
    assert (cfg.decode_step_token_budget, cfg.backlog_step_token_budget) == (256, 256)
    cfg = resolve(EngineConfig(decode_step_token_budget=100, backlog_step_token_budget=AUTO), True)
    assert (cfg.decode_step_token_budget, cfg.backlog_step_token_budget) == (100, 4096)
    cfg = resolve(EngineConfig(max_num_seqs=128), on_gpu=False)
    assert cfg.max_num_batched_tokens == 2048 and cfg.seq_buckets == [4, 16, 64, 128]


def test_the_server_defaults_to_the_device_budgets_and_flags_win():
    from serving.cli import parse

    ecfg, _ = parse(["--config", "configs/smollm2-135m.yaml"])
    assert ecfg.decode_step_token_budget == ecfg.backlog_step_token_budget == AUTO
    cfg = resolve(ecfg, on_gpu=False)
    assert (cfg.max_num_batched_tokens, cfg.decode_step_token_budget) == (512, 16)
    ecfg, _ = parse(["--decode-step-token-budget", "512", "--backlog-step-token-budget", "1024"])
    assert (ecfg.decode_step_token_budget, ecfg.backlog_step_token_budget) == (512, 1024)


def test_a_budget_that_is_not_a_number_is_named():
    from paxengine import LLM

    with pytest.raises(ValueError, match="decode_step_token_budget must be a number"):
        LLM(model="dummy:tiny", decode_step_token_budget="small", show_progress=False)
