"""Priming (EngineConfig.prime_steps, StepBuilder.prime): before serving, every compiled forward and
every sampler variant runs once on an all-padding batch, and those the background builds later
run while the server idles. It must run each of them, write nothing to the KV cache, leave no
previous-step samples behind, and change no output."""

import asyncio
import logging
import re
import threading
import time

import jax
import numpy as np
import pytest
from test_background_compile import ENGINE as BACKGROUND_ENGINE
from test_background_compile import PROMPTS

from paxengine import LLM, AsyncEngine, SamplingParams, kv_memory
from paxengine.step_build import StepBuilder

# the background-compile tests' engine, with the grammar samplers (structured outputs) on
ENGINE = {**BACKGROUND_ENGINE, "structured_outputs": True}
PARAMS = [
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0, presence_penalty=0.5),
]


def _run(llm):
    outs = []
    for params in PARAMS:
        outs += [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outs


@pytest.fixture(scope="module")
def unprimed():
    return LLM(**ENGINE, prime_steps=False)


def test_runs_every_executable_once_and_writes_no_kv(unprimed):
    r = unprimed.engine.runner
    calls = {}

    def counted(name, fn):
        def run(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        return run

    saved = dict(r.compiled), dict(r.samplers), dict(r.plp_compiled)
    r.compiled = {k: counted(("fwd", *k), f) for k, f in r.compiled.items()}
    r.samplers = {k: counted(("smp", *k), f) for k, f in r.samplers.items()}
    r.plp_compiled = {k: counted(("plp", k), f) for k, f in r.plp_compiled.items()}
    r.prev_tokens = r.prev_tokens + 7  # a previous step's samples: priming must clear them
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(r.kv_cache)]
    r.builder._primed.clear()
    try:
        ran, _ = r.builder.prime()
    finally:
        r.compiled, r.samplers, r.plp_compiled = saved
    forwards = {k for k in calls if k[0] == "fwd"}
    samplers = {k for k in calls if k[0] == "smp"}
    assert forwards == {("fwd", *k) for k in r.compiled}
    assert samplers == {("smp", *k) for k in r.samplers}
    assert len(r.samplers) > len(r.seq_buckets)  # several flag variants per sequence bucket
    # each run is one forward and one sampler: every forward with the plainest sampler, the
    # other sampler variants after their sequence bucket's smallest forward
    expected = len(r.compiled) + len(r.samplers) - len(r.seq_buckets)
    assert ran == expected == sum(calls[k] for k in forwards) == sum(calls[k] for k in samplers)
    # each prompt-logprob executable once, after a forward of its token bucket
    assert {k for k in calls if k[0] == "plp"} == {("plp", T) for T in r.token_buckets}
    assert all(calls[("plp", T)] == 1 for T in r.token_buckets)
    total = len(r.compiled) + len(r.samplers) + len(r.plp_compiled)
    assert r.builder.num_primed == total and not r.builder.unprimed()
    assert r.builder.prime()[0] == 0  # all ran already
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(r.kv_cache)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert not np.asarray(r.prev_tokens).any()


def test_primed_engine_gives_the_same_tokens(unprimed, caplog):
    with caplog.at_level(logging.INFO, logger="paxengine"):
        primed = LLM(**ENGINE, prime_steps=True)
    assert primed.engine.runner.builder.num_primed > 0
    assert _run(primed) == _run(unprimed)
    # before priming, the start-up log measures the KV plan's margin: the largest temporaries
    # of each kind of executable (XLA's buffer assignment, on the CPU too) against the reserve
    said = [r.getMessage() for r in caplog.records if "temporaries" in r.getMessage()]
    kinds = [m.split(" temporaries")[0].removeprefix("largest ") for m in said]
    assert kinds == ["forward", "prompt-logprob", "sampler"], said
    assert all("activation reserve 4.29 GB" in m for m in said), said


def test_default_is_on_only_on_a_gpu(unprimed):
    from paxengine.config import EngineConfig

    assert EngineConfig().prime_steps is None
    auto = LLM(**ENGINE)  # this machine has no GPU: nothing is primed
    assert auto.engine.runner.builder.num_primed == 0


@pytest.mark.parametrize("flag,value", [("--prime-steps", True), ("--no-prime-steps", False)])
def test_serve_flag(flag, value):
    from serving.cli import parse

    ecfg, _ = parse(["--model", "dummy:tiny", flag])
    assert ecfg.prime_steps is value


def test_background_built_steps_run_while_the_server_idles(monkeypatch):
    gate = threading.Event()
    build_later = StepBuilder._build_later

    def held(self, jobs):  # the background waits until the test lets it go
        gate.wait(120)
        build_later(self, jobs)

    monkeypatch.setattr(StepBuilder, "_build_later", held)
    engine = AsyncEngine(**ENGINE, prime_steps=True, background_compile=True)
    core, r = engine.core, engine.core.runner
    assert (
        not r.builder.unprimed() and 0 < r.builder.num_primed
    )  # the first buckets ran before serving
    waiting = core.stats()["step_executables_pending"]
    assert waiting == r.builder.pending > 0  # to build
    gate.set()
    assert r.builder.wait_background(300) and r.builder.unprimed()
    assert core.stats()["step_executables_pending"] == waiting  # built now, but not run once
    core.groups["busy"] = None  # a request in the engine: nothing is primed now
    try:
        assert core.prime_idle() is False and r.builder.unprimed()
    finally:
        del core.groups["busy"]

    async def main():
        await engine.start()
        for _ in range(600):  # the idle loop runs them, a few at a time
            if not r.builder.unprimed():
                break
            await asyncio.sleep(0.05)
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
        outs = [o async for o in engine.generate("after", PROMPTS[3], params)]
        await engine.shutdown()
        return outs[-1].outputs[0].token_ids

    started = time.monotonic()
    tokens = asyncio.run(main())
    assert not r.builder.unprimed(), f"still unprimed after {time.monotonic() - started:.1f} s"
    assert core.stats()["step_executables_pending"] == 0
    ref = LLM(**ENGINE, prime_steps=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    assert tokens == ref.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids


def test_running_out_of_memory_while_priming_says_what_to_change(monkeypatch):
    """An OOM in the start-up runs means the KV plan left too little for the steps: the error
    names the knobs; any other runtime error passes through as it is."""

    def oom(self, limit=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes")

    monkeypatch.setattr(StepBuilder, "prime", oom)
    with pytest.raises(RuntimeError, match="PAXENGINE_ACTIVATION_RESERVE") as info:
        LLM(**ENGINE, prime_steps=True)
    assert "KV blocks" in str(info.value) and "RESOURCE_EXHAUSTED" in str(info.value.__cause__)
    # what the compiled steps' temporaries measured, and a reserve above them and the plan's
    said = re.search(
        r"largest temporaries are ([\d.]+) GB \((\w+).*ACTIVATION_RESERVE=(\d+)", str(info.value)
    )
    assert said and said[2] in ("forward", "sampler", "prompt"), str(info.value)
    assert int(said[3]) >= max(1.25 * float(said[1]) * 1e9, kv_memory.activation_reserve(64))

    def other(self, limit=None):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(StepBuilder, "prime", other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        LLM(**ENGINE, prime_steps=True)
