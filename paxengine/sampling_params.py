"""Per-request sampling parameters, validated before a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from paxengine.errors import InvalidRequest
from paxengine.structured import StructuredOutputs
from paxengine.thinking import ThinkTags

MAX_LOGPROBS = 20
MAX_N = 64
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 128  # token sequences after tokenizing bad_words (vLLM's VLLM_MAX_NUM_BAD_WORDS)


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
    # vLLM's: words the output must not contain. Each is tokenized at entry (`update_from_tokenizer`,
    # from `validation.check_request`) into bad_words_token_ids; a sequence's last token is then
    # masked whenever the output tokens end with the rest of it (`sampling.bad_words_banned`)
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
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
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)

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

    @property
    def has_bad_word_prefixes(self) -> bool:
        """Whether a bad word has more than one token: its last token is banned only after the
        others, so the row's mask follows the output tokens (read each step before the next is
        built, like a penalty's history). A one-token word is banned always: a fixed mask."""
        return any(len(w) > 1 for w in self.bad_words_token_ids or ())

    def update_from_tokenizer(self, tokenizer, vocab_size: int) -> None:
        """bad_words -> bad_words_token_ids, as vLLM's `SamplingParams.update_from_tokenizer`:
        each word (its leading whitespace stripped) without special tokens, and again after a
        space, that variant kept when its first token differs from the plain one's and it has as
        many tokens (the word in the middle of a text). Raises InvalidRequest naming bad_words."""
        if not self.bad_words:
            return
        self._check_bad_words()
        if tokenizer is None:
            raise InvalidRequest(
                "bad_words: needs the model's tokenizer, and this model has none",
                param="bad_words",
            )
        seqs: list[list[int]] = []
        for word in dict.fromkeys(self.bad_words):
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise InvalidRequest(
                    f"bad_words: {word!r} must tokenize to at least one token", param="bad_words"
                )
            seqs.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        self.bad_words_token_ids = seqs
        self._check_bad_words_token_ids(vocab_size)

    def _check_bad_words(self) -> None:
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) for w in self.bad_words
        ):
            raise InvalidRequest(
                f"bad_words: must be a list of strings, got {self.bad_words!r}", param="bad_words"
            )
        if not all(self.bad_words):
            raise InvalidRequest("bad_words: cannot contain an empty string", param="bad_words")

    def _check_bad_words_token_ids(self, vocab_size: int) -> None:
        seqs = self.bad_words_token_ids
        if seqs is None:
            return
        if len(seqs) > MAX_BAD_WORDS:
            raise InvalidRequest(
                f"bad_words: {len(seqs)} token sequences after tokenization, at most "
                f"{MAX_BAD_WORDS}",
                param="bad_words",
            )
        for w in seqs:
            if not isinstance(w, list) or not w:
                raise InvalidRequest(
                    "bad_words: each word's token ids must be a non-empty list", param="bad_words"
                )
            for t in w:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                    raise InvalidRequest(
                        f"bad_words: token id {t!r} is outside the vocabulary [0, {vocab_size})",
                        param="bad_words",
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
        self._check_bad_words()
        self._check_bad_words_token_ids(vocab_size)
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
