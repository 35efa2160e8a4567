"""ProcessEngine: the engine in a process of its own gives what the in-process engine gives,
refuses bad input at `generate` as AsyncEngine does, and a child that dies is visible. Its
outputs cross the pipe as deltas (paxengine/output_delta.py) and come out cumulative, equal to
the engine's."""

import asyncio
import copy
import dataclasses
import os
import pickle
import signal
import time
from types import SimpleNamespace

import pytest
from engines import TINY

from paxengine import EngineDead, InvalidRequest, SamplingParams
from paxengine.engine import EngineCore
from paxengine.engine_process import ProcessEngine, _ChildTransport
from paxengine.errors import StepFailed
from paxengine.output_delta import DeltaDecoder, DeltaEncoder
from paxengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paxengine.structured import StructuredOutputs

PROMPTS = ["Count: 1, 2, 3,", "The capital of France is", "Tell me a story"]


# the end-to-end requests: logprobs, a stop string (r0 greedily runs " 4, 5, 6, 7,"), n=2
E2E = {
    "r0": (
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, stop=[" 6,"]),
    ),
    "r1": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    "r2": (
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=0),
    ),
}


@pytest.fixture(scope="module")
def engine():
    e = ProcessEngine(**TINY)
    yield e
    if e._proc.is_alive():
        e._proc.kill()


@pytest.fixture(scope="module")
def core():
    return EngineCore(**TINY)


async def _collect(engine, rid, prompt, params):
    return [out async for out in engine.generate(rid, prompt, params)]


def _assert_same_completion(got: CompletionOutput, want: CompletionOutput) -> None:
    """Equal, logprob values within float noise: the two engines batch the requests differently."""
    assert (got.index, got.text, got.token_ids) == (want.index, want.text, want.token_ids)
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    if want.logprobs is None:
        assert got.logprobs is None and got.cumulative_logprob is None
        return
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys()
        for t in w:
            assert (g[t].rank, g[t].decoded_token) == (w[t].rank, w[t].decoded_token)
            assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-3)


def test_same_outputs_as_the_engine_in_this_process(engine, core):
    want = {}
    for rid, (prompt, params) in E2E.items():
        core.add_request(rid, prompt, params)
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                want[out.request_id] = out
    assert want["r0"].outputs[0].stop_reason == " 6,"  # the stop string trimmed its text
    assert want["r0"].outputs[0].text == " 4, 5,"

    async def main():
        await engine.start()
        runs = [_collect(engine, rid, p, params) for rid, (p, params) in E2E.items()]
        return dict(zip(E2E, await asyncio.gather(*runs)))

    for rid, outs in asyncio.run(main()).items():
        final, ref = outs[-1], want[rid]
        assert final.finished and final.request_id == rid
        assert len(final.outputs) == len(ref.outputs) == E2E[rid][1].n
        for got, w in zip(final.outputs, ref.outputs):
            _assert_same_completion(got, w)
        # the prompt came back on this side, though the child sends outputs without it
        assert final.prompt == E2E[rid][0] and final.prompt_token_ids == ref.prompt_token_ids
        assert final.metrics.num_prompt_tokens == ref.metrics.num_prompt_tokens
        assert final.metrics.finished_time is not None
        assert final.num_cached_tokens == final.metrics.num_cached_tokens
        for j in range(len(ref.outputs)):  # each streamed output is cumulative
            texts = [o.outputs[j].text for o in outs]
            ids = [o.outputs[j].token_ids for o in outs]
            assert all(texts[k + 1].startswith(texts[k]) for k in range(len(texts) - 1))
            assert all(ids[k + 1][: len(ids[k])] == ids[k] for k in range(len(ids) - 1))
    assert engine._posted == 0 and engine._posted_tokens == 0  # every add was counted taken
    generated = sum(len(c.token_ids) for ref in want.values() for c in ref.outputs)
    assert engine.stats()["generation_tokens"] == generated
    assert engine._delta.state == {} and engine._prompts == {}  # freed at each final output


