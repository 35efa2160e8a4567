"""Per-sequence output processing on the host: detokenize, logprobs, stop strings.

It reads a request's tokens and never changes them: the scheduler owns those (appending,
token-level stops, max_tokens). A stop string is text, so it is found here; the engine then
asks the scheduler to finish the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from paxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paxengine.prompt_logprobs import PromptLogprobs
from paxengine.request import Request
from paxengine.tokenizer import IncrementalDetokenizer, Tokenizer

# One generated token's logprob data: (its logprob, its rank, top ids in rank order, their logprobs)
TokenLogprobs = tuple[float, int, list[int], list[float]]


class SequenceOutput:
    """Text and logprobs of one generated sequence."""

    def __init__(self, req: Request, index: int, tokenizer: Tokenizer | None):
        self.req, self.index = req, index
        self.tok = tokenizer
        self.detok = (
            IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
            if tokenizer
            else None
        )
        self.text = ""
        self.num_seen = 0  # output tokens already detokenized
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if req.params.logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        self.stop_string: str | None = None
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1

    def _decode_one(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok else str(t)

    def update(self, logprobs: list[TokenLogprobs]) -> str | None:
        """Take the tokens the scheduler appended since the last call (`logprobs`: one entry per
        new token); return the stop string they complete, if any."""
        req, p = self.req, self.req.params
        new = req.output_token_ids[self.num_seen :]
        for token, lp in zip(new, logprobs):
            self.num_seen += 1
            self._add_logprobs(token, lp)
            hidden = self._is_hidden_stop_token()
            delta = self.detok.add(token) if self.detok and not hidden else ""
            self.text += delta
            if p.stop and delta and self.num_seen >= p.min_tokens and self._match_stop(len(delta)):
                return self.stop_string
        return None

    def _is_hidden_stop_token(self) -> bool:
        """The token just seen is the stop token (EOS, or one of stop_token_ids) that ended the
        request, and the text leaves it out: vLLM's detokenizer skips it unless
        include_stop_str_in_output (with skip_special_tokens=False, '</s>' ended every text)."""
        req = self.req
        return (
            req.ended_by_stop_token
            and self.num_seen == len(req.output_token_ids)
            and not req.params.include_stop_str_in_output
        )

    def _add_logprobs(self, token: int, lp: TokenLogprobs) -> None:
        logprob, rank, top_ids, top_lps = lp
        self.cumulative_logprob += float(logprob)
        if self.logprobs is None:
            return
        k = self.req.params.logprobs
        entry = {token: Logprob(float(logprob), int(rank), self._decode_one(token))}
        # top_ids come in rank order: the j-th has rank j + 1
        for j, (i, v) in enumerate(zip(top_ids[:k], top_lps[:k])):
            entry.setdefault(int(i), Logprob(float(v), j + 1, self._decode_one(int(i))))
        self.logprobs.append(entry)

    def _match_stop(self, delta_len: int) -> bool:
        p = self.req.params
        longest = max(len(s) for s in p.stop)
        start = max(0, len(self.text) - delta_len - longest + 1)
        best = None
        for s in p.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if p.include_stop_str_in_output else self.text[:i]
        self.stop_string = s
        return True

    def finish(self) -> None:
        if self.detok and self.stop_string is None:
            self.text += self.detok.flush()

    def snapshot(self) -> CompletionOutput:
        req = self.req
        text = self.text
        if not req.is_finished and self.hold and req.params.stop:
            text = text[: max(0, len(text) - self.hold)]  # a stop string may be forming
        # a stop string ends the text even when the same token also reached max_tokens
        stopped = self.stop_string is not None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=req.output_token_ids[: self.num_seen],
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason="stop" if stopped else req.finish_reason,
            stop_reason=self.stop_string if stopped else req.stop_reason,
        )


@dataclass
class RequestGroup:
    """One user request: n sequences over one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceOutput]
    arrival_time: float
    final_only: bool = False  # no per-step outputs, only the finished one (LLM.generate)
    # the prompt's logprobs, filled as its steps are read (SamplingParams.prompt_logprobs)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:  # asked twice per request per step: skip the generator
            return self.seqs[0].req.is_finished
        return all(s.req.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        reqs = [s.req for s in self.seqs]
        finished = self.finished
        if len(reqs) == 1:  # n=1, every streamed step of most requests: no aggregation
            r = reqs[0]
            sched, first, done = r.first_scheduled_time, r.first_token_time, r.finished_time
        else:
            sched = min(
                (r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None),
                default=None,
            )
            first = min(
                (r.first_token_time for r in reqs if r.first_token_time is not None), default=None
            )
            done = max((r.finished_time for r in reqs if r.finished_time is not None), default=None)
        m = RequestMetrics(
            self.arrival_time,
            sched,
            first,
            done if finished else None,
            len(self.prompt_token_ids),
            reqs[0].num_cached_tokens,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [s.snapshot() for s in self.seqs],
            finished,
            m,
            num_cached_tokens=reqs[0].num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> list | None:
        plp = self.prompt_logprobs
        if plp is None:
            return None
        seq = self.seqs[0]
        return plp.entries(seq._decode_one)
