"""Start-up with background compilation (EngineConfig.background_compile): the engine serves once
the first buckets are built, steps whose bucket is still missing run in a larger built one, and
every output equals that of an engine with every bucket built before it served."""

import threading

import jax
import pytest

import paxengine.step_build as step_build
from paxengine import LLM, SamplingParams
from paxengine.step_build import StepBuilder, compiles_after_warmup, first_buckets

ENGINE = dict(
    model="dummy:tiny",
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets=[16, 32, 64],
    seq_buckets=[2, 8],
    num_kv_blocks=64,
    structured_outputs=False,
    store_executables=False,
    show_progress=False,
)
# prompts of 3 to 40 tokens (steps in every token bucket), greedy and seeded sampling
PROMPTS = [list(range(5, 5 + n)) for n in (3, 9, 17, 40, 6, 25)]
PARAMS = [
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.8, seed=3),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7, seed=11, logprobs=2),
]


def _run(llm):
    outs = []
    for params in PARAMS:
        outs += [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outs


def test_first_buckets_hold_every_step():
    tb = [1, 16, 64, 256, 320, 384, 512, 1024, 2048, 4096, 8192]
    sb = [8, 64, 256, 512]
    from paxengine.batch import bucket_pairs

    pairs = bucket_pairs(tb, sb)
    first = first_buckets(pairs, tb, sb)
    assert first == [(16, 8), (64, 64), (256, 256), (512, 512), (8192, 512)]
    assert (tb[-1], sb[-1]) in first  # whatever a step holds, one of them holds it


def test_serves_before_the_background_is_done_and_gives_the_same_tokens(monkeypatch):
    gate = threading.Event()
    build_later = StepBuilder._build_later

    def held(self, jobs):  # the background waits until the test lets it go
        gate.wait(120)
        build_later(self, jobs)

    monkeypatch.setattr(StepBuilder, "_build_later", held)
    # samplers are shared by every runner of the process: ones an earlier test built for these
    # shapes would be there before the background built them
    monkeypatch.setattr(step_build, "_SAMPLERS", {})
    llm = LLM(**ENGINE, background_compile=True)
    r = llm.engine.runner
    try:
        first = set(
            first_buckets(r.builder.planned, ENGINE["token_buckets"], ENGINE["seq_buckets"])
        )
        assert set(r.compiled) == first != set(r.builder.planned)
        missing_samplers = [
            (S, f)
            for S in ENGINE["seq_buckets"]
            for f in r.sampler_flags
            if (S, f) not in r.samplers
        ]
        # prompt logprobs: the largest token bucket's now, the others in the background
        tb = ENGINE["token_buckets"]
        assert set(r.plp_compiled) == {tb[-1]}
        pending = llm.engine.stats()["step_executables_pending"]
        missing = len(set(r.builder.planned) - first) + len(missing_samplers) + len(tb) - 1
        assert pending == missing > 0
        assert r.bucket_for(17, 2, prompt_logprobs=True)[0] == tb[-1]
        cheap, full = min(r.sampler_flags, key=sum), max(r.sampler_flags, key=sum)
        assert r.available_flags(2) == [cheap, full]
        T, S = r.bucket_for(17, 2)  # (32, 2) is not built yet: a larger built bucket holds it
        assert (T, S) in r.compiled and T >= 17 and S >= 2 and (32, 2) not in r.compiled
        before = _run(llm)
    finally:
        gate.set()
    assert r.builder.wait_background(300)
    assert set(r.compiled) == set(r.builder.planned)
    assert set(r.plp_compiled) == set(ENGINE["token_buckets"])
    assert llm.engine.stats()["step_executables_pending"] == 0
    assert r.available_flags(2) == r.sampler_flags
    # the background's planned compiles are start-up work, not recompiles
    assert compiles_after_warmup() == 0
    after = _run(llm)
    assert compiles_after_warmup() == 0

    ref = LLM(**ENGINE)  # every bucket built before it serves
    assert ref.engine.runner.builder.background is None
    assert before == after == _run(ref)


def test_background_compile_is_off_offline_and_on_for_the_server():
    from paxengine.config import EngineConfig
    from serving.cli import parse

    assert EngineConfig().background_compile is False  # LLM: every bucket before the first step
    ecfg, _ = parse(["--model", "dummy:tiny"])
    assert ecfg.background_compile is True
    ecfg, _ = parse(["--model", "dummy:tiny", "--performance-mode", "throughput"])
    assert ecfg.background_compile is True


@pytest.mark.parametrize(
    "flag,value", [("--background-compile", True), ("--no-background-compile", False)]
)
def test_serve_flag(flag, value):
    from serving.cli import parse

    ecfg, _ = parse(["--model", "dummy:tiny", flag])
    assert ecfg.background_compile is value


def test_overlapping_cache_bypasses_end_with_the_last():
    """A background build and another replica's foreground build overlap: the first to end must
    not turn JAX's cache back on under the other."""
    import jax

    from paxengine.executables import bypassing_jax_cache

    saved = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        a, b = bypassing_jax_cache(), bypassing_jax_cache()
        a.__enter__()
        b.__enter__()
        assert not jax.config.jax_enable_compilation_cache
        a.__exit__(None, None, None)  # ends first, not nested
        assert not jax.config.jax_enable_compilation_cache
        b.__exit__(None, None, None)
        assert jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)


