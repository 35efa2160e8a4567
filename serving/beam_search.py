"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM serves it: `n` is the
beam width, the response's n choices are the best beams, best first. The search runs above the
engine (paxengine/beam_search.py: one-token requests through the engine's `generate`), and each
prompt's search is a job whose stream yields one finished output, so the response is built as any
other's (openai_api.py): a chat's reasoning and tool-call parsing after the search, logprobs (the
beam's top candidates each step), echo, return_token_ids, usage (the prompt's tokens and every
choice's); a stream sends each choice whole when the search ends.

vLLM's beam search uses n, max_tokens, temperature, ignore_eos, length_penalty and
include_stop_str_in_output and silently ignores the other sampling fields; here a field it would
ignore is a 400 naming it when its value asks for something (issue #16: never ignored).
"""

from __future__ import annotations

import functools

from paxengine import beam_search
from paxengine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from paxengine.errors import EngineError
from serving import constraints
from serving.errors import bad_request
from serving.generation import Job, ServerState, abort_unfinished, log_inputs

# Fields beam search does not use, with the values that ask for nothing (None always does).
_UNUSED = {
    "top_p": (1.0,),
    "top_k": (-1, 0),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "seed": (),
    "stop": ([],),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "min_tokens": (0,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "thinking_token_budget": (),
}


def check_request(req, kind: str) -> None:
    """Before anything runs: length_penalty only with use_beam_search; with it, n in range and
    no field beam search would ignore (a 400 naming it)."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise bad_request(
                "length_penalty: only applies with use_beam_search true", "length_penalty"
            )
        return
    if not 1 <= req.n <= MAX_BEAM_WIDTH:
        raise bad_request(
            f"n: with use_beam_search, the beam width: an integer in [1, {MAX_BEAM_WIDTH}] "
            f"(each step asks 2 x n logprobs), got {req.n}",
            "n",
        )
    for name, noops in _UNUSED.items():
        value = getattr(req, name)
        if value is not None and not any(value == v for v in noops):
            raise _unused(name)
    name = constraints.constraint_field(req)
    if name is not None:
        raise _unused(name)
    if kind == "chat":
        if req.tools and req.tool_choice not in (None, "none", "auto"):
            raise _unused("tool_choice", "a forced tool call (its grammar)")
    elif req.echo and req.logprobs is not None:
        raise _unused("echo", "echo with logprobs (the prompt's logprobs)")


def _unused(name: str, what: str | None = None):
    return bad_request(
        f"{name}: {what or 'this field'} is not supported with use_beam_search (beam search "
        "uses n, max_tokens, temperature, ignore_eos, length_penalty and "
        "include_stop_str_in_output)",
        name,
    )


def params_of(job: Job, length_penalty: float) -> BeamSearchParams:
    p = job.params
    return BeamSearchParams(
        beam_width=p.n,
        max_tokens=p.max_tokens,
        ignore_eos=p.ignore_eos,
        temperature=p.temperature,
        length_penalty=length_penalty,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        cache_salt=p.cache_salt,
        priority=p.priority,
    )


def start_jobs(state: ServerState, jobs: list[Job], length_penalty: float) -> None:
    """generation.start_jobs for beam searches: each job's stream is its prompt's search, checked
    here (a refusal is a 4xx before the response starts); every job or none."""
    if state.drain.draining:
        state.metrics.rejected("draining")
        raise state.draining_error()
    engine = state.engine
    # the engine's own (abort by the search's id reaches it), else the same over its generate
    search = getattr(engine, "beam_search", None) or functools.partial(
        beam_search.beam_search, engine
    )
    for i, job in enumerate(jobs):
        if state.config.enable_log_requests:
            log_inputs(state.config, job)
        params = params_of(job, length_penalty)
        try:
            beam_search.check(engine, job.prompt_ids, params)
        except EngineError as e:
            abort_unfinished(state, jobs[:i], count=False)
            raise state.api_error(e) from None
        text = getattr(job, "prompt", None)
        job.stream = search(job.request_id, job.prompt_ids, params, prompt=text)
        state.drain.track(job.request_id)
