"""Request validation, in one place: the engine runs it before a request enters, a server runs
the same function (through `EngineClient.validate`) before it answers 200, and a test fake runs
it too. Every failure is an `InvalidRequest` naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from paxengine.errors import InvalidRequest
from paxengine.sampling_params import SamplingParams, check_truncate_prompt_tokens


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_kv_tokens: int  # tokens the whole KV pool holds: one request can never need more


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    # a list of plain ints (what JSON bodies and tokenizers give) in builtins' C loops: 2.3x
    # faster for 1,024 ids, and the server checks every prompt twice; anything else, or a bad
    # id, goes through the loop that names it
    if type(ids) is list and all(type(t) is int for t in ids):
        if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
            return
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
            raise InvalidRequest(
                f"{param}: token id {t!r} is outside the vocabulary [0, {vocab_size})", param=param
            )


def validate_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, limits: Limits
) -> None:
    """Refuse, with a clear message, a request that is malformed or could never be scheduled."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params must be a SamplingParams")
    params.validate(limits.vocab_size)
    n, context = len(prompt_token_ids), limits.max_model_len
    if n == 0:
        raise InvalidRequest("prompt: the prompt is empty", param="prompt")
    check_token_ids(prompt_token_ids, limits.vocab_size)
    if n >= context:
        raise InvalidRequest(
            f"prompt: the prompt has {n} tokens but max_model_len is {context} "
            f"(at most {context - 1} prompt tokens leave room for one generated "
            "token)",
            param="prompt",
            code="context_length_exceeded",
        )
    total = n + (params.max_tokens or context - n)
    if total > context:
        raise InvalidRequest(
            f"max_tokens: the prompt ({n} tokens) + max_tokens "
            f"({params.max_tokens}) = {total} exceeds max_model_len ({context})",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if total > limits.max_kv_tokens:
        raise InvalidRequest(
            f"max_tokens: the prompt + max_tokens = {total} tokens needs more KV "
            f"blocks than the pool holds ({limits.max_kv_tokens} tokens)",
            param="max_tokens",
        )


def truncate_prompt(
    text: str | None, ids: list[int], k: int | None, max_model_len: int
) -> tuple[str | None, list[int]]:
    """The prompt as truncate_prompt_tokens k keeps it: its last k token ids (-1: the last
    max_model_len), its text dropped when tokens were cut (it no longer says what runs)."""
    check_truncate_prompt_tokens(k)
    if k is None:
        return text, ids
    if k > max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens: {k} exceeds max_model_len ({max_model_len})",
            param="truncate_prompt_tokens",
        )
    k = max_model_len if k == -1 else k
    return (text, ids) if len(ids) <= k else (None, list(ids[-k:]))


def prompt_and_ids(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """A prompt (text, token ids, or {'prompt_token_ids': [...]}) -> (its text or None, ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest(
                "this model has no tokenizer: pass prompt_token_ids", param="prompt"
            )
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise InvalidRequest(
        f"a prompt is a string, a list of token ids or "
        f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
        param="prompt",
    )


def check_request(
    prompt_token_ids, params: SamplingParams, limits: Limits, config, grammars, tokenizer=None
):
    """`validate_request` plus what the engine's configuration refuses; compiles a
    structured-output constraint with `grammars` (cached by its text), so a grammar that does
    not compile is refused here, and tokenizes bad_words with `tokenizer` (into
    `params.bad_words_token_ids`). Thread safe."""
    validate_request(prompt_token_ids, params, limits)
    if params.priority != 0 and config.scheduling_policy != "priority":
        raise InvalidRequest(
            f"priority: {params.priority} asks for priority scheduling, which this engine "
            "does not run (start it with scheduling_policy 'priority', "
            "--scheduling-policy priority)",
            param="priority",
        )
    if params.allowed_token_ids is not None and not config.structured_outputs:
        raise InvalidRequest(
            "allowed_token_ids: needs the token mask, which is off on this server "
            "(structured_outputs: false)",
            param="allowed_token_ids",
        )
    if params.bad_words:
        if not config.structured_outputs:
            raise InvalidRequest(
                "bad_words: needs the token mask, which is off on this server "
                "(structured_outputs: false)",
                param="bad_words",
            )
        params.update_from_tokenizer(tokenizer, limits.vocab_size)
    if params.structured_outputs is not None:
        if not config.structured_outputs:
            raise InvalidRequest(
                "structured output is off on this server (structured_outputs: false)",
                param="structured_outputs",
            )
        grammars.compile(params.structured_outputs)
