"""Qwen3.5 and Qwen3.5-MoE under tensor parallelism on simulated CPU devices (tests/devices.py):
each device holds half of the Gated DeltaNet's key and value heads, their conv channels and
their slices of the state pools, half of the gated attention's heads and of the MLP's channels
or experts; the greedy tokens equal HF fp32's (which the one-device engine's equal:
test_qwen3_5.py), through 32-token chunked prefill and a second pass from the prefix cache."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from paxengine import LLM  # noqa: E402
from tests.test_qwen3_5 import (  # noqa: E402
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    _write_tokenizer,
    causal_lm,  # noqa: F401 (a fixture)
)
from tests.test_qwen3_5_moe import checkpoint, target  # noqa: E402, F401 (fixtures)

# One 32-token bucket: the 70- and 150-token prompts prefill in chunks, the state carried
# between them.
CHUNKED = dict(ENGINE, max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[4])
# n-gram speculation on prompts that repeat (test_qwen3_5_spec's): drafts accepted and rejected
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
SPEC_PROMPTS = [[5, 9, 13, 200, 3] * 4, [7, 8, 9, 10, 11, 12] * 3 + [7, 8]]
SPEC_TOKENS = 40


@pytest.fixture(scope="module")
def tp_runs(causal_lm, checkpoint, tmp_path_factory):  # noqa: F811
    """One worker of 2 CPU devices: the dense model under TP 2 (each prompt twice: the second
    pass restores the cached prefixes' states), on the jnp oracle (the CPU default) and through
    the GPU's Pallas kernels in interpret mode; FP8 weights under TP 2 (the q|k|v channels
    reordered with their scales; the one-device FP8 engine they are compared with runs in this
    process: in the worker it cost a second device placement's step and samplers, compiled
    afresh); Qwen3.5-MoE under TP 2 with each expert's channels split and with expert
    parallelism (4 whole experts a device)."""
    from devices import run_worker

    cache = str(tmp_path_factory.mktemp("qwen35_tp") / "jax")
    engine = {k: v for k, v in CHUNKED.items() if k != "show_progress"}
    engine.update(compilation_cache_dir=cache, tensor_parallel_size=2)
    dense, moe = str(causal_lm[0]), str(checkpoint[0])
    runs = [
        {"engine": dict(engine, model=dense), "passes": 2},
        {
            "engine": dict(engine, model=dense),
            "passes": 2,
            "env": {"PAXENGINE_KERNEL_GDN": "interpret"},
        },
        {"engine": dict(engine, model=dense, quantization="fp8")},
        {"engine": dict(engine, model=moe)},
        {"engine": dict(engine, model=moe, enable_expert_parallel=True)},
    ]
    for r in runs:
        r.update(prompts=PROMPTS, max_tokens=MAX_TOKENS)
    spec = dict(engine, model=dense, speculative_config=NGRAM, max_num_batched_tokens=64)
    spec.update(token_buckets=[32, 64])  # a verify row of 4 beside a 32-token chunk
    runs.append({"engine": spec, "prompts": SPEC_PROMPTS, "max_tokens": SPEC_TOKENS})
    return run_worker("tp_worker.py", [json.dumps(runs)], 2)


def test_dense_tp2_equals_hf_through_chunks_and_the_prefix_cache(causal_lm, tp_runs):  # noqa: F811
    _, want = causal_lm
    run, kernels = tp_runs[:2]
    assert run["passes"] == [want, want] and run["prefix_hits"] == 64 + 144
    assert kernels["passes"] == [want, want] and kernels["prefix_hits"] == 64 + 144
    # layer 0 is a DeltaNet: its fused q|k|v|z split by output channel, out by input, its
    # pools by channel / value head (4 value heads of 16 x 16: 2 a device)
    assert run["qkv"]["spec"] == [None, "tp"] and run["wo"]["spec"] == ["tp", None]
    conv, ssm = run["state"]["conv"], run["state"]["ssm"]
    assert conv["spec"] == [None, "tp"] and conv["shard_shape"][1] == conv["shape"][1] // 2
    assert ssm["spec"] == [None, "tp"] and ssm["shard_shape"][1:] == [2, 16, 16]
    assert run["cache"]["spec"] == [None, "tp"] and run["cache"]["shard_shape"][1] == 1


def test_fp8_weights_under_tp2_generate_what_one_device_does(causal_lm, tp_runs):  # noqa: F811
    """The worker's engine configuration on one device, in this process."""
    from paxengine import SamplingParams

    path, _ = causal_lm
    llm = LLM(model=str(path), quantization="fp8", **CHUNKED)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    tp2 = tp_runs[2]
    assert tp2["tokens"] == one and tp2["qkv"]["spec"] == ["tp", None]  # [out, in]


