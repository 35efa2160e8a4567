"""A chat or completion request's fields as the engine's SamplingParams (`sampling_params`,
--generation-config's defaults where the request leaves one out) and the request checks that
need the server's settings (--max-logprobs, --reasoning-parser's think tags, echo's text)."""

from __future__ import annotations

from typing import Optional

from paxengine.sampling_params import MAX_LOGPROBS, SamplingParams
from paxengine.structured import StructuredOutputs
from paxengine.thinking import ThinkTags
from serving import reasoning
from serving.errors import bad_request
from serving.generation import ServerState
from serving.protocol import ChatCompletionRequest


def sampling_params(
    state: ServerState,
    req,
    max_tokens: Optional[int],
    logprobs: Optional[int],
    structured_outputs: Optional[StructuredOutputs] = None,
) -> SamplingParams:
    """The request's fields as SamplingParams; their values are checked by the engine. Where the
    request leaves one out, --generation-config's default (state.defaults), else vLLM's.
    structured_outputs: the request's constraint (constraints.constraint)."""
    bias = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            bias[int(k)] = v
        except ValueError:
            raise bad_request(f"logit_bias: key {k!r} is not a token id", "logit_bias") from None
    d = state.defaults

    def opt(name: str, default):
        v = getattr(req, name)
        return d.get(name, default) if v is None else v

    return SamplingParams(
        n=req.n,
        temperature=opt("temperature", 1.0),
        top_p=opt("top_p", 1.0),
        # top_k beyond the vocabulary means "all tokens": clamp (the engine packs it into int32)
        top_k=min(opt("top_k", -1), state.vocab_size),
        min_p=opt("min_p", 0.0),
        presence_penalty=opt("presence_penalty", 0.0),
        frequency_penalty=opt("frequency_penalty", 0.0),
        repetition_penalty=opt("repetition_penalty", 1.0),
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=bias,
        skip_special_tokens=req.skip_special_tokens,
        priority=req.priority,
        structured_outputs=structured_outputs,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=list(req.bad_words or []),
        cache_salt=req.cache_salt,
        prompt_logprobs=prompt_logprobs_asked(req),
    )


def prompt_logprobs_asked(req) -> Optional[int]:
    """vLLM's prompt_logprobs; an echo asks for them as in vLLM: a completion's with logprobs
    for as many (OpenAI's echo shows the prompt tokens' logprobs), a chat's for top_logprobs
    (vLLM's default 0) where the response shows them (not in a stream: vLLM's sends none)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    if not req.echo:
        return None
    if isinstance(req, ChatCompletionRequest):
        return None if req.stream else (req.top_logprobs or 0)
    return req.logprobs


def default_max_tokens(state: ServerState, room: int, given: Optional[int] = None) -> int:
    """max_tokens when the request gives none: the room left in the context, at most the
    generation config's max_new_tokens (and a completion's 16, `given`)."""
    caps = [x for x in (given, state.defaults.get("max_tokens")) if x is not None]
    return max(1, min([room, *caps]))


def tokens_as_ids(state: ServerState, req) -> bool:
    """Logprobs' tokens as "token_id:<id>": the request's return_tokens_as_token_ids, or every
    request's under --return-tokens-as-token-ids (vLLM's)."""
    return bool(req.return_tokens_as_token_ids) or state.config.return_tokens_as_token_ids


def check_logprobs_cap(state: ServerState, kind: str, params: SamplingParams) -> None:
    """--max-logprobs (vLLM's): a request asking a token's top k past it is a 400, as vLLM's."""
    cap = state.config.max_logprobs
    sample = "top_logprobs" if kind == "chat" else "logprobs"
    asked = (
        (sample, "sample", params.logprobs),
        ("prompt_logprobs", "prompt", params.prompt_logprobs),
    )
    for name, what, k in asked:
        if isinstance(k, int) and k > cap:
            raise bad_request(
                f"{name}: requested {what} logprobs of {k}, which is greater than max "
                f"allowed: {cap} (the server's --max-logprobs)",
                name,
            )


def check_top_logprobs(req) -> None:
    if req.top_logprobs is None:
        return
    if not req.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
            "top_logprobs",
        )


def echo_text(req, role: str) -> Optional[str]:
    """A chat's echo as vLLM's: the last message's text (parts joined by newlines, as vLLM
    joins them) when its role is the answer's, else "" (None: no echo asked)."""
    if not req.echo:
        return None
    last = req.messages[-1]
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content)


def set_think_tags(state: ServerState, req, params: SamplingParams, prompt: str) -> None:
    """Under --reasoning-parser, for thinking_token_budget or an output constraint (which
    applies after the reasoning, vLLM's rule): the parser's tags as token ids, and whether the
    output starts inside the block (paxengine/thinking.py). A prompt that closed the block
    (thinking off) needs none: a constraint applies from the first token."""
    budget = req.thinking_token_budget
    parser = state.config.reasoning_parser
    if parser is None:
        if budget is not None:
            raise bad_request(
                "thinking_token_budget: needs a reasoning parser (serve with --reasoning-parser)",
                "thinking_token_budget",
            )
        return
    where = reasoning.prompt_block(prompt, parser)
    if where == "closed" or (budget is None and params.structured_outputs is None):
        return
    enc = lambda s: tuple(state.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    inside = where == "open" or parser == "deepseek_r1"
    params.thinking_token_budget = budget
    start, end = reasoning.tags(parser)
    params.think_tags = ThinkTags(enc(start), enc(end), inside)
