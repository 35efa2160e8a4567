"""Tensor parallelism over one `jax.sharding.Mesh` (axis "tp"), Megatron-style.

Each of the N devices holds 1/N of every layer: the query heads and their KV heads (a KV head is
copied to the N / kv_heads devices that share it when there are fewer KV heads than devices),
1/N of the MLP's intermediate channels, and the KV cache pages of its own KV heads. The layers
run under one `shard_map`: each device computes its heads' attention with the same kernels as
one GPU (a local config with its head counts), and the two row-parallel projections (O and
down) end in one all-reduce each. Norms are replicated. The embedding table and the LM head are
vocabulary-parallel, as vLLM's: each device holds 1/N of the vocabulary's rows (the vocabulary
padded to a multiple of N, `pad_vocab`; padded rows are never looked up and their logits are cut
off by `gathered_logits`). They stay outside the shard_map, where XLA's partitioner turns the
lookup into a masked local gather plus an all-reduce of [T, H]; `gathered_logits` pins the LM
head to each device's slice of the logits plus one all-gather of [rows, V] (left to itself,
XLA gathered the whole table instead): the sampler sees every vocabulary entry on every
device, and no device holds the whole table.

Column-parallel weights are split along their output channels into N contiguous blocks, so the
fused projections are fused per shard ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...], see
`weights.unstack_layers(shards=N)`); row-parallel ones (wo, w_down) along their inputs.

Mixture-of-experts layers (models/moe.py; the router is replicated): without expert parallelism
every expert's intermediate channels are split like a dense MLP's (its gate|up stack
[E, H, 2I] column-parallel, fused per shard; its down stack [E, I, H] row-parallel), so the
MLP's all-reduce sums every expert's partial products. With `expert_parallel` each device holds
E / N whole experts (the stacks split on their expert axis): a token's pairs with experts of
another device add zero here, and the same all-reduce sums the devices' partial outputs
(`moe.grouped_experts`' `first_expert`). Every device routes every token (the activations are
replicated under tensor parallelism), so this dispatch needs no collective of its own; an
all-to-all of the tokens to their experts' devices (vLLM's EP kernels) is the alternative to
measure on GPUs, where it moves k rows a token instead of one all-reduce of all of them.

Gated DeltaNet layers (Qwen3.5, as vLLM splits Qwen3-Next's): each device holds 1/N of the key
heads and of the value heads (q, k by key head; v, z, b, a, the conv's channels, A_log and
dt_bias by value head; `qwen3_5.tp_layout` orders the fused q|k|v channels shard by shard) and
its heads' slices of the state pools (STATE_SPEC); the out-projection is row-parallel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paxengine.models.config import ModelConfig
from paxengine.models.quant import Fp8Weight, array_module

AXIS = "tp"
# output-channel (column) parallel, input (row) parallel, and per-layer names kept whole
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "wqkv", "w_gate_up", "bq", "bk", "bv", "bqkv")
COLUMN += ("s_gate", "s_up", "s_gate_up", "e_gate", "e_up", "e_gate_up")  # MoE: shared, experts
COLUMN += ("la_qkv", "la_z", "la_b", "la_a", "la_qkvz", "la_ba")  # Gated DeltaNet (Qwen3.5)
ROW = ("wo", "w_down", "s_down", "e_down", "la_out")
# per-channel or per-head arrays split on their first axis: the DeltaNet's conv [C, K] (its
# channels in the per-shard order of its in-projection, qwen3_5.tp_layout), A_log, dt_bias [Hv]
LEADING = ("la_conv", "la_dt_bias", "la_A_log")
EXPERTS = ("e_gate", "e_up", "e_gate_up", "e_down")  # [E, ...] stacks: split by expert under EP
KV_HEADS = ("wk", "wv", "bk", "bv")  # copied per device when kv_heads < N


@dataclass(frozen=True)
class TensorParallel:
    mesh: Mesh
    size: int
    expert_parallel: bool = False  # MoE experts whole, E / N a device (else their channels split)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model one device runs: its heads, intermediate channels, and its experts (expert
        parallelism) or its share of every expert's channels."""
        ep = self.expert_parallel
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // self.size,
            num_kv_heads=max(1, cfg.num_kv_heads // self.size),
            intermediate_size=cfg.intermediate_size // self.size,
            num_experts=cfg.num_experts // self.size if ep else cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size // (1 if ep else self.size),
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // self.size,
            linear_num_key_heads=cfg.linear_num_key_heads // self.size,
            linear_num_value_heads=cfg.linear_num_value_heads // self.size,
        )

    def first_expert(self, cfg: ModelConfig):
        """Inside the shard_map: the global id of this device's first expert (expert
        parallelism, `cfg` the local config), else None (every device holds every expert)."""
        return jax.lax.axis_index(AXIS) * cfg.num_experts if self.expert_parallel else None

    def kv_copies(self, cfg: ModelConfig) -> int:
        """How many devices hold each KV head (1 unless kv_heads < N)."""
        return max(1, self.size // cfg.num_kv_heads)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def local_device(self):
        """The first of the mesh's devices this process owns: the one whose memory it can read
        (several hosts: the mesh's first device belongs to process 0 alone)."""
        mine = jax.process_index()
        return next(d for d in self.mesh.devices.flat if d.process_index == mine)

    def psum(self, x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, AXIS)


def init_distributed(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """One JAX runtime over several processes (hosts), before anything touches a device:
    `jax.distributed.initialize` with the same names. CPU processes exchange through gloo."""
    if num_processes <= 1:
        return
    if not coordinator_address:
        raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU client's only
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def make_tensor_parallel(
    size: int, cfg: ModelConfig, first_device: int = 0, expert_parallel: bool = False
) -> TensorParallel | None:
    """The mesh over devices [first_device, first_device + size), or a clear error; None for
    one device at index 0 (the plain single-device path). A one-device mesh elsewhere is how a
    data-parallel replica is pinned to its device."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1 and first_device == 0:
        return None
    split = [("attention heads", cfg.num_heads), ("intermediate size", cfg.intermediate_size)]
    if cfg.recurrent_layers:  # Gated DeltaNet: each device its key heads and their value heads
        split.append(("linear-attention key heads", cfg.linear_num_key_heads))
        split.append(("linear-attention value heads", cfg.linear_num_value_heads))
    if cfg.moe_layers:
        split.append(("shared expert's intermediate size", cfg.shared_expert_intermediate_size))
        if not expert_parallel:
            split.append(("experts' intermediate size", cfg.moe_intermediate_size))
        elif cfg.num_experts % size:
            raise ValueError(
                f"enable_expert_parallel: tensor_parallel_size={size} does not divide the "
                f"{cfg.num_experts} experts (each device holds num_experts / "
                f"tensor_parallel_size whole experts)"
            )
    for what, n in split:
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the {what} ({n})")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size} and the KV heads ({kv}): one must divide the other"
        )
    devices = jax.devices()
    if first_device + size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={size} from device {first_device} needs "
            f"{first_device + size} devices; this process sees {len(devices)} "
            f"({devices[0].platform})"
        )
    mine = devices[first_device : first_device + size]
    kinds = sorted({d.device_kind for d in mine})
    if len(kinds) > 1:
        raise ValueError(f"tensor parallelism over mixed device kinds {kinds} is not supported")
    return TensorParallel(Mesh(np.array(mine), (AXIS,)), size, expert_parallel)


def _copy_kv_heads(w, copies: int, head_dim: int):
    """Each KV head's output channels repeated `copies` times, in place: [h0 h0 h1 h1 ...]."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(
            _copy_kv_heads_axis(w.values, copies, head_dim, axis=-2),
            _copy_kv_heads_axis(w.scales, copies, head_dim, axis=-1),
        )
    return _copy_kv_heads_axis(w, copies, head_dim, axis=-1)


def _copy_kv_heads_axis(a: jax.Array, copies: int, head_dim: int, axis: int) -> jax.Array:
    axis = axis % a.ndim
    n = a.shape[axis] // head_dim
    split = a.reshape(*a.shape[:axis], n, head_dim, *a.shape[axis + 1 :])
    return (
        array_module(a)
        .repeat(split, copies, axis=axis)
        .reshape(*a.shape[:axis], n * copies * head_dim, *a.shape[axis + 1 :])
    )


def copy_kv_heads(params: dict, cfg: ModelConfig, tp: TensorParallel) -> dict:
    """Stacked (unfused) params with every KV projection widened to one head per device."""
    copies = tp.kv_copies(cfg)
    if copies == 1:
        return params

    def widen(layer: dict) -> dict:
        layer = dict(layer)
        for name in KV_HEADS:
            if name in layer:
                layer[name] = _copy_kv_heads(layer[name], copies, cfg.head_dim)
        return layer

    layers = params["layers"]  # stacked, or a family's per-layer list (Qwen3-MoE)
    layers = [widen(d) for d in layers] if isinstance(layers, list) else widen(layers)
    return {**params, "layers": layers}


def _layer_spec(name: str, leaf: jax.Array, fp8_values: bool = False, ep: bool = False) -> P:
    """The spec of one layer array; a leading layer axis (stacked layout) stays whole. FP8
    values are [out, in]: their channel axes swap places with a dense weight's [in, out]. An
    expert stack [E, ...] under expert parallelism: split by expert, each expert whole."""
    if (ep and name in EXPERTS) or name in LEADING:
        return P(AXIS, *(None,) * (leaf.ndim - 1))
    lead = (None,) * (leaf.ndim - (1 if name.startswith("b") else 2))
    if name in COLUMN:
        if name.startswith("b"):
            return P(*lead, AXIS)
        return P(*lead, AXIS, None) if fp8_values else P(*lead, None, AXIS)
    if name in ROW:
        return P(*lead, None, AXIS) if fp8_values else P(*lead, AXIS, None)
    return P()


def layer_specs(layer: dict, expert_parallel: bool = False) -> dict:
    """A PartitionSpec per array of a layer dict (the stacked dict or one of the per-layer)."""
    specs = {}
    for name, w in layer.items():
        if isinstance(w, Fp8Weight):
            lead = (None,) * (w.scales.ndim - 1)
            if expert_parallel and name in EXPERTS:  # scales [E, out]: with their experts
                scales = P(AXIS, None)
            else:
                scales = P(*lead, AXIS) if name in COLUMN else P()
            values = _layer_spec(name, w.values, fp8_values=True, ep=expert_parallel)
            specs[name] = Fp8Weight(values, scales)
        else:
            specs[name] = _layer_spec(name, w, ep=expert_parallel)
    return specs


# vocabulary-parallel: the embedding [V, H] by rows, an untied LM head [H, V] by columns
VOCAB = {"embed": P(AXIS, None), "lm_head": P(None, AXIS)}


def pad_vocab(params: dict, n: int) -> dict:
    """The embedding's rows and the LM head's columns padded with zeros to a multiple of n
    (device_put splits only evenly). Host arrays stay on the host (numpy), device ones on their
    device."""
    V = params["embed"].shape[0]
    pad = -V % n
    if not pad:
        return params

    def padded(a, axis: int):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        return array_module(a).pad(a, widths)

    out = {**params, "embed": padded(params["embed"], 0)}
    if "lm_head" in params:
        out["lm_head"] = padded(params["lm_head"], 1)
    return out


def gathered_logits(tp: TensorParallel, logits: jax.Array, vocab_size: int) -> jax.Array:
    """The LM head's [rows, V (padded)] logits: each device's vocabulary slice computed where
    its rows of the head lie, then gathered whole on every device (the sampler's view), the
    padding cut off."""
    sliced = P(*(None,) * (logits.ndim - 1), AXIS)
    logits = jax.lax.with_sharding_constraint(logits, tp.sharding(sliced))
    logits = jax.lax.with_sharding_constraint(logits, tp.sharding(P()))
    return logits[..., :vocab_size]


def param_specs(params: dict, expert_parallel: bool = False) -> dict:
    layers = params["layers"]
    out = {k: VOCAB.get(k, P()) for k in params if k != "layers"}
    if isinstance(layers, list):
        out["layers"] = [layer_specs(d, expert_parallel) for d in layers]
    else:
        out["layers"] = layer_specs(layers, expert_parallel)
    return out


def shard_params(params: dict, tp: TensorParallel) -> dict:
    """The params placed on the mesh by their specs: from host arrays (the loader's, under a mesh)
    each device receives only its shards. Across processes each one places the same host copy
    (every process loaded the same checkpoint), keeping its own shards."""
    params = pad_vocab(params, tp.size)
    specs = param_specs(params, tp.expert_parallel)
    host = jax.process_count() > 1

    def place(a, spec: P):
        where = tp.sharding(spec)
        if isinstance(a, jax.Array) and a.sharding.is_equivalent_to(where, a.ndim):
            return a  # placed already (engine_setup.prepare_params, then the Runner)
        return jax.device_put(np.asarray(a) if host else a, where)

    return jax.tree_util.tree_map(place, params, specs, is_leaf=lambda x: isinstance(x, P))


CACHE_SPEC = P(None, AXIS)  # [L or 1, kv_heads, blocks, block_size, head_dim]: split by KV head
# a recurrent layer's state pool, [slots, channels, K-1] or [slots, Hv, dk, dv]: split by
# channel / value head (each device's own, in its in-projection's per-shard order)
STATE_SPEC = P(None, AXIS)


def run_sharded(tp: TensorParallel, body, rope, h, layers, kv_cache, states=None):
    """body(rope, h, layers, kv_cache) -> (h, kv_cache), the layers of one step, run under one
    shard_map: each device on its shards of `layers` (per layer or stacked) and of the cache
    (split by KV head), `rope` and the residual stream `h` replicated. states (a hybrid's
    {kind: [per-layer pool]}): body takes and returns them last too, each device its heads'."""
    per_layer = isinstance(layers, (list, tuple))
    if per_layer:
        w_spec = [layer_specs(d, tp.expert_parallel) for d in layers]
    else:
        w_spec = layer_specs(layers, tp.expert_parallel)
    pair = (CACHE_SPEC, CACHE_SPEC)
    c_spec = [pair] * len(kv_cache) if per_layer else pair
    args = (rope, h, list(layers) if per_layer else layers)
    args += (list(kv_cache) if per_layer else kv_cache,)
    in_specs, out_specs = ((P(), P()), P(), w_spec, c_spec), (P(), c_spec)
    if states is not None:
        s_spec = {k: [STATE_SPEC] * len(v) for k, v in states.items()}
        args += ({k: list(v) for k, v in states.items()},)
        in_specs, out_specs = in_specs + (s_spec,), out_specs + (s_spec,)
    return jax.shard_map(
        body, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )(*args)
