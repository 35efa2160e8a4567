"""Disaggregated prefill (issue #23) on 2 simulated CPU devices: a prefill engine on device 0
hands each prompt's KV pages and first token to a decode engine on device 1; the tokens are one
engine's, every block comes back on both sides, the decode side's prefix cache saves pages, and
the server streams one response per request. The worker runs it all (tests/disagg_worker.py).

Data-parallel replicas (issue #19, tests/dp_worker.py) are here too: the same engine settings on
the same 2 devices, and the same compilation cache (conftest.two_device_cache) is a session's of
one xdist worker: in one file, the second of the two loads its steps instead of compiling them
(in two, they may land on both workers and each compiles everything)."""

import json

import pytest
from devices import SMALL, run_worker, truncated_smollm2

from paxengine import LLM
from paxengine.disagg.config import parse_kv_transfer_config
from paxengine.engine import EngineCore

SMALL_PD = dict(SMALL, max_model_len=256, max_num_batched_tokens=64, token_buckets=[16, 64])
SMALL_DP = SMALL_PD  # the same engines: the same steps, compiled once for both


@pytest.fixture(scope="module")
def pd(two_device_cache):
    small = dict(SMALL_PD, model=truncated_smollm2(), compilation_cache_dir=two_device_cache)
    return run_worker("disagg_worker.py", [json.dumps(small)], 2)


def test_each_engine_runs_on_its_own_device(pd):
    assert pd["devices"] == [[0], [1]]


def test_split_requests_give_one_engines_tokens(pd):
    assert pd["pd_greedy"] == pd["one_greedy"]
    assert pd["pd_seeded"] == pd["one_seeded"]  # same seed, same step: same draws


def test_logprobs_stop_strings_grammars_and_the_dispatch_thread_carry_over(pd):
    assert pd["variants_equal"] == [True, True, True]
    for side in ("prefill", "decode"):
        free, total = pd["free_dispatch_thread"][side]
        assert free == total


def test_backpressure_holds_new_prompts_while_the_decode_side_is_behind(pd):
    assert pd["backpressure"] == [True, 0]  # pages waiting there; the next prompt not started
    assert pd["backpressure_tokens"] == pd["one_greedy"][:2]
    for side in ("prefill", "decode"):
        free, total = pd["free_after_backpressure"][side]
        assert free == total


def test_pages_move_in_pieces_not_one_per_copy(pd):
    copies, pages = pd["copies_pages"]
    # 8 requests, 10 pages, pieces of <= 2 pages: the 3-page prompt went as 2 + 1
    assert pages == 10 and copies == 9


def test_every_block_comes_back_on_both_sides(pd):
    for key in (
        "free_after_finish",
        "free_after_failures",
        "free_after_aborts",
        "free_after_drain",
    ):
        for side in ("prefill", "decode"):
            free, total = pd[key][side]
            assert free == total, (key, side)


def test_a_prefix_the_decode_side_holds_is_not_sent(pd):
    moved, skipped = pd["prefix_moved_skipped"]
    assert skipped == 4 and moved == pd["prefix_prompt_blocks"] - 4 == 1


def test_a_long_prompts_pages_go_chunk_by_chunk(pd):
    sends, pages = pd["chunked"]
    # chunks of 64, 16, 16 and 5 tokens (the scheduler fits buckets): 4 + 1 + 1 pages as they
    # are dispatched, the last one with the first token
    assert sends == 4 and pages == pd["chunked_blocks"] == 7
    assert pd["chunked_equal"]


def test_a_failed_transfer_recomputes_with_the_same_tokens(pd):
    send_failed, receive_failed = pd["failed_transfer_tokens"]
    assert send_failed == receive_failed == pd["one_greedy"][:2]
    assert pd["recomputed"] == 2


def test_abort_while_pages_wait_and_while_decoding(pd):
    assert pd["parked"] == 1 and pd["running_before_abort"] == 1


def test_the_server_streams_one_response_per_request(pd):
    assert pd["is_engine_client"]
    assert pd["served"] == pd["want_text"]
    assert pd["streamed"] == pd["want_text"]
    # the first token's chunk, then the decoded ones: one a token, or fewer where the server
    # merged the deltas a slow reader had not taken yet (a loaded machine), never more
    assert all(2 <= n <= 8 for n in pd["stream_chunks"]), pd["stream_chunks"]
    assert pd["served_usage"] == [0.0, 0.0] and pd["served_free"] == [True, True]
    assert pd["served_pages"] > 0 and pd["compiles_after_warmup"] == 0
    assert pd["metrics_engines"] == ["0", "1"]
    assert pd["n2_status"] == 400


def test_aborts_through_the_front_free_both_sides(pd):
    f = pd["front_aborts"]
    assert f["abort_after_first"] == ["abort", 1]  # aborted before the decode engine took it
    assert f["closed_after"] == 3 and f["idle"] and f["free"] == [True, True]


