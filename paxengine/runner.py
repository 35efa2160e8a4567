"""The device side: KV cache allocation, bucketed AOT-compiled steps, one host transfer per step.

The runner knows nothing of requests: it takes a StepArrays + SamplingTensors and returns
sampled tokens and logprobs. Every bucket is compiled at start-up; calling a compiled
executable can never trace again, so nothing compiles while serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import kernels_pallas
from paxengine import parallel
from paxengine.attention import PagedAttend
from paxengine.batch import StepArrays, bucket_pairs, pick
from paxengine.executables import ExecutableStore, bypassing_jax_cache
from paxengine.kv_memory import allocate_kv_cache
from paxengine.models import quant
from paxengine.models.config import ModelConfig
from paxengine.models.llama import compute_logits, forward_hidden
from paxengine.models.weights import is_per_layer
from paxengine.packing import PackedLayout
from paxengine.sampling import (
    ALL_FLAGS,
    DATA_FIELDS,
    NUM_TOP_LOGPROBS,
    SamplingTensors,
    abstract_sampling_tensors,
    build_sampling_tensors,
    pack_samples,
    sample,
    unpack_samples,
)
from paxengine.spec_decode.chain import ChainSpec, chain_layout, chained_inputs

log = logging.getLogger("paxengine")
_compile_count = 0
_warm_at = 0  # the count when the latest runner of this process finished warming up
_SAMPLERS: dict[tuple, object] = {}  # (S, V, history, rows, flags) -> compiled, per process


BACKGROUND_THREAD = "paxengine-background-compile"
# A probe's knob (benchmarks/profile/cmdbuf_updates.py), off: the step's fresh input buffers
# make XLA re-record the forward's CUDA graph every step (~1 ms of host time); copied into
# buffers kept across steps, a step read before the next is built skips that (H200 batch 1: 6.9
# -> 5.9 ms), but verify steps and overlapped steps gained nothing
# (benchmarks/results/gpu_2026-12-02_spec_launch/). Its copies compile at first use.
_STABLE_INPUTS = os.environ.get("PAXENGINE_STABLE_INPUTS", "0") == "1"
# a real copy into the donated buffer (jit would forward a bare `new` without running anything)
_copy_into = jax.jit(
    lambda old, new: jax.lax.dynamic_update_slice(old, new, (0,) * old.ndim), donate_argnums=0
)


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
    time on the GPU (benchmarks.profile.fp8_compile) without a rebuild. Part of the executable
    store's key."""
    raw = os.environ.get("PAXENGINE_XLA_OPTIONS", "").strip()
    if not raw:
        return None
    import json

    opts = json.loads(raw)
    if not isinstance(opts, dict):
        raise ValueError(f"PAXENGINE_XLA_OPTIONS must be a JSON object, got {raw!r}")
    return opts


def resolve_backend(name: str) -> str:
    """auto: the Pallas kernel on GPUs, the tiled XLA attention elsewhere."""
    if name not in ("auto", "reference", "pallas", "xla"):
        raise ValueError(f"attention_backend must be auto, reference, xla or pallas, got {name!r}")
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return name


def resolve_layer_loop(name: str) -> str:
    """auto: unrolled per-layer weights on GPUs (XLA copies scanned weights there), scan elsewhere
    (compile time does not grow with depth, which the CPU tests need)."""
    if name not in ("auto", "scan", "unroll"):
        raise ValueError(f"layer_loop must be auto, scan or unroll, got {name!r}")
    if name == "auto":
        return "unroll" if jax.default_backend() == "gpu" else "scan"
    return name


def _smallest_holding(pairs, n: int) -> tuple[int, int] | None:
    """The smallest (T, S) bucket with n tokens and n sampled rows (a chained step's shape)."""
    return min((p for p in pairs if p[0] >= n and p[1] >= n), default=None)


