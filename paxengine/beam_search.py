"""Beam search above the engine, as vLLM's (vllm/beam_search.py, `LLM.beam_search` and the
server's `beam_search`): no engine change, only requests of one token.

Each iteration extends every live beam by one engine request (max_tokens 1, logprobs
2 x beam_width: the raw log-softmax's top 2 x beam_width and the sampled token, as vLLM asks
following transformers), all of an iteration's requests submitted together so they run in one
batch, their prompts (the beams so far) hitting the prefix cache but for the last block. Each
candidate is scored by its beam's cumulative logprob plus its own; one ending in EOS (unless
ignore_eos) is finished, the best beam_width others go on. After max_tokens iterations, or when
no beam is left, the finished and live beams are ranked by `get_beam_search_score`
(length_penalty) and the best beam_width returned. Temperature only changes which token the
engine samples (an extra candidate when it is not among the top ones): the logprobs are the raw
model's, vLLM's default logprobs mode.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from paxengine.errors import InvalidRequest
from paxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paxengine.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks 2 x beam_width logprobs


@dataclass
class BeamSearchParams:
    """vLLM's fields; skip_special_tokens, cache_salt and priority are paxengine's (the text as
    a SamplingParams' default decodes it; what each engine request carries)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0

    def validate(self) -> None:
        bw, lp = self.beam_width, self.length_penalty
        if isinstance(bw, bool) or not isinstance(bw, int) or not 1 <= bw <= MAX_BEAM_WIDTH:
            raise InvalidRequest(
                f"beam_width: must be an integer in [1, {MAX_BEAM_WIDTH}] (each step asks "
                f"2 x beam_width logprobs, at most {MAX_LOGPROBS}), got {bw!r}",
                param="beam_width",
            )
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidRequest(
                f"length_penalty: must be a finite number, got {lp!r}", param="length_penalty"
            )

    def step_params(self) -> SamplingParams:
        """One engine request of an iteration."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            logprobs=2 * self.beam_width,
            cache_salt=self.cache_salt,
            priority=self.priority,
        )

    def whole_params(self) -> SamplingParams:
        """The search as one request, for the engine's checks before it starts (the prompt and
        max_tokens fit the context, temperature, ...): refused there, refused here."""
        p = self.step_params()
        p.n, p.max_tokens = self.beam_width, self.max_tokens
        return p


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's first), one logprobs dict per generated token (the
    step's top candidates), and its cumulative logprob; text is set when it is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | Collection[int],
    length_penalty: float = 1.0,
) -> float:
    """vLLM's (from transformers): the cumulative logprob over the length (the prompt's tokens
    included, a final EOS not) to the power length_penalty."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    # any finite length_penalty ranks (BeamSearchParams.validate): where the power leaves the
    # floats' range, its limit (1e30 overflows: -0.0; -1e308 underflows: -inf)
    try:
        denom = float(seq_len) ** length_penalty
    except (OverflowError, ZeroDivisionError):
        denom = math.inf
    if denom == 0:
        return -math.inf if cumulative_logprob < 0 else 0.0
    return cumulative_logprob / denom


def create_sort_beams_key_function(eos_token_id, length_penalty: float):
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


class BeamSearch:
    """One prompt's search: its live beams and its finished ones. keep_eos: a beam finished by
    EOS keeps the token (vLLM's LLM.beam_search always; its server with
    include_stop_str_in_output)."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        keep_eos: bool | None = None,
    ):
        self.params, self.eos = params, frozenset(eos_token_ids)
        self.keep_eos = params.include_stop_str_in_output if keep_eos is None else keep_eos
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def extend(self, outputs: Sequence[CompletionOutput]) -> None:
        """outputs[i]: the one-token output of self.beams[i]'s request."""
        p, self.steps = self.params, self.steps + 1
        if any(o.finish_reason == "abort" for o in outputs):  # vLLM's: the search ends there
            self.abort()
            return
        candidates = []
        for beam, o in zip(self.beams, outputs):
            if not o.logprobs:  # ended without a token: nothing to extend
                continue
            lps = o.logprobs[0]  # the sampled token first, then the top 2 x beam_width
            for token, lp in lps.items():
                cum = beam.cum_logprob + lp.logprob
                if token in self.eos and not p.ignore_eos:
                    tokens = beam.tokens + [token] if self.keep_eos else list(beam.tokens)
                    self.completed.append(
                        BeamSearchSequence(
                            tokens,
                            beam.logprobs + [lps],
                            cum,
                            finish_reason="stop",
                            stop_reason=token,
                        )
                    )
                else:
                    candidates.append((cum, token, beam, lps))
        # all candidates have one length: their score's order is their logprob's (stable sort,
        # so ties keep the engine's order, as vLLM's sorted())
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.beams = [
            BeamSearchSequence(beam.tokens + [token], beam.logprobs + [lps], cum)
            for cum, token, beam, lps in candidates[: p.beam_width]
        ]

    def abort(self) -> None:
        for beam in self.beams:
            beam.finish_reason = "abort"
        self.completed += self.beams
        self.beams = []

    def best(self) -> list[BeamSearchSequence]:
        key = create_sort_beams_key_function(self.eos, self.params.length_penalty)
        ranked = sorted(self.completed + self.beams, key=key, reverse=True)
        return ranked[: self.params.beam_width]

    def generated_text_ids(self, beam: BeamSearchSequence) -> list[int]:
        """The server's text: the generated tokens without a final EOS (vLLM's)."""
        ids = beam.tokens[self.prompt_len :]
        if ids and ids[-1] in self.eos and not self.params.ignore_eos:
            ids = ids[:-1]
        return ids


