"""rope_write_kv (Pallas, interpret mode) against its oracle ref_rope_write_kv, and the oracle
against the model's own RoPE (models/llama.py's apply_rope) + ref_write_kv."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (
    ref_rope_write_kv,
    ref_write_kv,
    rope_write_kv,
    value_cache_dtype,
    value_page_shape,
)
from kernels_pallas.testing import v_rows
from paxengine.models.llama import apply_rope, rope_tables

FP8 = jnp.float8_e4m3fn
SCALES = dict(k_scale=0.5, v_scale=0.25)  # powers of two: x * (1 / s) == x / s exactly


def _angles(rng, T, D):
    pos = jnp.asarray(rng.integers(0, 100_000, T), jnp.int32)
    inv_freq = 1.0 / (500_000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    return pos, inv_freq


def _cos_sin(pos, inv_freq):
    f = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(f), jnp.sin(f)


def make_inputs(rng, *, T, Hq, Hkv, D, dtype, kv_dtype, L=3, bs=16, NB=None, pad=()):
    """qkv [T, (Hq + 2 Hkv) D], cos / sin, random caches (V pages per value_cache_dtype) and
    slots: T distinct slots in a random permutation of the blocks, -1 at the tokens `pad`."""
    NB = NB or max(4, -(-T // bs) + 2)
    qkv = jnp.asarray(rng.standard_normal((T, (Hq + 2 * Hkv) * D)) * 2, dtype)
    cos, sin = _cos_sin(*_angles(rng, T, D))
    shape = (L, Hkv, NB, bs, D)
    v_shape = shape[:3] + value_page_shape(kv_dtype, bs, D)  # [D, bs] for 64-token fp8 pages
    kc = jnp.asarray(rng.standard_normal(shape), kv_dtype)
    vc = jnp.asarray(rng.standard_normal(v_shape), value_cache_dtype(kv_dtype))
    perm = rng.permutation(NB)
    pos = rng.choice(NB * bs, T, replace=False)
    slots = (perm[pos // bs] * bs + pos % bs).astype(np.int32)
    slots[list(pad)] = -1
    return qkv, cos, sin, kc, vc, jnp.asarray(slots)


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _check(got, want, old, slots, layer):
    q, kc, vc = got
    rq, rk, rv = want
    np.testing.assert_array_equal(_f32(q), _f32(rq))
    assert q.dtype == rq.dtype and q.shape == rq.shape
    n_written = int((np.asarray(slots) >= 0).sum())
    for new, ref, prev, is_v in ((kc, rk, old[0], False), (vc, rv, old[1], True)):
        assert new.dtype == prev.dtype and new.shape == prev.shape == ref.shape
        if is_v:  # compare position by position
            new, ref, prev = (v_rows(old[0], x) for x in (new, ref, prev))
        new32, prev32 = _f32(new), _f32(prev)
        np.testing.assert_array_equal(new32, _f32(ref))
        # other layers and every slot not in slot_mapping are untouched
        others = [i for i in range(new.shape[0]) if i != layer]
        np.testing.assert_array_equal(new32[others], prev32[others])
        changed = (new32 != prev32).any(axis=-1).sum()
        assert int(changed) == n_written * new.shape[1]


LLAMA, SMOL, TINY = (32, 8, 128), (9, 3, 64), (4, 2, 32)
BF16, F32 = jnp.bfloat16, jnp.float32
CASES = {
    # heads (Hq, Hkv, D), T, activations, K cache dtype, scales, padded tokens, block_t[, bs]
    "llama_t1_bf16": (LLAMA, 1, BF16, BF16, {}, (), None),
    "llama_t16_fp8": (LLAMA, 16, BF16, FP8, SCALES, (5, 14, 15), None),
    # 64-token fp8 pages: V stored [D, bs] (layout.v_transposed)
    "llama_t16_fp8_bs64": (LLAMA, 16, BF16, FP8, SCALES, (5, 14, 15), None, 64),
    "tiny_t37_fp8_bs64": (TINY, 37, F32, FP8, SCALES, (7, 36), 4, 64),
    "smol_t37_bf16": (SMOL, 37, BF16, BF16, {}, (0, 20, 35, 36), None),
    "smol_t16_f32": (SMOL, 16, F32, F32, {}, (3,), None),
    "smol_t1_pad": (SMOL, 1, BF16, BF16, {}, (0,), None),  # q_rot only, caches untouched
    "tiny_t37_fp8_f32": (TINY, 37, F32, FP8, SCALES, (7, 36), None),
    "tiny_t3_f16_bt2": (TINY, 3, jnp.float16, jnp.float16, {}, (1,), 2),  # a partial block
}


@pytest.mark.parametrize("name", list(CASES))
def test_rope_write_kv(name):
    (Hq, Hkv, D), T, dtype, kv_dtype, scales, pad, block_t, *bs = CASES[name]
    rng = np.random.default_rng(1)
    args = make_inputs(
        rng, T=T, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, kv_dtype=kv_dtype, pad=pad, bs=(bs or [16])[0]
    )
    qkv, cos, sin, kc, vc, slots = args
    layer = jnp.int32(1)
    heads = dict(num_heads=Hq, num_kv_heads=Hkv)
    got = jax.jit(lambda *a: rope_write_kv(*a, **heads, **scales, interpret=True, block_t=block_t))(
        qkv, cos, sin, kc, vc, layer, slots
    )
    # the oracle jitted too: XLA fuses both the same way (f32 FMA contraction included)
    want = jax.jit(lambda *a: ref_rope_write_kv(*a, **heads, **scales))(
        qkv, cos, sin, kc, vc, layer, slots
    )
    _check(got, want, (kc, vc), slots, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_oracle_is_apply_rope(dtype):
    """ref_rope_write_kv == the model's path: split qkv, apply_rope(q), apply_rope(k),
    ref_write_kv. Bit-exact op by op (x1 c + (-x2) s == x1 c - x2 s in IEEE arithmetic, and
    cos(concat([f, f])) is cos(f) twice). Under jit, XLA CPU fuses each expression and may
    contract a multiply-add into an FMA (one rounding instead of two) for one spelling and not
    the other: where the exact value sits on a rounding tie of a bf16 output, the two f32
    results land on either side of it and the outputs differ by one bf16 step (seen on
    jax 0.10.2 in ~1e-4 of the elements; f32 outputs agreed). Never more than one step."""
    Hq, Hkv, D, T = 9, 3, 64, 37
    rng = np.random.default_rng(97)
    qkv, _, _, kc, vc, slots = make_inputs(
        rng, T=T, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, kv_dtype=dtype, pad=(4, 36)
    )
    pos, inv_freq = _angles(rng, T, D)
    layer = jnp.int32(2)

    def model(qkv, kc, vc, pos):
        nq, nkv = Hq * D, Hkv * D
        q = qkv[:, :nq].reshape(T, Hq, D)
        k = qkv[:, nq : nq + nkv].reshape(T, Hkv, D)
        v = qkv[:, nq + nkv :].reshape(T, Hkv, D)
        rope = rope_tables(pos, inv_freq)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return (q, *ref_write_kv(kc, vc, layer, k, v, slots))

    def oracle(qkv, kc, vc, pos):
        cos, sin = _cos_sin(pos, inv_freq)
        return ref_rope_write_kv(
            qkv, cos, sin, kc, vc, layer, slots, num_heads=Hq, num_kv_heads=Hkv
        )

    for got, want in zip(oracle(qkv, kc, vc, pos), model(qkv, kc, vc, pos)):
        np.testing.assert_array_equal(_f32(got), _f32(want))
    for got, want in zip(jax.jit(oracle)(qkv, kc, vc, pos), jax.jit(model)(qkv, kc, vc, pos)):
        assert got.dtype == want.dtype
        g, w = _codes(got), _codes(want)
        assert (np.abs(g - w) <= 1).all()  # neighbouring values of the dtype at most
        assert (g != w).mean() < 0.01


def _codes(x):
    """The bit patterns as integers: neighbouring values of one sign differ by 1."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.int16, 4: np.int32}[x.dtype.itemsize]).astype(np.int64)


