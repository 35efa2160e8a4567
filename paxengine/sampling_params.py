"""Per-request sampling parameters, validated before a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from paxengine.errors import InvalidRequest
from paxengine.structured import StructuredOutputs
from paxengine.thinking import ThinkTags

MAX_LOGPROBS = 20
MAX_N = 64
MAX_LOGIT_BIAS = 300


def check_truncate_prompt_tokens(k) -> None:
    """None, -1 or an integer >= 1 (the one check: SamplingParams.validate and
    validation.truncate_prompt, which runs before it, both call it)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1 or k == 0):
        raise InvalidRequest(
            f"truncate_prompt_tokens: must be -1 or an integer >= 1, got {k!r}",
            param="truncate_prompt_tokens",
        )


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # number of top logprobs per generated token (0: only the sampled one)
    )
    # vLLM's: the prompt tokens' logprobs with the top k each (0: only the prompt's own token);
    # computed on the device (prompt_logprobs.py), and such a request takes no prefix-cache hit
    prompt_logprobs: int | None = None
    # vLLM's: after this many tokens inside the think block, its end tag is forced (thinking.py);
    # think_tags say which tokens those are (the server sets them from --reasoning-parser)
    thinking_token_budget: int | None = None
    think_tags: ThinkTags | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    # scheduling, not sampling: lower runs first (vLLM's convention); needs the engine's
    # scheduling_policy "priority"
    priority: int = 0
    # a JSON schema, regex, choice or Lark grammar the output must follow (structured.py)
    structured_outputs: StructuredOutputs | None = None
    # keep only the prompt's last k tokens (-1: the last max_model_len), vLLM's; the engine
    # applies it when the request enters (`validation.truncate_prompt`)
    truncate_prompt_tokens: int | None = None
    # sample only among these token ids (vLLM's): the token mask structured output uses
    allowed_token_ids: list[int] | None = None
    # the prefix cache, not sampling: KV is shared only between requests with the same salt (a
    # tenant's), so one tenant cannot time another's prompts (vLLM's cache_salt)
    cache_salt: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = list(self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the token history (presence, frequency or repetition)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest (a ValueError) naming the first bad field."""

        def bad(name, why):
            raise InvalidRequest(f"{name}: {why}", param=name)

        def num(name, v):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                bad(name, f"must be a number, got {v!r}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            num(name, getattr(self, name))
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            bad("top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        b = self.thinking_token_budget
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                bad("thinking_token_budget", f"must be an integer >= 0, got {b!r}")
            if not isinstance(self.think_tags, ThinkTags):
                bad("thinking_token_budget", "needs think_tags (a reasoning parser's)")
        if self.think_tags is not None:
            if not isinstance(self.think_tags, ThinkTags):
                bad("think_tags", "must be a paxengine.thinking.ThinkTags")
            why = self.think_tags.check(vocab_size)
            if why is not None:
                bad("think_tags", why)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            bad("priority", f"must be an integer, got {self.priority!r}")
        if not -(2**31) <= self.priority < 2**31:
            bad("priority", f"must fit in 32 bits, got {self.priority}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                bad("stop_token_ids", f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must name at least one token id")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                    bad(
                        "allowed_token_ids",
                        f"token id {t!r} is outside the vocabulary [0, {vocab_size})",
                    )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            bad("cache_salt", f"must be a non-empty string, got {self.cache_salt!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad("structured_outputs", "must be a paxengine.StructuredOutputs")
            self.structured_outputs.key()  # exactly one constraint, of the right type
        for t, b in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                bad("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab_size})")
            if not -100 <= b <= 100:
                bad("logit_bias", f"bias for token {t} must be in [-100, 100], got {b}")
