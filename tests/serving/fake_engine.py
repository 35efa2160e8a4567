"""A tiny `EngineClient` for fast unit tests of the server's validation and response shapes (the
real-engine tests are in the other test files). It validates with the engine's own
`validate_request` and returns the engine's own output types; only the tokens are made up."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Optional

from paxengine.client import ModelInfo, served_name, served_names
from paxengine.config import EngineConfig
from paxengine.errors import EngineDead, EngineOverloaded, InvalidRequest
from paxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paxengine.validation import validate_request


class CharTokenizer:
    vocab_size = 256
    eos_token_ids = [0]
    bos_id = None  # a test's knob: a BOS id that add_special_tokens puts first

    def encode(self, text, add_special_tokens=True):
        ids = [b or 1 for b in text.encode("latin-1", "replace")]
        return [self.bos_id] + ids if add_special_tokens and self.bos_id is not None else ids

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i).decode("latin-1")

    def apply_chat_template(
        self, messages, add_generation_prompt=True, continue_final_message=False, **variables
    ):
        s = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        s = s[:-1] if continue_final_message else s  # the last turn stays open
        return s + ("<assistant>" if add_generation_prompt else "")


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        o.index,
        o.text,
        list(o.token_ids),
        o.cumulative_logprob,
        None if o.logprobs is None else list(o.logprobs),
        o.finish_reason,
        o.stop_reason,
    )


class FakeEngine:
    """Generates letters a-z from a seeded RNG, one token per 'step' of `step_s` seconds; or,
    with `script` set, each choice writes that text (one character a token) and stops.
    `waiting` and `healthy` are knobs for the tests; `prefix_cache_busy` makes a reset fail."""

    script: Optional[str] = None

    def __init__(self, config: Optional[EngineConfig] = None, step_s: float = 0.002):
        self.config = config or EngineConfig(
            max_model_len=128, max_waiting_requests=8, served_model_name="fake-model"
        )
        self.tokenizer = CharTokenizer()
        self.step_s = step_s
        self.running: dict[str, bool] = {}
        self.waiting = 0
        self.healthy = True
        self.prefix_cache_busy = False
        self.resets = 0
        self.aborted: list[str] = []
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}
        cfg = self.config
        self.info = ModelInfo(
            name=served_name(cfg),  # the engine's aliases: the other served names, the model
            aliases=tuple(served_names(cfg)[1:]) + ((cfg.model,) if cfg.model else ()),
            max_model_len=cfg.max_model_len or 128,
            vocab_size=256,
            dtype="float32",
            weight_dtype="float32",
            kv_cache_dtype="float32",
            kv_capacity_tokens=1 << 20,
            buckets=((16, 4),),
        )

    def model_info(self) -> ModelInfo:
        return self.info

    async def start(self):
        pass

    async def shutdown(self):
        pass

    def is_healthy(self):
        return self.healthy

    def stats(self):
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": self.waiting,
            "kv_cache_usage_perc": 0.01 * len(self.running),
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            **self.totals,
        }

    def validate(self, prompt_token_ids, params):
        validate_request(prompt_token_ids, params, self.info.limits)

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    async def reset_prefix_cache(self):
        if not self.healthy:
            raise EngineDead("fake engine is down")
        self.resets += 1
        return not self.prefix_cache_busy

    def generate(self, request_id, prompt, params):
        """Checks at once, like AsyncEngine; the outputs come from the returned iterator."""
        if not self.healthy:
            raise EngineDead("fake engine is down")
        prompt_token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        self.validate(prompt_token_ids, params)
        if request_id in self.running:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if self.waiting >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"{self.waiting} requests are waiting")
        self.running[request_id] = True
        return self._run(request_id, list(prompt_token_ids), params)

    async def _run(self, request_id, ids, params):
        m = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(ids))
        outs = [
            CompletionOutput(
                index=i, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
            )
            for i in range(params.n)
        ]
        rngs = [
            random.Random(hash((params.seed, i)) if params.seed is not None else None)
            for i in range(params.n)
        ]
        self.totals["prompt_tokens"] += len(ids)
        try:
            m.first_scheduled_time = time.monotonic()
            while not all(o.finish_reason for o in outs):
                await asyncio.sleep(self.step_s)
                if request_id not in self.running:  # aborted: a last output, as AsyncEngine
                    for o in outs:
                        o.finish_reason = o.finish_reason or "abort"
                    m.finished_time = time.monotonic()
                    yield RequestOutput(request_id, None, ids, [_copy(o) for o in outs], True, m)
                    return
                for o, rng in zip(outs, rngs):
                    if o.finish_reason:
                        continue
                    k = len(o.token_ids)
                    tid = ord(self.script[k]) if self.script else 97 + rng.randrange(26)
                    o.token_ids.append(tid)
                    self.totals["generation_tokens"] += 1
                    o.text += chr(tid)
                    if o.logprobs is not None:
                        o.logprobs.append(
                            {
                                tid: Logprob(-0.5, 1, chr(tid)),
                                **{
                                    t: Logprob(-1.0 - r, r + 2, chr(t))
                                    for r, t in enumerate(x for x in range(97, 123) if x != tid)
                                    if r < max(params.logprobs - 1, 0)
                                },
                            }
                        )
                    for s in params.stop:
                        if s in o.text:
                            o.text = o.text[: o.text.index(s)]
                            o.finish_reason, o.stop_reason = "stop", s
                    if self.script and not o.finish_reason and k + 1 == len(self.script):
                        o.finish_reason = "stop"
                    if not o.finish_reason and len(o.token_ids) >= (params.max_tokens or 16):
                        o.finish_reason = "length"
                m.first_token_time = m.first_token_time or time.monotonic()
                done = all(o.finish_reason for o in outs)
                if done:
                    m.finished_time = time.monotonic()
                out = RequestOutput(request_id, None, ids, [_copy(o) for o in outs], done, m)
                out.prompt_logprobs = _prompt_logprobs(ids, params.prompt_logprobs)
                yield out
        finally:
            self.running.pop(request_id, None)


def _prompt_logprobs(ids, k):
    """A prompt's logprobs as the engine shapes them (made up: each token -0.25 at rank 1, then
    the next letters of the alphabet), or None when not asked."""
    if k is None:
        return None
    out = [None]
    for t in ids[1:]:
        e = {t: Logprob(-0.25, 1, chr(t))}
        for r, x in enumerate(x for x in range(97, 123) if x != t):
            if r >= max(k - 1, 0):
                break
            e[x] = Logprob(-2.0 - r, r + 2, chr(x))
        out.append(e)
    return out


class ScriptedEngine(FakeEngine):
    """Writes `script` one character (token) per step, then stops; records each request's
    SamplingParams and template variables."""

    script = ""

    def __init__(self, config=None):
        config = config or EngineConfig(max_model_len=4096, served_model_name="fake-model")
        super().__init__(config, step_s=0.0005)
        self.params, self.variables = [], []
        tok, record = self.tokenizer, self.variables
        original = tok.apply_chat_template

        def apply(messages, add_generation_prompt=True, continue_final_message=False, **v):
            record.append({"messages": messages, **v})
            return original(messages, add_generation_prompt, continue_final_message, **v)

        tok.apply_chat_template = apply

    def generate(self, request_id, prompt, params):
        self.params.append(params)
        return super().generate(request_id, prompt, params)

    async def _run(self, request_id, ids, params):
        m = RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(ids))
        text = self.script[: params.max_tokens]
        try:
            for n in range(1, len(text) + 1):
                done = n == len(text)
                finish = ("stop" if len(text) == len(self.script) else "length") if done else None
                o = CompletionOutput(0, text[:n], [ord(ch) for ch in text[:n]], None, None, finish)
                yield RequestOutput(request_id, None, ids, [o], done, m)
        finally:
            self.running.pop(request_id, None)