class Runner:
    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        token_buckets: list[int],
        seq_buckets: list[int],
        kv_dtype,
        attention_backend: str = "auto",
        show_progress: bool = True,
        store: ExecutableStore | None = None,
        tp: parallel.TensorParallel | None = None,
        sampler_flags: list[tuple] = ALL_FLAGS,
        background_compile: bool = False,
        aux: AuxHidden | None = None,
        chain: ChainSpec | None = None,
    ):
        """params: stacked layers (scanned) or a list of per-layer dicts (unrolled), see
        `weights.unstack_layers`; the KV cache takes the same layout. tp: tensor parallelism
        (params prepared by `parallel.copy_kv_heads` and fused per shard); they and the cache
        are placed on its mesh here. aux: keep the auxiliary hidden states an EAGLE-3
        speculator reads (`AuxHidden`); None: the forward computes nothing for them. chain: also
        compile chained n-gram verify steps (spec_decode/chain.py) for up to chain.rows requests."""
        self.tp = tp
        self.chain = chain
        if chain is not None and (tp is not None or aux is not None):
            raise ValueError("chained verify steps run on one device, without EAGLE-3 states")
        self.aux = aux
        if aux is not None and tp is not None:
            raise ValueError("auxiliary hidden states under tensor parallelism are not implemented")
        # where the steps run, in every executable's key: the same shapes on other devices (a
        # data-parallel replica) or under other shardings need executables of their own
        self.placement = tuple(d.id for d in tp.mesh.devices.flat) if tp is not None else ()
        self.cfg = cfg
        self.params = parallel.shard_params(params, tp) if tp is not None else params
        if aux is not None:
            self.params = {**self.params, "aux_proj": aux.proj}
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.history_len = max_model_len
        self.token_buckets, self.seq_buckets = token_buckets, seq_buckets
        self.max_rows = max(seq_buckets)
        # the last step's samples, on device (every device of a tensor-parallel group)
        self.prev_tokens = jnp.zeros(self.max_rows, jnp.int32)
        if tp is not None:
            zeros = np.zeros(self.max_rows, np.int32)  # host data: the mesh may span processes
            self.prev_tokens = jax.device_put(zeros, tp.sharding(P()))
        self.backend = resolve_backend(attention_backend)
        self.layer_loop = "unroll" if is_per_layer(params) else "scan"
        self.fp8 = quant.weight_dtype(params) == "fp8_e4m3"
        self._kv_args = (cfg, num_blocks, block_size, kv_dtype, self.layer_loop, tp)
        self.kv_cache = allocate_kv_cache(*self._kv_args)
        self.aux_cache = aux.allocate(num_blocks * block_size) if aux is not None else None
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,), static_argnames=("layout",))
        self.compiled: dict[tuple[int, int], object] = {}  # (T, S) -> forward
        self.chained: dict[tuple[int, int], object] = {}  # (T, S) -> chained verify forward
        # the last chained step's drafts (the next chained step reads them), [chain.rows, K]
        self.prev_drafts = jnp.full((chain.rows, chain.k), -1, jnp.int32) if chain else None
        self._chain_fwd = jax.jit(
            self._chain_fn, donate_argnums=(1,), static_argnames=("layout", "T", "S")
        )
        self._zero_shift: dict[int, jax.Array] = {}  # S -> zeros: no key shift (unchained)
        self._staged: dict = {}  # _stable's buffers
        self.samplers: dict[tuple, object] = {}  # (S, flags) -> sampler
        self._layouts: dict[tuple, PackedLayout] = {}  # ("fwd", T, S) / ("smp", S, flags)
        self.compile_seconds = self.trace_seconds = 0.0
        self.store = store
        self.sampler_flags = list(sampler_flags)  # the variants compiled (sampling.choose_flags)
        self.background: threading.Thread | None = None  # see _compile_all
        self._primed: set[tuple] = set()  # the (T, S) forwards and (S, flags) samplers run once
        self._compile_all(show_progress, background_compile)
        for S in seq_buckets:  # made now: an array made while serving is a compile of its own
            self._no_shift(S)
        global _warm_at
        _warm_at = compile_count()

    # -- the jitted step: a forward per (T, S) bucket, then a sampler per (S, flags) ------------
    # Each takes its host inputs packed into one int32 vector (paxengine/packing.py): one
    # transfer per executable instead of one per array.
    def step_layout(self, T: int, S: int) -> PackedLayout:
        """The forward's host inputs: StepArrays' fields, by name."""
        P = self.max_blocks_per_seq
        return PackedLayout.of(
            [
                ("tokens", (T,), np.int32),
                ("positions", (T,), np.int32),
                ("slot_mapping", (T,), np.int32),
                ("block_tables", (S, P), np.int32),
                ("seq_lens", (S,), np.int32),
                ("query_start_loc", (S + 1,), np.int32),
                ("num_seqs", (1,), np.int32),
                ("logits_indices", (S,), np.int32),
                ("prev_index", (T,), np.int32),
            ]
        )

    def sampling_layout(self, S: int, flags) -> PackedLayout:
        """The sampler's host inputs: SamplingTensors' arrays but the two large optional ones
        (penalties' history, a grammar's mask), which stay arguments of their own."""
        st = abstract_sampling_tensors(S, self.history_len, flags, self.cfg.vocab_size)
        return PackedLayout.of(
            (f, getattr(st, f).shape, getattr(st, f).dtype) for f in DATA_FIELDS if f not in _APART
        )

    def _forward_fn(self, params, kv_cache, packed, prev_tokens, *, layout: PackedLayout):
        x = layout.unpack(packed)
        md = kernels_pallas.AttentionMetadata(
            x["slot_mapping"], x["block_tables"], x["seq_lens"], x["query_start_loc"], x["num_seqs"]
        )
        tokens, positions, prev_index = x["tokens"], x["positions"], x["prev_index"]
        # Tokens sampled by the previous step never visit the host before they are used here.
        tokens = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], tokens)
        return self._model(params, kv_cache, tokens, positions, md, x["logits_indices"])

    def _chain_fn(self, params, kv_cache, packed, prev_tokens, prev_drafts, *, layout, T, S):
        """A chained verify step: its rows laid out on the device from the previous step's
        samples and drafts (spec_decode/chain.py). -> (KV, logits, key shift, drafts)."""
        x = layout.unpack(packed)
        tokens, positions, slots, seq_lens, qsl, logits_indices, shift, drafts = chained_inputs(
            x, prev_tokens, prev_drafts, self.chain, self.block_size, T, S
        )
        md = kernels_pallas.AttentionMetadata(
            slots, x["block_tables"], seq_lens, qsl, x["num_seqs"]
        )
        kv_cache, logits = self._model(params, kv_cache, tokens, positions, md, logits_indices)
        return kv_cache, logits, shift, drafts

    def _model(self, params, kv_cache, tokens, positions, md, logits_indices):
        attend = PagedAttend(md, self.backend, self.cfg, fused_rope=self.tp is None)
        if self.aux is not None:  # (KV, aux cache): every token's projected aux states, by slot
            kv_cache, aux_cache = kv_cache
            hidden, kv_cache, aux = forward_hidden(
                params, self.cfg, tokens, positions, kv_cache, attend, aux_layers=self.aux.layers
            )
            feats = quant.linear(aux, params["aux_proj"]).astype(aux_cache.dtype)
            slots = md.slot_mapping
            slots = jnp.where(slots < 0, aux_cache.shape[0], slots)  # padding: dropped
            kv_cache = (kv_cache, aux_cache.at[slots].set(feats, mode="drop"))
        else:
            hidden, kv_cache = forward_hidden(
                params, self.cfg, tokens, positions, kv_cache, attend, tp=self.tp
            )
        logits = compute_logits(params, self.cfg, hidden[logits_indices])
        if self.tp is not None:  # every device samples from all of them (see _lower_sampler)
            logits = jax.lax.with_sharding_constraint(logits, self.tp.sharding(P()))
        return kv_cache, logits

    def _abstract_inputs(self, T: int, S: int):
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        return i32(self.step_layout(T, S).size), i32(self.max_rows)

    def _sampler_key(self, S: int, flags) -> tuple:
        return (
            S,
            self.cfg.vocab_size,
            self.history_len,
            self.max_rows,
            tuple(flags),
            self.placement,
        )

    def _lower_sampler(self, S: int, flags):
        max_rows = self.max_rows
        layout = self.sampling_layout(S, flags)
        names = dict(zip(("penalties", "top", "logprobs", "grammar"), flags))

        def sample_step(logits, packed, history, mask, shift):
            x = layout.unpack(packed)
            x["steps"] = x["steps"] + shift  # a chained step's keys: its rows' places, on device
            st = SamplingTensors(**x, history=history, mask=mask, **names)
            result = sample(logits, st)
            padded = jnp.zeros(max_rows, jnp.int32).at[:S].set(result[0])
            return pack_samples(result, st.logprobs), padded

        sharding = self.tp.sharding(P()) if self.tp is not None else None
        logits = jax.ShapeDtypeStruct((S, self.cfg.vocab_size), jnp.float32, sharding=sharding)
        st = abstract_sampling_tensors(S, self.history_len, flags, self.cfg.vocab_size)
        packed = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        shift = jax.ShapeDtypeStruct((S,), jnp.int32, sharding=sharding)
        return jax.jit(sample_step).lower(logits, packed, st.history, st.mask, shift)

    def _compile_all(self, show_progress: bool, background: bool) -> None:
        """Loads each bucket's executable from the store, or traces it (tracing holds the GIL)
        and compiles it on a thread pool (XLA's compile releases it): an unrolled 8B model's
        buckets compile side by side. The samplers are small and shared by every runner of the
        process with the same shapes.

        background: only the buckets that serve any step well enough are built now
        (`first_buckets`, the cheapest and the all-flags sampler of every sequence bucket); the
        others follow on a thread of their own while the engine serves, and until one is there a
        step runs in the smallest compiled bucket that holds it (`bucket_for`)."""
        t0 = time.perf_counter()
        pairs = bucket_pairs(self.token_buckets, self.seq_buckets)
        sampler_keys = [(S, f) for S in self.seq_buckets for f in self.sampler_flags]
        self.planned = pairs
        self._layouts = {("fwd", T, S): self.step_layout(T, S) for T, S in pairs}
        self._layouts.update({("smp", S, f): self.sampling_layout(S, f) for S, f in sampler_keys})
        for S, f in sampler_keys:  # compiled by another runner of this process already
            if self._sampler_key(S, f) in _SAMPLERS:
                self.samplers[(S, f)] = _SAMPLERS[self._sampler_key(S, f)]
        jobs = [(("fwd", T, S), self._forward_job(T, S)) for T, S in pairs]  # (key, lower, opts)
        self.chain_planned = self._chain_pairs(pairs)
        for T, S in self.chain_planned:
            self._layouts[("chn", T, S)] = self._chain_layout(T, S)
            jobs.append((("chn", T, S), self._chain_job(T, S)))
        jobs += [
            (("smp", S, f), self._sampler_job(S, f))
            for S, f in sampler_keys
            if (S, f) not in self.samplers
        ]
        later = []
        if background:
            first = set(first_buckets(pairs, self.token_buckets, self.seq_buckets))
            cheap, full = min(self.sampler_flags, key=sum), max(self.sampler_flags, key=sum)
            now = [
                j
                for j in jobs
                if (j[0][0] == "fwd" and j[0][1:] in first)
                or (j[0][0] == "smp" and j[0][2] in (cheap, full))
            ]
            later = sorted(
                (j for j in jobs if j not in now), key=lambda j: (j[0][0] == "fwd", j[0][1:])
            )
            jobs = now
        bar = tqdm(total=len(jobs), desc="compiling step buckets", disable=not show_progress)
        self._build(jobs, bar.update)
        bar.close()
        self.compile_seconds = time.perf_counter() - t0
        if later:
            self.background = threading.Thread(
                target=self._build_later, args=(later,), name=BACKGROUND_THREAD, daemon=True
            )
            self.background.start()

    def _build(self, jobs, done) -> None:
        workers = max(1, min(len(jobs), (os.cpu_count() or 1) // 2, 8))
        prefix = threading.current_thread().name  # the background's compiles are its own
        no_jax_cache = bypassing_jax_cache() if self.store is not None else nullcontext()
        with no_jax_cache, ThreadPoolExecutor(workers, thread_name_prefix=prefix) as pool:
            # stored executables load side by side (a GPU executable loads its kernels)
            stored = {}
            if self.store is not None:
                kernels_pallas.prepare_runtime()  # before any stored kernel is loaded
                stored = {name: pool.submit(self.store.load, key) for name, (key, _, _) in jobs}
            futures = {}
            for name, (store_key, lower, opts) in jobs:
                exe = stored[name].result() if name in stored else None
                if exe is None:
                    t = time.perf_counter()
                    lowered = lower()
                    self.trace_seconds += time.perf_counter() - t
                    futures[name] = (store_key, pool.submit(lowered.compile, opts))
                else:
                    self._keep(name, exe)
                    done(1)
            for name, (store_key, fut) in futures.items():
                exe = fut.result()
                if self.store is not None:
                    self.store.save(store_key, exe, label=str(name))
                self._keep(name, exe)
                done(1)

    def _build_later(self, jobs) -> None:
        t = time.perf_counter()
        try:
            self._build(jobs, lambda n: None)
        except Exception as e:  # the compiled buckets keep serving; the missing ones stay missing
            if isinstance(e, RuntimeError) and "interpreter shutdown" in str(e):
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
        smallest forward. Sorted: every process of a mesh runs them in the same order."""
        built, smp = sorted(self.compiled), sorted(self.samplers)  # snapshots: the background
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
        return runs

    @property
    def num_primed(self) -> int:
        """The forwards and samplers `prime` has run."""
        return len(self._primed)

    def unprimed(self) -> bool:
        """Whether a compiled step or sampler has not run yet (the background built it)."""
        return any(k not in self._primed for k in list(self.compiled) + list(self.samplers))

    def prime(self, limit: int | None = None) -> tuple[int, float]:
        """Runs each compiled forward and sampler variant not run yet once, on an all-padding
        batch (every slot -1: nothing is written to the KV cache; nobody reads the samples),
        then clears the previous step's samples; at most `limit` runs. Returns (runs, seconds).
        Why: a GPU executable's first run loads its kernels and sets up its launches, 30-165 ms
        for an 8B bucket on the H200 (benchmarks/results/gpu_2026-12-03_bf16_lease/), and the
        first requests after a start paid that in their TTFT. Not while a step is in flight:
        the forward donates the KV cache."""
        t = time.perf_counter()
        runs = self._priming_runs()[:limit]
        result = None
        for T, S, flags in runs:
            st = build_sampling_tensors(
                [], S, self.history_len, [], vocab_size=self.cfg.vocab_size, available=[flags]
            )
            result = self.execute(StepArrays.padding(T, S, self.max_blocks_per_seq, 0), st)
            self._primed.update({(T, S), (S, flags)})
        if result is not None:
            jax.block_until_ready(result[0])
        self.prev_tokens = jnp.zeros_like(self.prev_tokens)
        return len(runs), time.perf_counter() - t

    def wait_background(self, timeout: float | None = None) -> bool:
        """Until the background's buckets are built (True), or timeout seconds (False)."""
        if self.background is not None:
            self.background.join(timeout)
            return not self.background.is_alive()
        return True

    def available_flags(self, S: int) -> list[tuple]:
        """The sampler variants compiled for S rows (all of them, once the background is done)."""
        return [f for f in self.sampler_flags if (S, f) in self.samplers]

    def _forward_job(self, T: int, S: int):
        # shapes only: a job the background lowers later must not hold the KV arrays, which
        # the steps donate (and free) meanwhile
        params, kv = jax.tree.map(_abstract, (self.params, self._caches()))
        args = (params, kv, *self._abstract_inputs(T, S))
        static = (self.cfg, self.backend, self.max_blocks_per_seq, self.max_rows, self.placement)
        if self.aux is not None:  # which layers' states it keeps is in the program, not its shapes
            static += (("aux_layers", self.aux.layers),)
        key, opts = self._store_key("forward", static, args, T)
        layout = self.step_layout(T, S)
        return key, lambda: self._forward.lower(*args, layout=layout), opts

    def _store_key(self, name: str, static: tuple, args, T: int) -> tuple[str | None, dict | None]:
        """A T-token step's store key (None without a store) and its XLA options, which are
        part of the key."""
        opts = self._xla_options(T)
        if opts:
            static += (tuple(sorted(opts.items())),)
        return (self.store.key(name, static, args) if self.store is not None else None), opts

    def _xla_options(self, T: int) -> dict | None:
        """XLA options for the forward of a T-token bucket: FP8 weights' own (quant.xla_options),
        then PAXENGINE_XLA_OPTIONS."""
        opts = quant.xla_options(T) if self.fp8 else {}
        return {**opts, **(xla_compile_options() or {})} or None

    def _chain_pairs(self, pairs) -> list[tuple[int, int]]:
        """The buckets chained steps of 1..chain.rows requests run in (K + 1 tokens and
        sampled rows each): the smallest planned one that holds them."""
        if self.chain is None:
            return []
        need = [r * (self.chain.k + 1) for r in range(1, self.chain.rows + 1)]
        fits = [_smallest_holding(pairs, n) for n in need]
        return sorted({p for p in fits if p is not None})

    def _chain_layout(self, T: int, S: int) -> PackedLayout:
        return chain_layout(self.chain, T, S, self.max_blocks_per_seq, self.history_len)

    def _chain_job(self, T: int, S: int):
        params, kv = jax.tree.map(_abstract, (self.params, self._caches()))
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        layout = self._chain_layout(T, S)
        args = (params, kv, i32(layout.size), i32(self.max_rows), _abstract(self.prev_drafts))
        static = (self.cfg, self.backend, self.max_blocks_per_seq, self.max_rows, self.chain)
        key, opts = self._store_key("chain", static, args, T)
        return key, lambda: self._chain_fwd.lower(*args, layout=layout, T=T, S=S), opts

    def chain_bucket(self, num_requests: int) -> tuple[int, int] | None:
        """The compiled chained bucket for that many requests, or None (not chainable now)."""
        if self.chain is None or not 0 < num_requests <= self.chain.rows:
            return None
        return _smallest_holding(self.chained, num_requests * (self.chain.k + 1))

    def _sampler_job(self, S: int, flags):
        static = self._sampler_key(S, flags)
        key = self.store.key("sampler", static, ()) if self.store is not None else None
        return key, lambda: self._lower_sampler(S, flags), None

    def _keep(self, name: tuple, exe) -> None:
        if name[0] == "fwd":
            self.compiled[name[1:]] = exe
        elif name[0] == "chn":
            self.chained[name[1:]] = exe
        else:
            _SAMPLERS[self._sampler_key(*name[1:])] = exe
            self.samplers[name[1:]] = exe

    def reset_device_state(self) -> None:
        """After a failed step: a fresh KV cache (the old one was donated to the step, and may
        be gone or half written) and no previous samples. The compiled steps stay."""
        for leaf in jax.tree_util.tree_leaves(self.kv_cache):
            try:
                leaf.delete()
            except Exception:  # already deleted (donated)
                pass
        self.kv_cache = allocate_kv_cache(*self._kv_args)
        if self.aux is not None:
            slots = self.aux_cache.shape[0]
            try:
                self.aux_cache.delete()
            except Exception:  # already deleted (donated)
                pass
            self.aux_cache = self.aux.allocate(slots)
        self.prev_tokens = jnp.zeros_like(self.prev_tokens)
        if self.prev_drafts is not None:
            self.prev_drafts = jnp.full_like(self.prev_drafts, -1)

    def _caches(self):
        """What the forward donates and returns: the KV cache, with the aux cache if kept."""
        return self.kv_cache if self.aux is None else (self.kv_cache, self.aux_cache)

    # -- running a step -------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest compiled (T, S) that holds the step (T first): 17 single-token rows take
        (64, 64); a 2048-token prefill of 3 sequences (2048, 64), see `bucket_pairs`."""
        T = pick(self.token_buckets, num_tokens)
        S = pick(self.seq_buckets, num_seqs)
        if (T, S) not in self.compiled:  # not planned, or still compiling in the background
            ready = tuple(self.compiled)  # a snapshot: the background may add to it meanwhile
            T, S = min(k for k in ready if k[0] >= num_tokens and k[1] >= num_seqs)
        return T, S

    def _stable(self, key, x):
        """x in a device buffer kept for `key`, the same one every step (overwritten in place)."""
        old = self._staged.get(key)
        if old is None:
            old = jnp.zeros(x.shape, x.dtype)
        self._staged[key] = _copy_into(old, x)
        return self._staged[key]

    def execute(self, arrays: StepArrays, st: SamplingTensors):
        T, S = arrays.tokens.shape[0], arrays.seq_lens.shape[0]
        packed = self._layouts[("fwd", T, S)].pack(vars(arrays))
        prev = self.prev_tokens
        if _STABLE_INPUTS:
            packed, prev = self._stable(("fwd", T, S), packed), self._stable("prev", prev)
        caches, logits = self.compiled[(T, S)](self.params, self._caches(), packed, prev)
        if self.aux is None:
            self.kv_cache = caches
        else:
            self.kv_cache, self.aux_cache = caches
        return self._sample(logits, st, S, self._no_shift(S))

    def _no_shift(self, S: int) -> jax.Array:
        z = self._zero_shift.get(S)
        if z is None:
            zeros = np.zeros(S, np.int32)
            z = jax.device_put(zeros, self.tp.sharding(P())) if self.tp else jnp.asarray(zeros)
            self._zero_shift[S] = z
        return z

    def _sample(self, logits, st: SamplingTensors, S: int, shift):
        layout = self._layouts[("smp", S, st.flags)]
        packed = layout.pack({f: getattr(st, f) for f in layout.names})
        if _STABLE_INPUTS:
            packed = self._stable(("smp", S, st.flags), packed)
        samples, self.prev_tokens = self.samplers[(S, st.flags)](
            logits, packed, st.history, st.mask, shift
        )
        return samples, S, st.logprobs  # the samples vector's first S entries are the tokens

    def execute_chained(self, bucket: tuple[int, int], values: dict, st: SamplingTensors):
        """A chained verify step (values: chain.build_chained's arrays). Its drafts stay on the
        device for the next chained step; `fetch_drafts` reads them."""
        T, S = bucket
        packed = self._layouts[("chn", T, S)].pack(values)
        self.kv_cache, logits, shift, self.prev_drafts = self.chained[bucket](
            self.params, self.kv_cache, packed, self.prev_tokens, self.prev_drafts
        )
        return (*self._sample(logits, st, S, shift), self.prev_drafts)

    @staticmethod
    def fetch_drafts(result) -> np.ndarray:
        """A chained step's drafts, [chain.rows, K] (-1: none), after `fetch` of its result."""
        return np.asarray(jax.device_get(result[3]))

    def fetch(self, result) -> tuple[np.ndarray, ...]:
        """The one host transfer of a step: `execute`'s result -> (tokens, logprobs, ranks, top
        ids, top logprobs) on the host."""
        samples, S, logprobs = result[:3]
        if samples.is_fully_addressable:
            v = np.asarray(jax.device_get(samples))
        else:  # several processes (one host each): the samples are replicated, this host's copy
            v = np.asarray(samples.addressable_data(0))
        return unpack_samples(v, S, min(NUM_TOP_LOGPROBS, self.cfg.vocab_size), logprobs)


@dataclass(frozen=True)
class AuxHidden:
    """What a target runner keeps for an EAGLE-3 speculator (spec_decode/eagle3.py): the
    residual stream entering `layers` for every token of every step, concatenated and projected
    by `proj` ([len(layers) * H, width], the speculator's fc), written at the token's KV slot
    into an aux cache [num_slots, width]. It lives beside the KV pages and is as valid as they
    are (prefix-cache hits, rejected drafts and preemption included), so the speculator reads a
    position's input from the slot of that position."""

    layers: tuple[int, ...]
    proj: jax.Array
    dtype: object

    def allocate(self, num_slots: int) -> jax.Array:
        return jnp.zeros((num_slots, self.proj.shape[-1]), self.dtype)


_APART = ("history", "mask")  # SamplingTensors' arrays the sampler takes unpacked


def _abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
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
