"""The kernel benchmarks' shared harness, on the CPU (interpret mode, a tiny batch)."""

import jax.numpy as jnp

from benchmarks.device_trace import span_of
from benchmarks.kernels import harness as K
from kernels_pallas import ref_ragged_paged_attention


def test_timed_variant_checks_times_and_records_failures():
    seqs = [(1, 40), (1, 17)]
    data = K.build(seqs, 2, 2, 3)
    assert data[2].dtype == jnp.float16 and data[1].dtype == K.DT  # the engine's V pages
    ref = K.oracle(*data)
    eager = ref_ragged_paged_attention(
        data[0].astype(jnp.float32), data[1], data[2], 0, data[3], sm_scale=K.D**-0.5
    )
    assert bool(jnp.allclose(ref, eager, rtol=1e-5, atol=1e-6))
    row = {}
    f = K.timed_variant(row, {}, data, ref, 2)
    assert f is not None and row["rel_err"] < 2e-3
    assert len(row["us_rounds"]) == 1 and row["us_rounds"][0] > 0
    bad = {}
    assert K.timed_variant(bad, dict(no_such_field=1), data, ref, 2) is None
    assert "no_such_field" in bad["error"] and "us_rounds" not in bad


def test_more_rounds_keeps_the_median_of_interleaved_rounds():
    seqs = [(1, 40), (1, 17)]
    data = K.build(seqs, 2, 2, 3)
    ref = K.oracle(*data)
    rows, loops = [{}, {}], {}
    for i, tun in enumerate([{}, dict(no_such_field=1)]):
        f = K.timed_variant(rows[i], tun, data, ref, 2)
        if f is not None:
            loops[i] = (f, data)
    K.more_rounds(rows, loops, 2)
    ok, failed = rows
    assert len(ok["us_rounds"]) == 3 and ok["us"] == sorted(ok["us_rounds"])[1]
    assert "us" not in failed and "error" in failed


def test_decode_trace_helpers():
    """decode_trace's device span (gaps counted once, overlaps not twice), its in-order page
    tables (same attention output as the permuted ones) and its unrolled form (one output per
    query buffer, each the attention of that buffer)."""
    from benchmarks.kernels import decode_trace as DT

    span, idle = span_of([("a", 0.0, 10.0), ("b", 12.0, 3.0), ("c", 13.0, 5.0), ("d", 30.0, 1.0)])
    assert span == 31.0 and idle == 2.0 + 12.0
    assert span_of([]) == (0.0, 0.0)
    seqs = [(1, 40), (1, 17), (1, 33)]
    q, kc, vc, md = K.build(seqs, 3, 4, 5)
    md2 = DT.in_order(md, K.BS)
    bt = md2.block_tables
    assert bt[0, :3].tolist() == [0, 1, 2] and bt[1, :2].tolist() == [3, 4]
    assert bt[2, :3].tolist() == [5, 6, 7] and int(bt[3].max()) == 0
    # the same pages' contents at their new ids: the output must not change
    live = [(s, i) for s, (_, kv) in enumerate(seqs) for i in range(-(-kv // K.BS))]
    new = jnp.asarray([int(bt[s, i]) for s, i in live])
    old = jnp.asarray([int(md.block_tables[s, i]) for s, i in live])
    k2, v2 = kc.at[:, :, new].set(kc[:, :, old]), vc.at[:, :, new].set(vc[:, :, old])
    ref = K.oracle(q, kc, vc, md)
    assert bool(jnp.allclose(K.oracle(q, k2, v2, md2)[:3], ref[:3], atol=1e-5))
    outs = DT.unrolled({})([q, q * 2], kc, vc, md)
    assert len(outs) == 2
    assert float(jnp.max(jnp.abs(outs[0][:3].astype(jnp.float32) - ref[:3]))) < 2e-2
    ref2 = K.oracle(q * 2, kc, vc, md)
    assert float(jnp.max(jnp.abs(outs[1][:3].astype(jnp.float32) - ref2[:3]))) < 2e-2
    assert float(jnp.max(jnp.abs(ref2[:3] - ref[:3]))) > 0.1  # the two calls differ


def test_compare_decode_levels():
    """kernels_compare's decode table: our median over the runs against FA3, per level."""
    from benchmarks.kernels.compare import compare_decode, markdown_decode

    def run(kernel, span, loop):
        v = {
            "overrides": {},
            "pages": "permuted",
            "us": loop,
            "kernel_us": kernel + 3,
            "unrolled_us": span + 10,
            "unrolled": {"span_us": span, "kernel_us": kernel},
        }
        other = dict(
            v, overrides={"num_warps": 8}, unrolled={"span_us": 1.0, "kernel_us": 1.0}
        )  # not the default: ignored
        return {"shapes": [{"name": "decode_b64_ctx2048", "variants": [other, v]}]}

    fa3 = {
        "rows": [
            {
                "name": "decode_b64_ctx2048",
                "kv_bytes": 10**8,
                "fa3_us": 150.0,
                "fa3_graph_us": 140.0,
                "fa3_graph_trace": {"kernel_us": 120.0, "span_us": 130.0},
            },
            {"name": "prefill_2048", "flops": 1, "fa3_us": 80.0},
        ]
    }
    rows = compare_decode(
        [run(100.0, 110.0, 160.0), run(140.0, 150.0, 170.0), run(120.0, 130.0, 200.0)], fa3
    )
    assert len(rows) == 1
    r = rows[0]
    assert r["ours_kernel_us"] == 120.0 and r["kernel_rate"] == 1.0  # back to back: unrolled
    assert r["ours_kernel_in_loop_us"] == 123.0
    assert r["ours_step_us"] == 130.0 and r["step_rate"] == 1.0
    assert r["ours_alone_us"] == 170.0 and abs(r["alone_rate"] - 150 / 170) < 1e-12
    assert "| decode_b64_ctx2048 | 120.0 (0.83) / 120.0 (0.83) | 1.00x |" in markdown_decode(rows)