def test_a_dead_decode_engine_fails_requests_and_leaks_nothing(pd):
    assert pd["dead_peer_status"] == 503 and pd["after_dead_status"] == 503
    assert not pd["healthy_after_dead"] and pd["prefill_free_after_dead"]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"kv_role": "kv_producer"}, "needs a peer engine in another process"),
        ({"kv_role": "kv_consumer"}, "needs a peer engine in another process"),
        ({"kv_role": "prefill"}, "kv_role must be one of"),
        ({}, None),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "is not implemented"),
        ({"kv_connector": "Foo", "kv_role": "kv_both"}, "unknown kv_connector"),
        ({"kv_role": "kv_both", "kv_port": 1234}, "another process"),
        ({"kv_role": "kv_both", "kv_buffer_device": "cpu"}, "host memory"),
        ({"kv_role": "kv_both", "typo": 1}, "unknown keys"),
        ({"kv_role": "kv_both", "decode_device": 0}, "overlap"),
        ({"kv_role": "kv_both", "max_blocks_per_copy": 0}, "max_blocks_per_copy"),
        ({"kv_role": "kv_both", "prefill_device": "0"}, "must be an integer"),
        ({"kv_role": "kv_both", "kv_buffer_size": 0}, "kv_buffer_size"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_kv_transfer_configs_are_refused(raw, message):
    if message is None:
        assert parse_kv_transfer_config(raw) is None
        return
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(raw)


def test_defaults_and_tensor_parallel_placement():
    c = parse_kv_transfer_config('{"kv_role": "kv_both"}')
    assert (c.prefill_device, c.decode_device, c.max_blocks_per_copy) == (0, 1, 256)
    c = parse_kv_transfer_config({"kv_role": "kv_both"}, tensor_parallel_size=2)
    assert c.decode_device == 2
    with pytest.raises(ValueError, match="overlap"):
        parse_kv_transfer_config({"kv_role": "kv_both", "decode_device": 1}, 2)


def test_refused_before_the_model_loads():
    with pytest.raises(ValueError, match="kv_producer"):
        LLM(kv_transfer_config={"kv_role": "kv_producer"}, show_progress=False)
    with pytest.raises(ValueError, match="served by paxengine.disagg"):
        EngineCore(kv_transfer_config={"kv_role": "kv_both"}, show_progress=False)


def test_serve_flag_refuses_a_bad_config():
    from serving.cli import parse

    ecfg, _ = parse(["--kv-transfer-config", '{"kv_role": "kv_both", "decode_device": 3}'])
    assert ecfg.kv_transfer_config == {"kv_role": "kv_both", "decode_device": 3}
    with pytest.raises(SystemExit):
        parse(["--kv-transfer-config", '{"kv_role": "kv_consumer"}'])


def test_serve_builds_the_disaggregated_engine_and_refuses_a_bad_yaml(tmp_path, monkeypatch):
    from paxengine.disagg import front
    from serving.cli import main

    bad = tmp_path / "pd.yaml"
    bad.write_text("kv_transfer_config: {kv_role: kv_producer}\n")
    assert main(["--config", str(bad)]) == 2  # refused before any model loads

    built = []

    class Probe:
        def __init__(self, cfg):
            built.append(cfg.kv_transfer_config)
            raise ValueError("probe: not starting")

    monkeypatch.setattr(front, "DisaggregatedEngine", Probe)
    assert main(["--kv-transfer-config", '{"kv_role": "kv_both"}']) == 2
    assert built == [{"kv_role": "kv_both"}]


# -- data-parallel replicas ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp(two_device_cache):
    small = dict(SMALL_DP, model=truncated_smollm2(), compilation_cache_dir=two_device_cache)
    return run_worker("dp_worker.py", [json.dumps(small)], 2)


def test_each_replica_runs_on_its_own_device(dp):
    assert dp["devices"] == [[0], [1]]


def test_a_shared_prefix_stays_on_the_replica_that_cached_it(dp):
    # the first request went to one replica; the three sharing its prefix followed it
    assert dp["routed_prefix"] == [2, 3, 4] and dp["by_prefix"] == 3


def test_both_replicas_serve_and_answer_as_one_engine(dp):
    assert all(n > 0 for n in dp["routed"]) and sum(dp["routed"]) == 8
    assert dp["texts"] == dp["single"]


def test_no_replica_counts_another_replicas_warm_up_as_a_recompile(dp):
    assert dp["compiles_after_warmup"] == [0, 0]


def test_metrics_per_replica(dp):
    engines = sorted(ln.split('engine="')[1].split('"')[0] for ln in dp["metrics"])
    assert engines == ["0", "1"]


def test_one_engine_core_refuses_data_parallel():
    with pytest.raises(ValueError, match="runs one replica"):
        LLM(data_parallel_size=2, show_progress=False)
