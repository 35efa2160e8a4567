"""The kernel benchmarks' shared timing helper, on the CPU (interpret mode, a tiny batch)."""
import jax.numpy as jnp

from benchmarks import kernels as K
from kernels_pallas import ref_ragged_paged_attention


def test_timed_variant_checks_times_and_records_failures():
    seqs = [(1, 40), (1, 17)]
    data = K.build(seqs, 2, 2, 3)
    assert data[2].dtype == jnp.float16 and data[1].dtype == K.DT   # the engine's V pages
    ref = K.oracle(*data)
    eager = ref_ragged_paged_attention(data[0].astype(jnp.float32), data[1], data[2], 0,
                                       data[3], sm_scale=K.D ** -0.5)
    assert bool(jnp.allclose(ref, eager, rtol=1e-5, atol=1e-6))
    row = {}
    f = K.timed_variant(row, {}, data, ref, 2)
    assert f is not None and row["rel_err"] < 2e-3
    assert len(row["us_rounds"]) == 1 and row["us_rounds"][0] > 0
    bad = {}
    assert K.timed_variant(bad, dict(no_such_field=1), data, ref, 2) is None
    assert "no_such_field" in bad["error"] and "us_rounds" not in bad
