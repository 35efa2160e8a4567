"""The offline stages: paxengine's `LLM` and vLLM's on the same workloads. Both engines are
measured through one function each, `gen(requests) -> output lengths`, so the inter-token
latency and throughput are the same arithmetic for both:

  ITL: (time of a generate of n2 output tokens - one of n1) / (n2 - n1), all decode steps and
  their scheduling included, median of the spec's reps, per batch size;
  throughput: output tokens / wall time of one generate call per workload.

For an A/B that needs only some rows: GPU_BENCH_ITL_BATCHES (comma list, "" for none) and
GPU_BENCH_OFFLINE (workload names separated by ";": the names hold commas) narrow the spec.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from benchmarks.bench.datasets import random_dataset
from benchmarks.gpu.dummy_model import stage_model_dir
from benchmarks.gpu.stage import log, save_partial, seconds_left
from benchmarks.gpu.workloads import engine_args, pax_model, vocab_size, with_model


def itl(gen, spec, vocab: int) -> dict:
    """ITL for each batch size: (t(n2) - t(n1)) / (n2 - n1), median of reps, fresh prompts."""
    w = spec["itl"]
    res = {}
    seed = 100
    batches = w["batches"]
    if "GPU_BENCH_ITL_BATCHES" in os.environ:
        batches = [int(b) for b in os.environ["GPU_BENCH_ITL_BATCHES"].split(",") if b]
    for b in batches:
        vals = []
        for _ in range(w["reps"]):
            times = {}
            for n in (w["n1"], w["n2"]):
                seed += 1
                reqs = random_dataset(b, w["input_len"], n, vocab_size=vocab, seed=seed)
                t = time.perf_counter()
                outs = gen(reqs)
                times[n] = time.perf_counter() - t
                assert sum(outs) == b * n, f"asked {b * n} tokens, got {sum(outs)}"
            vals.append((times[w["n2"]] - times[w["n1"]]) / (w["n2"] - w["n1"]))
        res[f"itl_batch{b}_ms"] = 1e3 * statistics.median(vals)
        res[f"itl_batch{b}_all_ms"] = [1e3 * v for v in vals]
        log(f"batch-{b} ITL {res[f'itl_batch{b}_ms']:.2f} ms")
        save_partial(**res)
    return res


def offline(gen, spec, vocab: int, stats=None) -> dict:
    """Output tok/s of each offline workload, n x (input, output) in one generate call; a
    workload projected to overrun the stage's deadline is skipped. stats: a callable giving
    engine counters (steps, preemptions), recorded per workload."""
    res = {}
    rate = None  # output tok/s of the last workload, to project the next one's duration
    only = os.environ.get("GPU_BENCH_OFFLINE")
    for k, w in enumerate(spec["offline"]):
        if only is not None and w["name"] not in only.split(";"):
            continue
        left = seconds_left()
        if rate and left is not None:
            projected = 1.2 * w["num_prompts"] * w["output_len"] / rate + 5
            left -= 15
            if projected > left:
                res[w["name"]] = {
                    "skipped": f"projected {projected:.0f} s at {rate:,.0f} tok/s; "
                    f"{left:.0f} s left in this stage"
                }
                log(f"offline {w['name']}: skipped, {res[w['name']]['skipped']}")
                save_partial(offline=dict(res))
                continue
        reqs = random_dataset(
            w["num_prompts"], w["input_len"], w["output_len"], vocab_size=vocab, seed=1000 + k
        )
        log(f"offline {w['name']} ...")
        before = stats() if stats else None
        t = time.perf_counter()
        outs = gen(reqs)
        el = time.perf_counter() - t
        n_out = sum(outs)
        n_in = sum(r.prompt_len for r in reqs)
        assert n_out == w["num_prompts"] * w["output_len"], f"output tokens {n_out}"
        res[w["name"]] = {
            "elapsed_s": el,
            "requests_per_s": len(reqs) / el,
            "output_tok_s": n_out / el,
            "total_tok_s": (n_in + n_out) / el,
        }
        if stats:
            after = stats()
            steps = after["steps"] - before["steps"]
            res[w["name"]].update(
                steps=steps,
                mean_step_ms=1e3 * el / max(steps, 1),
                preemptions=after["num_preemptions"] - before["num_preemptions"],
            )
        log(f"offline {w['name']}: {n_out / el:,.0f} output tok/s ({el:.1f} s)")
        save_partial(offline=dict(res))
        rate = n_out / el
    return res


def stage_pax_offline(
    spec: dict, out: Path, variant: str | None = None, model: str | None = None
) -> dict:
    """paxengine's `LLM` at its defaults; variant: one of the spec's "variants" ("fp8"); model:
    one of its "models" ("qwen35") instead of the preset."""
    from benchmarks.bench.throughput import greedy_params, token_prompts
    from benchmarks.measure import CompileCounter
    from paxengine import LLM
    from paxengine.config import EngineConfig
    from paxengine.memory_plan import temporaries_by_kind

    spec = with_model(spec, model)
    args = engine_args(spec, variant)
    cfg = EngineConfig(model=pax_model(spec), dtype=spec["dtype"], **args)
    t = time.perf_counter()
    llm = LLM(config=cfg)
    startup = time.perf_counter() - t
    kv = llm.engine.kv
    log(
        f"paxengine started in {startup:.1f} s ({llm.engine.info.weight_dtype} weights, "
        f"a KV cache of {kv.num_blocks * kv.block_size:,} tokens)"
    )
    save_partial(
        startup_s=startup,
        engine_stats=llm.engine.stats(),
        engine_args=args,
        kv_block_size=kv.block_size,
        kv_blocks=kv.num_blocks,
    )
    vocab = vocab_size(spec)

    def gen(reqs):
        outs = llm.generate(token_prompts(reqs), greedy_params(reqs), use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    gen(random_dataset(4, 64, 8, vocab_size=vocab, seed=7))  # warm-up (untimed)
    compiles = CompileCounter()
    res = {"startup_s": startup, "kv_block_size": kv.block_size, "kv_blocks": kv.num_blocks}
    res.update(itl(gen, spec, vocab))
    save_partial(jax_compiles_during_timed_runs=compiles.n)
    res["offline"] = offline(gen, spec, vocab, llm.engine.stats)
    res["jax_compiles_during_timed_runs"] = compiles.n
    res.update(device_memory())  # the KV plan's margin after every workload ran
    # what the activation reserve must hold, by XLA's buffer assignment, per kind of executable
    temps = temporaries_by_kind(llm.engine.runner)
    if temps:
        res["step_temp"] = {kind: [size, str(key)] for kind, (size, key) in temps.items()}
    return res


def device_memory() -> dict:
    """The allocator's peak, pool and bytes in use on the first device, and the live arrays'
    bytes (weights, KV, engine state; the rest in use is the runtime's own), where it keeps them."""
    import jax

    from paxengine.kv_memory import live_bytes, pool_peak

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    keys = {
        "peak_bytes_in_use": "device_peak_bytes",
        "bytes_limit": "device_pool_bytes",
        "bytes_in_use": "device_bytes_in_use",
    }
    out = {name: stats[k] for k, name in keys.items() if k in stats}
    if len(out) == 3:
        out["device_live_array_bytes"] = live_bytes(dev)
        log(
            f"device memory: {pool_peak(dev)}; in use {out['device_bytes_in_use'] / 1e9:.1f} GB, "
            f"live arrays {out['device_live_array_bytes'] / 1e9:.1f} GB"
        )
    return out


def stage_vllm_offline(
    spec: dict, out: Path, variant: str | None = None, model: str | None = None
) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    spec = with_model(spec, model)
    d = stage_model_dir(spec, out.parent)
    args = engine_args(spec, variant)
    t = time.perf_counter()
    llm = LLM(
        model=str(d),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        seed=0,
        **args,
        **spec.get("vllm_required", {}),
    )
    startup = time.perf_counter() - t
    log(f"vLLM {vllm.__version__} started in {startup:.1f} s")
    save_partial(startup_s=startup, vllm_version=vllm.__version__, engine_args=args)
    vocab = vocab_size(spec)

    def gen(reqs):
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=False
            )
            for r in reqs
        ]
        outs = llm.generate(
            [{"prompt_token_ids": list(r.prompt)} for r in reqs], params, use_tqdm=False
        )
        return [len(o.outputs[0].token_ids) for o in outs]

    gen(random_dataset(4, 64, 8, vocab_size=vocab, seed=7))
    res = {"startup_s": startup, "vllm_version": vllm.__version__}
    res.update(itl(gen, spec, vocab))
    res["offline"] = offline(gen, spec, vocab)
    return res
