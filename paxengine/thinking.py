"""A thinking budget (vLLM's `thinking_token_budget`): after N tokens inside the think block the
engine forces the block's end tag, token by token, so the reasoning closes and the answer
follows.

`ThinkTags` (SamplingParams.think_tags; the server sets them from --reasoning-parser and the
prompt) names the tags' token ids and whether the output starts inside the block. A request's
`ThinkingState` (Request.thinking) is advanced by the scheduler once per accepted token, as a
grammar is; `forced_token` says which token the next sample must be, and the step's sampling
tensors make that row greedy with a large bias on it (no new sampler variant: the bias is in
every one). The next sample depends on the last one, so while a request is forcing or may
force, the engine reads each step before it builds the next (`active`), as for a grammar, and
the request does not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass

FORCE_BIAS = 1e9  # added to the forced token's logit; its row is greedy


@dataclass(frozen=True)
class ThinkTags:
    start_ids: tuple[int, ...]  # the tokens of `<think>`
    end_ids: tuple[int, ...]  # the tokens of `</think>` (forced, in order)
    inside: bool  # the output starts inside the block (the prompt opened it)

    def check(self, vocab_size: int) -> str | None:
        """Why these tags cannot be used, or None."""
        if not self.end_ids or not self.start_ids:
            return "think tags must have at least one token each"
        if any(not 0 <= t < vocab_size for t in self.start_ids + self.end_ids):
            return f"think tag token ids must be in [0, {vocab_size})"
        return None


class ThinkingState:
    """Where one sequence is: before the block, inside it (tokens counted), or done."""

    def __init__(self, budget: int, tags: ThinkTags):
        self.budget, self.tags = budget, tags
        self.state = "think" if tags.inside else "before"
        self.count = 0  # tokens inside the block so far
        self.recent: list[int] = []  # the last few tokens (a tag may span several)

    @property
    def active(self) -> bool:
        """Whether a sample may still be forced (the engine then reads each step first)."""
        return self.state != "done"

    def accept(self, token: int) -> None:
        n = max(len(self.tags.start_ids), len(self.tags.end_ids))
        self.recent = (self.recent + [token])[-n:]
        if self.state == "before":
            if _ends_with(self.recent, self.tags.start_ids):
                self.state, self.recent = "think", []
        elif self.state == "think":
            if _ends_with(self.recent, self.tags.end_ids):
                self.state = "done"
            else:
                self.count += 1

    def forced_token(self) -> int | None:
        """The token the next sample must be (the end tag's next one), or None."""
        if self.state != "think" or self.count < self.budget:
            return None
        end = self.tags.end_ids
        for m in range(min(len(end) - 1, len(self.recent)), 0, -1):  # a partial tag so far
            if tuple(self.recent[-m:]) == end[:m]:
                return end[m]
        return end[0]


def _ends_with(tokens: list[int], tag: tuple[int, ...]) -> bool:
    return len(tokens) >= len(tag) and tuple(tokens[-len(tag) :]) == tag
