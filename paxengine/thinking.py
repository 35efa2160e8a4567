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

With a grammar (structured output under --reasoning-parser, vLLM's rule), the grammar applies
after the block: inside it the row is unconstrained and its tokens are not the grammar's; at
the first output token the grammar's mask also allows the start tag (the model may open a
block), and any other first token starts the grammar (the block can no longer open). Single-token
start tags (Qwen3's, DeepSeek-R1's) are exact; a longer one's first tokens would be lost to the
grammar if it did not complete.
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
    """Where one sequence is: before the block, inside it (tokens counted), or done.
    budget None: nothing is forced (a grammar waits for the block's end); grammar: a grammar
    follows the block, which must then open at the first output token."""

    def __init__(self, budget: int | None, tags: ThinkTags, grammar: bool = False):
        self.budget, self.tags, self.grammar = budget, tags, grammar
        self.state = "think" if tags.inside else "before"
        self.count = 0  # tokens inside the block so far
        self.recent: list[int] = []  # the last few tokens (a tag may span several)
        self.seen = 0  # output tokens so far

    @property
    def active(self) -> bool:
        """Whether a sample may still be forced (the engine then reads each step first)."""
        return self.budget is not None and self.state != "done"

    @property
    def grammar_waits(self) -> bool:
        """Whether a grammar's mask is off for the next sample (inside the block)."""
        return self.state == "think"

    def start_token(self) -> int | None:
        """The token a grammar's mask must also allow for the next sample (the start tag's
        next token, while the block may still open at the output's start), or None."""
        start = self.tags.start_ids
        if self.state != "before" or not self.grammar or self.seen >= len(start):
            return None
        return start[self.seen]

    def accept(self, token: int) -> bool:
        """Advance by one output token; True when the token is past the block (a grammar's)."""
        n = max(len(self.tags.start_ids), len(self.tags.end_ids))
        self.recent = (self.recent + [token])[-n:]
        self.seen += 1
        if self.state == "before":
            if _ends_with(self.recent, self.tags.start_ids):
                self.state, self.recent = "think", []
                return False
            if not self.grammar:
                return True
            start = self.tags.start_ids
            if self.seen <= len(start) and token == start[self.seen - 1]:
                return False  # a longer start tag, so far
            self.state = "done"  # the grammar's first token: the block can no longer open
            return True
        if self.state == "think":
            if _ends_with(self.recent, self.tags.end_ids):
                self.state = "done"
            else:
                self.count += 1
            return False
        return True

    def forced_token(self) -> int | None:
        """The token the next sample must be (the end tag's next one), or None."""
        if self.state != "think" or self.budget is None or self.count < self.budget:
            return None
        end = self.tags.end_ids
        for m in range(min(len(end) - 1, len(self.recent)), 0, -1):  # a partial tag so far
            if tuple(self.recent[-m:]) == end[:m]:
                return end[m]
        return end[0]


def _ends_with(tokens: list[int], tag: tuple[int, ...]) -> bool:
    return len(tokens) >= len(tag) and tuple(tokens[-len(tag) :]) == tag
