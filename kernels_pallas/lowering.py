"""Lower kernels for CUDA on a machine without a GPU, so broken Triton rules fail CI.

Interpret mode does not enforce Triton's rules (power-of-two shapes, supported casts, dot
shapes); lowering to the Triton IR does: `jax.export.export(fn, platforms=["cuda"])` with the
Triton custom-call safety check disabled, on jax 0.10 as is, on jax 0.11 under an abstract mesh
naming the target GPU (without one, 0.11's Triton lowering stops at "No supported GPU devices
found"). PTX/ptxas errors are only caught on a GPU.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import export as jax_export

from kernels_pallas.layout import value_cache_dtype, value_page_shape
from kernels_pallas.metadata import AttentionMetadata


def _disabled_checks():
    checks = []
    for name in ("__gpu$xla.gpu.triton", "triton_kernel_call"):
        try:
            checks.append(jax_export.DisabledSafetyCheck.custom_call(name))
        except Exception:  # pragma: no cover
            pass
    return checks


def _gpu_target():
    """jax >= 0.11 asks the Triton lowering for the GPU it compiles for, and without one attached
    it takes that from an abstract mesh: an H200 (sm_90, 132 SMs), the card we benchmark on.
    jax 0.10 has no abstract devices and needs none."""
    sharding = jax.sharding
    if not hasattr(sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    return sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def lower_for_cuda(fn, *args_specs):
    """Exports `fn` (already jitted or not) for CUDA from abstract args; returns the Exported."""
    if not hasattr(fn, "lower"):
        fn = jax.jit(fn)
    with _gpu_target():
        return jax_export.export(fn, platforms=["cuda"], disabled_checks=_disabled_checks())(
            *args_specs
        )


def metadata_specs(T: int, S: int, P: int) -> AttentionMetadata:
    i32 = jnp.int32
    return AttentionMetadata(
        slot_mapping=jax.ShapeDtypeStruct((T,), i32),
        block_tables=jax.ShapeDtypeStruct((S, P), i32),
        seq_lens=jax.ShapeDtypeStruct((S,), i32),
        query_start_loc=jax.ShapeDtypeStruct((S + 1,), i32),
        num_seqs=jax.ShapeDtypeStruct((1,), i32),
    )


def check_cuda_lowering(
    *,
    T,
    S,
    P,
    num_layers=2,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    num_blocks=64,
    dtype=jnp.bfloat16,
    kv_dtype=None,
    v_dtype=None,
    sliding_window=None,
    soft_cap=None,
    kv_scales=False,
    rope_write=False,
    **tuning,
):
    """Lowers write_kv + ragged_paged_attention for CUDA at one configuration (V pages of
    `v_dtype`, by default the engine's: layout.value_cache_dtype(kv_dtype)); with
    `rope_write=True`, rope_write_kv (from the fused qkv [T, (Hq + 2 Hkv) * D] and cos / sin
    [T, D // 2]) in place of write_kv.

    Returns the StableHLO text (it contains the Triton kernels); raises on a lowering error.
    """
    from kernels_pallas.dispatch import ragged_paged_attention
    from kernels_pallas.kv_write import write_kv
    from kernels_pallas.rope_write import rope_write_kv

    kv_dtype = kv_dtype or dtype
    shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = jax.ShapeDtypeStruct(shape, kv_dtype)
    v_shape = shape[:3] + value_page_shape(kv_dtype, block_size, head_dim)  # the engine's layout
    v_cache = jax.ShapeDtypeStruct(v_shape, v_dtype or value_cache_dtype(kv_dtype))
    q = jax.ShapeDtypeStruct((T, num_heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((T, num_kv_heads, head_dim), dtype)
    scales = dict(k_scale=0.5, v_scale=0.25) if kv_scales else {}

    def attend(q, kc, vc, layer, md):
        return ragged_paged_attention(
            q,
            kc,
            vc,
            layer,
            md,
            sm_scale=head_dim**-0.5,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            **scales,
            **tuning,
        )

    def step(kc, vc, layer, q, k, v, md):
        kc, vc = write_kv(kc, vc, layer, k, v, md.slot_mapping, impl="pallas", **scales)
        return attend(q, kc, vc, layer, md), kc, vc

    def fused_step(kc, vc, layer, qkv, cos, sin, md):
        q, kc, vc = rope_write_kv(
            qkv,
            cos,
            sin,
            kc,
            vc,
            layer,
            md.slot_mapping,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            **scales,
        )
        return attend(q, kc, vc, layer, md), kc, vc

    if rope_write:
        qkv = jax.ShapeDtypeStruct((T, (num_heads + 2 * num_kv_heads) * head_dim), dtype)
        cs = jax.ShapeDtypeStruct((T, head_dim // 2), jnp.float32)
        inputs, step = (qkv, cs, cs), fused_step
    else:
        inputs = (q, kv, kv)
    exp = lower_for_cuda(
        jax.jit(step, donate_argnums=(0, 1)),
        k_cache,
        v_cache,
        jax.ShapeDtypeStruct((), jnp.int32),
        *inputs,
        metadata_specs(T, S, P),
    )
    return exp.mlir_module()
