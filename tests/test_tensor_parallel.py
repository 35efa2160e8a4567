"""Tensor parallelism (issue #19) on simulated CPU devices: the model split over N devices
generates the same greedy tokens as on one, with its weights and KV cache really split."""

import json
import os

import pytest
from devices import SMALL, run_worker, truncated_smollm2

from paxengine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fib(n):", "word " * 30]  # the last in two chunks
# One token bucket: every step (prefill chunks and decodes) runs in the 32-token forward, one
# compile less per engine layout in the worker; what is split over the devices does not depend
# on the bucket.
ENGINE = dict(SMALL, token_buckets=[32])
# FP8 weights and KV: 8 of the fp8 cache's 64-token pages (512 tokens) hold the three prompts;
# XLA emulates fp8 on CPUs, so every byte of cache costs step time
FP8 = dict(ENGINE, quantization="fp8", kv_cache_dtype="fp8", num_kv_blocks=8)


def one_device(engine: dict, prompts, max_tokens: int) -> list[list[int]]:
    """The greedy tokens of a worker's run (tp_worker.py) on this process's one device: the
    reference a split engine is compared with, built here rather than in the worker: its steps
    compile into this process's default cache (kept between runs), not the worker's fresh one."""
    llm = LLM(show_progress=False, **engine)
    ps = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def run_on_devices(n: int, runs: list[dict], cache_dir: str) -> list[dict]:
    for r in runs:
        r["engine"].setdefault("compilation_cache_dir", os.path.join(cache_dir, "jax"))
    return run_worker("tp_worker.py", [json.dumps(runs)], n)


@pytest.fixture(scope="module")
def smollm_runs(tmp_path_factory):
    """SmolLM2 (9 query heads, 3 KV heads; four of its layers, devices.SMOLLM2_LAYERS: every
    layer is split the same way) on 3 devices: TP=1 and TP=3, per-layer (fused) and stacked
    layouts, FP8 weights + FP8 KV, and a restart of TP=3 from the executable store."""
    cache = str(tmp_path_factory.mktemp("tp3"))
    model = truncated_smollm2()
    runs = [
        {"engine": dict(ENGINE, layer_loop="unroll"), "prompts": PROMPTS, "max_tokens": 10},
        {"engine": dict(ENGINE, layer_loop="unroll", tensor_parallel_size=3)},
        {"engine": dict(ENGINE, layer_loop="scan", tensor_parallel_size=3)},
        {"engine": dict(ENGINE, layer_loop="unroll", tensor_parallel_size=3)},  # from the store
        {"engine": dict(FP8, layer_loop="unroll")},
        {"engine": dict(FP8, layer_loop="unroll", tensor_parallel_size=3)},
        # one device again, from the store: a stored one-device step must not claim every
        # device of the process when it is loaded (it did: "Expected 3 shards, got 1")
        {"engine": dict(ENGINE, layer_loop="unroll")},
    ]
    for r in runs:
        r["engine"]["model"] = model
        r.setdefault("prompts", PROMPTS)
        r.setdefault("max_tokens", 10)
    return run_on_devices(3, runs, cache)


def test_tp3_generates_what_one_device_does(smollm_runs):
    one, unrolled, stacked, restarted = smollm_runs[:4]
    assert one["devices"] == 3 and one["cache"]["devices"] == 1
    assert unrolled["tokens"] == one["tokens"]
    assert stacked["tokens"] == one["tokens"]
    assert restarted["tokens"] == one["tokens"] and restarted["store_hits"] > 0


def test_a_one_device_step_reloads_from_the_store_on_a_multi_device_host(smollm_runs):
    one, again = smollm_runs[0], smollm_runs[6]
    assert again["store_hits"] > 0 and again["tokens"] == one["tokens"]


