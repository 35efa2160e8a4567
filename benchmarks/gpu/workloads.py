"""The GPU run's workloads: Llama-3.1-8B shapes on the H200 (FULL) and the same code at CPU size
(QUICK, `--quick`: a smoke run). Each stage reads its part of the dict; the driver writes the
whole dict into gpu_bench.json ("spec"), and the report reads it back from there."""

FULL = {
    "preset": "llama-3.1-8b",
    "dtype": "bfloat16",
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
        # paxengine's server only: while requests decode, a step takes 512 tokens (a prompt
        # chunk beside ~60 decode rows, one weight read for both: +8% output at c=64 over 2,048,
        # benchmarks/results/gpu_2026-12-02_serve_budget/), and 4,096 (~95 ms of an 8B step on
        # the H200) while 8,192+ prompt tokens wait: a burst's prefill in large steps
        "pax_engine": {"decode_step_token_budget": 512, "backlog_step_token_budget": 4096},
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
        "pax_engine": {"decode_step_token_budget": 512, "backlog_step_token_budget": 4096},
    },
    "engine": {
        "max_num_seqs": 512,
        "max_num_batched_tokens": 8192,
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.9,
        # 33 compiled shapes: start-up fits the device call. 512 rows so 300 requests
        # decode together; T=512 so their decode step is not padded to 1024 tokens (at
        # M=1024 the matmuls are compute-bound: ~21 ms a step); T=2048 so a prompt or two
        # next to the decodes is not padded to 4096 (the scheduler fills buckets).
        # 320 and 384: 300 decoding rows padded to 512 spent ~40% of each step's GEMM time
        # on padding (compute-bound at that M), vLLM runs them unpadded
        # 1: a batch-1 decode step's matmuls at M=1, where the FP8 GEMV kernel streams the
        # weights (at M=16 FP8 falls back to XLA's upcast, 1.4x slower per matmul)
        "token_buckets": [1, 16, 64, 256, 320, 384, 512, 1024, 2048, 4096, 8192],
        "seq_buckets": [8, 64, 256, 512],
    },
    # the FP8 stages (issue #17): FP8 weights (online quantization) and an FP8 KV cache in both
    "fp8": {
        "pax_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
        "vllm_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    },
    # the same with 16-token KV pages (fp8 caches default to 64, V pages [D, 64]: the pages
    # the layout was measured against, side by side in one lease)
    "fp8bs16": {
        "pax_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8", "block_size": 16},
        "vllm_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8", "block_size": 16},
    },
    # the two-GPU stages (issue #19; device kind nvidia-h200-x2): the same model split in two
    "tp2": {
        "pax_engine": {"tensor_parallel_size": 2},
        "vllm_engine": {"tensor_parallel_size": 2},
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
    "itl": {"input_len": 16, "n1": 4, "n2": 36, "batches": [1, 4], "reps": 1},
    "offline": [{"name": "8x(32,8)", "num_prompts": 8, "input_len": 32, "output_len": 8}],
    "serve": {
        "input_len": 16,
        "output_len": 8,
        "concurrency": [1, 4],
        "num_prompts": 8,
        "per_concurrency": 0,
        "pax_engine": {"decode_step_token_budget": 64, "backlog_step_token_budget": 128},
    },
    "poisson": {
        "input_len": 16,
        "output_len": 8,
        "range_ratio": 0.5,
        "rates": [20, 80],
        "seconds": 0.2,
        "min_prompts": 8,
        "pax_engine": {"decode_step_token_budget": 64, "backlog_step_token_budget": 128},
    },
    "engine": {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_model_len": 256,
        "num_kv_blocks": 128,
    },
    "fp8": {
        "pax_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
        "vllm_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    },
    # the same with 16-token KV pages (fp8 caches default to 64, V pages [D, 64]: the pages
    # the layout was measured against, side by side in one lease)
    "fp8bs16": {
        "pax_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8", "block_size": 16},
        "vllm_engine": {"quantization": "fp8", "kv_cache_dtype": "fp8", "block_size": 16},
    },
    "tp2": {  # the tiny preset's 4 heads, 2 KV heads and 128 channels split in two
        "pax_engine": {"tensor_parallel_size": 2},
        "vllm_engine": {"tensor_parallel_size": 2},
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