# -- the delta wire, without a process -----------------------------------------------------------
WIRE_FIELDS = (
    "index",
    "ids_keep",
    "new_ids",
    "text_keep",
    "new_text",
    "lps_keep",
    "new_lps",
    "cumulative_logprob",
    "finish_reason",
    "stop_reason",
)


def _comps(wire) -> list[dict]:
    return [dict(zip(WIRE_FIELDS, c)) for c in wire[2]]


def _lp(t: int) -> dict[int, Logprob]:
    return {t: Logprob(-0.1 * t, 1, f"<{t}>"), t + 100: Logprob(-5.0, 2, "x")}


def _comp(ids, text, index=0, logprobs=False, reason=None, stop=None) -> CompletionOutput:
    lps = [_lp(t) for t in ids] if logprobs else None
    cum = sum(d[t].logprob for t, d in zip(ids, lps)) if logprobs else None
    return CompletionOutput(index, text, list(ids), cum, lps, reason, stop)


def _out(rid, comps, finished=False, first_token_time=2.0, cached=0) -> RequestOutput:
    m = RequestMetrics(1.0, 1.5, first_token_time, 3.0 if finished else None, 3, cached)
    return RequestOutput(rid, "p", [1, 2, 3], comps, finished, m, num_cached_tokens=cached)


def _roundtrip(steps, enc=None, dec=None):
    """Each step's outputs through the encoder, pickle (as the pipe does) and the decoder. Every
    rebuilt output equals its original (less the prompt, which ProcessEngine puts back), when
    rebuilt and after all the later steps. Returns the wire forms."""
    enc, dec = enc or DeltaEncoder(), dec or DeltaDecoder()
    wires, got, want = [], [], []
    for step in steps:
        for out in step:
            wire = pickle.loads(pickle.dumps(enc.encode(out.request_id, out)))
            x = dec.decode(out.request_id, wire)
            expected = dataclasses.replace(out, prompt=None, prompt_token_ids=None)
            assert x == expected
            wires.append(wire)
            got.append(x)
            want.append(copy.deepcopy(expected))
    assert got == want  # a later output changed no earlier one
    return wires


def test_delta_appends_carry_only_what_is_new():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    texts = ["He", "Hello", "Hello", "Hello wo", "Hello world"]
    steps = [
        [
            _out(
                "a",
                [_comp(range(5, 6 + k), texts[k], reason="length" if k == 4 else None)],
                finished=k == 4,
            )
        ]
        for k in range(5)
    ]
    wires = _roundtrip(steps, enc, dec)
    cs = [_comps(w)[0] for w in wires]
    assert [c["new_ids"] for c in cs] == [[5], [6], [7], [8], [9]]
    assert [c["ids_keep"] for c in cs] == [0, 1, 2, 3, 4]
    assert [c["new_text"] for c in cs] == ["He", "llo", "", " wo", "rld"]
    assert [c["text_keep"] for c in cs] == [0, 2, 5, 5, 8]
    assert [c["finish_reason"] for c in cs] == [None] * 4 + ["length"]
    assert [w[0] for w in wires] == [False] * 4 + [True]
    assert enc.sent == {} and dec.state == {}  # freed at the finished output


def test_delta_text_that_is_not_an_append_goes_whole():
    steps = [
        [_out("a", [_comp([1, 2, 3], "Hello wor")])],
        [_out("a", [_comp([1, 2, 3, 4], "Hello w\u00f6")])],  # the tail revised
        [_out("a", [_comp([1, 2, 3, 4, 5], "Hello w\u00f6 x")])],
        # a stop string trims the text
        [_out("a", [_comp([1, 2, 3, 4, 5, 6], "Hello", reason="stop", stop="w")], finished=True)],
    ]
    cs = [_comps(w)[0] for w in _roundtrip(steps)]
    assert [(c["text_keep"], c["new_text"]) for c in cs] == [
        (0, "Hello wor"),
        (0, "Hello w\u00f6"),
        (8, " x"),
        (0, "Hello"),
    ]
    assert [c["new_ids"] for c in cs] == [[1, 2, 3], [4], [5], [6]]
    assert cs[-1]["stop_reason"] == "w"