def test_background_order_takes_chained_steps_and_samplers_of_equal_shape():
    # a chained (16, 16) and a sampler of S=16 once compared (16,) < (flags,): the server's
    # start-up with --speculative-config died there (issue #53)
    from paxengine.step_build import background_order

    jobs = [
        (("fwd", 16, 16), None),
        (("smp", 16, (0, 1, 0, 0)), None),
        (("chn", 16, 16), None),
        (("smp", 16, (0, 0, 0, 0)), None),
    ]
    keys = [j[0] for j in sorted(jobs, key=background_order)]
    assert keys[-1] == ("fwd", 16, 16)
    assert keys[:3] == [("chn", 16, 16), ("smp", 16, (0, 0, 0, 0)), ("smp", 16, (0, 1, 0, 0))]


def test_ngram_speculation_starts_with_background_compile():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    # a chained step of one request (5 rows) runs in (16, 16), beside the samplers of S = 16
    engine = dict(ENGINE, max_num_seqs=16, seq_buckets=[4, 16])
    llm = LLM(**engine, background_compile=True, speculative_config=spec)
    assert llm.engine.runner.builder.wait_background(300)
    ref = LLM(**engine, speculative_config=spec)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]


def test_exit_drops_the_queued_background_builds(monkeypatch, caplog):
    """A process exiting while its background compiles are queued (a stopped server) cancels
    the queue at interpreter exit, before concurrent.futures joins its workers: each running
    compile ends, the others never start (before, every queued bucket was built first: a
    data-parallel server took 33 s to exit on a CPU)."""
    monkeypatch.setattr(step_build, "_SAMPLERS", {})
    monkeypatch.setattr(step_build.os, "cpu_count", lambda: 2)  # one worker: a queue behind it
    engine = dict(ENGINE, max_num_batched_tokens=512, token_buckets=None, seq_buckets=[2, 8])
    llm = LLM(**engine, background_compile=True)
    builder = llm.engine.runner.builder
    try:
        step_build._drop_background_builds()  # what the interpreter's exit hooks call
        assert builder.wait_background(120)
        assert builder.pending > 0  # queued builds were cancelled, not run
        assert "failed" not in caplog.text  # quietly: the process is exiting
    finally:
        step_build._EXITING.clear()


def test_a_failed_compile_names_its_step_executable(monkeypatch):
    """An executable XLA cannot build (on the GPU: a kernel over the shared memory, only at
    the default buckets) stops the start-up with the bucket it was compiling named."""
    from jax import stages

    def fail(self, *args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")

    monkeypatch.setattr(stages.Lowered, "compile", fail)
    with pytest.raises(RuntimeError, match="Shared memory") as failed:
        LLM(**ENGINE)
    assert any("compiling the step executable" in n for n in failed.value.__notes__)


def test_background_compiles_never_run_beside_a_step(monkeypatch):
    """Every background compile takes its turn on the device (device_turns): XLA's autotuning
    beside a step's temporaries ran a GPU out of memory at a server's cold start."""
    from contextlib import contextmanager

    from paxengine import device_turns, engine, runner

    class Recording(device_turns.DeviceTurns):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()
            self.now = {"step": 0, "compile": 0}
            self.entered = {"step": 0, "compile": 0}
            self.overlaps = 0

        @contextmanager
        def _watch(self, kind, other, ctx):
            with ctx:
                with self.lock:
                    self.now[kind] += 1
                    self.entered[kind] += 1
                    self.overlaps += self.now[other] > 0
                try:
                    yield
                finally:
                    with self.lock:
                        self.now[kind] -= 1

        def step(self):
            return self._watch("step", "compile", super().step())

        def compile(self):
            return self._watch("compile", "step", super().compile())

    turns = Recording()
    for module in (runner, step_build, engine):
        monkeypatch.setattr(module, "TURNS", turns)
    monkeypatch.setattr(step_build, "_SAMPLERS", {})
    llm = LLM(**ENGINE, background_compile=True, prime_steps=True)
    r = llm.engine.runner
    pending = r.builder.pending
    assert pending > 0
    _run(llm)  # steps while the background compiles
    assert r.builder.wait_background(300)
    assert turns.entered["compile"] == pending  # each background compile took its turn
    assert turns.entered["step"] > 0 and turns.overlaps == 0


def test_a_compile_out_of_device_memory_is_built_again_by_itself(monkeypatch, caplog):
    """XLA autotunes on the device while it compiles; eight compiles side by side outgrew the
    memory the KV plan leaves (Qwen3.5-9B at 0.92 of an H100). Such a compile is built again
    alone once the others are done, in the foreground and the background; one that runs out
    alone too is built without autotuning (and not stored); the engine serves the tokens of one
    that never ran out."""
    from jax import stages

    compile_ = stages.Lowered.compile
    failed, calls, untuned = {}, [0], []

    def sometimes_out_of_memory(self, *args, **kwargs):
        calls[0] += 1
        opts = args[0] if args else kwargs.get("compiler_options")
        if opts and opts.get("xla_gpu_autotune_level") == 0:
            untuned.append(id(self))
        elif calls[0] % 5 == 1 and id(self) not in failed or failed.get(id(self)) == "twice":
            # the first to fail fails alone too
            failed[id(self)] = "twice" if not failed else "once"
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.91GiB"
            )
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(step_build, "_SAMPLERS", {})
    monkeypatch.setattr(stages.Lowered, "compile", sometimes_out_of_memory)
    with caplog.at_level("WARNING", logger="paxengine"):
        llm = LLM(**ENGINE, background_compile=True)
        foreground = len(failed)
        assert llm.engine.runner.builder.wait_background(300)
    assert foreground >= 1 and len(failed) > foreground  # in both
    assert caplog.text.count("again by itself") == len(failed)
    assert caplog.text.count("without autotuning") == 1 and len(untuned) == 1
    r = llm.engine.runner
    assert set(r.compiled) == set(r.builder.planned)
    got = _run(llm)
    monkeypatch.setattr(stages.Lowered, "compile", compile_)
    assert got == _run(LLM(**ENGINE))
