"""Figures of each engine iteration, counted as vLLM 0.26 counts them (its `IterationStats`):
the tokens an iteration output (vllm:iteration_tokens_total, a histogram the engine keeps as
bucket counts) and the prompt tokens by where their KV came from (vllm:prompt_tokens_by_source,
vllm:prompt_tokens_cached). A prompt counts once, in the iteration that outputs its sequence's
first token: its tokens computed there plus that iteration's generated tokens make the
iteration's count (vLLM's `prompt_token_stats.computed + num_generation_tokens`)."""

from __future__ import annotations

from bisect import bisect_left

# vLLM's buckets of vllm:iteration_tokens_total (the last count is +Inf's)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationStats:
    def __init__(self):
        self.iteration_tokens_buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.prompt_tokens_local_compute = 0
        self.prompt_tokens_local_cache_hit = 0

    def prefilled(self, num_prompt_tokens: int, num_cached_tokens: int) -> int:
        """A sequence's first token is out: its prompt counts, by source. -> tokens computed."""
        cached = min(max(num_cached_tokens, 0), num_prompt_tokens)
        self.prompt_tokens_local_compute += num_prompt_tokens - cached
        self.prompt_tokens_local_cache_hit += cached
        return num_prompt_tokens - cached

    def iteration(self, num_tokens: int) -> None:
        """An iteration that output tokens: its computed prompt tokens plus generated ones."""
        self.iteration_tokens_buckets[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens

    def as_dict(self) -> dict:
        return {
            "iteration_tokens_buckets": list(self.iteration_tokens_buckets),
            "iteration_tokens_sum": self.iteration_tokens_sum,
            "prompt_tokens_local_compute": self.prompt_tokens_local_compute,
            "prompt_tokens_local_cache_hit": self.prompt_tokens_local_cache_hit,
            # no KV connector loads a prompt's KV from outside this engine (the disaggregated
            # pair's prefill engine computes every prompt; its decode engine counts none)
            "prompt_tokens_external_kv_transfer": 0,
        }