def test_delta_token_ids_that_shrink_go_whole():
    steps = [[_out("a", [_comp([1, 2, 3], "abc")])], [_out("a", [_comp([1, 2], "ab")])]]
    c = _comps(_roundtrip(steps)[1])[0]
    assert (c["ids_keep"], c["new_ids"]) == (0, [1, 2])


def test_delta_two_requests_of_two_completions_each():
    enc, dec = DeltaEncoder(), DeltaDecoder()

    def two(rid, k, first_done_at, finished=False):
        c1 = min(k, first_done_at)  # the second completion stops early, on a stop token
        return _out(
            rid,
            [
                _comp(range(k), "x" * k, 0, reason="length" if finished else None),
                _comp(
                    range(10, 10 + c1),
                    "y" * c1,
                    1,
                    reason="stop" if k >= first_done_at else None,
                    stop=7 if k >= first_done_at else None,
                ),
            ],
            finished=finished,
        )

    steps = [[two("a", k, 2, k == 4), two("b", k, 3)] for k in range(1, 5)]
    wires = _roundtrip(steps, enc, dec)
    a = [_comps(w) for w in wires[0::2]]
    assert [c[1]["new_ids"] for c in a] == [[10], [11], [], []]  # nothing new once it stopped
    assert [c[1]["stop_reason"] for c in a] == [None, 7, 7, 7]
    assert [c[0]["new_ids"] for c in a] == [[0], [1], [2], [3]]
    assert [c["index"] for c in a[0]] == [0, 1]
    assert set(enc.sent) == set(dec.state) == {"b"}  # a finished, b runs on
    _roundtrip([[two("b", 5, 3, finished=True)]], enc, dec)
    assert enc.sent == {} and dec.state == {}


def test_delta_logprobs_go_once_each():
    steps = [
        [_out("a", [_comp([], "", logprobs=True)])],  # asked for, none yet: [] stays []
        [_out("a", [_comp([4], "d", logprobs=True)])],
        [_out("a", [_comp([4, 5, 6], "def", logprobs=True)])],  # two tokens in a step
        [_out("a", [_comp([4, 5, 6], "def", logprobs=True, reason="abort")], finished=True)],
    ]
    cs = [_comps(w)[0] for w in _roundtrip(steps)]
    assert [len(c["new_lps"]) for c in cs] == [0, 1, 2, 0]
    assert cs[1]["new_lps"] == [{4: (-0.4, 1, "<4>"), 104: (-5.0, 2, "x")}]  # values, no objects
    assert [c["lps_keep"] for c in cs] == [0, 0, 1, 3]
    assert cs[2]["cumulative_logprob"] == pytest.approx(-1.5)
    # and without logprobs none go
    c = _comps(_roundtrip([[_out("b", [_comp([4], "d")])]])[0])[0]
    assert c["new_lps"] is None and c["cumulative_logprob"] is None


def test_delta_metrics_go_when_they_change():
    steps = [
        [_out("a", [_comp([], "")], first_token_time=None)],
        [_out("a", [_comp([1], "a")], first_token_time=2.0)],
        [_out("a", [_comp([1, 2], "ab")], first_token_time=2.0)],
        [_out("a", [_comp([1, 2, 3], "abc")], first_token_time=2.0, cached=16)],
        [_out("a", [_comp([1, 2, 3, 4], "abcd")], first_token_time=2.0, cached=16)],
        [_out("a", [_comp([1, 2, 3, 4], "abcd", reason="length")], True, 2.0, cached=16)],
    ]
    metas = [w[1] for w in _roundtrip(steps)]
    assert [m is None for m in metas] == [False, False, True, False, True, False]
    assert metas[-1] == ((1.0, 1.5, 2.0, 3.0, 3, 16), 16)


def test_delta_prompt_logprobs_go_once():
    """A prompt's logprobs (complete at the first output) go in one message, and every rebuilt
    output after it has them."""
    plp = [None, _lp(7), _lp(8)]
    steps = [
        [dataclasses.replace(_out("a", [_comp([1], "a")]), prompt_logprobs=plp)],
        [dataclasses.replace(_out("a", [_comp([1, 2], "ab")]), prompt_logprobs=plp)],
        [
            dataclasses.replace(
                _out("a", [_comp([1, 2], "ab", reason="stop")], finished=True),
                prompt_logprobs=plp,
            )
        ],
    ]
    wires = _roundtrip(steps)
    assert [w[3] is not None for w in wires] == [True, False, False]


