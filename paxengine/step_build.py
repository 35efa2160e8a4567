"""Building a Runner's step executables: every (T, S) forward, chained verify step and sampler
variant, loaded from the executable store or traced and compiled at start-up (or the first few
now and the rest in the background), then run once each (priming).

Why a module of its own: building is start-up work with its own state (what is planned, built
and primed, the background thread, the compile counters) and its own cost model (tracing holds
the GIL, XLA's compile releases it); `runner.py` only runs what this fills into its dicts, and
nothing here runs while serving but the background's builds and `prime`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import kernels_pallas
from paxengine.batch import StepArrays, bucket_pairs, pick
from paxengine.device_turns import TURNS
from paxengine.executables import ExecutableStore, bypassing_jax_cache
from paxengine.models import quant
from paxengine.models.config import ModelConfig
from paxengine.packing import PackedLayout
from paxengine.parallel import TensorParallel
from paxengine.sampling import (
    SamplingTensors,
    abstract_sampling_tensors,
    build_sampling_tensors,
    pack_samples,
    sample,
)
from paxengine.spec_decode.chain import ChainSpec

log = logging.getLogger("paxengine")
_compile_count = 0
_warm_at = 0  # the count when the latest runner of this process finished warming up
_SAMPLERS: dict[tuple, object] = {}  # (S, V, history, rows, flags) -> compiled, per process
_EXITING = threading.Event()
_BACKGROUND_POOLS: set = set()  # the background's compile pools now building


def _drop_background_builds() -> None:
    """At interpreter exit, before concurrent.futures joins its workers (threading's exit hooks
    run last-registered first): the background's queued compiles are cancelled, each running one
    finishes, so a stopping server exits in seconds instead of after every bucket (a data-parallel
    server, whose engines are threads of its process, waited 33 s on a CPU)."""
    _EXITING.set()
    for pool in list(_BACKGROUND_POOLS):
        pool.shutdown(wait=False, cancel_futures=True)


threading._register_atexit(_drop_background_builds)


BACKGROUND_THREAD = "paxengine-background-compile"


def _count_compiles(event: str, duration: float, **kw) -> None:
    """Compiles of a serving process's steps; the background's planned ones (Runner
    background_compile) are start-up work, not recompiles."""
    global _compile_count
    if event == "/jax/core/compile/backend_compile_duration":
        if not threading.current_thread().name.startswith(BACKGROUND_THREAD):
            _compile_count += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_count() -> int:
    """XLA backend compiles in this process so far (tests assert it stays flat after warm-up)."""
    return _compile_count


def compiles_after_warmup() -> int:
    """Compiles since the last runner of this process was warm: one replica's warm-up is not
    another's recompile (data-parallel replicas share the process and the counter)."""
    return _compile_count - _warm_at


def mark_warm() -> None:
    """The compiles so far belong to start-up (`compiles_after_warmup` counts from here)."""
    global _warm_at
    _warm_at = compile_count()


def enable_persistent_cache(path: str | None) -> Path | None:
    """JAX's compilation cache in `path` (default ~/.cache/paxengine/jax); returns the folder, or
    None when it cannot be made."""
    d = Path(path or Path.home() / ".cache/paxengine/jax")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return d


def xla_compile_options() -> dict | None:
    """XLA options for every step's forward, from PAXENGINE_XLA_OPTIONS (a JSON object, e.g.
    '{"xla_gpu_autotune_level": 0}'): for measuring what an option costs at compile and run
    time on the GPU (benchmarks.profile.fp8_compile at 5f74b6d) without a rebuild. Part of the
    executable store's key."""
    raw = os.environ.get("PAXENGINE_XLA_OPTIONS", "").strip()
    if not raw:
        return None
    import json

    opts = json.loads(raw)
    if not isinstance(opts, dict):
        raise ValueError(f"PAXENGINE_XLA_OPTIONS must be a JSON object, got {raw!r}")
    return opts