def test_tp3_splits_weights_and_cache_over_the_devices(smollm_runs):
    one, tp = smollm_runs[0], smollm_runs[1]
    # the KV cache [1, kv_heads=3, blocks, 16, 64]: one KV head a device
    assert tp["cache"]["devices"] == 3 and tp["cache"]["spec"] == [None, "tp"]
    assert tp["cache"]["shape"] == one["cache"]["shape"]
    assert tp["cache"]["shard_shape"][1] == 1
    # fused q/k/v [576, (9 + 3 + 3) * 64] by columns, o [576, 576] by rows
    assert tp["qkv"]["shard_shape"] == [576, 15 * 64 // 3]
    assert tp["qkv"]["spec"] == [None, "tp"] and tp["wo"]["spec"] == ["tp", None]
    assert tp["wo"]["shard_shape"] == [576 // 3, 576]
    # the tied embedding [49152, 576], vocabulary-parallel: a third of its rows a device, and no
    # step gathers it whole (the lookup all-reduces [T, H]; the logits gather [rows, V])
    assert tp["embed"]["spec"] == ["tp", None] and tp["embed"]["shard_shape"] == [16384, 576]
    assert 0 < tp["largest_all_gather"] <= 32 * 49152 < 49152 * 576
    # the weights went from the host straight into each device's shards: no device array
    # (a whole copy on the first device) was handed to the placement
    assert tp["placed_from_device_bytes"] == 0 and one["placed_from_device_bytes"] is None


def test_tp3_with_fp8_weights_and_kv(smollm_runs):
    one, tp = smollm_runs[4], smollm_runs[5]
    assert tp["tokens"] == one["tokens"]
    # FP8 values are [out, in]: q/k/v split along their output channels (the first axis)
    assert tp["qkv"]["shard_shape"] == [15 * 64 // 3, 576] and tp["qkv"]["devices"] == 3


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """A tiny random Llama: 8 query heads, `kv` KV heads, an untied LM head over 250 tokens
    (4 devices split them as 252, padded: parallel.pad_vocab)."""

    def write(kv: int) -> str:
        d = tmp_path_factory.mktemp(f"tiny_kv{kv}")
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 250,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": kv,
            "head_dim": 8,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
        }
        (d / "config.json").write_text(json.dumps(cfg))
        return f"dummy:{d / 'config.json'}"

    return write


def test_tp2_with_4_kv_heads_and_tp4_with_fewer_kv_heads_than_devices(tiny_config, tmp_path):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]
    runs, want = [], []
    for model, tp in (
        (tiny_config(4), 2),
        (tiny_config(2), 4),  # each of the 2 KV heads on two devices
    ):
        # no grammar samplers here (the SmolLM2 runs above compile them under TP): 3 compiles
        # less on each device layout
        engine = dict(ENGINE, model=model, dtype="float32", structured_outputs=False)
        runs.append({"engine": dict(engine, tensor_parallel_size=tp), "prompts": prompts})
        runs[-1]["max_tokens"] = 8
        want.append(one_device(engine, prompts, 8))  # the same random weights (seed 0)
    kv4_tp2, kv2_tp4 = run_on_devices(4, runs, str(tmp_path))
    assert kv4_tp2["tokens"] == want[0]
    assert kv4_tp2["cache"]["shard_shape"][1] == 2  # 4 KV heads over 2 devices
    assert kv2_tp4["tokens"] == want[1]
    # 2 KV heads copied to 4 (one a device): the cache holds 4 heads, one per shard
    assert kv2_tp4["cache"]["shape"][1] == 4 and kv2_tp4["cache"]["shard_shape"][1] == 1
    # the untied LM head [64, 250] by vocabulary columns: 125 a device; 252 (padded) over 4
    head = kv4_tp2["lm_head"]
    assert head["shard_shape"] == [64, 125] and head["spec"] == [None, "tp"]
    assert kv2_tp4["lm_head"]["shape"] == [64, 252] and kv2_tp4["embed"]["shard_shape"] == [63, 64]


def test_a_mesh_loads_the_weights_on_the_host(short_smollm):
    """Under a mesh the loader leaves the weights on the host, in the model dtype (FP8 values
    as e4m3 bytes): the same numbers the one-device load puts on its device."""
    import ml_dtypes
    import numpy as np

    from paxengine.models.loader import load_model
    from paxengine.models.quant import Fp8Weight

    src = short_smollm.source
    host = load_model(src, "bfloat16", progress=False, quantization="fp8", on_device=False)
    dev = load_model(src, "bfloat16", progress=False, quantization="fp8")
    assert host.params["embed"].dtype == ml_dtypes.bfloat16
    wq = host.params["layers"]["wq"]
    assert isinstance(wq, Fp8Weight) and wq.values.dtype == ml_dtypes.float8_e4m3fn
    for name, a in flatten_leaves(host.params).items():
        assert isinstance(a, np.ndarray), name
        assert np.array_equal(a, np.asarray(flatten_leaves(dev.params)[name])), name


def flatten_leaves(params) -> dict:
    from paxengine.models.weights import flatten

    flat = {}
    for k, v in flatten(params).items():
        parts = (("values", v.values), ("scales", v.scales)) if hasattr(v, "scales") else ()
        flat.update({f"{k}.{n}": a for n, a in parts} if parts else {k: v})
    return flat


def test_clear_errors(tiny_config):
    with pytest.raises(ValueError, match=r"does not divide the attention heads \(9\)"):
        LLM(tensor_parallel_size=2, show_progress=False, **SMALL)  # SmolLM2: 9 query heads
    with pytest.raises(ValueError, match="needs 2 devices; this process sees 1"):
        LLM(model=tiny_config(2), tensor_parallel_size=2, show_progress=False, **SMALL)
    with pytest.raises(ValueError, match="must be >= 1"):
        LLM(tensor_parallel_size=0, show_progress=False, **SMALL)