def test_delta_an_id_used_again_or_dropped_starts_afresh():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    _roundtrip([[_out("a", [_comp([1, 2], "ab", reason="stop")], finished=True)]], enc, dec)
    w = _roundtrip([[_out("a", [_comp([3], "c")])]], enc, dec)[0]
    assert (_comps(w)[0]["ids_keep"], _comps(w)[0]["new_ids"]) == (0, [3])
    enc.drop("a")
    dec.drop("a")
    assert enc.sent == {} and dec.state == {}
    w = _roundtrip([[_out("a", [_comp([3, 4], "cd")])]], enc, dec)[0]
    assert (_comps(w)[0]["ids_keep"], _comps(w)[0]["new_ids"]) == (0, [3, 4])
    assert w[1] is not None


def test_the_delta_codec_knows_every_output_field():
    """A field added to the outputs must be carried: revisit paxengine/output_delta.py."""
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    assert names(RequestOutput) == [
        "request_id",
        "prompt",
        "prompt_token_ids",
        "outputs",
        "finished",
        "metrics",
        "num_cached_tokens",
        "prompt_logprobs",
    ]
    assert names(CompletionOutput) == [
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "finish_reason",
        "stop_reason",
    ]
    assert names(Logprob) == ["logprob", "rank", "decoded_token"]
    # RequestMetrics goes as its values in field order, whatever its fields
    m = RequestMetrics(1.0, 2.0, 3.0, 4.0, 5, 6)
    assert RequestMetrics(*vars(m).values()) == m


def _fake_core(stats, background=None, pending=lambda: 0):
    """What _ChildTransport reads of an EngineCore."""
    return SimpleNamespace(
        config=SimpleNamespace(max_waiting_tokens=None),
        stats=stats,
        runner=SimpleNamespace(builder=SimpleNamespace(background=background)),
        pending_executables=pending,
    )