def compile_workers() -> int:
    """Threads compiling step executables side by side: half the CPUs, at most 8, or
    PAXENGINE_COMPILE_WORKERS (an A/B knob: XLA autotunes each GEMM on the GPU while it compiles,
    and compiles side by side time their candidates at the same time)."""
    raw = os.environ.get("PAXENGINE_COMPILE_WORKERS", "").strip()
    return int(raw) if raw else min((os.cpu_count() or 1) // 2, 8)


def _compile_now(lowered, opts):
    return lowered.compile(opts)


def out_of_device_memory(e: BaseException) -> bool:
    """XLA's allocator's error (not a kernel over the shared memory: that one fails alone too)."""
    text = str(e)
    return isinstance(e, jax.errors.JaxRuntimeError) and "Out of memory" in text


# The last try of a compile that ran out of device memory by itself: XLA's GEMM autotuning off
# (its default tilings; the executable is not stored, so a later start tunes it again)
UNTUNED = {"xla_gpu_autotune_level": 0}


def results_or_alone(futures: dict, alone: dict):
    """(name, store key, executable, tuned) of each compile in `futures` (name -> (key,
    future)). A compile that ran out of device memory is run again by itself once the others
    are done (`alone`: name -> (compile function, lowered, options)), and if it runs out again,
    once more without autotuning (tuned False). Why: XLA autotunes a step's GEMMs on the device
    while it compiles, with copies of their operands from the pool the KV plan leaves for the
    steps' temporaries (~4 GiB a try for Qwen3.5-9B's 248,320-token lm_head), and eight
    compiles side by side outgrew it: Qwen3.5-9B at 0.92 of an H100 stopped its start-up with
    RESOURCE_EXHAUSTED in one of them (benchmarks/results/gpu_2026-12-07h/). Alone, a compile's
    autotuning has the whole reserve; untuned, it needs none."""
    later = []
    for name, (store_key, fut) in futures.items():
        try:
            yield name, store_key, fut.result(), True
        except Exception as e:
            if not out_of_device_memory(e):
                e.add_note(f"(compiling the step executable {name})")  # which bucket
                raise
            later.append((name, store_key))
    for name, store_key in later:
        fn, lowered, opts = alone[name]
        log.warning(
            "compiling the step executable %s again by itself: compiled beside others, its "
            "autotuning ran out of device memory",
            name,
        )
        tuned = True
        try:
            exe = fn(lowered, opts)
        except Exception as e:
            if not out_of_device_memory(e):
                e.add_note(f"(compiling the step executable {name}, by itself)")
                raise
            log.warning(
                "compiling the step executable %s without autotuning (XLA's default GEMM "
                "tilings; not stored): by itself, its autotuning ran out of device memory too",
                name,
            )
            exe, tuned = fn(lowered, {**(opts or {}), **UNTUNED}), False
        yield name, store_key, exe, tuned


def _compile_in_turn(lowered, opts):
    """A background compile: XLA autotunes on the device, between the steps (device_turns)."""
    with TURNS.compile():
        return lowered.compile(opts)


def smallest_holding(pairs, n: int) -> tuple[int, int] | None:
    """The smallest (T, S) bucket with n tokens and n sampled rows (a chained step's shape)."""
    return min((p for p in pairs if p[0] >= n and p[1] >= n), default=None)


def abstract_of(x: jax.Array) -> jax.ShapeDtypeStruct:
    """x's shape and dtype, and its sharding where it has a mesh's (tensor parallelism): one
    device's array lowers as it would itself (no sharding annotations)."""
    sharding = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def first_buckets(pairs, token_buckets, seq_buckets) -> list[tuple[int, int]]:
    """The buckets a start-up with background compilation builds first: for each sequence
    bucket S the smallest token bucket holding S rows (a decode step of any batch size runs in
    one of these), and the largest (every prefill fits it)."""
    first = [(pick(token_buckets, s), s) for s in seq_buckets if s <= token_buckets[-1]]
    first.append((token_buckets[-1], seq_buckets[-1]))
    return [p for p in dict.fromkeys(first) if p in pairs]


def background_order(job) -> tuple:
    """The background's build order: samplers and chained steps before forwards (a step that
    runs in a larger forward bucket meanwhile is only slower), each kind by its shape. The kind
    comes before the shape: a chained (T, S) and a sampler's (S, flags) do not compare."""
    kind = job[0][0]
    return (kind == "fwd", kind, job[0][1:])


class StepRunner(Protocol):
    """What a StepBuilder reads and fills of its runner: `runner.Runner` (and its subclasses),
    named here by what it has, not imported (runner.py imports this module)."""

    cfg: ModelConfig
    tp: TensorParallel | None
    store: ExecutableStore | None
    chain: ChainSpec | None
    fp8: bool
    placement: tuple
    history_len: int
    max_rows: int
    max_blocks_per_seq: int
    token_buckets: list[int]
    seq_buckets: list[int]
    sampler_flags: list[tuple]
    compiled: dict  # filled here: (T, S) -> forward
    chained: dict  # (T, S) -> chained verify step
    samplers: dict  # (S, flags) -> sampler
    _layouts: dict
    prev_tokens: jax.Array
    plp: bool  # prompt-logprob executables too
    plp_compiled: dict  # filled here: T -> prompt-logprob executable

    def step_layout(self, T: int, S: int) -> PackedLayout: ...
    def sampling_layout(self, S: int, flags) -> PackedLayout: ...
    def _chain_layout(self, T: int, S: int) -> PackedLayout: ...
    def _forward_job(self, T: int, S: int) -> tuple: ...  # (store key, lower, XLA options)
    def _chain_job(self, T: int, S: int) -> tuple: ...
    def _plp_job(self, T: int) -> tuple: ...
    def execute(self, arrays: StepArrays, st: SamplingTensors, plp_targets=None) -> tuple: ...


class StepBuilder:
    """Fills one Runner's `compiled`, `chained`, `samplers` and `_layouts`, and primes them. The
    runner says what each bucket's program is (its `_forward_job` and `_chain_job`: a store key,
    a lowering and XLA options; a subclass may lower another forward); the samplers are lowered
    here, shared by every runner of the process with the same shapes."""

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self.compile_seconds = self.trace_seconds = 0.0
        self.background: threading.Thread | None = None  # see build_all
        self.pending = 0  # executables the background has still to build
        self._primed: set[tuple] = set()  # the (T, S) forwards and (S, flags) samplers run once

    def _sampler_key(self, S: int, flags) -> tuple:
        r = self.runner
        return (S, r.cfg.vocab_size, r.history_len, r.max_rows, tuple(flags), r.placement)

    def _lower_sampler(self, S: int, flags):
        r = self.runner
        max_rows = r.max_rows
        layout = r.sampling_layout(S, flags)
        names = dict(zip(("penalties", "top", "logprobs", "grammar"), flags))

        def sample_step(logits, packed, history, mask, shift):
            x = layout.unpack(packed)
            x["steps"] = x["steps"] + shift  # a chained step's keys: its rows' places, on device
            st = SamplingTensors(**x, history=history, mask=mask, **names)
            result = sample(logits, st)
            padded = jnp.zeros(max_rows, jnp.int32).at[:S].set(result[0])
            return pack_samples(result, st.logprobs), padded

        sharding = r.tp.sharding(P()) if r.tp is not None else None
        logits = jax.ShapeDtypeStruct((S, r.cfg.vocab_size), jnp.float32, sharding=sharding)
        st = abstract_sampling_tensors(S, r.history_len, flags, r.cfg.vocab_size)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        shift = jax.ShapeDtypeStruct((S,), jnp.int32, sharding=sharding)
        return jax.jit(sample_step).lower(logits, packed, st.history, st.mask, shift)

    def build_all(self, show_progress: bool, background: bool) -> None:
        """Loads each bucket's executable from the store, or traces it (tracing holds the GIL)
        and compiles it on a thread pool (XLA's compile releases it): an unrolled 8B model's
        buckets compile side by side. The samplers are small and shared by every runner of the
        process with the same shapes.

        background: only the buckets that serve any step well enough are built now
        (`first_buckets`, the cheapest and the all-flags sampler of every sequence bucket); the
        others follow on a thread of their own while the engine serves, and until one is there a
        step runs in the smallest compiled bucket that holds it (`Runner.bucket_for`)."""
        r = self.runner
        t0 = time.perf_counter()
        pairs = bucket_pairs(r.token_buckets, r.seq_buckets)
        sampler_keys = [(S, f) for S in r.seq_buckets for f in r.sampler_flags]
        self.planned = pairs
        r._layouts = {("fwd", T, S): r.step_layout(T, S) for T, S in pairs}
        r._layouts.update({("smp", S, f): r.sampling_layout(S, f) for S, f in sampler_keys})
        for S, f in sampler_keys:  # compiled by another runner of this process already
            if self._sampler_key(S, f) in _SAMPLERS:
                r.samplers[(S, f)] = _SAMPLERS[self._sampler_key(S, f)]
        jobs = [(("fwd", T, S), r._forward_job(T, S)) for T, S in pairs]  # (key, lower, opts)
        self.chain_planned = self._chain_pairs(pairs)
        for T, S in self.chain_planned:
            r._layouts[("chn", T, S)] = r._chain_layout(T, S)
            jobs.append((("chn", T, S), r._chain_job(T, S)))
        jobs += [
            (("smp", S, f), self._sampler_job(S, f))
            for S, f in sampler_keys
            if (S, f) not in r.samplers
        ]
        if r.plp:  # one per token bucket (prompt_logprobs.py)
            jobs += [(("plp", T), r._plp_job(T)) for T in r.token_buckets]
        later = []
        if background:
            first = set(first_buckets(pairs, r.token_buckets, r.seq_buckets))
            cheap, full = min(r.sampler_flags, key=sum), max(r.sampler_flags, key=sum)
            # the largest token bucket's prompt logprobs: a step that asks runs in it meanwhile
            now = [
                j
                for j in jobs
                if (j[0][0] == "fwd" and j[0][1:] in first)
                or (j[0][0] == "smp" and j[0][2] in (cheap, full))
                or j[0] == ("plp", r.token_buckets[-1])
            ]
            later = sorted((j for j in jobs if j not in now), key=background_order)
            jobs = now
        bar = tqdm(total=len(jobs), desc="compiling step buckets", disable=not show_progress)
        self._build(jobs, bar.update)
        bar.close()
        self.compile_seconds = time.perf_counter() - t0
        if later:
            self.pending = len(later)
            self.background = threading.Thread(
                target=self._build_later, args=(later,), name=BACKGROUND_THREAD, daemon=True
            )
            self.background.start()

    def _build(self, jobs, done) -> None:
        store = self.runner.store
        workers = max(1, min(len(jobs), compile_workers()))
        prefix = threading.current_thread().name  # the background's compiles are its own
        behind = prefix.startswith(BACKGROUND_THREAD)
        no_jax_cache = bypassing_jax_cache() if store is not None else nullcontext()
        with no_jax_cache, ThreadPoolExecutor(workers, thread_name_prefix=prefix) as pool:
            if behind:
                _BACKGROUND_POOLS.add(pool)
            # stored executables load side by side (a GPU executable loads its kernels)
            stored = {}
            if store is not None:
                kernels_pallas.prepare_runtime()  # before any stored kernel is loaded
                stored = {name: pool.submit(store.load, key) for name, (key, _, _) in jobs}
            futures, retry = {}, {}
            for name, (store_key, lower, opts) in jobs:
                exe = stored[name].result() if name in stored else None
                if exe is None:
                    t = time.perf_counter()
                    lowered = lower()
                    self.trace_seconds += time.perf_counter() - t
                    compile_fn = _compile_in_turn if behind else _compile_now
                    retry[name] = (compile_fn, lowered, opts)
                    futures[name] = (store_key, pool.submit(compile_fn, lowered, opts))
                else:
                    self._keep(name, exe)
                    done(1)
            for name, store_key, exe, tuned in results_or_alone(futures, retry):
                if store is not None and tuned:
                    store.save(store_key, exe, label=str(name))
                self._keep(name, exe)
                done(1)
        _BACKGROUND_POOLS.discard(pool)

    def _build_later(self, jobs) -> None:
        t = time.perf_counter()

        def one_less(n: int) -> None:
            self.pending -= n

        try:
            self._build(jobs, one_less)
        except Exception as e:  # the compiled buckets keep serving; the missing ones stay missing
            if _EXITING.is_set() or "interpreter shutdown" in str(e):
                return  # the process is exiting while this compiled: nothing is left to serve
            log.exception("compiling step buckets in the background failed")
            return
        log.info(
            "%d more step executables ready in the background in %.1f s",
            len(jobs),
            time.perf_counter() - t,
        )

    def _priming_runs(self) -> list[tuple[int, int, tuple]]:
        """(T, S, sampler flags) runs that reach every compiled forward and sampler not run yet:
        each forward with its S's plainest built sampler, each other sampler after its S's
        smallest forward; a prompt-logprob executable after a forward of its T. Sorted: every
        process of a mesh runs them in the same order."""
        r = self.runner
        built, smp = sorted(r.compiled), sorted(r.samplers)  # snapshots: the background
        forwards = [k for k in built if k not in self._primed]  # may add to both meanwhile
        samplers = [k for k in smp if k not in self._primed]
        runs, used = [], set()
        for T, S in forwards:
            flags = min((f for s, f in smp if s == S), key=sum, default=None)
            if flags is not None:
                runs.append((T, S, flags))
                used.add((S, flags))
        for S, flags in samplers:
            T = next((t for t, s in built if s == S), None)
            if T is not None and (S, flags) not in used:
                runs.append((T, S, flags))
        for T in sorted(r.plp_compiled):
            if ("plp", T) in self._primed or any(t == T for t, _, _ in runs):
                continue
            S = next((s for t, s in built if t == T), None)
            flags = min((f for s, f in smp if s == S), key=sum, default=None)
            if flags is not None:
                runs.append((T, S, flags))
        return runs

    @property
    def num_primed(self) -> int:
        """The forwards and samplers `prime` has run."""
        return len(self._primed)

    def unprimed(self) -> bool:
        """Whether a compiled step or sampler has not run yet (the background built it)."""
        return self.num_unprimed() > 0

    def num_unprimed(self) -> int:
        r = self.runner
        plps = [("plp", T) for T in list(r.plp_compiled)]
        return sum(k not in self._primed for k in list(r.compiled) + list(r.samplers) + plps)

    def prime(self, limit: int | None = None) -> tuple[int, float]:
        """Runs each compiled forward and sampler variant not run yet once, on an all-padding
        batch (every slot -1: nothing is written to the KV cache; nobody reads the samples),
        then clears the previous step's samples; at most `limit` runs. Returns (runs, seconds).
        Why: a GPU executable's first run loads its kernels and sets up its launches, 30-165 ms
        for an 8B bucket on the H200 (benchmarks/results/gpu_2026-12-03_bf16_lease/), and the
        first requests after a start paid that in their TTFT. Not while a step is in flight:
        the forward donates the KV cache."""
        r = self.runner
        t = time.perf_counter()
        runs = self._priming_runs()[:limit]
        result = None
        for T, S, flags in runs:
            st = build_sampling_tensors(
                [], S, r.history_len, [], vocab_size=r.cfg.vocab_size, available=[flags]
            )
            targets = None
            if T in r.plp_compiled and ("plp", T) not in self._primed:
                targets = np.full(T, -1, np.int32)
                self._primed.add(("plp", T))
            arrays = StepArrays.padding(T, S, r.max_blocks_per_seq, 0)
            result = r.execute(arrays, st) if targets is None else r.execute(arrays, st, targets)
            self._primed.update({(T, S), (S, flags)})
        if result is not None:
            jax.block_until_ready(result[0])
        r.prev_tokens = jnp.zeros_like(r.prev_tokens)
        return len(runs), time.perf_counter() - t

    def wait_background(self, timeout: float | None = None) -> bool:
        """Until the background's buckets are built (True), or timeout seconds (False)."""
        if self.background is not None:
            self.background.join(timeout)
            return not self.background.is_alive()
        return True

    def store_key(self, name: str, static: tuple, args, T: int) -> tuple[str | None, dict | None]:
        """A T-token step's store key (None without a store) and its XLA options, which are
        part of the key."""
        opts = self._xla_options(T)
        if opts:
            static += (tuple(sorted(opts.items())),)
        store = self.runner.store
        return (store.key(name, static, args) if store is not None else None), opts

    def _xla_options(self, T: int) -> dict | None:
        """XLA options for the forward of a T-token bucket: FP8 weights' own (quant.xla_options),
        then PAXENGINE_XLA_OPTIONS."""
        if self.runner.fp8:
            opts = quant.xla_options(T)
        else:
            # a family's cuBLAS choice was measured on its dense models: MoE layers' ragged_dot
            # keeps XLA's own lowering
            dense = not self.runner.cfg.moe_layers
            n = getattr(self.runner.family, "CUBLAS_MAX_TOKENS", 0) if dense else 0
            opts = quant.dense_xla_options(T, n)
        return {**opts, **(xla_compile_options() or {})} or None

    def _chain_pairs(self, pairs) -> list[tuple[int, int]]:
        """The buckets chained steps of 1..chain.rows requests run in (K + 1 tokens and
        sampled rows each): the smallest planned one that holds them."""
        chain = self.runner.chain
        if chain is None:
            return []
        need = [r * (chain.k + 1) for r in range(1, chain.rows + 1)]
        fits = [smallest_holding(pairs, n) for n in need]
        return sorted({p for p in fits if p is not None})

    def _sampler_job(self, S: int, flags):
        static = self._sampler_key(S, flags)
        store = self.runner.store
        key = store.key("sampler", static, ()) if store is not None else None
        return key, lambda: self._lower_sampler(S, flags), None

    def _keep(self, name: tuple, exe) -> None:
        r = self.runner
        if name[0] == "fwd":
            r.compiled[name[1:]] = exe
        elif name[0] == "chn":
            r.chained[name[1:]] = exe
        elif name[0] == "plp":
            r.plp_compiled[name[1]] = exe
        else:
            _SAMPLERS[self._sampler_key(*name[1:])] = exe
            r.samplers[name[1:]] = exe
