"""What callers get back: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # vLLM's: None first, then {token id: Logprob} per prompt token (SamplingParams'
    # prompt_logprobs), once the whole prompt is computed; None when not asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