class _Conn:
    """The child's end of the pipe: keeps what is sent, pickled as the pipe pickles it."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, msg) -> None:
        self.sent.append(pickle.dumps(msg))


def _wire(core=None):
    """_ChildTransport and ProcessEngine's reading side (`_restore`) joined by pickled messages
    instead of a process: `through(items)` delivers a step's items and returns (the items on the
    wire, what the front end rebuilt)."""
    core = core or _fake_core(dict)
    conn = _Conn()
    child = _ChildTransport(core, conn)
    front = SimpleNamespace(_prompts={}, _delta=DeltaDecoder())

    def through(items):
        child.deliver(items)
        (raw,) = conn.sent
        conn.sent.clear()
        msg = pickle.loads(raw)
        assert msg[0] == "out"
        return msg[1], [(rid, ProcessEngine._restore(front, rid, d, e)) for rid, d, e in msg[1]]

    return child, front, through


def test_each_step_rebuilt_on_the_front_end_equals_the_engines_output(core):
    reqs = {
        **E2E,
        "s": (
            PROMPTS[2],
            SamplingParams(
                temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True, logprobs=1
            ),
        ),
        "gone": (PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True)),
    }
    child, front, through = _wire(core)
    for rid, (prompt, params) in reqs.items():
        core.add_request(rid, prompt, params)
        text, ids = core.tokenize_prompt(prompt)
        front._prompts[rid] = {"prompt": text, "prompt_token_ids": ids}
    got, want, steps = [], [], 0
    sent_ids = sent_lps = 0
    while core.has_unfinished():
        items = [(out.request_id, out) for out in core.step()]
        steps += 1
        if steps == 4:  # as core_loop ends a request whose consumer left
            out = core.abort("gone")
            out.finished = True
            items.append(("gone", out))
        up, rebuilt = through(items)
        assert rebuilt == items  # the prompt back, every field equal
        for _, delta, _ in up:
            sent_ids += sum(len(c[2]) for c in delta[2])
            sent_lps += sum(len(c[6]) for c in delta[2] if c[6] is not None)
        got += [x for _, x in rebuilt]
        want += [copy.deepcopy(x) for _, x in items]
    assert got == want
    final = {x.request_id: x for x in want if x.finished}
    assert set(final) == set(reqs)
    assert final["r0"].outputs[0].stop_reason == " 6," and final["gone"].finished
    # each token id and logprob entry crossed once
    assert sent_ids == sum(len(c.token_ids) for x in final.values() for c in x.outputs)
    assert sent_lps == sum(len(c.logprobs or ()) for x in final.values() for c in x.outputs) > 0
    assert child._delta.sent == {} and front._delta.state == {} and front._prompts == {}


def test_an_idle_child_sends_counters_that_moved():
    """The background's builds count step_executables_pending down while no step runs: the
    front end's stats (a scrape's) must follow without a request."""
    stats = {"step_executables_pending": 5}
    core = _fake_core(stats.copy)
    conn = _Conn()
    conn.poll = lambda timeout=0: False  # nothing comes down
    child = _ChildTransport(core, conn)
    assert child.take(block=True) == [] and len(conn.sent) == 1  # the first look: sent
    assert pickle.loads(conn.sent[-1])[2] == {"step_executables_pending": 5}
    child.take(block=True)
    child.take(block=False)  # a busy loop's look never sends on its own
    assert len(conn.sent) == 1  # nothing moved: nothing sent
    stats["step_executables_pending"] = 0
    child.take(block=False)
    assert len(conn.sent) == 1
    child.take(block=True)
    assert len(conn.sent) == 2
    assert pickle.loads(conn.sent[-1])[:2] == ("out", [])
    assert pickle.loads(conn.sent[-1])[2] == {"step_executables_pending": 0}


def test_the_child_freezes_its_heap_once_the_background_is_done(monkeypatch):
    """Once the background's builds are in (and run once), an idle child collects and freezes
    the heap they left, once; never while busy or before they are done."""
    import paxengine.engine_process as ep

    frozen = []
    monkeypatch.setattr(ep, "freeze_heap", lambda: frozen.append(1))
    pending = [3]
    core = _fake_core(dict, background=object(), pending=lambda: pending[0])
    conn = _Conn()
    conn.poll = lambda timeout=0: False
    child = _ChildTransport(core, conn)
    child.take(block=True)
    assert frozen == []  # still building
    pending[0] = 0
    child.take(block=False)
    assert frozen == []  # busy
    child.take(block=True)
    child.take(block=True)
    assert frozen == [1]
    # without a background (everything built before ready) the start-up froze it already
    child = _ChildTransport(_fake_core(dict), conn)
    child.take(block=True)
    assert frozen == [1]


def test_errors_and_aborts_end_the_state_on_both_sides():
    child, front, through = _wire()
    front._prompts.update({r: {"prompt": r, "prompt_token_ids": [9]} for r in "abc"})
    _, got = through([(r, _out(r, [_comp([1], "x")])) for r in "abc"])
    assert [x.prompt for _, x in got] == ["a", "b", "c"]
    assert set(child._delta.sent) == set(front._delta.state) == {"a", "b", "c"}
    # a step fails: what it made before goes first, then the error ends the request
    up, got = through(
        [
            ("a", _out("a", [_comp([1, 2], "xy")])),
            ("a", StepFailed("the device step failed", ["a"])),
            ("b", InvalidRequest("bad", param="n")),
        ]
    )
    assert up[1][1] is None and up[1][2][0] == "StepFailed"
    assert got[0][1].outputs[0].token_ids == [1, 2]
    assert isinstance(got[1][1], StepFailed) and isinstance(got[2][1], InvalidRequest)
    assert got[2][1].param == "n"
    assert set(child._delta.sent) == set(front._delta.state) == set(front._prompts) == {"c"}
    # an abort's output (finished) ends the last one
    _, got = through([("c", _out("c", [_comp([1, 2], "xy", reason="abort")], finished=True))])
    assert got[0][1].finished and got[0][1].outputs[0].token_ids == [1, 2]
    assert child._delta.sent == {} and front._delta.state == {} and front._prompts == {}


def test_bad_input_is_refused_at_generate_and_the_engine_runs_on(engine):
    async def main():
        await engine.start()
        with pytest.raises(InvalidRequest, match="top_p"):
            engine.generate("bad1", "hi", SamplingParams(top_p=0))
        with pytest.raises(InvalidRequest, match="priority"):
            engine.generate("bad2", "hi", SamplingParams(priority=1))
        with pytest.raises(InvalidRequest) as e:  # compiled on this side, before any output
            engine.generate(
                "bad3", "hi", SamplingParams(structured_outputs=StructuredOutputs(regex="(("))
            )
        assert e.value.param == "regex"
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            engine.generate("bad4", [10**7], SamplingParams())
        # a constraint that compiles runs in the child, which compiles it again
        choice = SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=["yes", "no"])
        )
        outs = await _collect(engine, "ok", "Is the sky blue?", choice)
        assert outs[-1].outputs[0].text in ("yes", "no")
        assert await engine.reset_prefix_cache() is True

    asyncio.run(main())
    assert engine.is_healthy()


def test_a_consumer_that_leaves_frees_its_blocks(engine):
    async def main():
        await engine.start()
        gen = engine.generate("gone", "Tell me a story", SamplingParams(max_tokens=100))
        for _ in range(2):
            await gen.__anext__()
        assert "gone" in engine._delta.state  # its outputs so far, on this side
        await gen.aclose()
        for _ in range(200):
            stats = engine.stats()
            if stats["kv_cache_usage_perc"] == 0 and stats["num_requests_running"] == 0:
                if "gone" not in engine._delta.state:  # the abort's output, read after stats
                    break
            await asyncio.sleep(0.05)
        assert engine.stats()["kv_cache_usage_perc"] == 0
        assert engine.stats()["num_requests_running"] == 0
        assert "gone" not in engine._prompts
        assert engine._delta.state == {}  # the abort's (finished) output freed it

    asyncio.run(main())


def test_beam_search_over_the_engine_process(engine, core):
    """The server's beam search (paxengine/beam_search.py) over the child's `generate`: the
    same beams as over the engine in this process."""
    from paxengine.async_engine import AsyncEngine
    from paxengine.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=5)
    ids = core.tokenize_prompt(PROMPTS[1])[1]

    async def search(e, rid):
        await e.start()  # (idempotent) so the test also runs alone
        return [out async for out in e.beam_search(rid, ids, params)]

    async def here():
        local = AsyncEngine(core=core)
        await local.start()
        try:
            return await search(local, "beam-here")
        finally:
            await local.shutdown()

    (want,) = asyncio.run(here())
    (got,) = asyncio.run(search(engine, "beam-child"))
    assert got.finished and len(got.outputs) == 2
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert [o.text for o in got.outputs] == [o.text for o in want.outputs]
    for g, w in zip(got.outputs, want.outputs):
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)


def test_a_dead_child_is_visible_and_nobody_waits(engine):
    """Last in this module: it kills the engine's process."""

    async def main():
        await engine.start()
        gen = engine.generate("long", "Tell me a story", SamplingParams(max_tokens=100))
        await gen.__anext__()
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDead):
            async for _ in gen:
                pass
        for _ in range(100):
            if not engine.is_healthy():
                break
            await asyncio.sleep(0.05)
        assert not engine.is_healthy()
        engine._reader.join(5)
        assert engine._delta.state == {} and engine._prompts == {}  # dropped with the engine
        with pytest.raises(EngineDead):
            engine.generate("after", "hi", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDead):
            await engine.reset_prefix_cache()
        t0 = time.monotonic()
        await engine.shutdown()  # returns at once: the child is gone
        assert time.monotonic() - t0 < 10

    asyncio.run(main())


def test_a_failed_start_up_raises_its_error_here(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        ProcessEngine(model=str(missing), show_progress=False)


def test_serve_refuses_engine_process_where_it_does_not_apply(caplog):
    from serving.cli import main

    assert main(["--engine-process", "--data-parallel-size", "2"]) == 2
    assert "--engine-process runs one engine" in caplog.text
