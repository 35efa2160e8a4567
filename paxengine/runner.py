"""The device side: KV cache allocation, the step programs, one host transfer per step.

The runner knows nothing of requests: it takes a StepArrays + SamplingTensors and returns
sampled tokens and logprobs. It defines each (T, S) bucket's forward and runs the executables
its `step_build.StepBuilder` compiled at start-up; calling a compiled executable can never
trace again, so nothing compiles while serving.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import kernels_pallas
from paxengine import parallel
from paxengine import prompt_logprobs as plp_mod
from paxengine.attention import PagedAttend
from paxengine.batch import StepArrays, pick
from paxengine.device_turns import TURNS
from paxengine.executables import ExecutableStore
from paxengine.kv_memory import allocate_kv_cache
from paxengine.models import quant, registry
from paxengine.models.config import ModelConfig
from paxengine.models.llama import forward_hidden
from paxengine.models.weights import is_per_layer
from paxengine.packing import PackedLayout
from paxengine.sampling import (
    ALL_FLAGS,
    DATA_FIELDS,
    NUM_TOP_LOGPROBS,
    SamplingTensors,
    abstract_sampling_tensors,
    unpack_samples,
)
from paxengine.spec_decode.chain import ChainSpec, chain_layout, chained_inputs
from paxengine.step_build import StepBuilder, abstract_of, mark_warm, smallest_holding

# A probe's knob (benchmarks/profile/cmdbuf_updates.py at 5f74b6d), off: the step's fresh input
# buffers make XLA re-record the forward's CUDA graph every step (~1 ms of host time); copied
# into buffers kept across steps, a step read before the next is built skips that (H200 batch
# 1: 6.9 -> 5.9 ms), but verify steps and overlapped steps gained nothing
# (benchmarks/results/gpu_2026-12-02_spec_launch/). Its copies compile at first use.
_STABLE_INPUTS = os.environ.get("PAXENGINE_STABLE_INPUTS", "0") == "1"
# a real copy into the donated buffer (jit would forward a bare `new` without running anything)
_copy_into = jax.jit(
    lambda old, new: jax.lax.dynamic_update_slice(old, new, (0,) * old.ndim), donate_argnums=0
)


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
        num_state_slots: int = 0,
        prompt_logprobs: bool = False,
        verify_span: tuple[int, int] | None = None,
    ):
        """params: stacked layers (scanned) or a list of per-layer dicts (unrolled), see
        `weights.unstack_layers`; the KV cache takes the same layout. tp: tensor parallelism
        (params prepared by `parallel.copy_kv_heads` and fused per shard); they and the cache
        are placed on its mesh here. aux: keep the auxiliary hidden states an EAGLE-3
        speculator reads (`AuxHidden`); None: the forward computes nothing for them. chain: also
        compile chained n-gram verify steps (spec_decode/chain.py) for up to chain.rows requests.
        num_state_slots: the per-request state slots of the model's recurrent layers (its
        family's pools, donated with the KV cache; kv_cache.KVCacheManager hands them out).
        prompt_logprobs: the forward also returns the step's final hidden states, and a
        prompt-logprob executable per token bucket is built (paxengine/prompt_logprobs.py).
        verify_span: speculative decoding on a model with recurrent layers, (first slot, P):
        every row of at most P tokens also leaves the state after each position behind
        (the family's forward_step; kv_cache.KVCacheManager.position_slot)."""
        self.tp = tp
        self.chain = chain
        self.verify_span = verify_span
        if chain is not None and (tp is not None or aux is not None):
            raise ValueError("chained verify steps run on one device, without EAGLE-3 states")
        self.aux = aux
        if aux is not None and tp is not None:
            raise ValueError("auxiliary hidden states under tensor parallelism are not implemented")
        # where the steps run, in every executable's key: the same shapes on other devices (a
        # data-parallel replica) or under other shardings need executables of their own
        self.placement = tuple(d.id for d in tp.mesh.devices.flat) if tp is not None else ()
        self.cfg = cfg
        self.family = registry.family(cfg)
        self.plp = prompt_logprobs
        self.plp_compiled: dict[int, object] = {}  # T -> prompt-logprob executable
        self.hidden_dtype = jnp.dtype(params["final_norm"].dtype)
        self.params = parallel.shard_params(params, tp) if tp is not None else params
        if aux is not None and aux.proj is not None:
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
        self._state_args = (cfg, num_state_slots, params["embed"].dtype)
        if tp is not None and num_state_slots:  # each device its heads' share of the pools
            self._state_args += (tp,)
        self.state = self.family.allocate_state(*self._state_args) if num_state_slots else {}
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,), static_argnames=("layout",))
        self.compiled: dict[tuple[int, int], object] = {}  # (T, S) -> forward
        self.chained: dict[tuple[int, int], object] = {}  # (T, S) -> chained verify forward
        # the last chained step's drafts (the next chained step reads them), [chain.rows, K]
        self.prev_drafts = jnp.full((chain.rows, chain.k), -1, jnp.int32) if chain else None
        self._plp_fn = jax.jit(self._prompt_logprobs_fn)
        self._chain_fwd = jax.jit(
            self._chain_fn, donate_argnums=(1,), static_argnames=("layout", "T", "S")
        )
        self._zero_shift: dict[int, jax.Array] = {}  # S -> zeros: no key shift (unchained)
        self._staged: dict = {}  # _stable's buffers
        self.samplers: dict[tuple, object] = {}  # (S, flags) -> sampler
        self._layouts: dict[tuple, PackedLayout] = {}  # ("fwd", T, S) / ("smp", S, flags)
        self.store = store
        self.sampler_flags = list(sampler_flags)  # the variants compiled (sampling.choose_flags)
        self.builder = StepBuilder(self)  # fills compiled, chained, samplers and _layouts
        self.builder.build_all(show_progress, background_compile)
        for S in seq_buckets:  # made now: an array made while serving is a compile of its own
            self._no_shift(S)
        mark_warm()

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
            + [(name, (S,), np.int32) for name in STATE_FIELDS if self.state]
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
        if self.verify_span is not None:  # static: which slots keep the per-position states
            x = {**x, "verify_span": self.verify_span}
        kv_cache, logits, hidden = self._model(
            params, kv_cache, tokens, positions, md, x["logits_indices"], x
        )
        if self.plp:  # for the prompt-logprob executable, which runs only when a row asks
            return kv_cache, logits, hidden.astype(self.hidden_dtype)
        return kv_cache, logits

    def _prompt_logprobs_fn(self, params, hidden, targets):
        """A step's prompt logprobs from its hidden states (prompt_logprobs.device_values)."""

        def logits_fn(h):
            logits = self.family.compute_logits(params, self.cfg, h)
            if self.tp is not None:
                logits = parallel.gathered_logits(self.tp, logits, self.cfg.vocab_size)
            return logits

        V = self.cfg.vocab_size
        return plp_mod.device_values(logits_fn, hidden, targets, V, self.n_top)

    @property
    def n_top(self) -> int:
        return min(NUM_TOP_LOGPROBS, self.cfg.vocab_size)

    def _chain_fn(self, params, kv_cache, packed, prev_tokens, prev_drafts, *, layout, T, S):
        """A chained verify step: its rows laid out on the device from the previous step's
        samples and drafts (spec_decode/chain.py). -> (KV, logits, key shift, drafts)."""
        x = layout.unpack(packed)
        tokens, positions, slots, seq_lens, qsl, logits_indices, shift, drafts, step = (
            chained_inputs(x, prev_tokens, prev_drafts, self.chain, self.block_size, T, S)
        )
        md = kernels_pallas.AttentionMetadata(
            slots, x["block_tables"], seq_lens, qsl, x["num_seqs"]
        )
        # step: a hybrid's state slots, each row's from the previous step's accepted count
        kv_cache, logits, _ = self._model(
            params, kv_cache, tokens, positions, md, logits_indices, step
        )
        return kv_cache, logits, shift, drafts

    def _model(self, params, kv_cache, tokens, positions, md, logits_indices, step=None):
        attend = PagedAttend(md, self.backend, self.cfg, fused_rope=self.tp is None)
        if self.aux is not None and not self.aux.layers:  # an MTP head's: the final hidden
            kv_cache, aux_cache = kv_cache
            hidden, kv_cache = self.family.forward_step(
                params, self.cfg, tokens, positions, kv_cache, attend, step, tp=self.tp
            )
            slots = jnp.where(md.slot_mapping < 0, aux_cache.shape[0], md.slot_mapping)
            aux_cache = aux_cache.at[slots].set(hidden.astype(aux_cache.dtype), mode="drop")
            kv_cache = (kv_cache, aux_cache)
        elif self.aux is not None:  # (KV, aux cache): every token's projected aux states, by slot
            kv_cache, aux_cache = kv_cache
            hidden, kv_cache, aux = forward_hidden(
                params, self.cfg, tokens, positions, kv_cache, attend, aux_layers=self.aux.layers
            )
            feats = quant.linear(aux, params["aux_proj"]).astype(aux_cache.dtype)
            slots = md.slot_mapping
            slots = jnp.where(slots < 0, aux_cache.shape[0], slots)  # padding: dropped
            kv_cache = (kv_cache, aux_cache.at[slots].set(feats, mode="drop"))
        else:
            hidden, kv_cache = self.family.forward_step(
                params, self.cfg, tokens, positions, kv_cache, attend, step, tp=self.tp
            )
        logits = self.family.compute_logits(params, self.cfg, hidden[logits_indices])
        if self.tp is not None:  # every device samples from all of them (StepBuilder's sampler)
            logits = parallel.gathered_logits(self.tp, logits, self.cfg.vocab_size)
        return kv_cache, logits, hidden

    # -- each bucket's forward as a job for the builder: (store key, lowering, XLA options) -----
    def _abstract_inputs(self, T: int, S: int):
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        return i32(self.step_layout(T, S).size), i32(self.max_rows)

    def _forward_job(self, T: int, S: int):
        # shapes only: a job the background lowers later must not hold the KV arrays, which
        # the steps donate (and free) meanwhile
        params, kv = jax.tree.map(abstract_of, (self.params, self._caches()))
        args = (params, kv, *self._abstract_inputs(T, S))
        static = (self.cfg, self.backend, self.max_blocks_per_seq, self.max_rows, self.placement)
        if self.tp is not None and self.tp.expert_parallel:  # same shapes, experts split apart
            static += ("expert_parallel",)
        if self.aux is not None:  # which layers' states it keeps is in the program, not its shapes
            static += (("aux_layers", self.aux.layers),)
        if self.plp:  # it also returns the hidden states
            static += ("hidden",)
        if self.verify_span is not None:  # it also keeps per-position recurrent states
            static += (("verify_span", self.verify_span),)
        key, opts = self.builder.store_key("forward", static, args, T)
        layout = self.step_layout(T, S)
        return key, lambda: self._forward.lower(*args, layout=layout), opts

    def _plp_job(self, T: int):
        params = jax.tree.map(abstract_of, self.params)
        sharding = self.tp.sharding(P()) if self.tp is not None else None
        hidden = jax.ShapeDtypeStruct(
            (T, self.cfg.hidden_size), self.hidden_dtype, sharding=sharding
        )
        targets = jax.ShapeDtypeStruct((T,), jnp.int32, sharding=sharding)
        args = (params, hidden, targets)
        static = (self.cfg, self.placement, plp_mod.CHUNK_ELEMENTS, self.n_top)
        store = self.store
        key = store.key("prompt_logprobs", static, args) if store is not None else None
        return key, lambda: self._plp_fn.lower(*args), None

    def _chain_layout(self, T: int, S: int) -> PackedLayout:
        return chain_layout(self.chain, T, S, self.max_blocks_per_seq, self.history_len)

    def _chain_job(self, T: int, S: int):
        params, kv = jax.tree.map(abstract_of, (self.params, self._caches()))
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        layout = self._chain_layout(T, S)
        args = (params, kv, i32(layout.size), i32(self.max_rows), abstract_of(self.prev_drafts))
        static = (self.cfg, self.backend, self.max_blocks_per_seq, self.max_rows, self.chain)
        key, opts = self.builder.store_key("chain", static, args, T)
        return key, lambda: self._chain_fwd.lower(*args, layout=layout, T=T, S=S), opts

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
        if self.state:  # the requests in flight are recomputed from zeros
            jax.tree.map(lambda a: a.delete() if not a.is_deleted() else None, self.state)
            self.state = self.family.allocate_state(*self._state_args)
        self.prev_tokens = jnp.zeros_like(self.prev_tokens)
        if self.prev_drafts is not None:
            self.prev_drafts = jnp.full_like(self.prev_drafts, -1)

    def _caches(self):
        """What the forward donates and returns: the KV cache, with the aux cache if kept, or
        with the recurrent layers' state pools."""
        base = (self.kv_cache, self.state) if self.state else self.kv_cache
        return (base, self.aux_cache) if self.aux is not None else base

    def _set_caches(self, caches) -> None:
        if self.aux is not None:
            caches, self.aux_cache = caches
        if self.state:
            self.kv_cache, self.state = caches
        else:
            self.kv_cache = caches

    # -- running a step -------------------------------------------------------------------------
    def available_flags(self, S: int) -> list[tuple]:
        """The sampler variants compiled for S rows (all of them, once the background is done)."""
        return [f for f in self.sampler_flags if (S, f) in self.samplers]

    def chain_bucket(self, num_requests: int) -> tuple[int, int] | None:
        """The compiled chained bucket for that many requests, or None (not chainable now)."""
        if self.chain is None or not 0 < num_requests <= self.chain.rows:
            return None
        return smallest_holding(self.chained, num_requests * (self.chain.k + 1))

    def bucket_for(
        self, num_tokens: int, num_seqs: int, prompt_logprobs: bool = False
    ) -> tuple[int, int]:
        """The smallest compiled (T, S) that holds the step (T first): 17 single-token rows take
        (64, 64); a 2048-token prefill of 3 sequences (2048, 64), see `bucket_pairs`.
        prompt_logprobs: a T whose prompt-logprob executable is built too."""
        T = pick(self.token_buckets, num_tokens)
        S = pick(self.seq_buckets, num_seqs)
        plps = self.plp_compiled
        if (T, S) not in self.compiled or (prompt_logprobs and T not in plps):
            # not planned, or still compiling in the background
            ready = tuple(self.compiled)  # a snapshot: the background may add to it meanwhile
            T, S = min(
                k
                for k in ready
                if k[0] >= num_tokens and k[1] >= num_seqs and (not prompt_logprobs or k[0] in plps)
            )
        return T, S

    def _stable(self, key, x):
        """x in a device buffer kept for `key`, the same one every step (overwritten in place)."""
        old = self._staged.get(key)
        if old is None:
            old = jnp.zeros(x.shape, x.dtype)
        self._staged[key] = _copy_into(old, x)
        return self._staged[key]

    def execute(self, arrays: StepArrays, st: SamplingTensors, plp_targets=None):
        """plp_targets: [T] int32, each token's next prompt token (-1: none) for the prompt
        logprobs of the rows that ask (prompt_logprobs.StepTargets); its result is the 5th item
        of the returned tuple (`fetch_prompt_logprobs`)."""
        T, S = arrays.tokens.shape[0], arrays.seq_lens.shape[0]
        packed = self._layouts[("fwd", T, S)].pack(vars(arrays))
        prev = self.prev_tokens
        if _STABLE_INPUTS:
            packed, prev = self._stable(("fwd", T, S), packed), self._stable("prev", prev)
        with TURNS.step():  # not beside a background compile's autotuning (device_turns)
            out = self.compiled[(T, S)](self.params, self._caches(), packed, prev)
            caches, logits = out[:2]
            self._set_caches(caches)
            result = self._sample(logits, st, S, self._no_shift(S))
            if plp_targets is not None:
                plp = self.plp_compiled[T](self.params, out[2], plp_targets)
                result = (*result, None, (plp, T))
            TURNS.dispatched(self.prev_tokens)
        return result

    def fetch_prompt_logprobs(self, result) -> tuple[np.ndarray, ...] | None:
        """A step's prompt logprobs on the host (prompt_logprobs.unpack), or None."""
        if len(result) < 5:
            return None
        v, T = result[4]
        return plp_mod.unpack(np.asarray(jax.device_get(v)), T, self.n_top)

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
        with TURNS.step():
            caches, logits, shift, self.prev_drafts = self.chained[bucket](
                self.params, self._caches(), packed, self.prev_tokens, self.prev_drafts
            )
            self._set_caches(caches)  # with a hybrid's state pools
            result = (*self._sample(logits, st, S, shift), self.prev_drafts)
            TURNS.dispatched(self.prev_tokens)
        return result

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
    by `proj` ([len(layers) * H, width], the speculator's fc), or with no layers (and proj None)
    the family's final (normed) hidden state, which an MTP head reads (spec_decode/mtp.py),
    written at the token's KV slot
    into an aux cache [num_slots, width]. It lives beside the KV pages and is as valid as they
    are (prefix-cache hits, rejected drafts and preemption included), so the speculator reads a
    position's input from the slot of that position."""

    layers: tuple[int, ...]
    proj: jax.Array | None
    dtype: object
    width: int = 0  # without proj: the hidden size

    def allocate(self, num_slots: int) -> jax.Array:
        width = self.proj.shape[-1] if self.proj is not None else self.width
        return jnp.zeros((num_slots, width), self.dtype)


_APART = ("history", "mask")  # SamplingTensors' arrays the sampler takes unpacked
# StepArrays' fields a model with recurrent layers reads (its state slots)
STATE_FIELDS = ("state_slots", "has_state", "restore_slots", "snapshot_slots")
