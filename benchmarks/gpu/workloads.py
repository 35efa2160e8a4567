"""The GPU run's workloads: Llama-3.1-8B shapes on the H200 (FULL) and the same code at CPU size
(QUICK, `--quick`: a smoke run). Each stage reads its part of the dict; the driver writes the
whole dict into gpu_bench.json ("spec"), and the report reads it back from there.

Both engines run at their defaults, as a user starts them: each is given the model, its dtype,
max_model_len and what a variant is about (`engine_args`), nothing else; no step budgets,
buckets, batch limits or memory shares (tests/benchmarks/test_bench_gpu_script.py checks it).
Only the CPU smoke run sizes its engine down (QUICK's "cpu_size"), to stay a smoke test on two
cores: at the CPU defaults its stages compile 54 executables each, and an FP8 KV cache of the
default 512 MiB (4M tokens of the tiny model) took 2.6 s a decode step on the CPU.
"""


def engine_args(spec: dict, variant: str | None = None) -> dict:
    """The settings a stage gives its engine besides the model and dtype, the same dict for
    paxengine and vLLM: max_model_len, the variant's own ("fp8", "tp2") and, in QUICK only,
    the CPU size."""
    extra = spec["variants"][variant] if variant else {}
    return {"max_model_len": spec["max_model_len"], **spec.get("cpu_size", {}), **extra}


def with_model(spec: dict, model: str | None) -> dict:
    """The spec of a stage on one of its "models" (another architecture than the preset's):
    the model's entry merged over the spec."""
    return {**spec, **spec["models"][model], "model": model} if model else spec


def pax_model(spec: dict) -> str:
    """paxengine's dummy-weight model: a config file of the spec's (a stage's model) or the preset."""
    return f"dummy:{spec['config']}" if spec.get("config") else f"dummy:{spec['preset']}"


def vocab_size(spec: dict) -> int:
    if spec.get("config"):
        import json
        from pathlib import Path

        raw = json.loads(Path(spec["config"]).read_text())
        return (raw.get("text_config") or raw)["vocab_size"]
    from paxengine.models.config import PRESETS

    return PRESETS[spec["preset"]].vocab_size


# Architectures beside the preset's, by stage suffix (<engine>-offline-qwen35[-fp8], -qwen3moe): the HF
# config (dummy weights) and what vLLM needs to run it at all (VLLM-PEER.md: its FlashInfer GDN
# prefill kernel is missing from the wheel set; text only, as paxengine serves Qwen3.5)
QWEN35_VLLM = {"language_model_only": True, "additional_config": {"gdn_prefill_backend": "triton"}}

FULL = {
    "preset": "llama-3.1-8b",
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "itl": {"input_len": 128, "n1": 32, "n2": 288, "batches": [1, 8], "reps": 3},
    # the long workload first: the short one's time is then projected from a decode-heavy rate
    # (the other way round, 256x(1024,128)'s prefill-bound rate over-projected 300x(1000,1000))
    "offline": [
        {"name": "300x(1000,1000)", "num_prompts": 300, "input_len": 1000, "output_len": 1000},
        {"name": "256x(1024,128)", "num_prompts": 256, "input_len": 1024, "output_len": 128},
    ],
    "serve": {
        "input_len": 1024,
        "output_len": 128,
        "concurrency": [1, 16, 64],
        "num_prompts": 32,
        "per_concurrency": 4,
    },
    # realistic arrivals (issue #18): Poisson rates, random lengths around the means; each run
    # sends about `seconds` worth of requests, at least `min_prompts`
    "poisson": {
        "input_len": 1024,
        "output_len": 256,
        "range_ratio": 0.9,
        "rates": [4, 8, 16],
        "seconds": 30,
        "min_prompts": 32,
    },
    # the variants' stages (<engine>-offline-<variant>, <engine>-serve-<variant>), the same
    # settings for both engines: FP8 weights (online quantization) and an FP8 KV cache (issue
    # #17); the model split over two GPUs (issue #19, device kind nvidia-h200-x2)
    "variants": {
        "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
        "tp2": {"tensor_parallel_size": 2},
    },
    "models": {
        "qwen35": {"config": "benchmarks/gpu/models/qwen35_9b.json", "vllm_required": QWEN35_VLLM},
        "qwen3moe": {"config": "benchmarks/gpu/models/qwen3_30b_a3b.json", "vllm_required": {}},
    },
    "copy_mib": 2048,
    "matmul_n": 8192,
    "iters": 20,
    # HF transformers on the same dummy model: batch-1 ITL eager and with a static cache +
    # torch.compile (the gpt-fast recipe), batched generate on the first offline-like workload
    # (n2 tokens generated, the first n1 decode gaps left out of the ITL)
    "hf": {
        "input_len": 128,
        "n1": 16,
        "n2": 80,
        "compile": True,
        "batched": {
            "name": "256x(1024,128)",
            "num_prompts": 256,
            "input_len": 1024,
            "output_len": 128,
        },
    },
}
# A CPU-sized smoke run of the same code (`--quick`, dummy:tiny).
QUICK = {
    "preset": "tiny",
    "dtype": "float32",
    "max_model_len": 256,
    # 4 sequences / 64 tokens: each offline stage compiles 14 step executables, not 30 (the bulk
    # of a 2-core CI run); 64 tokens still takes the FP8 GEMMs beside the upcast path
    "cpu_size": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 128},
    "itl": {"input_len": 16, "n1": 4, "n2": 36, "batches": [1, 4], "reps": 1},
    "offline": [{"name": "8x(32,8)", "num_prompts": 8, "input_len": 32, "output_len": 8}],
    "serve": {
        "input_len": 16,
        "output_len": 8,
        "concurrency": [1, 4],
        "num_prompts": 8,
        "per_concurrency": 0,
    },
    "poisson": {
        "input_len": 16,
        "output_len": 8,
        "range_ratio": 0.5,
        "rates": [20, 80],
        "seconds": 0.2,
        "min_prompts": 8,
    },
    "variants": {  # tp2: the tiny preset's 4 heads, 2 KV heads and 128 channels split in two
        "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
        "tp2": {"tensor_parallel_size": 2},
    },
    "models": {
        "qwen35": {
            "config": "benchmarks/gpu/models/qwen35_tiny.json",
            "vllm_required": QWEN35_VLLM,
        },
        "qwen3moe": {"config": "benchmarks/gpu/models/qwen3moe_tiny.json", "vllm_required": {}},
    },
    "copy_mib": 16,
    "matmul_n": 256,
    "iters": 3,
    "hf": {
        "input_len": 16,
        "n1": 2,
        "n2": 10,
        "compile": False,
        "batched": {"name": "4x(16,4)", "num_prompts": 4, "input_len": 16, "output_len": 4},
    },
}
