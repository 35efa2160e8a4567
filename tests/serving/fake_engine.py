"""A tiny stand-in for AsyncEngine with the documented API, for fast unit tests of the server's
validation and response shapes (the real-engine tests are in the other test files)."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Optional

from paxengine.config import EngineConfig


class CharTokenizer:
    vocab_size = 256
    eos_token_ids = [0]

    def encode(self, text, add_special_tokens=True):
        return [b or 1 for b in text.encode("latin-1", "replace")]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i).decode("latin-1")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        s = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: Optional[list] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: object = None


@dataclass
class Metrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: Metrics


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(o.index, o.text, list(o.token_ids),
                            None if o.logprobs is None else list(o.logprobs),
                            o.cumulative_logprob, o.finish_reason, o.stop_reason)


class FakeEngine:
    """Generates letters a-z from a seeded RNG, one token per 'step' of `step_s` seconds."""

    def __init__(self, config: Optional[EngineConfig] = None, step_s: float = 0.002):
        self.config = config or EngineConfig(max_model_len=128, max_waiting_requests=8,
                                             served_model_name="fake-model")
        self.tokenizer = CharTokenizer()
        self.step_s = step_s
        self.running: dict[str, bool] = {}
        self.waiting = 0
        self.healthy = True
        self.aborted: list[str] = []
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}

    async def start(self):
        pass

    async def shutdown(self):
        pass

    def is_healthy(self):
        return self.healthy

    def stats(self):
        return {"num_requests_running": len(self.running), "num_requests_waiting": self.waiting,
                "kv_cache_usage_perc": 0.01 * len(self.running), "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_preemptions": 0, **self.totals}

    def validate(self, prompt_token_ids, params):
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError("prompt: too long")
        params.validate(self.tokenizer.vocab_size)

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    async def generate(self, request_id, prompt, params):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        m = Metrics(arrival_time=time.monotonic(), num_prompt_tokens=len(ids))
        outs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)]
        rngs = [random.Random(hash((params.seed, i)) if params.seed is not None else None)
                for i in range(params.n)]
        self.running[request_id] = True
        self.totals["prompt_tokens"] += len(ids)
        try:
            m.first_scheduled_time = time.monotonic()
            while not all(o.finish_reason for o in outs):
                await asyncio.sleep(self.step_s)
                if request_id not in self.running:
                    return
                for o, rng in zip(outs, rngs):
                    if o.finish_reason:
                        continue
                    tid = 97 + rng.randrange(26)
                    o.token_ids.append(tid)
                    self.totals["generation_tokens"] += 1
                    o.text += chr(tid)
                    if o.logprobs is not None:
                        o.logprobs.append({tid: Logprob(-0.5, 1, chr(tid)),
                                           **{t: Logprob(-1.0 - r, r + 2, chr(t))
                                              for r, t in enumerate(x for x in range(97, 123) if x != tid)
                                              if r < max(params.logprobs - 1, 0)}})
                    for s in params.stop:
                        if s in o.text:
                            o.text = o.text[:o.text.index(s)]
                            o.finish_reason, o.stop_reason = "stop", s
                    if not o.finish_reason and len(o.token_ids) >= (params.max_tokens or 16):
                        o.finish_reason = "length"
                m.first_token_time = m.first_token_time or time.monotonic()
                done = all(o.finish_reason for o in outs)
                if done:
                    m.finished_time = time.monotonic()
                yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids,
                                    [_copy(o) for o in outs], done, m)
        finally:
            self.running.pop(request_id, None)
