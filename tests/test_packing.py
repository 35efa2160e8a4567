"""The one-transfer packing of a step's host inputs (paxengine/packing.py) and the layouts the
runner packs with."""

import dataclasses

import jax
import numpy as np
import pytest

from paxengine.batch import StepArrays
from paxengine.packing import PackedLayout
from paxengine.sampling import DATA_FIELDS


def _random(rng, shape, kind):
    if kind == "int32":
        return rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int32)
    if kind == "uint32":
        return rng.integers(0, 2**32, shape, dtype=np.uint32)
    if kind == "bool":
        return rng.random(shape) < 0.5
    x = rng.standard_normal(shape).astype(np.float32)
    special = np.array([np.inf, -np.inf, -0.0], np.float32)  # bits that must survive as they are
    x.reshape(-1)[: min(3, x.size)] = special[: min(3, x.size)]
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_through_a_jitted_unpack(seed):
    rng = np.random.default_rng(seed)
    kinds = ["int32", "float32", "uint32", "bool"]
    fields = [
        (f"f{i}", tuple(rng.integers(1, 6, rng.integers(1, 3))), kinds[rng.integers(4)])
        for i in range(9)
    ]
    layout = PackedLayout.of(fields)
    values = {n: _random(rng, s, k) for n, s, k in fields}
    packed = layout.pack(values)
    assert packed.dtype == np.int32 and packed.shape == (layout.size,)
    out = jax.jit(layout.unpack)(packed)
    assert list(out) == [n for n, _, _ in fields]
    for name, shape, kind in fields:
        got = np.asarray(out[name])
        assert got.shape == shape and got.dtype == np.dtype(kind), name
        want = values[name]
        if kind == "float32":  # bit for bit (inf, -0.0)
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
        else:
            np.testing.assert_array_equal(got, want)


def test_a_nan_keeps_its_bits():
    layout = PackedLayout.of([("x", (2,), np.float32)])
    x = np.array([np.nan, 1.5], np.float32)
    got = np.asarray(jax.jit(layout.unpack)(layout.pack({"x": x}))["x"])
    np.testing.assert_array_equal(got.view(np.int32), x.view(np.int32))


def test_wrong_shape_and_unsupported_dtype_are_refused():
    layout = PackedLayout.of([("a", (3,), np.int32)])
    with pytest.raises(ValueError, match="a: shape"):
        layout.pack({"a": np.zeros(4, np.int32)})
    with pytest.raises(TypeError, match="float64"):
        PackedLayout.of([("b", (2,), np.float64)])


def test_the_runner_layouts_cover_every_input():
    """Every StepArrays field goes into the forward's layout, and every SamplingTensors array
    into the sampler's or stays an argument of its own (history, mask): nothing is dropped."""
    from paxengine.engine import EngineCore
    from paxengine.runner import _APART, STATE_FIELDS

    eng = EngineCore(
        model="dummy:tiny",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        seq_buckets=[4],
        num_kv_blocks=16,
        structured_outputs=False,
        store_executables=False,
        show_progress=False,
    )
    r = eng.runner
    # the state slots go in only for a model with recurrent layers (test_qwen3_5 runs them)
    fields = [f.name for f in dataclasses.fields(StepArrays) if f.name not in STATE_FIELDS]
    assert list(r.step_layout(16, 4).names) == fields
    for flags in r.sampler_flags:
        names = r.sampling_layout(4, flags).names
        assert sorted(names + _APART) == sorted(DATA_FIELDS)


@pytest.mark.parametrize("logprobs", [False, True])
def test_samples_round_trip_as_one_vector(logprobs):
    """The sampler's five outputs travel as one vector (sampling.pack_samples) and come back
    whole: tokens always, the logprob arrays when the batch asked for them (zeros otherwise)."""
    from paxengine.sampling import pack_samples, unpack_samples

    rng = np.random.default_rng(4)
    S, N = 5, 3
    result = (
        rng.integers(0, 1000, S).astype(np.int32),
        -rng.random(S).astype(np.float32),
        rng.integers(1, 9, S).astype(np.int32),
        rng.integers(0, 1000, (S, N)).astype(np.int32),
        np.array([[-np.inf, -1.5, -0.0]] * S, np.float32),
    )
    packed = np.asarray(jax.jit(lambda r: pack_samples(r, logprobs))(result))
    assert packed.dtype == np.int32 and packed.shape == ((3 + 2 * N) * S if logprobs else S,)
    got = unpack_samples(packed, S, N, logprobs)
    np.testing.assert_array_equal(got[0], result[0])
    for g, want in zip(got[1:], result[1:]):
        assert g.shape == want.shape and g.dtype == want.dtype
        if logprobs:
            np.testing.assert_array_equal(g.view(np.int32), want.view(np.int32))
        else:
            assert not g.any()
