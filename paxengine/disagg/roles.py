"""The two engines of disaggregated prefill, and the hand-off between them.

`PrefillCore` runs a request's prompt and samples its first token (the request's max_tokens is
1 there, as in vLLM's P/D). A prompt's full pages are sent as each of its chunks is dispatched,
the rest when the first token finishes the request (the scheduler's `on_finish` hook, before the
blocks go back to the pool): a compiled gather on the prefill device and copies onto the decode
devices, dispatched and not waited for (`transfer.py`). Pages the decode engine's prefix cache
already holds are not sent (its index, read as a hint). The result is a `Handoff`.

`DecodeCore.receive(handoff)` (on the decode engine's thread) admits the request as soon as a
sequence slot and blocks are free: it allocates blocks first (taking its own cached prefix),
scatters the arrived pages into them and puts the request among the running ones with the
prompt computed and the first token known, so its next step samples token 2 with the same seed
and step as one engine would. A transfer that failed, or pages its prefix cache lost meanwhile,
make it compute the prompt itself (the request re-runs there, same tokens). Neither side holds
a block for the other: the prefill side frees its pages once the gather is dispatched (the
device runs the gather before any later step overwrites them).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from paxengine.disagg.transfer import KVTransfer, Piece, TransferFailed
from paxengine.engine import EngineCore
from paxengine.errors import InvalidRequest
from paxengine.output import RequestGroup, SequenceOutput
from paxengine.outputs import RequestMetrics, RequestOutput
from paxengine.request import Request, Status
from paxengine.sampling_params import SamplingParams

log = logging.getLogger("paxengine")


@dataclass
class Handoff:
    """A request whose prompt ran on the prefill engine, on its way to the decode engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the client's
    seed: int
    first_token: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    num_cached_tokens: int  # of the prompt, on the prefill side
    start_block: int  # the first page sent (those before it the decode side holds)
    num_blocks: int  # the prompt's pages
    # the sends' pieces (each a list, or a Future of one with dispatch_thread); None: one failed
    pieces: list[list[Piece] | Future] | None
    # the first token's logprobs as the prefill engine's output has them (attach_output)
    logprobs: list | None = None
    cumulative_logprob: float | None = None

    def attach_output(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.logprobs, self.cumulative_logprob = c.logprobs, c.cumulative_logprob
        self.num_cached_tokens = out.num_cached_tokens

    def sequence(self, tokenizer, grammars=None) -> SequenceOutput:
        """The request as it stands after its first token: what the decode engine continues,
        and the first output the client sees (text and logprobs as one engine has them)."""
        p = self.params
        req = Request(self.request_id, list(self.prompt_token_ids), p, self.seed, self.arrival_time)
        req.output_token_ids.append(self.first_token)
        req.first_scheduled_time = self.first_scheduled_time
        req.first_token_time = self.first_token_time
        req.num_cached_tokens = self.num_cached_tokens
        if grammars is not None and p.structured_outputs is not None:
            req.grammar = grammars.new_state(p.structured_outputs)
            req.grammar.accept(self.first_token)
        seq = SequenceOutput(req, 0, tokenizer)
        # SequenceOutput.update's work for the first token, with the prefill side's logprobs
        seq.num_seen = 1
        seq.text = seq.detok.add(self.first_token) if seq.detok else ""
        seq.cumulative_logprob = self.cumulative_logprob or 0.0
        if seq.logprobs is not None and self.logprobs:
            seq.logprobs = list(self.logprobs[:1])
        return seq

    def first_output(self, tokenizer) -> RequestOutput:
        """The not-yet-finished output a client streams before the decode engine's."""
        seq = self.sequence(tokenizer)
        m = RequestMetrics(
            self.arrival_time,
            self.first_scheduled_time,
            self.first_token_time,
            None,
            len(self.prompt_token_ids),
            self.num_cached_tokens,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [seq.snapshot()],
            False,
            m,
            self.num_cached_tokens,
        )


def first_token_params(params: SamplingParams) -> SamplingParams:
    """What the prefill engine runs: the prompt and one sample, drawn exactly as one engine
    draws a request's first token (min_tokens > 0 bans the stop ids at that step either way;
    stop strings are not looked for while min_tokens > 1 is not reached, so not here)."""
    return dataclasses.replace(
        params,
        max_tokens=1,
        min_tokens=min(params.min_tokens, 1),
        stop=list(params.stop) if params.min_tokens <= 1 else [],
    )


def check_disaggregable(params: SamplingParams) -> None:
    if params.n != 1:
        raise InvalidRequest(
            "n > 1 is not supported with disaggregated prefill yet (kv_transfer_config)",
            param="n",
        )
    for name in ("prompt_logprobs", "thinking_token_budget", "think_tags"):
        if getattr(params, name) is not None:
            raise InvalidRequest(
                f"{name} is not supported with disaggregated prefill yet (kv_transfer_config)",
                param=name,
            )


def _on_engine_thread(core: EngineCore, fn, *args):
    """Run fn where the core's KV cache is replaced: with dispatch_thread, after the step
    launches queued on that worker (the cache is donated to each)."""
    if core._dispatcher is not None:
        return core._dispatcher.submit(fn, *args).result()
    return fn(*args)


@dataclass
class _Outgoing:
    """A prompt's pages on their way out, sent as the prefill computes them."""

    start_block: int  # the pages before it the decode engine holds (its prefix index, a hint)
    next_block: int  # the first page not sent yet
    parts: list  # each send's pieces, or a Future of them
    failed: bool = False


class PrefillCore(EngineCore):
    """kv_producer: prompts and first tokens; hands each finished prompt's pages on."""

    def __init__(self, config, **overrides):
        super().__init__(config, **overrides)
        self.scheduler.on_finish = self._on_finish
        self.transfer: KVTransfer | None = None  # set by link()
        self.peer: DecodeCore | None = None  # its prefix index and backlog, read only here
        self.kv_buffer_size = float("inf")
        self._max_num_seqs = self.scheduler.max_num_seqs
        self._goes_on: dict[str, SamplingParams] = {}  # requests the decode engine continues
        self.handoffs: dict[str, Handoff] = {}  # finished here, for the caller to take
        self._outgoing: dict[str, _Outgoing] = {}

    def link(self, transfer: KVTransfer, peer: DecodeCore, kv_buffer_size: float) -> None:
        self.transfer, self.peer, self.kv_buffer_size = transfer, peer, kv_buffer_size

    def _backed_up(self) -> bool:
        return self.peer is not None and self.peer.waiting_bytes >= self.kv_buffer_size

    def stats(self) -> dict:
        st = super().stats()
        if self._backed_up():  # no prompt starts: the waiting ones wait for the decode side
            st["num_requests_waiting_deferred"] = st["num_requests_waiting"]
        return st

    def step(self):
        """While the decode engine holds more arrived pages than kv_buffer_size (device memory
        outside its KV pool: it cannot admit them yet), no new prompt starts here; the running
        ones finish. Backpressure instead of an out-of-memory on the decode device."""
        sched = self.scheduler
        backed_up = self._backed_up()
        sched.max_num_seqs = len(sched.running) if backed_up else self._max_num_seqs
        if backed_up and not sched.running and self.inflight is None:
            time.sleep(0.001)  # nothing to run until the decode side admits: do not spin
        outputs = super().step()
        # a long prompt's full pages go as its chunks are dispatched (the gather runs on the
        # device after the step that writes them), so their copy overlaps the next chunk
        bs = self.kv.block_size
        for req in sched.running:
            if req.request_id in self._goes_on and req.num_computed_tokens < req.num_prompt_tokens:
                self._send(req, req.num_computed_tokens // bs)
        return outputs

    def add_request(self, request_id, prompt, params=None, final_only=False) -> None:
        params = params or SamplingParams()
        check_disaggregable(params)
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids, params)  # the client's request, whole
        prompt = {"prompt": text, "prompt_token_ids": ids}
        super().add_request(request_id, prompt, first_token_params(params), final_only)
        more = params.max_tokens is None or params.max_tokens > 1
        if more and len(ids) + 1 < self.max_model_len:
            self._goes_on[request_id] = params

    def abort(self, request_id: str):
        self._goes_on.pop(request_id, None)
        self._outgoing.pop(request_id, None)  # pieces sent so far are dropped
        self.handoffs.pop(request_id, None)
        return super().abort(request_id)

    def _send(self, req: Request, stop: int) -> _Outgoing:
        """Send the request's pages up to `stop` not sent yet (nor held by the decode side)."""
        out = self._outgoing.get(req.request_id)
        if out is None:
            held = self.peer.kv.cached_prefix_blocks(req.prompt_token_ids, req.params.cache_salt)
            held = min(held, req.num_prompt_tokens // self.kv.block_size)
            out = self._outgoing[req.request_id] = _Outgoing(held, held, [])
        if out.failed or stop <= out.next_block:
            return out
        blocks, first = req.block_ids[out.next_block : stop], out.next_block - out.start_block
        if self._dispatcher is not None:  # read the cache after the launches queued there
            out.parts.append(self._dispatcher.submit(self.transfer.send, blocks, first))
        else:
            try:
                out.parts.append(self.transfer.send(blocks, first))
            except TransferFailed as e:
                log.warning(
                    "%s: KV transfer failed, the decode engine recomputes: %s", req.request_id, e
                )
                out.failed = True
        out.next_block = stop
        return out

    def _on_finish(self, req: Request, reason: str) -> None:
        params = self._goes_on.pop(req.request_id, None)
        if params is None or reason != "length":  # aborted, or its first token ended it
            self._outgoing.pop(req.request_id, None)
            return
        num_blocks = self.kv.blocks_needed(req.num_prompt_tokens)
        out = self._send(req, num_blocks)
        del self._outgoing[req.request_id]
        self.handoffs[req.request_id] = Handoff(
            req.request_id,
            self.groups[req.request_id].prompt,
            req.prompt_token_ids,
            params,
            req.seed,
            req.output_token_ids[0],
            req.arrival_time,
            req.first_scheduled_time,
            req.first_token_time,
            req.num_cached_tokens,
            out.start_block,
            num_blocks,
            None if out.failed else out.parts,
        )


class DecodeCore(EngineCore):
    """kv_consumer: continues handed-off requests from their second token."""

    def __init__(self, config, **overrides):
        super().__init__(config, **overrides)
        self.transfer: KVTransfer | None = None
        self.arrivals: deque[Handoff] = deque()  # received, waiting for a slot and blocks
        self.waiting_bytes = 0  # their pages on this engine's devices (read by the prefill side)
        self.recomputed = 0  # requests whose pages did not arrive: their prompt ran here

    def link(self, transfer: KVTransfer) -> None:
        self.transfer = transfer

    def stats(self) -> dict:
        return {
            **super().stats(),
            "num_requests_waiting": len(self.scheduler.waiting) + len(self.arrivals),
            "kv_transfer_recomputed": self.recomputed,
            "kv_transfer_waiting_bytes": self.waiting_bytes,
        }

    def receive(self, h: Handoff, final_only: bool = False) -> None:
        """Take a handed-off request (on this engine's thread); it runs once it fits."""
        if h.request_id in self.groups:
            raise InvalidRequest(f"request id {h.request_id!r} is already in use")
        seq = h.sequence(self.tokenizer, self.grammars)
        group = RequestGroup(
            h.request_id, h.prompt, seq.req.prompt_token_ids, [seq], h.arrival_time, final_only
        )
        self.groups[h.request_id] = group
        self.seq_of[h.request_id] = (group, seq)
        self.arrivals.append(h)
        self.waiting_bytes += self._bytes(h)
        self._admit_arrivals()

    def abort(self, request_id: str):
        for h in self.arrivals:
            if h.request_id == request_id:
                self.arrivals.remove(h)  # its pages are dropped with it; it holds no block
                self.waiting_bytes -= self._bytes(h)
                break
        return super().abort(request_id)

    def step(self):
        self._admit_arrivals()
        return super().step()

    def _admit_arrivals(self) -> None:
        while self.arrivals and self._admit(self.arrivals[0]):
            self.waiting_bytes -= self._bytes(self.arrivals.popleft())

    def _bytes(self, h: Handoff) -> int:
        pages = h.num_blocks - h.start_block if h.pieces is not None else 0
        return pages * self.transfer.page_bytes

    def _admit(self, h: Handoff) -> bool:
        """False: no slot or blocks yet (it stays first in line)."""
        sched = self.scheduler
        req = self.seq_of[h.request_id][1].req
        if len(sched.running) >= sched.max_num_seqs:
            return False
        pieces = [] if h.pieces is not None else None
        for part in h.pieces or ():
            try:
                pieces += part.result() if isinstance(part, Future) else part
            except TransferFailed as e:
                log.warning("%s: KV transfer failed, recomputing here: %s", h.request_id, e)
                pieces = None
                break
        cached = self.kv.find_cached_prefix(req)
        if pieces is None or len(cached) < h.start_block:  # lost, or its prefix evicted since
            return self._recompute(req)
        n = req.num_prompt_tokens
        if not self.kv.allocate(req, n - len(cached) * self.kv.block_size, cached):
            return False
        # page i of the transfer is prompt page start_block + i; the cached ones stay as they are
        dst = [b if i >= len(cached) else -1 for i, b in enumerate(req.block_ids[: h.num_blocks])][
            h.start_block :
        ]
        try:
            _on_engine_thread(self, self.transfer.receive, pieces, dst)
        except TransferFailed as e:
            log.warning("%s: KV transfer failed, recomputing here: %s", h.request_id, e)
            self.kv.free_request(req)
            return self._recompute(req)
        self.transfer.stats.pages_skipped += len(cached)
        req.num_computed_tokens = n
        req.status = Status.RUNNING
        sched.running.append(req)
        return True

    def _recompute(self, req: Request) -> bool:
        """The request computes its prompt (and first token) here, like a preempted one."""
        self.recomputed += 1
        self.scheduler.add(req)
        return True


def build_pair(config, kvt) -> tuple[PrefillCore, DecodeCore, KVTransfer]:
    """The prefill engine on kvt.prefill_device, the decode engine on kvt.decode_device (each
    with config's tensor_parallel_size devices from there), linked by a KVTransfer."""
    base = config.replace(kv_transfer_config=None)
    # the prefill engine never decodes: no speculation there (nor a draft model to load)
    prefill = PrefillCore(base.replace(first_device=kvt.prefill_device, speculative_config=None))
    decode = DecodeCore(base.replace(first_device=kvt.decode_device))
    transfer = KVTransfer(
        prefill.runner, decode.runner, kvt.max_blocks_per_copy, kvt.measure_transfers
    )
    prefill.link(transfer, decode, kvt.kv_buffer_size)
    decode.link(transfer)
    return prefill, decode, transfer


class DisaggregatedCore:
    """Both engines stepped in turn on one thread, behind EngineCore's calls (add_request,
    step, abort): the offline `LLM(kv_transfer_config=...)`. The server runs each engine on its
    own thread instead (`front.DisaggregatedEngine`)."""

    def __init__(self, config):
        from paxengine.disagg.config import parse_kv_transfer_config

        kvt = parse_kv_transfer_config(config.kv_transfer_config, config.tensor_parallel_size)
        self.config = config
        self.prefill, self.decode, self.transfer = build_pair(config, kvt)
        self.tokenizer = self.prefill.tokenizer
        self.info = self.prefill.info
        self._final_only: dict[str, bool] = {}

    def add_request(self, request_id, prompt, params=None, final_only=False) -> None:
        if request_id in self.decode.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self.prefill.add_request(request_id, prompt, params, final_only)
        self._final_only[request_id] = final_only

    def abort(self, request_id: str):
        self._final_only.pop(request_id, None)
        return self.decode.abort(request_id) or self.prefill.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs = []
        if self.prefill.has_unfinished():
            for out in self.prefill.step():
                h = self.prefill.handoffs.pop(out.request_id, None) if out.finished else None
                if h is None:
                    if out.finished:
                        self._final_only.pop(out.request_id, None)
                    outputs.append(out)
                    continue
                h.attach_output(out)
                final_only = self._final_only.pop(out.request_id, False)
                self.decode.receive(h, final_only)
                if not final_only:
                    outputs.append(h.first_output(self.tokenizer))
        if self.decode.has_unfinished():
            outputs += self.decode.step()
        return outputs

    def stats(self) -> dict:
        return disagg_stats(self.prefill.stats(), self.decode.stats(), self.transfer)


def disagg_stats(prefill: dict, decode: dict, transfer: KVTransfer) -> dict:
    """Both engines' figures, each under `replicas` (a series each on /metrics, labelled
    engine="0" prefill, "1" decode), their requests summed, and the transfer's counters."""
    total = {}
    for k, v in decode.items():
        if isinstance(v, list):
            total[k] = [a + b for a, b in zip(prefill.get(k, [0] * len(v)), v)]
        elif k == "kv_cache_usage_perc":
            total[k] = (prefill[k] + v) / 2
        elif k == "xla_compiles_after_warmup":
            total[k] = max(prefill[k], v)
        elif isinstance(v, (int, float)):
            total[k] = prefill.get(k, 0) + v
    total["prompt_tokens"] = prefill["prompt_tokens"]
    return {**total, **transfer.stats.as_dict(), "replicas": [prefill, decode]}
