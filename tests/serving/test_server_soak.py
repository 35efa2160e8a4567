"""A CI-sized soak of the real SmolLM2 server (benchmarks/soak.py, the same code as the GPU
run's): mixed streamed and whole requests, a third of the streams dropped by the client, bad
requests mixed in; afterwards nothing is left running or holding KV, and the server counted
every request the client sent."""

from benchmarks.soak import check, soak


def test_soak_leaves_nothing_behind(server):
    report = soak(
        server.base,
        seconds=12,
        concurrency=6,
        drop=0.3,
        bad=0.1,
        max_tokens=12,
        api_key=server.api_key,
        seed=1,
    )
    assert check(report) == [], report
    kinds = report["requests"]
    assert kinds["dropped"]["n"] and kinds["stream"]["n"] and kinds["bad"]["n"], kinds
    windows = report["windows"]  # 12 s in windows of 12 / 5 s, each with the requests it began
    assert len(windows) == 5 and [w["start_s"] for w in windows] == [0, 2.4, 4.8, 7.2, 9.6]
    assert sum(w["ttft"]["n"] for w in windows) > 0
