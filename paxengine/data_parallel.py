"""DataParallelEngine: N engine replicas behind one `EngineClient`, each on its own devices.

Replica r is an `AsyncEngine` on devices [r * tp, (r + 1) * tp) (`EngineConfig.first_device`),
with its own scheduler and KV cache. A request goes to the replica that holds the longest cached
prefix of its prompt, unless that replica is busier than the least loaded one by more than
`slack` requests; otherwise to the least loaded (vllm#11477 asks vLLM for this routing). Load is
running + waiting requests, read between steps without a lock (a hint, as a metrics scrape is).
"""

from __future__ import annotations

import itertools
import logging
from typing import AsyncIterator, Sequence

from paxengine.async_engine import AsyncEngine
from paxengine.beam_search import BeamSearches
from paxengine.client import ModelInfo
from paxengine.config import EngineConfig
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams

log = logging.getLogger("paxengine")

# how a stat of the replicas adds up: counters and gauges of requests sum, these do not
_MEAN = ("kv_cache_usage_perc",)
# compiles are counted per process (each replica sees them all); every replica has one block size
_MAX = ("xla_compiles_after_warmup", "block_size")


class DataParallelEngine(BeamSearches):
    """An `EngineClient` over `config.data_parallel_size` AsyncEngine replicas."""

    def __init__(self, config: EngineConfig | None = None, **overrides):
        cfg = (config or EngineConfig()).replace(**overrides)
        n, tp = cfg.data_parallel_size, cfg.tensor_parallel_size
        if n < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {n}")
        self.config = cfg
        self.replicas = [
            AsyncEngine(cfg.replace(data_parallel_size=1, first_device=cfg.first_device + r * tp))
            for r in range(n)
        ]
        # a replica may be this many requests busier than the least loaded one and still get
        # a request whose prefix it holds
        self.slack = max(2, self.replicas[0].config.max_num_seqs // 4)  # its resolved one
        self._owner: dict[str, int] = {}
        self._turn = itertools.count()
        self.routed = [0] * n  # requests sent to each replica
        self.routed_by_prefix = 0  # of those, sent for a cached prefix

    # -- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    def model_info(self) -> ModelInfo:
        return self.replicas[0].model_info()  # every replica runs the same model and limits

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        # a structured-output constraint compiles on every replica (each caches its own): the
        # server validates in a worker thread, so `generate` then finds it compiled wherever the
        # request is routed and never compiles on the event loop
        constrained = getattr(params, "structured_outputs", None) is not None
        for r in self.replicas if constrained else self.replicas[:1]:
            r.validate(prompt_token_ids, params)

    def is_healthy(self) -> bool:
        return all(r.is_healthy() for r in self.replicas)

    def stats(self) -> dict:
        per = [r.stats() for r in self.replicas]
        total = {}
        for k in per[0]:
            vals = [s[k] for s in per]
            if isinstance(vals[0], list):  # per-position counters
                total[k] = [sum(x) for x in zip(*vals)]
            elif k in _MEAN:
                total[k] = sum(vals) / len(vals)
            elif k in _MAX:
                total[k] = max(vals)
            else:
                total[k] = sum(vals)
        return {**total, "replicas": per, "routed": list(self.routed)}

    async def start(self) -> None:
        for r in self.replicas:
            await r.start()

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.shutdown()

    def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        _, ids = self.replicas[0].core.tokenize_prompt(prompt)  # InvalidRequest if malformed
        r = self.route(ids, getattr(params, "cache_salt", None))
        outputs = self.replicas[r].generate(request_id, prompt, params)  # raises before output
        self._owner[request_id] = r
        self.routed[r] += 1
        return self._forget_when_done(request_id, outputs)

    def engine_index(self, request_id: str) -> int | None:
        """The replica serving a live request (its `engine` label on /metrics)."""
        return self._owner.get(request_id)

    async def abort(self, request_id: str) -> None:
        r = self._owner.get(request_id)
        if r is not None:
            await self.replicas[r].abort(request_id)
        for step_id in self.beam_steps(request_id):  # a beam search's requests in flight
            await self.abort(step_id)

    async def reset_prefix_cache(self) -> bool:
        done = [await r.reset_prefix_cache() for r in self.replicas]
        return all(done)

    # -- routing --------------------------------------------------------------------------------
    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        loads = []
        for rep in self.replicas:
            s = rep.stats()
            loads.append(s["num_requests_running"] + s["num_requests_waiting"])
        least = min(loads)
        hits = [rep.core.kv.cached_prefix_blocks(token_ids, cache_salt) for rep in self.replicas]
        best = max(range(len(hits)), key=lambda r: (hits[r], -loads[r]))
        if hits[best] > 0 and loads[best] <= least + self.slack:
            self.routed_by_prefix += 1
            return best
        idle = [r for r, load in enumerate(loads) if load == least]
        return idle[next(self._turn) % len(idle)]  # ties in turn, not always replica 0

    async def _forget_when_done(self, request_id: str, outputs):
        try:
            async for out in outputs:
                yield out
        finally:
            self._owner.pop(request_id, None)
