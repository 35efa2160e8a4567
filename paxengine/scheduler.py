"""Continuous-batching scheduler in the style of vLLM V1: a step is {request_id: num_tokens}.

Running requests first (decode tokens and unfinished prefill chunks), then waiting ones, within
a token budget and a sequence cap. Long prompts are chunked. When blocks run out, the newest
running request is preempted (its blocks freed; it is recomputed later). No JAX in here.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from paxengine.kv_cache import KVCacheManager
from paxengine.request import PLACEHOLDER, Request, Status


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)   # in batch order
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, token_buckets: list[int] | None = None):
        self.kv = kv
        self.token_buckets = sorted(token_buckets or [])   # the runner's compiled step sizes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- admission ------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse, with a clear message, a request that could never be scheduled."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                             f"{total} exceeds max_model_len ({self.max_model_len})")
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs "
                             f"{self.kv.blocks_needed(total)} KV blocks but the pool has only "
                             f"{self.kv.num_blocks}")

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running[-1]          # newest first
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != Status.RUNNING:       # it preempted itself: nothing more fits
                break
            out.num_scheduled_tokens[req.request_id] = n
            out.requests.append(req)
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            already = req.num_computed_tokens + len(cached) * self.kv.block_size
            n = min(req.num_tokens - already, budget)
            if not self.kv.allocate(req, n, cached):
                break
            self.waiting.popleft()
            if req.num_computed_tokens == 0:
                req.num_cached_tokens = len(cached) * self.kv.block_size
            req.num_computed_tokens = already
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            out.requests.append(req)
            budget -= n
        self._fit_bucket(out)
        return out

    def _fit_bucket(self, out: SchedulerOutput) -> None:
        """Shorten the last prefill chunk so the step fills a compiled token bucket exactly when
        that defers fewer tokens than padding would waste: 63 decodes + a 1024-token prompt is
        1087 tokens, which pads to 4096 (every matmul runs 4096 rows); 1024 now and 63 next step
        costs nothing. The chunk's extra blocks stay allocated for the next step."""
        total = out.total_tokens
        i = bisect.bisect_left(self.token_buckets, total)
        if i == 0 or i == len(self.token_buckets) or self.token_buckets[i] == total:
            return
        lower, upper = self.token_buckets[i - 1], self.token_buckets[i]
        excess = total - lower
        last = out.requests[-1]
        n = out.num_scheduled_tokens[last.request_id]
        if n > excess and excess < upper - total:
            out.num_scheduled_tokens[last.request_id] = n - excess

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        if req.request_id in out.num_scheduled_tokens:
            del out.num_scheduled_tokens[req.request_id]
            out.requests.remove(req)

    # -- after the step -------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[Request]:
        """Count this step's tokens as computed; return the requests that produced a new token
        (those whose whole prompt and output are now in the cache)."""
        sampled = []
        for req in out.requests:
            if req.status != Status.RUNNING:      # finished (or preempted) since it was scheduled
                continue
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            self.kv.cache_computed_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req)
        return sampled

    def finish(self, req: Request, reason: str) -> None:
        """End a request for any reason; its blocks go back to the pool (or stay cached)."""
        if req.status == Status.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free_request(req)
        if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
            req.output_token_ids.pop()          # its sample is still on the device: drop it
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
