"""ProcessEngine: the engine in a process of its own gives what the in-process engine gives,
refuses bad input at `generate` as AsyncEngine does, and a child that dies is visible."""

import asyncio
import os
import signal
import time

import pytest

from paxengine import EngineDead, InvalidRequest, SamplingParams
from paxengine.engine import EngineCore
from paxengine.engine_process import ProcessEngine
from paxengine.structured import StructuredOutputs

CONFIG = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    show_progress=False,
    token_buckets=[16, 32],
    seq_buckets=[4],
)
PROMPTS = ["Count: 1, 2, 3,", "The capital of France is", "Tell me a story"]


@pytest.fixture(scope="module")
def engine():
    e = ProcessEngine(**CONFIG)
    yield e
    if e._proc.is_alive():
        e._proc.kill()


async def _collect(engine, rid, prompt, params):
    return [out async for out in engine.generate(rid, prompt, params)]


def test_same_tokens_as_the_engine_in_this_process(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    core = EngineCore(**CONFIG)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, params)
    want = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                want[out.request_id] = out

    async def main():
        await engine.start()
        runs = [_collect(engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*runs)

    for i, outs in enumerate(asyncio.run(main())):
        final, ref = outs[-1], want[f"r{i}"]
        assert final.finished and final.outputs[0].token_ids == ref.outputs[0].token_ids
        assert final.outputs[0].text == ref.outputs[0].text
        # the prompt came back on this side, though the child sends outputs without it
        assert final.prompt == PROMPTS[i] and final.prompt_token_ids == ref.prompt_token_ids
        texts = [o.outputs[0].text for o in outs]
        assert all(texts[j + 1].startswith(texts[j]) for j in range(len(texts) - 1))
    assert engine._posted == 0 and engine._posted_tokens == 0  # every add was counted taken
    assert engine.stats()["generation_tokens"] == 12 * len(PROMPTS)


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
        await gen.aclose()
        for _ in range(200):
            stats = engine.stats()
            if stats["kv_cache_usage_perc"] == 0 and stats["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats()["kv_cache_usage_perc"] == 0
        assert engine.stats()["num_requests_running"] == 0
        assert "gone" not in engine._prompts

    asyncio.run(main())


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
