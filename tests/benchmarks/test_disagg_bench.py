"""benchmarks/gpu/disagg.py's arithmetic (the script itself is smoke-run with --quick by hand:
~30 s of CPU, too long for CI)."""

from benchmarks.gpu.disagg import percentile, summarize


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_summary_compares_modes_and_the_transfer_share():
    run = {"tpot_p99_ms": 20.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "output_tok_s": 1000}
    pd_run = dict(run, tpot_p99_ms=10.0, output_tok_s=1100, requests=4, kv_transfer_bytes=4e9)
    results = {
        "colocated": {"runs": {"long_c16": run}},
        "disaggregated": {
            "runs": {"long_c16": pd_run},
            "transfer_probe": {"gb_per_s": 500.0},
        },
    }
    s = summarize(results)
    row = s["long_c16"]
    assert row["tpot_p99_gain"] == 2.0 and row["output_tok_s_ratio"] == 1.1
    assert row["transfer_ms_per_request"] == 2.0  # 1 GB a request at 500 GB/s
    assert row["transfer_share_of_ttft_p50"] == 0.02
    assert s["goal_met"] == {"long_c16": True}
