"""The settings an engine takes where its config leaves them, per device class: what the
benchmarks measured best on that class becomes the default, so a user (and the benchmark, which
passes no tuning flags, as vLLM runs at its own defaults) gets it without flags.

GPU (H100 / H200, Llama-3.1-8B shapes, `benchmarks/results/`): 512 sequences and 8,192 tokens
a step (300 requests decode together; vLLM's server runs 8,192 too), token buckets with 1 (the
FP8 GEMV's batch-1 decode) and 320 / 384 (300 decode rows padded to 512 spent ~40% of a step's
GEMM time on padding), and, serving, 512-token steps while requests decode, doubled up to 4,096
as prompts wait (`benchmarks/results/gpu_2026-12-02_serve_budget/`, `..._12-03d_graded_budget/`).

CPU (2 cores, SmolLM2-135M): a step costs about its token bucket (the XLA attention gathers
each token's pages), so a prompt is prefilled as fast in 16-token steps beside the decodes as in
512-token ones, and those do not stall the running streams: serving, steps take 16 tokens while
requests decode, no larger backlog steps (`benchmarks/results/cpu_2026-12-06_stall/`).
"""

from __future__ import annotations

import dataclasses

from paxengine.batch import seq_buckets, token_buckets
from paxengine.config import AUTO, EngineConfig, byte_count, token_count

GPU = {"max_num_seqs": 512, "max_num_batched_tokens": 8192}
CPU = {"max_num_seqs": 64, "max_num_batched_tokens": 2048}
# (decode_step_token_budget, backlog_step_token_budget) for "auto", each capped at the step size
GPU_STEP_BUDGETS = (512, 4096)
CPU_STEP_BUDGETS = (16, None)


def gpu_token_buckets(max_tokens: int, max_seqs: int) -> list[int]:
    """1, 16, 64, 256, then doubling to max_tokens, with 320 and 384 where that many sequences
    can decode together (the measured ladder at 8,192 / 512)."""
    ladder = [1, 16, 64] + token_buckets(max_tokens, smallest=256)
    if max_seqs > 256:
        ladder += [t for t in (320, 384) if t < max_tokens]
    return sorted(t for t in set(ladder) if t <= max_tokens)


def gpu_seq_buckets(max_seqs: int) -> list[int]:
    """8, 64, 256 below max_seqs, then max_seqs (the measured [8, 64, 256, 512])."""
    return [s for s in (8, 64, 256) if s < max_seqs] + [max_seqs]


def resolve(cfg: EngineConfig, on_gpu: bool) -> EngineConfig:
    """cfg with every None / "auto" above filled in for this device class."""
    base = GPU if on_gpu else CPU
    seqs = cfg.max_num_seqs or base["max_num_seqs"]
    given = token_count(cfg.max_num_batched_tokens, "max_num_batched_tokens")  # "8k" from YAML
    tokens = given or max(base["max_num_batched_tokens"], seqs)
    out = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}
    # "8G" from YAML as from the flag
    out["kv_cache_memory_bytes"] = byte_count(cfg.kv_cache_memory_bytes, "kv_cache_memory_bytes")
    if cfg.token_buckets is None:
        out["token_buckets"] = gpu_token_buckets(tokens, seqs) if on_gpu else token_buckets(tokens)
    if cfg.seq_buckets is None:
        out["seq_buckets"] = gpu_seq_buckets(seqs) if on_gpu else seq_buckets(seqs)
    decode, backlog = GPU_STEP_BUDGETS if on_gpu else CPU_STEP_BUDGETS
    if cfg.decode_step_token_budget == AUTO:
        out["decode_step_token_budget"] = min(decode, tokens)
    if cfg.backlog_step_token_budget == AUTO:
        budget = out.get("decode_step_token_budget", cfg.decode_step_token_budget)
        out["backlog_step_token_budget"] = (
            None if backlog is None or budget is None else max(budget, min(backlog, tokens))
        )
    return dataclasses.replace(cfg, **out)