def test_moe_tp2_and_expert_parallel_equal_hf(checkpoint, tp_runs):  # noqa: F811
    _, want = checkpoint
    split, ep = tp_runs[3:5]
    assert split["tokens"] == want and ep["tokens"] == want
    assert split["experts"]["e_gate_up"]["spec"] == [None, None, "tp"]
    assert ep["experts"]["e_gate_up"]["spec"] == ["tp", None, None]


def test_heads_that_do_not_divide_are_refused_by_number(causal_lm):  # noqa: F811
    """TP 4: the 4 attention heads and 2 KV heads would split, the DeltaNet's 2 key heads not
    (refused before any device is needed)."""
    path, _ = causal_lm
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* key heads \(2\)"):
        LLM(model=str(path), tensor_parallel_size=4, **ENGINE)


def test_ngram_speculation_under_tp2_generates_what_one_device_does(causal_lm, tp_runs):  # noqa: F811
    """Verify steps under TP 2 (each device its heads' per-position states, rolled back on a
    rejected draft) give the one-device plain engine's tokens (run in this process)."""
    from paxengine import SamplingParams

    path, _ = causal_lm
    llm = LLM(model=str(path), **dict(CHUNKED, max_num_batched_tokens=64, token_buckets=[32, 64]))
    params = SamplingParams(temperature=0, max_tokens=SPEC_TOKENS, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, params, use_tqdm=False)]
    run = tp_runs[5]
    assert run["tokens"] == one
    drafted, accepted = (
        run["spec"][k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    )
    assert 0 < accepted < drafted, run["spec"]


def test_mtp_under_tp_is_refused_by_name(causal_lm):  # noqa: F811
    path, _ = causal_lm
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="method 'mtp' with tensor_parallel_size > 1"):
        LLM(model=str(path), tensor_parallel_size=2, speculative_config=spec, **ENGINE)


def test_the_server_serves_it_over_two_devices(causal_lm, tp_runs):  # noqa: F811
    """`paxengine serve DIR -tp 2 --speculative-config ngram` as a user starts it, on 2
    simulated CPU devices: a completion's tokens equal HF's (and so the one-device server's);
    a prompt that repeats gets the tokens the worker's TP 2 engine gave it, drafts proposed."""
    import httpx
    from served import greedy_token_ids, served

    path, want = causal_lm
    _write_tokenizer(path)
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    args += ["--served-model-name", "q35", "-tp", "2", "--speculative-config", json.dumps(NGRAM)]
    with served(str(path), *args, devices=2) as base:
        assert greedy_token_ids(base, "q35", PROMPTS[2], MAX_TOKENS) == want[2]
        got = greedy_token_ids(base, "q35", SPEC_PROMPTS[1], SPEC_TOKENS)
        assert got == tp_runs[5]["tokens"][1]
        lines = httpx.get(base + "/metrics").text.splitlines()
        name = "paxengine:spec_decode_num_draft_tokens_total"
        drafted = [ln for ln in lines if ln.startswith(name)]
        assert drafted and float(drafted[0].split()[-1]) > 0, drafted