def test_scan_layers_donated():
    """All L layers in lax.scan (traced layer index), the caches donated: as the engine runs it.
    Nothing is copied (the inputs are deleted) and the result is the oracle's."""
    Hq, Hkv, D, T, L = 4, 2, 32, 5, 3
    rng = np.random.default_rng(2)
    _, cos, sin, kc, vc, slots = make_inputs(
        rng, T=T, Hq=Hq, Hkv=Hkv, D=D, dtype=BF16, kv_dtype=BF16, L=L, pad=(3,)
    )
    qkvs = jnp.asarray(rng.standard_normal((L, T, (Hq + 2 * Hkv) * D)), BF16)

    def make_step(fn, **kw):
        def step(kc, vc, qkvs, cos, sin, slots):
            def body(carry, xs):
                layer, qkv = xs
                q, kc, vc = fn(
                    qkv, cos, sin, *carry, layer, slots, num_heads=Hq, num_kv_heads=Hkv, **kw
                )
                return (kc, vc), q

            (kc, vc), q = jax.lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), qkvs))
            return q, kc, vc

        return jax.jit(step, donate_argnums=(0, 1))

    want = make_step(ref_rope_write_kv)(jnp.copy(kc), jnp.copy(vc), qkvs, cos, sin, slots)
    kc2, vc2 = jnp.copy(kc), jnp.copy(vc)
    got = make_step(rope_write_kv, interpret=True)(kc2, vc2, qkvs, cos, sin, slots)
    assert kc2.is_deleted() and vc2.is_deleted(), "caches were not donated"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_f32(g), _f32(w))
    n_changed = (_f32(got[1]) != _f32(kc)).any(axis=-1).sum()
    assert int(n_changed) == L * Hkv * int((np.asarray(slots) >= 0).sum())


