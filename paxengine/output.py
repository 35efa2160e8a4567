"""Per-sequence output processing on the host: detokenize, logprobs, stop conditions."""
from __future__ import annotations

import time

from paxengine.outputs import CompletionOutput, Logprob
from paxengine.request import PLACEHOLDER, Request
from paxengine.tokenizer import IncrementalDetokenizer, Tokenizer


class SequenceOutput:
    """Text and logprobs of one generated sequence; decides when it must stop."""

    def __init__(self, req: Request, index: int, tokenizer: Tokenizer | None,
                 eos_token_ids: list[int], max_model_len: int):
        self.req, self.index = req, index
        self.tok = tokenizer
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                             req.params.skip_special_tokens) if tokenizer else None)
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if req.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1

    def _decode_one(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok else str(t)

    def append(self, token: int, logprob: float, rank: int, top_ids, top_lps) -> str | None:
        """Record one sampled token; return a finish reason when the sequence must end."""
        req, p = self.req, self.req.params
        if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
            req.output_token_ids[-1] = token
        else:
            req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.cumulative_logprob += float(logprob)
        if self.logprobs is not None:
            entry = {token: Logprob(float(logprob), int(rank), self._decode_one(token))}
            # top_ids come in rank order: the j-th has rank j + 1
            for j, (i, lp) in enumerate(zip(top_ids[:p.logprobs], top_lps[:p.logprobs])):
                entry.setdefault(int(i), Logprob(float(lp), j + 1, self._decode_one(int(i))))
            self.logprobs.append(entry)
        delta = self.detok.add(token) if self.detok else ""
        self.text += delta
        n = len(req.output_token_ids)
        if n >= p.min_tokens:
            if token in self.eos and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if p.stop and delta and self._match_stop(len(delta)):
                return "stop"
        if p.max_tokens is not None and n >= p.max_tokens:
            return "length"
        if req.num_tokens >= self.max_model_len:
            return "length"
        return None

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
        self.text = self.text[:i + len(s)] if p.include_stop_str_in_output else self.text[:i]
        self.req.stop_reason = s
        return True

    def finish(self) -> None:
        if self.detok and not isinstance(self.req.stop_reason, str):
            self.text += self.detok.flush()

    def snapshot(self) -> CompletionOutput:
        req = self.req
        text = self.text
        if not req.is_finished and self.hold and self.req.params.stop:
            text = text[:max(0, len(text) - self.hold)]   # a stop string may be forming
        return CompletionOutput(
            index=self.index, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason)
