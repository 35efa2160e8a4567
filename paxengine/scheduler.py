"""Continuous-batching scheduler in the style of vLLM V1: a step is {request_id: num_tokens}.

Running requests first (decode tokens and unfinished prefill chunks), then waiting ones, within
a token budget and a sequence cap. Long prompts are chunked. When blocks run out, the newest
running request is preempted (its blocks freed; it is recomputed later). No JAX in here.

The scheduler is the one owner of a request's tokens and progress: `schedule` counts the
scheduled tokens as computed and a sample as pending, `update_from_output` turns a step's samples
(1..k+1 per request) into output tokens, applies the token-level stops and max_tokens, and
`finish` frees the blocks. Stop strings are text: the output processor finds them and calls
`finish`. A request's grammar (structured output) advances here too, once per accepted token, and
a complete grammar ends the request.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

from paxengine.kv_cache import KVCacheManager
from paxengine.request import Request, Status
from paxengine.spec_decode import SpeculativeConfig, propose_ngram
from paxengine.spec_decode.metrics import SpecDecodeStats

# a step budget above decode_step_token_budget applies once the prompt tokens to prefill reach
# this many times it
BACKLOG_TRIGGER = 2
# "graded": the budget doubles with the backlog up to backlog_step_token_budget; "jump" (the rule
# before 2026-12-03, kept to measure against): decode_step_token_budget, or the backlog budget
# once 2x it waits. Read once per process (a spawned engine process inherits the environment).
BACKLOG_STEPS = os.environ.get("PAXENGINE_BACKLOG_STEPS", "graded")
if BACKLOG_STEPS not in ("graded", "jump"):
    raise ValueError(f"PAXENGINE_BACKLOG_STEPS must be graded or jump, got {BACKLOG_STEPS!r}")

log = logging.getLogger("paxengine")

POLICIES = ("fcfs", "priority")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")


def _rank(req: Request) -> tuple:
    """Priority order: lower priority value first, then earlier arrival."""
    return (req.params.priority, req.arrival_time)


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)  # in batch order
    preempted: list[Request] = field(default_factory=list)
    sampling: set[str] = field(default_factory=set)  # ids of the requests this step samples for
    # speculative decoding: request id -> the draft tokens this step verifies (scheduled after
    # its last known token; each has a sampled position of its own)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # a chained verify step (spec_decode/chain.py): every row takes K drafts the device makes;
    # `drafts` holds -1s until the engine reads the step and writes in what the device drafted
    chained: bool = False
    # a hybrid model's prefix cache (state_snapshots.py): request id -> the snapshot slot its
    # recurrent state starts from (a cache hit), and -> (boundary, slot) to keep the state
    # reached at the end of this step's chunk
    restore: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_sample_rows(self) -> int:
        """Sampled positions: one per request, one more per draft."""
        return len(self.requests) + sum(len(d) for d in self.drafts.values())

    def sample_rows(self) -> dict[str, int]:
        """Request id -> its first sampled position (its others follow), as build_step packs
        them."""
        rows, r = {}, 0
        for req in self.requests:
            rows[req.request_id] = r
            r += len(self.drafts.get(req.request_id, ())) + 1
        return rows

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        token_buckets: list[int] | None = None,
        eos_token_ids: list[int] = (),
        decode_step_token_budget: int | None = None,
        backlog_step_token_budget: int | None = None,
        policy: str = "fcfs",
        spec: SpeculativeConfig | None = None,
        max_sample_rows: int | None = None,
    ):
        """spec: speculative decoding (n-gram drafts for decoding requests while at most
        spec.disable_by_batch_size run); max_sample_rows: the sampled positions a step may have
        (the largest sequence bucket: each draft takes a row of its own);
        backlog_step_token_budget: see `_decoding_step_budget`."""
        check_policy(policy)
        self.spec = spec
        self.max_sample_rows = max_sample_rows or max_num_seqs
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        self.policy = policy
        self.kv = kv
        self.decode_step_token_budget = decode_step_token_budget
        self.backlog_step_token_budget = backlog_step_token_budget
        self.eos_token_ids = frozenset(eos_token_ids)
        self.token_buckets = sorted(token_buckets or [])  # the runner's compiled step sizes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # called as finish(req, reason) ends a request, before its blocks go back: disaggregated
        # prefill sends a finished prompt's pages from here (paxengine/disagg/roles.py)
        self.on_finish = None
        # proposer(req, k) -> drafts, instead of the n-gram lookup: the draft model's
        # (spec_decode/draft_model.py), which drafts every request before schedule() runs
        self.proposer = None

    # -- admission ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self._enqueue(req, front=False)

    def _enqueue(self, req: Request, front: bool) -> None:
        """fcfs: at the back, or at the front (a preempted request goes on before new ones);
        priority: in rank order, wherever it came from."""
        if self.policy == "priority":
            bisect.insort_right(self.waiting, req, key=_rank)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _victim(self) -> Request:
        """Whom to preempt when blocks run out: the newest running request (fcfs), or the
        lowest-ranked one (priority)."""
        if self.policy == "priority":
            return max(self.running, key=_rank)
        return self.running[-1]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decode rows first, so no prompt chunk can crowd a decoding request out of a step;
        then the running requests' prompt chunks, then waiting requests. While requests decode,
        the step takes at most `decode_step_token_budget` tokens: a long prefill then moves
        on in chunks and stalls each decode by one short step, not one full-budget step."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        budget, full = self._schedule_running(decoding, out, budget, self.speculating())
        if out.requests and self.decode_step_token_budget is not None:
            # prompts keep at least half the cap beside any number of decodes: at the cap's
            # worth of decoding rows they would otherwise never be prefilled
            cap = self._decoding_step_budget(prefilling)
            budget = min(budget, max(cap - out.total_tokens, cap // 2))
        if not full:
            budget, _ = self._schedule_running(prefilling, out, budget)

        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(self.running) + self._num_drafts(out) < self.max_sample_rows  # drafts' rows
            and not out.preempted
        ):
            req = self.waiting[0]
            if req.num_pending_tokens:  # preempted with a sample still on the device
                break
            # prompt logprobs need every prompt position computed: no hit for such a request
            hit = req.num_computed_tokens == 0 and req.params.prompt_logprobs is None
            cached = self.kv.find_cached_prefix(req) if hit else []
            already = req.num_computed_tokens + len(cached) * self.kv.block_size
            n = self._cut_at_snapshot(req, already, min(req.num_tokens - already, budget))
            if not self.kv.allocate(req, n, cached):
                break
            if cached and self.kv.snapshots is not None:
                out.restore[req.request_id] = self.kv.restore_slot(cached)
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
        self._mark_snapshots(out)
        self._count_scheduled(out)
        return out

    # -- a hybrid model's state snapshots (state_snapshots.py) ---------------------------------
    def _snapshot_boundary(self, req: Request) -> int:
        """Where the request's recurrent state is kept for the prefix cache: after the last full
        block before its prompt's last token (0: none)."""
        if self.kv.snapshots is None:
            return 0
        bs = self.kv.block_size
        return (req.num_prompt_tokens - 1) // bs * bs

    def _cut_at_snapshot(self, req: Request, start: int, n: int) -> int:
        """A prefill chunk of n tokens from `start` that would pass the boundary ends on it."""
        b = self._snapshot_boundary(req)
        return b - start if start < b < start + n else n

    def _mark_snapshots(self, out: SchedulerOutput) -> None:
        """The rows whose chunk ends on their boundary keep the state there (a slot each)."""
        if self.kv.snapshots is None:
            return
        for req in out.requests:
            b = self._snapshot_boundary(req)
            start = req.num_computed_tokens
            if b and start < b == start + out.num_scheduled_tokens[req.request_id]:
                out.snapshots[req.request_id] = (b, self.kv.snapshots.take())

    def _decoding_step_budget(self, prefilling: list[Request]) -> int:
        """A step's token cap while requests decode: decode_step_token_budget, doubled (up to
        backlog_step_token_budget) while the prompt tokens still to prefill (waiting requests',
        running ones' rest) come to twice the doubled cap or more. Small steps keep a trickle of
        arrivals next to the decodes, one weight read for both; a backlog would take longer to
        prefill in them, which is its TTFT tail (H200, 8B: ~33 us a prompt token in 512-token
        steps beside 60 decodes, ~23 us in 4,096-token steps). Graded, a few waiting prompts
        (Poisson arrivals at 16 req/s) get mid-sized steps where a burst of 64 gets the largest
        (sched_sim: TTFT p99 at 16 req/s 197 -> 150 ms for TPOT p99 13.1 -> 13.7 ms)."""
        small, big = self.decode_step_token_budget, self.backlog_step_token_budget
        if big is None:
            return small
        backlog = sum(r.num_prompt_tokens - r.num_computed_tokens for r in prefilling)
        trigger = BACKLOG_TRIGGER * big
        for req in self.waiting:  # stops early: the queue may hold thousands
            if backlog >= trigger:
                break
            backlog += req.num_tokens - req.num_computed_tokens
        if BACKLOG_STEPS == "jump":
            return big if backlog >= trigger else small
        budget = small
        while budget < big and backlog >= BACKLOG_TRIGGER * min(2 * budget, big):
            budget = min(2 * budget, big)
        return budget

    def speculating(self) -> bool:
        """Whether the next step proposes drafts: speculation is on and few enough run (above
        disable_by_batch_size a verify step costs more than it saves). The engine then reads
        the step in flight first, so every decoding request's last token is on the host."""
        return (
            self.spec is not None
            and 0 < len(self.running) <= self.spec.disable_by_batch_size
            # constrained ones never speculate
            and any(r.grammar is None and not r.forces_tokens for r in self.running)
        )

    def can_chain(self, prev: SchedulerOutput) -> bool:
        """Whether the next step can be a chained verify step on `prev`, still in flight:
        n-gram speculation with nothing waiting, every running request decoding with its
        sample pending in `prev`, and each far enough from its max_tokens and the context that
        the unchained engine would draft K for it too (so both draft the same). Requests whose
        sampling depends on the host's tokens (penalties, a grammar, min_tokens) are read
        first, masked rows (allowed_token_ids, bad_words) take the unchained path, and blocks
        for the worst case (K + 1 more tokens each) must be free: a chained step never
        preempts."""
        if self.proposer is not None or self.waiting or not self.speculating():
            return False
        K = self.spec.num_speculative_tokens
        if len(self.running) * (K + 1) > min(self.max_sample_rows, self.max_num_batched_tokens):
            return False
        need = 0
        for req in self.running:
            p = req.params
            if (
                req.request_id not in prev.sampling
                or req.num_pending_tokens != 1
                or req.grammar is not None
                or req.forces_tokens
                or p.allowed_token_ids is not None  # masked rows: the unchained path
                or p.bad_words_token_ids
                or p.has_penalties
                or len(req.output_token_ids) < p.min_tokens
                or req.num_known_tokens + 3 * (K + 1) > self.max_model_len
                or (
                    p.max_tokens is not None
                    and len(req.output_token_ids) + 3 * (K + 1) > p.max_tokens
                )
            ):
                return False
            blocks = self.kv.blocks_needed(req.num_computed_tokens + K + 1)
            need += max(blocks - len(req.block_ids), 0)
        return need <= len(self.kv.free)

    def schedule_chained(self) -> SchedulerOutput:
        """A chained verify step (after `can_chain`): every running request, K + 1 tokens."""
        K = self.spec.num_speculative_tokens
        out = SchedulerOutput(chained=True)
        for req in self.running:
            ok = self.kv.allocate(req, K + 1)
            assert ok, "can_chain counted the blocks"
            out.num_scheduled_tokens[req.request_id] = K + 1
            out.requests.append(req)
            out.drafts[req.request_id] = [-1] * K
        self._count_scheduled(out)
        return out

    @staticmethod
    def _num_drafts(out: SchedulerOutput) -> int:
        return sum(len(d) for d in out.drafts.values())

    def _propose(self, req: Request, out: SchedulerOutput, budget: int) -> list[int]:
        """Drafts for a decoding request whose tokens are all on the host, within the token
        budget, the sample rows, max_tokens and the context. A constrained request does not
        speculate (its mask for each draft position would need the grammar advanced through
        the drafts before they are verified)."""
        if (
            req.num_pending_tokens
            or req.grammar is not None
            or req.forces_tokens
            or req.num_tokens - req.num_computed_tokens != 1
        ):
            return []
        k = min(
            self.spec.num_speculative_tokens,
            budget - 1,
            self.max_model_len - req.num_tokens,
            self.max_sample_rows - len(self.running) - self._num_drafts(out),
        )
        if req.params.max_tokens is not None:  # the last draft's bonus token ends the request
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        if k < 1:
            return []
        if self.proposer is not None:
            return self.proposer(req, k)
        spec = self.spec
        return propose_ngram(req.token_array(), spec.prompt_lookup_min, spec.prompt_lookup_max, k)

    def _schedule_running(
        self, reqs: list[Request], out: SchedulerOutput, budget: int, speculate: bool = False
    ):
        """Schedule what each request needs next, in order, preempting the newest running
        request when blocks run out. Returns the budget left and whether the pool is full
        (a request had to preempt itself). speculate: decoding requests also take their drafts
        when their blocks fit (drafts never preempt anyone)."""
        for req in reqs:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = self._cut_at_snapshot(req, req.num_computed_tokens, n)
            if req.status != Status.RUNNING or n <= 0 or self._ends_with_pending(req):
                continue  # preempted above as a victim, or nothing to compute now
            drafts = self._propose(req, out, budget) if speculate else []
            if drafts and self.kv.allocate(req, n + len(drafts)):
                n += len(drafts)
                out.drafts[req.request_id] = drafts
            while not self.kv.allocate(req, n):
                victim = self._victim()
                self._preempt(victim, out)
                if victim is req:
                    return budget, True  # it preempted itself: nothing more fits
            out.num_scheduled_tokens[req.request_id] = n
            out.requests.append(req)
            if req.state_restore >= 0:  # drafts rejected last step: start from the kept state
                out.restore[req.request_id] = req.state_restore
                req.state_restore = -1
            budget -= n
        return budget, False

    def _ends_with_pending(self, req: Request) -> bool:
        """The sample on the device is its last (max_tokens or the context reached): another
        row would be wasted. It finishes in update_from_output."""
        p = req.params
        return req.num_pending_tokens > 0 and (
            (p.max_tokens is not None and req.num_output_tokens >= p.max_tokens)
            or req.num_tokens >= self.max_model_len
        )

    def _count_scheduled(self, out: SchedulerOutput) -> None:
        """The step will compute the scheduled tokens; a request whose every token is then in
        the cache gets a sample, pending until update_from_output."""
        for req in out.requests:
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            # past num_tokens: the drafts, computed until update_from_output rolls back the
            # rejected ones
            if req.num_computed_tokens >= req.num_tokens:
                req.num_pending_tokens += 1
                out.sampling.add(req.request_id)

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
        if last.request_id in out.drafts:  # a verify row is not a prompt chunk to shorten
            return
        n = out.num_scheduled_tokens[last.request_id]
        if n > excess and excess < upper - total:
            out.num_scheduled_tokens[last.request_id] = n - excess

    def _send_back(self, req: Request) -> None:
        """A running request gives up its blocks and waits to be recomputed."""
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._send_back(req)
        out.preempted.append(req)
        if req.request_id in out.num_scheduled_tokens:
            del out.num_scheduled_tokens[req.request_id]
            out.requests.remove(req)
            out.drafts.pop(req.request_id, None)

    def requeue_all(self) -> None:
        """After a failed step, whose device state is lost: every running request starts over by
        recompute (its blocks freed, its unread samples dropped), in order, ahead of the
        waiting ones. The tokens the host knows are kept."""
        for req in reversed(self.running):
            self._send_back(req)
        self.running.clear()
        for req in self.waiting:
            req.num_pending_tokens = 0

    # -- after the step -------------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Take a finished step's samples (request id -> its new token ids, 1..k+1 of them):
        append them, stop at EOS, a stop token, max_tokens or the context, publish the full
        blocks. Returns the requests that got tokens, finished ones included."""
        updated = []
        for req in out.requests:
            if req.status == Status.FINISHED:  # aborted or stopped since it was scheduled
                continue
            tokens = sampled.get(req.request_id)
            if tokens is not None:
                req.num_pending_tokens -= 1
                drafts = out.drafts.get(req.request_id)
                if out.chained:
                    self._settle_chained(req, drafts, len(tokens) - 1)
                elif drafts is not None:  # tokens: the accepted drafts and one more
                    self._settle_drafts(req, len(drafts), len(tokens) - 1)
                self._append(req, tokens)
                updated.append(req)
            if not req.is_finished:
                self.kv.cache_computed_blocks(req)
            snap = out.snapshots.get(req.request_id)
            if snap is not None:  # written by the step just done: bound, or the slot freed
                if req.status == Status.RUNNING:
                    self.kv.bind_snapshot(req, *snap)
                else:
                    self.kv.snapshots.release(snap[1])
        return updated

    def _settle_drafts(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """The rejected drafts' KV is not the sequence's: they no longer count as computed, and
        blocks that hold only rejected slots go back to the pool (the kept slots are overwritten
        by the next tokens, and attention never reads past seq_lens)."""
        req.num_computed_tokens -= num_drafts - num_accepted
        self.kv.trim(req, req.num_computed_tokens)
        self.spec_stats.record(num_drafts, num_accepted)
        self._settle_state(req, num_drafts, num_accepted)

    def _settle_state(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A hybrid's recurrent state rolls back too: the next unchained step starts from the
        last accepted position's slot; all accepted, the home slot. Always set: a step read
        after a chained step on it was dispatched sets a restore that the chained step made
        on the device already (spec_decode/chain.chained_states), which the chained step's
        own settle must replace."""
        if self.kv.verify_k:
            rejected = num_accepted < num_drafts
            req.state_restore = self.kv.position_slot(req, num_accepted) if rejected else -1

    def _settle_chained(self, req: Request, drafts: list[int], num_accepted: int) -> None:
        """A chained row computed K drafts, the lookup's and -1s: all but the accepted roll back,
        and only the lookup's count as drafts (a row without any is a plain decode row)."""
        req.num_computed_tokens -= len(drafts) - num_accepted
        self.kv.trim(req, req.num_computed_tokens)
        proposed = sum(1 for d in drafts if d >= 0)
        if proposed:
            self.spec_stats.record(proposed, num_accepted)
        self._settle_state(req, len(drafts), num_accepted)

    def _append(self, req: Request, tokens: list[int]) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for t in tokens:
            req.output_token_ids.append(t)
            # a think block's tokens are not a grammar's (thinking.py)
            past_block = req.thinking.accept(t) if req.thinking is not None else True
            if past_block and req.grammar is not None and not req.grammar.accept(t):
                # the mask allows only what the grammar takes: this is a bug, never a client's
                log.error("%s: token %d rejected by its grammar", req.request_id, t)
                self.finish(req, "abort")
                return
            reason, stop_reason = self._stop_reason(req, t)
            if reason is not None:  # tokens after a stop are dropped
                req.ended_by_stop_token = reason == "stop" and self._is_stop_token(req, t)
                self.finish(req, reason, stop_reason)
                return

    def _is_stop_token(self, req: Request, token: int) -> bool:
        """Whether `token` ends the request as a stop token (not a grammar's last token)."""
        p = req.params
        return (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids

    def _stop_reason(self, req: Request, token: int) -> tuple[str | None, int | None]:
        p, n = req.params, len(req.output_token_ids)
        if n >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if req.grammar is not None and req.grammar.is_complete:
            return "stop", None  # nothing but EOS could follow
        if p.max_tokens is not None and n >= p.max_tokens:
            return "length", None
        if req.num_known_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a request for any reason; its blocks go back to the pool (or stay cached).
        A sample still on the device is dropped."""
        if req.status == Status.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.on_finish is not None:
            self.on_finish(req, reason)
        self.kv.free_request(req)
        req.num_pending_tokens = 0
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.finished_time = time.monotonic()