def _outlier_inputs(kv_dtype):
    """Token 0 at position 0 (cos 1, sin 0: k_rot == k) with outliers in k and v head 0."""
    Hq, Hkv, D = 4, 2, 32
    rng = np.random.default_rng(3)
    qkv, cos, sin, kc, vc, slots = make_inputs(
        rng, T=4, Hq=Hq, Hkv=Hkv, D=D, dtype=BF16, kv_dtype=kv_dtype, L=1
    )
    cos, sin = cos.at[0].set(1.0), sin.at[0].set(0.0)
    big = jnp.asarray([1000.0, -3e38, 300.0, 70000.0], BF16)
    k0, v0 = Hq * D, (Hq + Hkv) * D
    qkv = qkv.at[0, k0 : k0 + 4].set(big).at[0, v0 : v0 + 4].set(big)
    return (qkv, cos, sin, kc, vc, jnp.int32(0), slots), dict(num_heads=Hq, num_kv_heads=Hkv)


def test_fp8_pages_saturate_instead_of_nan():
    """K/V values past e4m3's +-448 (after the scale) saturate; a plain cast would store NaN."""
    args, heads = _outlier_inputs(FP8)
    slot = int(args[-1][0])
    for name, fn in (
        ("pallas", lambda *a: rope_write_kv(*a, **heads, interpret=True, k_scale=0.5, v_scale=1.0)),
        ("oracle", lambda *a: ref_rope_write_kv(*a, **heads, k_scale=0.5, v_scale=1.0)),
    ):
        _, kc, vc = jax.jit(fn)(*args)
        k = _f32(kc[0, 0, slot // 16, slot % 16, :4])
        v = _f32(vc[0, 0, slot // 16, slot % 16, :4])
        np.testing.assert_array_equal(k, [448.0, -448.0, 448.0, 448.0], err_msg=name)
        np.testing.assert_array_equal(v, [448.0, -448.0, 288.0, 448.0], err_msg=name)


def test_fp16_value_pages_saturate():
    """bf16 activations, bf16 cache with fp16 V pages (the engine's layout): V outliers past
    fp16's range saturate at +-65280 instead of becoming inf; K stays bf16."""
    args, heads = _outlier_inputs(BF16)
    assert args[4].dtype == jnp.float16
    slot = int(args[-1][0])
    for name, fn in (
        ("pallas", lambda *a: rope_write_kv(*a, **heads, interpret=True)),
        ("oracle", lambda *a: ref_rope_write_kv(*a, **heads)),
    ):
        _, kc, vc = jax.jit(fn)(*args)
        k = _f32(kc[0, 0, slot // 16, slot % 16, :4])
        v = _f32(vc[0, 0, slot // 16, slot % 16, :4])
        np.testing.assert_array_equal(k, _f32(jnp.asarray([1000.0, -3e38, 300.0, 70000.0], BF16)))
        np.testing.assert_array_equal(v, [1000.0, -65280.0, 300.0, 65280.0], err_msg=name)


def test_fp8_scale_not_a_power_of_two():
    """Like write_kv, the kernel multiplies by 1 / scale where the oracle divides: the two agree
    exactly for power-of-two scales, else the f32 quotient can differ by an ulp and, rarely,
    round to the neighbouring fp8 value. Never further apart than that. The scales are traced
    ([2] f32, as the engine's per-layer kv_scale inside its layer scan)."""
    rng = np.random.default_rng(4)
    Hq, Hkv, D = 4, 2, 32
    args = make_inputs(rng, T=16, Hq=Hq, Hkv=Hkv, D=D, dtype=F32, kv_dtype=FP8, pad=(2,))
    scales = jnp.asarray([0.37, 0.0123], jnp.float32)

    def run(fn, **kw):
        def f(qkv, cos, sin, kc, vc, slots, sc):
            return fn(qkv, cos, sin, kc, vc, 1, slots, k_scale=sc[0], v_scale=sc[1], **kw)

        return jax.jit(f)(*args, scales)

    heads = dict(num_heads=Hq, num_kv_heads=Hkv)
    got = run(rope_write_kv, interpret=True, **heads)
    want = run(ref_rope_write_kv, **heads)
    np.testing.assert_array_equal(_f32(got[0]), _f32(want[0]))
    for g, w in zip(got[1:], want[1:]):
        g8, w8 = _codes(g), _codes(w)
        assert (np.abs(g8 - w8) <= 1).all()  # neighbouring e4m3 values at most
        assert (g8 != w8).mean() < 0.01


def test_rejects_head_dim_without_power_of_two_half():
    rng = np.random.default_rng(5)
    args = make_inputs(rng, T=2, Hq=2, Hkv=1, D=48, dtype=F32, kv_dtype=F32)
    with pytest.raises(AssertionError, match="power of two"):
        rope_write_kv(*args[:5], 0, args[5], num_heads=2, num_kv_heads=1, interpret=True)
