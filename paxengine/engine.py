"""EngineCore (synchronous: add, step, abort) and AsyncEngine (a background loop for servers)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.batch import build_step, seq_buckets, token_buckets
from paxengine.config import EngineConfig
from paxengine.kv_cache import KVCacheManager
from paxengine.models.loader import load_model
from paxengine.models.weights import unstack_layers
from paxengine.output import SequenceOutput
from paxengine.outputs import RequestMetrics, RequestOutput
from paxengine.request import PLACEHOLDER, Request
from paxengine.runner import (Runner, compile_count, enable_persistent_cache, plan_num_blocks,
                              resolve_layer_loop)
from paxengine.sampling import build_sampling_tensors
from paxengine.sampling_params import SamplingParams
from paxengine.scheduler import Scheduler

log = logging.getLogger("paxengine")


class EngineOverloaded(RuntimeError):
    """The waiting queue is over its bound; try again later."""


class EngineDead(RuntimeError):
    """The engine loop has stopped."""


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
           "fp8": jnp.float8_e4m3fn}


@dataclass
class _Group:
    """One user request: n sequences over one prompt."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceOutput]
    arrival_time: float
    final_only: bool = False     # no per-step outputs, only the finished one (LLM.generate)

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:    # asked twice per request per step: skip the generator
            return self.seqs[0].req.is_finished
        return all(s.req.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        reqs = [s.req for s in self.seqs]
        finished = self.finished
        if len(reqs) == 1:     # n=1, every streamed step of most requests: no aggregation
            r = reqs[0]
            sched, first, done = r.first_scheduled_time, r.first_token_time, r.finished_time
            generated = len(r.output_token_ids)
        else:
            sched = min((r.first_scheduled_time for r in reqs
                         if r.first_scheduled_time is not None), default=None)
            first = min((r.first_token_time for r in reqs if r.first_token_time is not None),
                        default=None)
            done = max((r.finished_time for r in reqs if r.finished_time is not None),
                       default=None)
            generated = sum(len(r.output_token_ids) for r in reqs)
        m = RequestMetrics(self.arrival_time, sched, first, done if finished else None,
                           len(self.prompt_token_ids), reqs[0].num_cached_tokens, generated)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.snapshot() for s in self.seqs], finished, m,
                             num_cached_tokens=reqs[0].num_cached_tokens)


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        cfg = (config or EngineConfig()).replace(**overrides) if overrides else (config or EngineConfig())
        self.config = cfg
        on_gpu = jax.default_backend() == "gpu"
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        if dtype not in _DTYPES or dtype == "fp8":
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {cfg.dtype!r}")
        if cfg.quantization not in (None, "none"):
            raise ValueError(f"quantization {cfg.quantization!r} is not implemented yet")
        self.dtype = dtype
        enable_persistent_cache(cfg.compilation_cache_dir)
        t0 = time.perf_counter()
        loaded = load_model(cfg.model, dtype, cache_dir=cfg.weights_cache_dir,
                            progress=cfg.show_progress, seed=cfg.seed)
        self.load_seconds = time.perf_counter() - t0
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        if cfg.tokenizer:   # an explicit tokenizer (e.g. for dummy weights) wins over the model's
            from paxengine.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_hf_dir(cfg.tokenizer, eos_token_ids=self.eos_token_ids)
            self.eos_token_ids = self.eos_token_ids or list(self.tokenizer.eos_token_ids)
        self.model_name = cfg.served_model_name or (loaded.config.name or loaded.source)
        self.max_model_len = min(cfg.max_model_len or min(loaded.config.max_position_embeddings, 8192),
                                 loaded.config.max_position_embeddings)
        kv_dtype_name = dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
        if kv_dtype_name not in _DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or fp8, got "
                             f"{cfg.kv_cache_dtype!r}")
        kv_dtype = _DTYPES[kv_dtype_name]
        max_tokens = cfg.max_num_batched_tokens
        if max_tokens < cfg.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_tokens}) must be >= max_num_seqs "
                             f"({cfg.max_num_seqs})")
        # Before sizing the KV pool: the per-layer split must not leave a stacked copy behind.
        params = loaded.params
        if resolve_layer_loop(cfg.layer_loop) == "unroll":
            params = unstack_layers(params)
        num_blocks = plan_num_blocks(loaded.config, cfg.block_size, kv_dtype,
                                     num_kv_blocks=cfg.num_kv_blocks,
                                     kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                                     gpu_memory_utilization=cfg.gpu_memory_utilization)
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        tb = cfg.token_buckets or token_buckets(max_tokens)
        sb = cfg.seq_buckets or seq_buckets(cfg.max_num_seqs)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, max_tokens, self.max_model_len, tb)
        self.runner = Runner(loaded.config, params, num_blocks=num_blocks,
                             block_size=cfg.block_size, max_model_len=self.max_model_len,
                             token_buckets=tb, seq_buckets=sb, kv_dtype=kv_dtype,
                             attention_backend=cfg.attention_backend,
                             show_progress=cfg.show_progress)
        self.groups: dict[str, _Group] = {}
        self.seq_of: dict[str, tuple[_Group, SequenceOutput]] = {}
        self.rng = np.random.default_rng(cfg.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.overlapped_steps = 0       # steps dispatched before the previous one was read
        self.inflight = None            # (device result, {request id: row}, sampled requests)
        # XLA:GPU launches a step's kernels on the calling thread (with the GIL released): from a
        # worker, that launch overlaps the host's reading and processing of the previous step.
        self._dispatcher = (ThreadPoolExecutor(1, thread_name_prefix="paxengine-dispatch")
                            if cfg.dispatch_thread else None)

    # -- figures --------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def stats(self) -> dict:
        return {"num_requests_running": len(self.scheduler.running),
                "num_requests_waiting": len(self.scheduler.waiting),
                "kv_cache_usage_perc": self.kv.usage,
                "prefix_cache_queries": self.kv.prefix_queries,
                "prefix_cache_hits": self.kv.prefix_hits,
                "num_preemptions": self.scheduler.num_preemptions,
                "prompt_tokens": self.prompt_tokens_total,
                "generation_tokens": self.generation_tokens_total,
                "kv_capacity_tokens": self.kv_capacity_tokens,
                "num_kv_blocks": self.kv.num_blocks,
                "buckets": len(self.runner.compiled),
                "steps": self.steps,
                "xla_compiles_after_warmup": compile_count() - self.runner.compiles_after_warmup}

    # -- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or {{'prompt_token_ids': "
                         f"[...]}}, got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate(vocab)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len} (the prompt must leave room for output)")
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_token_ids))
        self.scheduler.check_fits(len(prompt_token_ids), max_tokens)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    final_only: bool = False) -> None:
        """final_only: `step` returns this request's output once, when it finishes, instead of a
        cumulative snapshot every step (which costs O(tokens so far) each time)."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are waiting (bound "
                                   f"{self.config.max_waiting_requests}); retry later")
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids, params)
        ids = [int(t) for t in ids]
        now = time.monotonic()
        base_seed = params.seed if params.seed is not None else int(self.rng.integers(1 << 31))
        group = _Group(request_id, text, ids, [], now, final_only)
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, ids, params, seed=base_seed + 7919 * i, arrival_time=now)
            seq = SequenceOutput(req, i, self.tokenizer, self.eos_token_ids, self.max_model_len)
            group.seqs.append(seq)
            self.seq_of[seq_id] = (group, seq)
            self.scheduler.add(req)
        self.groups[request_id] = group
        self.prompt_tokens_total += len(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.req.is_finished:
                self.scheduler.finish(seq.req, "abort")
            self.seq_of.pop(seq.req.request_id, None)
        return group.output()

    def has_unfinished(self) -> bool:
        return bool(self.groups) or self.inflight is not None

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration, overlapped with the device: schedule, build and dispatch step N+1
        while step N runs, then read N's samples and process N's outputs, so the device always
        has the next step queued while the host works.

        Requests that sampled in step N carry a PLACEHOLDER token until N is read; step N+1 takes
        their real token from the device. A request that N finishes (EOS, stop) is also in N+1:
        that one wasted row writes KV only into its own last, partial (never hashed) block, which
        later steps overwrite in stream order, and `advance` skips it. Penalties need exact
        token history on the host, so while a running request uses one, N is read first.
        With `dispatch_thread`, N+1's launch (XLA:GPU enqueues its kernels on the calling thread)
        runs on a worker and is waited for only when N+1 is read, so it overlaps this bookkeeping.
        """
        outputs: list[RequestOutput] = []
        if self.inflight is not None and self._needs_sync():
            outputs += self._finish_inflight()
        out = self.scheduler.schedule()
        result = None
        if out:
            prev_rows = self.inflight[1] if self.inflight is not None else None
            T, S = self.runner.bucket_for(out.total_tokens, len(out.requests))
            arrays = build_step(out, self.kv.block_size, T, S, self.runner.max_blocks_per_seq,
                                prev_rows)
            st = build_sampling_tensors(out.requests, S, self.runner.history_len,
                                        self.eos_token_ids)
            if self._dispatcher is not None:
                result = self._dispatcher.submit(self.runner.execute, arrays, st)
            else:
                result = self.runner.execute(arrays, st)
            self.steps += 1
        if self.inflight is not None:
            self.overlapped_steps += bool(out)
            outputs += self._finish_inflight()
        if out:
            rows = {r.request_id: i for i, r in enumerate(out.requests)}
            sampled = self.scheduler.advance(out)
            for req in sampled:
                req.output_token_ids.append(PLACEHOLDER)
            self.inflight = (result, {r.request_id: rows[r.request_id] for r in sampled}, sampled)
        return outputs

    def _needs_sync(self) -> bool:
        return any(r.params.presence_penalty or r.params.frequency_penalty
                   or r.params.repetition_penalty != 1.0 for r in self.scheduler.running)

    def _finish_inflight(self) -> list[RequestOutput]:
        result, rows, sampled = self.inflight
        self.inflight = None
        if isinstance(result, Future):   # launched by the dispatch thread: wait for the launch
            result = result.result()
        tokens, lps, ranks, top_ids, top_lps = self.runner.fetch(result)   # the one sync
        touched: dict[str, _Group] = {}
        for req in sampled:
            if req.is_finished:          # aborted while its token was on the way
                continue
            group, seq = self.seq_of[req.request_id]
            i = rows[req.request_id]
            reason = seq.append(int(tokens[i]), lps[i], ranks[i], top_ids[i], top_lps[i])
            self.generation_tokens_total += 1
            if reason is not None:
                self.scheduler.finish(req, reason)
                seq.finish()
            touched[group.request_id] = group
        outputs = []
        for rid, group in touched.items():
            finished = group.finished
            if group.final_only and not finished:
                continue
            outputs.append(group.output())
            if finished:
                del self.groups[rid]
                for s in group.seqs:
                    self.seq_of.pop(s.req.request_id, None)
        return outputs


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    """Runs EngineCore in a background thread; `generate` is an async iterator of outputs."""

    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.core = EngineCore(config, **overrides)
        self.config = self.core.config
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="paxengine-loop", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def vocab_size(self) -> int:
        return self.core.model_config.vocab_size

    def stats(self) -> dict:
        # No lock: plain reads of counters between steps; a scrape must not wait for a step.
        return self.core.stats()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.core.validate(prompt_token_ids, params)

    def tokenize_prompt(self, prompt):
        return self.core.tokenize_prompt(prompt)

    async def generate(self, request_id: str, prompt, params: SamplingParams | None = None):
        if not self.is_healthy():
            raise EngineDead(f"the engine loop is not running ({self.error!r})")
        params = params or SamplingParams()
        text, ids = self.core.tokenize_prompt(prompt)
        self.core.validate(ids, params)             # bad input fails here, alone
        if len(self.core.scheduler.waiting) >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"the waiting queue is full ({self.config.max_waiting_requests})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._inbox.put(("add", request_id, ({"prompt": text, "prompt_token_ids": ids}, params)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:   # the consumer went away (disconnect, cancel): free its blocks
                self._inbox.put(("abort", request_id, None))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    # -- the loop -------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items) -> None:
        """(request id, output or error) pairs, in one wake-up per event loop (not one per
        request: at 64 streams the per-call wake-ups cost the loop thread more than the outputs)."""
        by_loop: dict = {}
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    def _handle(self, kind: str, rid: str, payload) -> None:
        if kind == "add":
            prompt, params = payload
            try:
                self.core.add_request(rid, prompt, params)
            except Exception as e:   # refused after all (e.g. a race on the queue bound)
                self._deliver(rid, e)
        elif kind == "abort":
            out = self.core.abort(rid)
            if out is not None:
                out.finished = True
                self._deliver(rid, out)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.core.has_unfinished()
                try:
                    item = self._inbox.get(block=block, timeout=0.5 if block else None)
                    while True:
                        with self._lock:
                            self._handle(*item)
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if self.core.has_unfinished():
                    with self._lock:
                        outputs = self.core.step()
                    self._deliver_all((out.request_id, out) for out in outputs)
        except BaseException as e:  # a dead loop must be visible, and nobody left waiting
            self.error = e
            log.exception("engine loop died")
            for rid in list(self._streams):
                self._deliver(rid, EngineDead(f"engine loop died: {e!r}"))
