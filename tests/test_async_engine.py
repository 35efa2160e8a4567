"""AsyncEngine: streaming outputs, abort by the consumer, and a dead loop that is visible."""

import asyncio

import pytest
from engines import TINY

from paxengine import AsyncEngine, EngineDead, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return AsyncEngine(**TINY)


def test_a_slow_reader_holds_one_output(engine):
    """Nobody reads while the request runs to its end: its outputs coalesce (memory stays
    bounded for a slow client), and the reader then gets the final one alone."""

    async def main():
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        gen = engine.generate("slow", "Count: 1, 2,", params)
        box = engine._streams["slow"][1]
        # until the final output is in the mailbox (up to 60 s: a cold start's compiles on a
        # loaded 2-core machine took longer than 12 s). Not until the engine drops the request:
        # its last delivery reaches the event loop after that, and a reader then came early.
        for _ in range(3000):
            if box._end is not None:
                break
            await asyncio.sleep(0.02)
        outs = [out async for out in gen]
        assert len(outs) == 1 and outs[0].finished
        assert len(outs[0].outputs[0].token_ids) == 24

    asyncio.run(main())


def test_waiting_prompt_tokens_are_bounded(engine):
    from paxengine import EngineOverloaded

    engine.config.max_waiting_tokens = 150
    try:
        engine._admit(1, 100)  # nothing waits: admitted even over the bound
        with pytest.raises(EngineOverloaded, match="prompt tokens are waiting"):
            engine._admit(1, 100)
        engine._admit(1, 50)  # fits beside the first
    finally:
        engine._posted -= 2
        engine._posted_tokens -= 150
        engine.config.max_waiting_tokens = None


def test_stream_abort_and_dead_loop(engine):
    async def main():
        await engine.start()
        assert engine.is_healthy()
        texts = []
        async for out in engine.generate(
            "a", "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=8)
        ):
            texts.append(out.outputs[0].text)
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
        # the consumer walks away after two outputs: the request is aborted, its blocks freed
        gen = engine.generate("b", "Tell me a story", SamplingParams(max_tokens=100))
        for _ in range(2):
            await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if engine.stats()["kv_cache_usage_perc"] == 0 and not engine.core.has_unfinished():
                break
            await asyncio.sleep(0.05)
        assert engine.stats()["kv_cache_usage_perc"] == 0
        with pytest.raises(ValueError, match="top_p"):
            async for _ in engine.generate("c", "hi", SamplingParams(top_p=0)):
                pass

        # a loop that dies says so: health goes false and waiting callers get an error
        def boom():
            raise RuntimeError("device lost")

        engine.core.step = boom
        with pytest.raises(EngineDead):
            async for _ in engine.generate("d", "hi", SamplingParams(max_tokens=4)):
                pass
        assert not engine.is_healthy()
        await engine.shutdown()

    asyncio.run(main())