# ----------------------------------------------------------------------------- over an engine
@dataclass
class _Live:
    """A running search's engine requests (abort by the search's id aborts them)."""

    step_ids: list[str] = field(default_factory=list)
    aborted: bool = False


def abort_live(live: dict, request_id: str) -> list[str]:
    """Mark the search `request_id` aborted; -> its engine requests in flight (to abort)."""
    entry = live.get(request_id)
    if entry is None:
        return []
    entry.aborted = True
    return list(entry.step_ids)


class BeamSearches:
    """An EngineClient's `beam_search` over its own `generate`, as a mixin: each engine client
    (AsyncEngine, the engine process, data parallel, disaggregated) keeps its running searches
    so that its `abort(request_id)` also aborts the search's step requests (`beam_steps`)."""

    def beam_search(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's EngineClient.beam_search: one finished output, the best beams first."""
        live = self.__dict__.setdefault("_beam_searches", {})
        return beam_search(self, request_id, prompt_token_ids, params, prompt=prompt, live=live)

    def beam_steps(self, request_id: str) -> list[str]:
        """Mark the search `request_id` (if one runs) aborted; -> its requests to abort."""
        return abort_live(self.__dict__.get("_beam_searches", {}), request_id)


def check(engine, prompt_token_ids: Sequence[int], params: BeamSearchParams) -> None:
    """Everything refused before the search starts (InvalidRequest naming the field)."""
    params.validate()
    engine.validate(list(prompt_token_ids), params.whole_params())


async def _last(stream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def _step(engine, prefix: str, beams, params: SamplingParams, entry: _Live):
    """One iteration: every beam's request at once; -> their final outputs, in order."""
    ids = [f"{prefix}-{i}" for i in range(len(beams))]
    entry.step_ids = ids
    tasks: list[asyncio.Future] = []
    try:
        for rid, beam in zip(ids, beams):
            stream = engine.generate(rid, beam.tokens, params)
            tasks.append(asyncio.ensure_future(_last(stream)))
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        for rid in ids:  # also a stream admitted and never iterated
            await engine.abort(rid)
        raise
    finally:
        entry.step_ids = []


async def beam_search(
    engine,
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: BeamSearchParams,
    *,
    prompt: str | None = None,
    live: dict | None = None,
) -> AsyncIterator[RequestOutput]:
    """vLLM's `EngineClient.beam_search` over any EngineClient's `generate`: yields one
    finished RequestOutput, its outputs the best beams (best first) as the server shows them.
    live: the engine's running searches, so that `abort(request_id)` reaches them."""
    check(engine, prompt_token_ids, params)
    ids = list(prompt_token_ids)
    tok = engine.tokenizer
    search = BeamSearch(ids, params, tok.eos_token_ids)
    step = params.step_params()
    entry = _Live()
    if live is not None:
        live[request_id] = entry
    metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(ids))
    cached = 0
    try:
        while not search.done:
            if entry.aborted:
                search.abort()
                break
            outs = await _step(
                engine, f"{request_id}-beam{search.steps}", search.beams, step, entry
            )
            if search.steps == 0:
                metrics.first_scheduled_time = min(
                    (
                        o.metrics.first_scheduled_time
                        for o in outs
                        if o.metrics.first_scheduled_time
                    ),
                    default=None,
                )
                metrics.first_token_time = time.monotonic()
                cached = outs[0].num_cached_tokens or 0
            search.extend([o.outputs[0] for o in outs])
    finally:
        if live is not None:
            live.pop(request_id, None)
    metrics.finished_time = time.monotonic()
    metrics.num_cached_tokens = cached
    outputs = []
    for i, beam in enumerate(search.best()):
        beam.text = tok.decode(
            search.generated_text_ids(beam), skip_special_tokens=params.skip_special_tokens
        )
        outputs.append(
            CompletionOutput(
                index=i,
                text=beam.text,
                token_ids=beam.tokens[search.prompt_len :],
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason,
            )
        )
    yield RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=ids,
        outputs=outputs,
        finished=True,
        metrics=metrics,
        num_cached_tokens=cached,
    )
