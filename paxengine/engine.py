"""EngineCore: the synchronous engine (add_request, step, abort), used by LLM and AsyncEngine."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import jax
import numpy as np

from paxengine import device_defaults, engine_setup, memory_plan, parallel
from paxengine.batch import build_step
from paxengine.client import served_name
from paxengine.config import EngineConfig, max_model_len_option, resolve_max_model_len
from paxengine.device_turns import TURNS
from paxengine.engine_setup import DTYPES
from paxengine.errors import InvalidRequest, StepFailed
from paxengine.executables import ExecutableStore
from paxengine.iteration_stats import IterationStats
from paxengine.kv_cache import KVCacheManager
from paxengine.kv_memory import claim_device_memory
from paxengine.output import RequestGroup, SequenceOutput
from paxengine.outputs import RequestOutput
from paxengine.prompt_logprobs import PromptLogprobs, StepTargets, step_targets
from paxengine.request import Request
from paxengine.runner import Runner
from paxengine.sampling import ALL_FLAGS, build_sampling_tensors, verify_drafts
from paxengine.sampling_params import SamplingParams
from paxengine.scheduler import SchedulerOutput
from paxengine.spec_decode import parse_speculative_config
from paxengine.spec_decode.chain import build_chained
from paxengine.step_build import compiles_after_warmup, enable_persistent_cache
from paxengine.step_trace import StepTrace
from paxengine.structured import GrammarCompiler
from paxengine.thinking import ThinkingState
from paxengine.validation import check_request, prompt_and_ids, truncate_prompt

log = logging.getLogger("paxengine")


# A step failure is contained (its requests end, the rest are recomputed) unless more than
# MAX_FAILURES happen within FAILURE_WINDOW_S: then the engine gives up (its loop ends, and a
# server exits non-zero for its orchestrator to restart it).
MAX_FAILURES = 3
FAILURE_WINDOW_S = 60.0


class _DeviceFailure(Exception):
    def __init__(self, cause: BaseException, blame: SchedulerOutput):
        super().__init__(repr(cause))
        self.cause, self.blame = cause, blame
        self.outputs: list[RequestOutput] = []  # what the step call made before it failed


@dataclass
class _InFlight:
    """A dispatched step whose samples the host has not read yet."""

    result: object  # the runner's device result (or a Future of it)
    out: SchedulerOutput
    rows: dict[str, int]  # request id -> its sample's row, for the requests that sample
    plp: StepTargets | None = None  # its rows' prompt logprobs (prompt_logprobs.py)


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        cfg = (config or EngineConfig()).replace(**overrides)
        self.config = cfg
        engine_setup.check_role(cfg)
        pool_not_claimed = claim_device_memory(cfg.gpu_memory_utilization)  # before JAX's backend
        parallel.init_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
        cfg = self.config = device_defaults.resolve(cfg, jax.default_backend() == "gpu")
        checked = engine_setup.check_config(cfg, jax.default_backend() == "gpu")
        if checked.on_gpu and pool_not_claimed:
            memory_plan.log_pool_not_claimed(pool_not_claimed, cfg.gpu_memory_utilization)
        dtype, kv_dtype = checked.dtype, checked.kv_dtype
        self.spec = parse_speculative_config(cfg.speculative_config)
        self.dtype = dtype
        cache_dir = enable_persistent_cache(cfg.compilation_cache_dir)
        store = (
            ExecutableStore(cache_dir / "executables")
            if cfg.store_executables and cache_dir is not None
            else None
        )
        models = engine_setup.load_models(cfg, checked, self.spec)
        loaded, draft, eagle = models.loaded, models.draft, models.eagle
        self.load_seconds = models.load_seconds
        self.model_config, self.tokenizer = loaded.config, models.tokenizer
        self.eos_token_ids = models.eos_token_ids
        self.model_name = served_name(cfg)
        # vLLM's derived length: max_position_embeddings, or YaRN's original length x factor
        model_len = loaded.config.derived_max_model_len
        want = max_model_len_option(cfg.max_model_len)  # a count, "auto" or None
        self.max_model_len = resolve_max_model_len(want, model_len)  # auto: cut to the pool below
        prepared = engine_setup.prepare_params(cfg, checked, loaded, self.tokenizer, store)
        params, tp, store = prepared.params, prepared.tp, prepared.store
        self.kv_scales, scales_from = prepared.kv_scales, prepared.scales_from
        engine_setup.log_weights(params, loaded.prequantized, checked.on_gpu)
        num_blocks = memory_plan.plan_kv_blocks(
            cfg,
            checked,
            loaded.config,
            tp,
            draft.config if draft is not None else None,
            eagle,
            self.spec,
        )
        if want == "auto" and num_blocks * checked.block_size < self.max_model_len:
            self.max_model_len = num_blocks * checked.block_size
            log.info(
                "max_model_len auto: %d tokens, what the KV pool holds (the model's: %d)",
                self.max_model_len,
                model_len,
            )
        slots, snapshots = memory_plan.state_slots(cfg, loaded.config)
        verify = memory_plan.verify_slots(cfg, loaded.config, self.spec)
        self.kv = KVCacheManager(
            num_blocks,
            checked.block_size,
            cfg.enable_prefix_caching,
            num_state_slots=slots,
            num_snapshot_slots=snapshots,
            num_verify_positions=self.spec.num_speculative_tokens if verify else 0,
        )
        tb, sb = cfg.token_buckets, cfg.seq_buckets
        # a hybrid's verify steps keep per-position states after the snapshots (verify_slots);
        # its chained steps pick each row's starting slot from the accepted count on the device
        chain = engine_setup.chain_spec(self.spec, cfg.max_num_seqs, tp, max(sb))
        span = None
        if verify:
            span = (slots + snapshots, self.spec.num_speculative_tokens + 1)
            chain = replace(chain, verify_span=span) if chain is not None else None
        self.scheduler = engine_setup.make_scheduler(
            cfg, self.kv, self.max_model_len, self.eos_token_ids, self.spec, tb, max(sb)
        )
        self.runner = Runner(
            loaded.config,
            params,
            num_blocks=num_blocks,
            block_size=checked.block_size,
            max_model_len=self.max_model_len,
            token_buckets=tb,
            seq_buckets=sb,
            kv_dtype=kv_dtype,
            attention_backend=cfg.attention_backend,
            show_progress=cfg.show_progress,
            store=store,
            tp=tp,
            sampler_flags=ALL_FLAGS
            if cfg.structured_outputs
            else [f for f in ALL_FLAGS if not f[3]],
            background_compile=cfg.background_compile,
            aux=eagle.aux_hidden(DTYPES[dtype]) if eagle is not None else None,
            chain=chain,
            num_state_slots=slots + snapshots + verify,
            verify_span=span,
            prompt_logprobs=True,
        )
        # chained verify steps (n-gram speculation on one device): built while the previous
        # step runs; False runs every verify step read first (benchmarks compare the two)
        self.chain_verify = self.runner.chain is not None
        self.drafter = engine_setup.make_drafter(
            cfg, checked, self.spec, models, self.runner, num_blocks, self.max_model_len
        )
        if self.drafter is not None:
            self.scheduler.proposer = self.drafter.proposal
        engine_setup.log_ready(
            self.load_seconds, self.runner, store, num_blocks, checked.block_size
        )
        # run each step executable once before serving (StepBuilder.prime); ones the background
        # builds later run between requests (prime_idle)
        self.primes = (
            cfg.prime_steps if cfg.prime_steps is not None else jax.default_backend() == "gpu"
        )
        if self.primes:
            dev = tp.local_device if tp is not None else jax.devices()[0]
            with TURNS.step():  # all of them before the background compiles another
                memory_plan.prime_and_report(
                    self.runner, num_blocks, dev, cfg.max_num_batched_tokens
                )
        self.grammars = GrammarCompiler(
            self.tokenizer, loaded.config.vocab_size, self.eos_token_ids
        )
        self.groups: dict[str, RequestGroup] = {}
        self.seq_of: dict[str, tuple[RequestGroup, SequenceOutput]] = {}
        self.rng = np.random.default_rng(cfg.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.iteration_stats = IterationStats()  # vLLM's per-iteration figures (/metrics)
        self.steps = 0
        self.overlapped_steps = 0  # steps dispatched before the previous one was read
        self.chained_steps = 0  # of them, chained verify steps (spec_decode/chain.py)
        self.inflight: _InFlight | None = None
        self.trace = StepTrace.from_env()  # per-step timings for profiles (step_trace.py)
        self.failed_steps = 0
        self._failures: list[float] = []  # monotonic times of recent step failures
        # XLA:GPU launches a step's kernels on the calling thread (with the GIL released): from a
        # worker, that launch overlaps the host's reading and processing of the previous step.
        self._dispatcher = (
            ThreadPoolExecutor(1, thread_name_prefix="paxengine-dispatch")
            if cfg.dispatch_thread
            else None
        )
        self.info = engine_setup.model_info(
            cfg, checked, self.model_name, self.max_model_len, self.runner, scales_from, num_blocks
        )

    # -- figures --------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
            "steps": self.steps,
            "failed_steps": self.failed_steps,
            "xla_compiles_after_warmup": compiles_after_warmup(),
            "step_executables_pending": self.pending_executables(),
            # every waiting request waits for room (vLLM's reason "capacity"): none is deferred
            "num_requests_waiting_deferred": 0,
            "block_size": self.kv.block_size,
            "num_gpu_blocks": self.kv.num_blocks,
            **self.iteration_stats.as_dict(),
            **self.scheduler.spec_stats.as_dict(),
        }

    # -- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return prompt_and_ids(self.tokenizer, prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Also compiles a structured-output constraint (cached by its text): a grammar that does
        not compile is refused here, and the step loop only ever copies compiled ones. Thread
        safe: the server runs it in a worker thread before `generate` validates again."""
        check_request(
            prompt_token_ids, params, self.info.limits, self.config, self.grammars, self.tokenizer
        )

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        final_only: bool = False,
    ) -> None:
        """final_only: `step` returns this request's output once, when it finishes, instead of a
        cumulative snapshot every step (which costs O(tokens so far) each time)."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        keep = getattr(
            params, "truncate_prompt_tokens", None
        )  # not a SamplingParams: validate says
        text, ids = truncate_prompt(text, ids, keep, self.info.limits.max_model_len)
        self.validate(ids, params)
        ids = [int(t) for t in ids]
        now = time.monotonic()
        base_seed = params.seed if params.seed is not None else int(self.rng.integers(1 << 31))
        group = RequestGroup(request_id, text, ids, [], now, final_only)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = PromptLogprobs(ids, params.prompt_logprobs)
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, ids, params, seed=base_seed + 7919 * i, arrival_time=now)
            if params.structured_outputs is not None:  # a copy of the compiled (cached) matcher
                req.grammar = self.grammars.new_state(params.structured_outputs)
            if params.think_tags is not None:  # a budget, or a grammar after the block
                grammar = params.structured_outputs is not None
                req.thinking = ThinkingState(
                    params.thinking_token_budget, params.think_tags, grammar
                )
            seq = SequenceOutput(req, i, self.tokenizer)
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
            self.scheduler.finish(seq.req, "abort")
            self.seq_of.pop(seq.req.request_id, None)
        return group.output()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self.groups) or self.inflight is not None

    def pending_executables(self) -> int:
        """Step executables the background has still to build, and (priming on) built ones that
        have not run once: until 0 some steps run padded into larger buckets or load kernels."""
        builder = self.runner.builder
        return builder.pending + (builder.num_unprimed() if self.primes else 0)

    def prime_idle(self, limit: int = 4) -> bool:
        """With nothing to run: up to `limit` of the step executables the background built
        since start-up run once (StepBuilder.prime), a few at a time so that a request arriving
        meanwhile waits for no more than those. True while some are left."""
        if not self.primes or self.has_unfinished() or not self.runner.builder.unprimed():
            return False
        try:
            n, seconds = self.runner.builder.prime(limit)
        except Exception:  # the steps will meet it themselves; the server stays up meanwhile
            log.exception("running a background-built step executable once failed")
            self.primes = False
            self.runner.reset_device_state()  # the forward may have taken the KV cache with it
            self.kv.reset_prefix_cache()  # and every cached block's KV with it
            return False
        log.debug("ran %d more step executables once in %.2f s", n, seconds)
        return self.runner.builder.unprimed()

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration (see `_step`). A failure on the device (a kernel error, device
        OOM: anything the runner raises) ends the requests of the step it hit and raises
        StepFailed after the engine has restored its device state (`_recover`); any other
        exception is a host-side bug and propagates as it is."""
        try:
            return self._step()
        except _DeviceFailure as f:
            return self._recover(f)

    def _device(self, blame: SchedulerOutput, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            raise _DeviceFailure(e, blame) from e

    def _recover(self, f: "_DeviceFailure"):
        now = time.monotonic()
        self._failures = [t for t in self._failures if now - t < FAILURE_WINDOW_S] + [now]
        reqs = f.blame.requests
        log.error(
            "a step failed on the device (%d tokens of %d requests): %s: %s",
            f.blame.total_tokens,
            len(reqs),
            type(f.cause).__name__,
            f.cause,
        )
        if len(self._failures) > MAX_FAILURES:
            raise RuntimeError(
                f"{len(self._failures)} steps failed within {FAILURE_WINDOW_S:.0f} s; giving up"
            ) from f.cause
        self.inflight = None
        if self._dispatcher is not None:  # a launch still queued would write the old cache back
            self._dispatcher.submit(lambda: None).result()
        self.runner.reset_device_state()
        failed = []
        for req in reqs:
            group = self.seq_of.get(req.request_id, (None,))[0]
            if group is not None and group.request_id not in failed:
                failed.append(group.request_id)
        for rid in failed:
            self.abort(rid)
        self.scheduler.requeue_all()
        self.kv.reset_prefix_cache()  # every cached block's KV went with the old cache
        self.failed_steps += 1
        raise StepFailed(
            f"the device step running this request failed ({type(f.cause).__name__}); the "
            "engine recovered: retry the request",
            failed,
            f.outputs,
        ) from f.cause

    def _step(self) -> list[RequestOutput]:
        """One engine iteration, overlapped with the device: schedule, build and dispatch step N+1
        while step N runs, then read N's samples and process N's outputs, so the device always
        has the next step queued while the host works.

        A request that sampled in step N has that sample pending (counted, its id unknown here)
        until N is read; step N+1 takes the id on the device. A request that N finishes (EOS,
        stop) may also be in N+1: that one wasted row writes KV only into its own last, partial
        (never hashed) block, and its sample is dropped. Penalties need exact token history on
        the host, and a grammar's mask for N+1 depends on N's token, so while a running request
        uses either, N is read first (unconstrained batches keep the overlap). So is a step
        whose requests speculate, unless N+1 can be a chained verify step (`_can_chain`,
        spec_decode/chain.py): its drafts and positions then come from N's samples on the device.
        With `dispatch_thread`, N+1's launch (XLA:GPU enqueues its kernels on the calling thread)
        runs on a worker and is waited for only when N+1 is read, so it overlaps this bookkeeping.
        """
        tr = self.trace
        if tr is not None:
            tr.begin()
        read = None
        chain = self._can_chain()
        if self.inflight is not None and not chain and self._needs_sync():
            # N's tokens reach the scheduler (and the grammars) before N+1 is built; its outputs
            # (detokenizing, stop strings) are processed after N+1 is dispatched, as below
            read = self._read_inflight()
            if tr is not None:
                tr.rec["sync"] = 1  # read before scheduling: no overlap this iteration
        try:
            outputs = self._dispatch_and_read(read, chain)
            if tr is not None:
                tr.mark("process_ms")
                tr.end(len(self.scheduler.running), len(self.scheduler.waiting))
            return outputs
        except _DeviceFailure as f:
            if read is not None:  # N was read whole before N+1 failed: its outputs stand
                f.outputs = self._process_outputs(*read)
            raise

    def _can_chain(self) -> bool:
        """Whether the next step is a chained verify step on the one in flight."""
        return (
            self.chain_verify
            and self.inflight is not None
            and self.scheduler.can_chain(self.inflight.out)
            and self.runner.chain_bucket(len(self.scheduler.running)) is not None
        )

    def _dispatch_and_read(self, read, chain: bool = False) -> list[RequestOutput]:
        if chain:
            out = self.scheduler.schedule_chained()
        else:
            if self.drafter is not None and self.inflight is None and self.scheduler.speculating():
                self.drafter.prepare(self.scheduler)  # the drafts Scheduler._propose hands out
            out = self.scheduler.schedule()
            if self.drafter is not None:
                self.drafter.settle(out)
        tr = self.trace
        if tr is not None:
            tr.mark("schedule_ms")
        dispatched = None
        if out:
            prev_rows = self.inflight.rows if self.inflight is not None else None
            plp = None if out.chained else step_targets(out)
            if out.chained:
                T, S = self.runner.chain_bucket(len(out.requests))
                arrays = build_chained(
                    out,
                    self.inflight.out,
                    prev_rows,
                    self.runner.chain,
                    T,
                    S,
                    self.runner.max_blocks_per_seq,
                    self.runner.history_len,
                )
            else:
                # a verify step samples more positions than it has sequences: its sequence
                # bucket holds them (never more than the largest, see Scheduler._propose)
                T, S = self.runner.bucket_for(
                    out.total_tokens, out.num_sample_rows, plp is not None
                )
                arrays = build_step(
                    out, self.kv.block_size, T, S, self.runner.max_blocks_per_seq, prev_rows
                )
            st = build_sampling_tensors(
                out.requests,
                S,
                self.runner.history_len,
                self.eos_token_ids,
                self.grammars,
                self.model_config.vocab_size,
                self.runner.available_flags(S),
                [out.drafts.get(r.request_id, []) for r in out.requests] if out.drafts else None,
            )
            if tr is not None:
                tr.mark("build_ms")
                tr.step(out, T, S)
            run = self.runner.execute
            if out.chained:
                run = partial(self.runner.execute_chained, (T, S))
            elif plp is not None:
                run = partial(self.runner.execute, plp_targets=plp.array(T))
            if self._dispatcher is not None:
                result = self._dispatcher.submit(run, arrays, st)
            else:
                result = self._device(out, run, arrays, st)
            rows = {rid: i for rid, i in out.sample_rows().items() if rid in out.sampling}
            dispatched = _InFlight(result, out, rows, plp)
            self.steps += 1
            self.chained_steps += out.chained
            if tr is not None:
                tr.mark("launch_ms")
        if self.inflight is not None:
            self.overlapped_steps += bool(out)
            read = self._read_inflight()
        self.inflight = dispatched
        return self._process_outputs(*read) if read is not None else []

    def _needs_sync(self) -> bool:
        """Read the step in flight before scheduling the next when its tokens decide the next:
        penalties' history, a grammar's mask, a multi-token bad word's mask, and speculative
        decoding (drafts continue the known tokens, and a verify step's row count per request is
        only known once read)."""
        if self.inflight.out.drafts or self.scheduler.speculating():
            return True
        return any(
            r.grammar is not None
            or r.params.has_penalties
            or r.forces_tokens
            or r.params.has_bad_word_prefixes
            for r in self.scheduler.running
        )

    def _read_inflight(self):
        """The one sync: the in-flight step's samples, handed to the scheduler (which appends
        them, stops, advances grammars). -> what `_process_outputs` needs."""
        step, self.inflight = self.inflight, None
        tr = self.trace
        if tr is not None:
            tr.mark("host_ms")  # since the last mark: whatever this iteration did before
        if isinstance(step.result, Future):
            result = self._device(step.out, step.result.result)
        else:
            result = step.result
        tokens, lps, ranks, top_ids, top_lps = self._device(step.out, self.runner.fetch, result)
        if step.plp is not None:
            self._record_prompt_logprobs(step, result)
        if step.out.chained:  # the drafts the device made for its rows
            drafts = self._device(step.out, self.runner.fetch_drafts, result)
            for r, req in enumerate(step.out.requests):
                step.out.drafts[req.request_id] = drafts[r].tolist()
        if tr is not None:
            tr.mark("wait_ms")
            tr.stamp("read_at")
        if step.out.drafts:  # a verify step: the rows' samples up to the first rejection
            sampled = {}
            for rid, i in step.rows.items():
                drafts = step.out.drafts.get(rid, ())
                a = verify_drafts(tokens[i : i + len(drafts)], drafts)
                sampled[rid] = tokens[i : i + a + 1].tolist()
        else:
            sampled = {rid: [int(tokens[i])] for rid, i in step.rows.items()}
        updated = self.scheduler.update_from_output(step.out, sampled)
        return step, updated, (lps, ranks, top_ids, top_lps)

    def _record_prompt_logprobs(self, step: _InFlight, result) -> None:
        values = self._device(step.out, self.runner.fetch_prompt_logprobs, result)
        for rid, span in step.plp.spans.items():
            group = self.seq_of.get(rid, (None,))[0]  # None: aborted meanwhile
            if group is not None and group.prompt_logprobs is not None:
                group.prompt_logprobs.record(span, values)

    def _process_outputs(self, step: _InFlight, updated, logprobs) -> list[RequestOutput]:
        """Text, logprobs and stop strings of the requests a read step updated. A stop string
        may end a request that the step dispatched since already holds: its row is wasted and
        its sample dropped, as for any request that ends while a step is in flight."""
        lps, ranks, top_ids, top_lps = logprobs
        touched: dict[str, RequestGroup] = {}
        its, iteration_tokens = self.iteration_stats, 0
        for req in updated:
            group, seq = self.seq_of[req.request_id]
            i = step.rows[req.request_id]  # its first sampled position; its next ones follow
            new = len(req.output_token_ids) - seq.num_seen
            if seq.num_seen == 0 and new:  # its first token: the prompt counts here (vLLM's)
                iteration_tokens += its.prefilled(req.num_prompt_tokens, req.num_cached_tokens)
            iteration_tokens += new
            stop = seq.update(
                [(lps[j], ranks[j], top_ids[j], top_lps[j]) for j in range(i, i + new)]
            )
            self.generation_tokens_total += new
            if stop is not None:
                self.scheduler.finish(req, "stop", stop)
            if req.is_finished:
                seq.finish()
            touched[group.request_id] = group
        if updated:
            its.iteration(iteration_tokens)
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
