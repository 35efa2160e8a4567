"""write_kv (Pallas, interpret mode) against the reference write; jit + scan + donation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
    ref_write_kv,
    write_kv,
)
from kernels_pallas.testing import make_batch, rel_err, v_rows

FP8_SCALES = dict(k_scale=0.5, v_scale=0.25)


@pytest.mark.parametrize(
    "dtype,kv_dtype,scales,bs",
    [
        (jnp.float32, jnp.float32, {}, 16),
        (jnp.bfloat16, jnp.bfloat16, {}, 16),
        (jnp.bfloat16, jnp.float8_e4m3fn, FP8_SCALES, 16),
        # 64-token fp8 pages: V pages stored [D, bs] (layout.v_transposed)
        (jnp.bfloat16, jnp.float8_e4m3fn, FP8_SCALES, 64),
    ],
)
def test_write_kv(dtype, kv_dtype, scales, bs):
    rng = np.random.default_rng()
    b = make_batch(
        rng,
        [(3, 20), (1, 9), (6, 6), (40, 130)],
        T=56,
        S=5,
        num_heads=6,
        num_kv_heads=3,
        head_dim=32,
        block_size=bs,
        dtype=dtype,
        kv_dtype=kv_dtype,
        poison=False,
    )
    slots = b["md"].slot_mapping
    assert int((slots < 0).sum()) > 0
    args = (b["k_cache"], b["v_cache"], jnp.int32(1), b["k_new"], b["v_new"], slots)
    kc, vc = jax.jit(lambda *a: write_kv(*a, interpret=True, **scales))(*args)
    rk, rv = ref_write_kv(*args, **scales)
    assert (
        vc.shape
        == b["v_cache"].shape
        == (2, 3, b["v_cache"].shape[2])
        + ((32, bs) if bs == 64 and kv_dtype == jnp.float8_e4m3fn else (bs, 32))
    )
    kc0 = b["k_cache"]
    vc, rv, vc0 = v_rows(kc0, vc), v_rows(kc0, rv), v_rows(kc0, b["v_cache"])  # as [bs, D] pages
    for got, want, old in ((kc, rk, kc0), (vc, rv, vc0)):
        got32 = np.asarray(got.astype(jnp.float32))
        np.testing.assert_array_equal(got32, np.asarray(want.astype(jnp.float32)))
        # layer 0 and every slot not in slot_mapping are untouched
        np.testing.assert_array_equal(got32[0], np.asarray(old[0].astype(jnp.float32)))
        assert (
            int((got32 != np.asarray(old.astype(jnp.float32))).any(axis=-1).sum())
            == int((slots >= 0).sum()) * got.shape[1]
        )


def test_fp16_value_pages_saturate():
    """bf16 K/V into a bf16 cache whose V pages are fp16 (the engine's layout): V outliers past
    fp16's range saturate at +-65280 instead of turning into inf, in the kernel and the oracle."""
    rng = np.random.default_rng()
    b = make_batch(
        rng,
        [(4, 9), (3, 3)],
        T=8,
        S=2,
        num_heads=4,
        num_kv_heads=2,
        dtype=jnp.bfloat16,
        poison=False,
    )
    assert b["v_cache"].dtype == jnp.float16 and b["k_cache"].dtype == jnp.bfloat16
    v = b["v_new"].at[0, 0, :3].set(jnp.asarray([1e6, -3e38, 70000.0], jnp.bfloat16))
    args = (b["k_cache"], b["v_cache"], jnp.int32(0), b["k_new"], v, b["md"].slot_mapping)
    for impl in ("pallas", "xla"):
        _, vc = jax.jit(lambda *a, impl=impl: write_kv(*a, interpret=True, impl=impl))(*args)
        slot = int(b["md"].slot_mapping[0])
        row = np.asarray(vc[0, 0, slot // 16, slot % 16, :4].astype(jnp.float32))
        np.testing.assert_array_equal(row[:3], [65280.0, -65280.0, 65280.0])
        assert row[3] == float(v[0, 0, 3].astype(jnp.float16).astype(jnp.float32))


def test_fp8_pages_saturate_instead_of_nan():
    """A K/V value past e4m3's +-448 (after its scale) saturates; a plain cast would store NaN,
    which poisons every later attention over that page."""
    rng = np.random.default_rng()
    b = make_batch(
        rng,
        [(4, 9), (3, 3)],
        T=8,
        S=2,
        num_heads=4,
        num_kv_heads=2,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.float8_e4m3fn,
        poison=False,
    )
    k = b["k_new"].at[0, 0, :3].set(jnp.asarray([1000.0, -3e38, 300.0], jnp.bfloat16))
    args = (b["k_cache"], b["v_cache"], jnp.int32(0), k, b["v_new"], b["md"].slot_mapping)
    slot = int(b["md"].slot_mapping[0])
    for name, fn in (
        ("pallas", lambda *a: write_kv(*a, interpret=True, k_scale=0.5)),
        ("oracle", lambda *a: ref_write_kv(*a, k_scale=0.5)),
    ):
        kc, _ = jax.jit(fn)(*args)
        row = np.asarray(kc[0, 0, slot // 16, slot % 16, :3].astype(jnp.float32))
        np.testing.assert_array_equal(row, [448.0, -448.0, 448.0], err_msg=name)


def test_scan_layers_donated():
    """2 layers in lax.scan with a traced layer index, caches donated: as the engine runs it."""
    rng = np.random.default_rng()
    b = make_batch(
        rng, [(1, 30), (5, 21), (1, 1)], T=8, S=4, num_heads=8, num_kv_heads=2, poison=False
    )
    md = b["md"]
    L = b["k_cache"].shape[0]
    qs = jnp.stack([b["q"], b["q"][::-1]])
    ks = jnp.stack([b["k_new"], -b["k_new"]])
    vs = jnp.stack([b["v_new"], b["v_new"] * 2])

    def make_step(write, attend, **kw):
        def step(kc, vc, qs, ks, vs, md):
            def body(carry, xs):
                kc, vc = carry
                layer, q, k, v = xs
                kc, vc = write(kc, vc, layer, k, v, md.slot_mapping, **kw)
                o = attend(q, kc, vc, layer, md, sm_scale=0.125, **kw)
                return (kc, vc), o

            (kc, vc), o = jax.lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), qs, ks, vs))
            return o, kc, vc

        return jax.jit(step, donate_argnums=(0, 1))

    ref_o, ref_k, ref_v = make_step(ref_write_kv, ref_ragged_paged_attention)(
        jnp.copy(b["k_cache"]), jnp.copy(b["v_cache"]), qs, ks, vs, md
    )
    kc, vc = jnp.copy(b["k_cache"]), jnp.copy(b["v_cache"])
    o, k2, v2 = make_step(write_kv, ragged_paged_attention, interpret=True)(kc, vc, qs, ks, vs, md)
    assert kc.is_deleted() and vc.is_deleted(), "caches were not donated"
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(ref_v))
    n = b["num_tokens"]
    for layer in range(L):
        assert rel_err(o[layer], ref_o[layer], n) < 1e-5
