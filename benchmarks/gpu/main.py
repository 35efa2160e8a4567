"""The GPU benchmark: paxengine (and optionally vLLM) on Llama-3.1-8B shapes with dummy weights,
in one device call. Run through `benchmarks/gpu/gpu_run.sh` on the lent GPU.

    python -m benchmarks.gpu.main --out DIR [--stages roofline,pax-offline,pax-serve] [--quick]
    python -m benchmarks.gpu.main report DIR/gpu_bench.json     # markdown table for the README

Stages (each in its own process, so each frees the GPU's memory for the next):
  roofline      measured copy bandwidth (read + write bytes) and bf16 matmul rate, and the floors
                they put under every workload below (bytes per decode step / bandwidth, prefill
                FLOPs / matmul rate)
  pax-offline   paxengine `LLM`: batch-1 and batch-8 inter-token latency, 256 x (1024 in, 128
                out), 300 x (1000, 1000); JAX compilations counted during the timed part (must be 0)
  pax-serve     `paxengine serve` + `paxengine bench serve`: random 1024/128 at concurrency 1,16,64
  vllm-offline  the same offline workloads on vLLM (when `import vllm` works; VLLM-PEER.md)
  vllm-serve    `vllm serve` + the same bench client and workload

Inter-token latency is measured the same way for both engines: the time of a generate call with
N2 output tokens minus one with N1, over N2 - N1 (all decode steps, scheduling included).
Every stage writes DIR/stage_<name>.json; the driver merges them into DIR/gpu_bench.json and
prints a table last. A failed stage is recorded and the next one still runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALL_STAGES = ("roofline", "pax-offline", "pax-serve", "vllm-offline", "vllm-serve", "hf")

FULL = {
    "preset": "llama-3.1-8b", "dtype": "bfloat16",
    "itl": {"input_len": 128, "n1": 32, "n2": 288, "batches": [1, 8], "reps": 3},
    # the long workload first: the short one's time is then projected from a decode-heavy rate
    # (the other way round, 256x(1024,128)'s prefill-bound rate over-projected 300x(1000,1000))
    "offline": [{"name": "300x(1000,1000)", "num_prompts": 300, "input_len": 1000, "output_len": 1000},
                {"name": "256x(1024,128)", "num_prompts": 256, "input_len": 1024, "output_len": 128}],
    "serve": {"input_len": 1024, "output_len": 128, "concurrency": [1, 16, 64],
              "num_prompts": 32, "per_concurrency": 4},
    "engine": {"max_num_seqs": 512, "max_num_batched_tokens": 8192, "max_model_len": 4096,
               "gpu_memory_utilization": 0.9,
               # 24 compiled shapes: start-up fits the device call. 512 rows so 300 requests
               # decode together; T=512 so their decode step is not padded to 1024 tokens (at
               # M=1024 the matmuls are compute-bound: ~21 ms a step); T=2048 so a prompt or two
               # next to the decodes is not padded to 4096 (the scheduler fills buckets).
               "token_buckets": [16, 64, 256, 512, 1024, 2048, 4096, 8192],
               "seq_buckets": [8, 64, 256, 512]},
    "copy_mib": 2048, "matmul_n": 8192, "iters": 20,
    # HF transformers on the same dummy model: batch-1 ITL eager and with a static cache +
    # torch.compile (the gpt-fast recipe), batched generate on the first offline-like workload
    # (n2 tokens generated, the first n1 decode gaps left out of the ITL)
    "hf": {"input_len": 128, "n1": 16, "n2": 80, "compile": True,
           "batched": {"name": "256x(1024,128)", "num_prompts": 256, "input_len": 1024,
                       "output_len": 128}},
}
# A CPU-sized smoke run of the same code (`--quick`, dummy:tiny).
QUICK = {
    "preset": "tiny", "dtype": "float32",
    "itl": {"input_len": 16, "n1": 4, "n2": 36, "batches": [1, 4], "reps": 1},
    "offline": [{"name": "8x(32,8)", "num_prompts": 8, "input_len": 32, "output_len": 8}],
    "serve": {"input_len": 16, "output_len": 8, "concurrency": [1, 4], "num_prompts": 8,
              "per_concurrency": 0},
    "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 256,
               "num_kv_blocks": 128},
    "copy_mib": 16, "matmul_n": 256, "iters": 3,
    "hf": {"input_len": 16, "n1": 2, "n2": 10, "compile": False,
           "batched": {"name": "4x(16,4)", "num_prompts": 4, "input_len": 16, "output_len": 4}},
}


def log(*a):
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}]", *a, flush=True)


# ----------------------------------------------------------------------------- dummy model dir

def write_dummy_model_dir(preset: str, path: Path) -> Path:
    """config.json with the preset's shapes (an HF LlamaForCausalLM/Qwen3 config, so vLLM can load
    it with load_format=dummy and our loader with dummy:<dir>/config.json) and a word-level
    tokenizer of exactly vocab_size tokens "t0".."t{V-1}" that round-trips any id."""
    from paxengine.models.config import PRESETS
    cfg = PRESETS[preset]
    path.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}[cfg.arch]
    hf = {"architectures": [arch], "model_type": cfg.arch, "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
          "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
          "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
          "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(cfg.rope_scaling)
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t0", "eos_token": "t1",
             "model_max_length": cfg.max_position_embeddings}))
    return path


# ----------------------------------------------------------------------------- roofline

def model_costs(cfg, dtype_bytes: int = 2) -> dict:
    h, i, d, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    layer_matmul = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * i
    head = cfg.vocab_size * h
    weights = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)  # embed: a gather
    return {"layer_matmul_params": L * layer_matmul, "lm_head_params": head,
            "weight_bytes_per_step": weights * dtype_bytes,
            "kv_bytes_per_token": 2 * L * cfg.num_kv_heads * d * dtype_bytes,
            "attn_flops_per_qk": 4 * L * cfg.num_heads * d}   # QK^T + PV, per (query, key) pair


def decode_step_floor(c: dict, batch: int, ctx: float, bw: float, rate: float) -> float:
    """Seconds: one decode step of `batch` sequences at context `ctx`."""
    bytes_ = c["weight_bytes_per_step"] + batch * ctx * c["kv_bytes_per_token"]
    flops = 2 * batch * (c["layer_matmul_params"] + c["lm_head_params"]) + batch * ctx * c["attn_flops_per_qk"]
    return max(bytes_ / bw, flops / rate)


def prefill_floor(c: dict, num_seqs: int, length: int, bw: float, rate: float) -> float:
    """Seconds: prefill of `num_seqs` prompts of `length` tokens (logits for the last token only)."""
    flops = (2 * num_seqs * length * c["layer_matmul_params"] + 2 * num_seqs * c["lm_head_params"]
             + num_seqs * c["attn_flops_per_qk"] * length * (length + 1) / 2)
    steps = max(1, math.ceil(num_seqs * length / 8192))
    return max(flops / rate, steps * c["weight_bytes_per_step"] / bw)


def workload_floor(c: dict, n: int, inp: int, out: int, max_seqs: int, bw: float, rate: float) -> float:
    """Seconds for n x (inp, out) in waves of max_seqs: prefill then out-1 decode steps each."""
    total, left = 0.0, n
    while left > 0:
        b = min(left, max_seqs)
        total += prefill_floor(c, b, inp, bw, rate)
        total += sum(decode_step_floor(c, b, inp + t, bw, rate) for t in range(1, out))
        left -= b
    return total


def measure_ceilings(spec: dict) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 (f32 on CPU) matmul FLOP/s,
    timed over many dispatches between syncs, on random data."""
    import jax
    import jax.numpy as jnp
    dev = jax.devices()[0]
    dt = jnp.bfloat16 if dev.platform == "gpu" else jnp.float32
    n = spec["copy_mib"] * 2**20 // jnp.dtype(dt).itemsize
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(jax.random.fold_in(key, k), (n,), dt) for k in range(2)]
    f = jax.jit(lambda x: x * 1.0001 + 0.5)
    for x in xs:
        f(x).block_until_ready()
    it = spec["iters"]
    best = []
    for r in range(3):
        y = xs[r % 2]
        t = time.perf_counter()
        for _ in range(it):          # chained: one live buffer, each pass reads and writes it all
            y = f(y)
        y.block_until_ready()
        best.append((time.perf_counter() - t) / it)
        del y
    copy_s = min(best)
    bw = 2 * n * jnp.dtype(dt).itemsize / copy_s
    m = spec["matmul_n"]
    a = [jax.random.normal(jax.random.fold_in(key, 10 + k), (m, m), dt) for k in range(2)]
    b = jax.random.normal(jax.random.fold_in(key, 20), (m, m), dt)
    g = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dt))
    g(a[0], b).block_until_ready()
    best = []
    for _ in range(3):
        t = time.perf_counter()
        ys = [g(a[k % 2], b) for k in range(it)]
        ys[-1].block_until_ready()
        best.append((time.perf_counter() - t) / it)
        del ys
    rate = 2 * m**3 / min(best)
    return {"device": str(dev.device_kind), "platform": dev.platform, "dtype": str(jnp.dtype(dt)),
            "copy_bytes": 2 * n * jnp.dtype(dt).itemsize, "copy_bandwidth_Bps": bw,
            "matmul_n": m, "matmul_flops_per_s": rate}


def stage_roofline(spec: dict, out: Path) -> dict:
    from paxengine.models.config import PRESETS
    ceil = measure_ceilings(spec)
    cfg = PRESETS[spec["preset"]]
    c = model_costs(cfg, 2 if spec["dtype"] == "bfloat16" else 4)
    bw, rate = ceil["copy_bandwidth_Bps"], ceil["matmul_flops_per_s"]
    itl = spec["itl"]
    ctx = itl["input_len"] + (itl["n1"] + itl["n2"]) / 2
    floors = {f"itl_batch{b}_ms": 1e3 * decode_step_floor(c, b, ctx, bw, rate) for b in itl["batches"]}
    S = spec["engine"]["max_num_seqs"]
    for w in spec["offline"]:
        t = workload_floor(c, w["num_prompts"], w["input_len"], w["output_len"], S, bw, rate)
        floors[f"offline_{w['name']}_output_tok_s"] = w["num_prompts"] * w["output_len"] / t
    sv = spec["serve"]
    for conc in sv["concurrency"]:
        step = decode_step_floor(c, conc, sv["input_len"] + sv["output_len"] / 2, bw, rate)
        # each request's prefill is spread over its output tokens
        step += conc / sv["output_len"] * prefill_floor(c, 1, sv["input_len"], bw, rate)
        floors[f"serve_c{conc}_tpot_ms"] = 1e3 * step
        floors[f"serve_c{conc}_output_tok_s"] = conc / step
    floors["prefill_1024_ms"] = 1e3 * prefill_floor(c, 1, 1024, bw, rate)
    return {**ceil, "model_costs": c, "floors": floors,
            "note": "floors: max(bytes / measured copy bandwidth, FLOPs / measured matmul rate) per "
                    "step; offline: waves of max_num_seqs, prefill then decode; serving: decode "
                    "step at the mean context plus each request's prefill spread over its tokens"}


# ----------------------------------------------------------------------------- engines

class CompileCounter:
    """Counts JAX lowerings (every jit compile, persistent-cache hit or not) after `start()`."""

    def __init__(self):
        import jax
        self.n, self.on = 0, False

        def listener(name, *_a, **_k):
            if self.on and name == "/jax/core/compile/jaxpr_to_mlir_module_duration":
                self.n += 1
        jax.monitoring.register_event_duration_secs_listener(listener)

    def start(self):
        self.n, self.on = 0, True

    def stop(self) -> int:
        self.on = False
        return self.n


def _median(xs):
    return statistics.median(xs) if xs else None


def _itl(gen, spec, vocab: int) -> dict:
    """ITL for each batch size: (t(n2) - t(n1)) / (n2 - n1), median of reps, fresh prompts."""
    from benchmarks.bench.datasets import random_dataset
    itl = spec["itl"]
    res = {}
    seed = 100
    for b in itl["batches"]:
        vals = []
        for _ in range(itl["reps"]):
            times = {}
            for n in (itl["n1"], itl["n2"]):
                seed += 1
                reqs = random_dataset(b, itl["input_len"], n, vocab_size=vocab, seed=seed)
                t = time.perf_counter()
                outs = gen(reqs)
                times[n] = time.perf_counter() - t
                assert sum(outs) == b * n, f"asked {b * n} tokens, got {sum(outs)}"
            vals.append((times[itl["n2"]] - times[itl["n1"]]) / (itl["n2"] - itl["n1"]))
        res[f"itl_batch{b}_ms"] = 1e3 * _median(vals)
        res[f"itl_batch{b}_all_ms"] = [1e3 * v for v in vals]
        log(f"batch-{b} ITL {res[f'itl_batch{b}_ms']:.2f} ms")
        save_partial(**res)
    return res


_DEADLINE: float | None = None   # time.time() by which this stage must be done


def _offline(gen, spec, vocab: int, stats=None) -> dict:
    """stats: a callable giving engine counters (steps, preemptions), recorded per workload."""
    from benchmarks.bench.datasets import random_dataset
    res = {}
    rate = None   # output tok/s of the last workload, to project the next one's duration
    for k, w in enumerate(spec["offline"]):
        if rate and _DEADLINE:
            projected = 1.2 * w["num_prompts"] * w["output_len"] / rate + 5
            left = _DEADLINE - time.time() - 15
            if projected > left:
                res[w["name"]] = {"skipped": f"projected {projected:.0f} s at {rate:,.0f} tok/s; "
                                             f"{left:.0f} s left in this stage"}
                log(f"offline {w['name']}: skipped, {res[w['name']]['skipped']}")
                save_partial(offline=dict(res))
                continue
        reqs = random_dataset(w["num_prompts"], w["input_len"], w["output_len"], vocab_size=vocab,
                              seed=1000 + k)
        log(f"offline {w['name']} ...")
        before = stats() if stats else None
        t = time.perf_counter()
        outs = gen(reqs)
        el = time.perf_counter() - t
        n_out = sum(outs)
        n_in = sum(r.prompt_len for r in reqs)
        assert n_out == w["num_prompts"] * w["output_len"], f"output tokens {n_out}"
        res[w["name"]] = {"elapsed_s": el, "requests_per_s": len(reqs) / el,
                          "output_tok_s": n_out / el, "total_tok_s": (n_in + n_out) / el}
        if stats:
            after = stats()
            steps = after["steps"] - before["steps"]
            res[w["name"]].update(steps=steps, mean_step_ms=1e3 * el / max(steps, 1),
                                  preemptions=after["num_preemptions"] - before["num_preemptions"])
        log(f"offline {w['name']}: {n_out / el:,.0f} output tok/s ({el:.1f} s)")
        save_partial(offline=dict(res))
        rate = n_out / el
    return res


def stage_pax_offline(spec: dict, out: Path) -> dict:
    from benchmarks.bench.throughput import _params, _prompts, compile_count
    from paxengine import LLM
    from paxengine.config import EngineConfig
    from paxengine.models.config import PRESETS
    counter = CompileCounter()
    cfg = EngineConfig(model=f"dummy:{spec['preset']}", dtype=spec["dtype"], **spec["engine"])
    t = time.perf_counter()
    llm = LLM(config=cfg)
    startup = time.perf_counter() - t
    log(f"paxengine started in {startup:.1f} s")
    save_partial(startup_s=startup, engine_stats=llm.engine.stats() if hasattr(llm.engine, "stats") else None)
    vocab = PRESETS[spec["preset"]].vocab_size

    def gen(reqs):
        outs = llm.generate(_prompts(reqs), _params(reqs), use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    from benchmarks.bench.datasets import random_dataset
    gen(random_dataset(4, 64, 8, vocab_size=vocab, seed=7))      # warm-up (untimed)
    engine_compiles_before = compile_count(llm)
    counter.start()
    res = {"startup_s": startup}
    res.update(_itl(gen, spec, vocab))
    save_partial(jax_compiles_during_timed_runs=counter.n)
    res["offline"] = _offline(gen, spec, vocab, llm.engine.stats)
    res["jax_compiles_during_timed_runs"] = counter.stop()
    after = compile_count(llm)
    res["engine_reported_compiles"] = (None if after is None or engine_compiles_before is None
                                       else after - engine_compiles_before)
    return res


def stage_vllm_offline(spec: dict, out: Path) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from paxengine.models.config import PRESETS
    d = write_dummy_model_dir(spec["preset"], out.parent / "dummy_model")
    e = spec["engine"]
    t = time.perf_counter()
    llm = LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, dtype=spec["dtype"],
              max_num_seqs=e["max_num_seqs"], max_num_batched_tokens=e["max_num_batched_tokens"],
              max_model_len=e["max_model_len"], gpu_memory_utilization=e.get("gpu_memory_utilization", 0.9),
              seed=0)
    startup = time.perf_counter() - t
    log(f"vLLM {vllm.__version__} started in {startup:.1f} s")
    save_partial(startup_s=startup, vllm_version=vllm.__version__)
    vocab = PRESETS[spec["preset"]].vocab_size

    def gen(reqs):
        outs = llm.generate([{"prompt_token_ids": list(r.prompt)} for r in reqs],
                            [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                                            detokenize=False) for r in reqs], use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    from benchmarks.bench.datasets import random_dataset
    gen(random_dataset(4, 64, 8, vocab_size=vocab, seed=7))
    res = {"startup_s": startup, "vllm_version": vllm.__version__}
    res.update(_itl(gen, spec, vocab))
    res["offline"] = _offline(gen, spec, vocab)
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_stage(spec: dict, out: Path, server_cmd: list[str], label: str, env: dict) -> dict:
    """Start a server, wait for it, run `bench serve` against it, stop it."""
    import urllib.request
    port = int(server_cmd[server_cmd.index("--port") + 1])
    base = f"http://127.0.0.1:{port}"
    logf = open(out.parent / f"{label}_server.log", "w")
    log("starting:", shlex.join(server_cmd))
    t = time.perf_counter()
    proc = subprocess.Popen(server_cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=False)
    try:
        wait = spec.get("server_start_timeout", 480)
        if _DEADLINE:
            wait = min(wait, _DEADLINE - time.time() - 60)
        deadline = time.monotonic() + wait
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {logf.name}: "
                                   + Path(logf.name).read_text()[-2000:])
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready in time")
            time.sleep(1)
        startup = time.perf_counter() - t
        log(f"{label} server ready in {startup:.1f} s")
        sv = spec["serve"]
        from benchmarks.bench import plots, serve
        from paxengine.models.config import PRESETS
        vocab = PRESETS[spec["preset"]].vocab_size
        combined_file = out.parent / f"{label}_serve.json"
        compiles_before = _scrape_compiles(base)
        combined, runs, rcs = None, {}, []
        # one `bench serve` per concurrency, so a stage cut off by its time limit keeps the runs done
        for k, conc in enumerate(sv["concurrency"]):
            n = max(sv["num_prompts"], sv.get("per_concurrency", 0) * conc)
            part = out.parent / f"{label}_serve_c{conc}.json"
            argv = ["--base-url", base, "--dataset-name", "random",
                    "--random-input-len", str(sv["input_len"]), "--random-output-len", str(sv["output_len"]),
                    "--num-prompts", str(n), "--max-concurrency", str(conc), "--seed", str(1000 * k),
                    "--vocab-size", str(vocab), "--result-file", str(part), "--plot-dir", "none",
                    "--label", label, "--disable-tqdm", "--num-warmups", "2"]
            log(f"{label} serve: concurrency {conc}, {n} requests")
            rc = serve.main(argv)
            rcs.append(rc)
            if not part.is_file():
                raise RuntimeError(f"bench serve exited with {rc} and wrote no results (its error is "
                                   f"in the log above)")
            res = json.loads(part.read_text())
            part.unlink()
            if combined is None:
                combined = res
                combined["command"] = f"{len(sv['concurrency'])} runs of " + res["command"]
            else:
                combined["runs"] += res["runs"]
            combined_file.write_text(json.dumps(combined))
            r = res["runs"][0]
            runs[f"c{conc}"] = {key: r.get(key) for key in (
                "completed", "failed", "num_prompts", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                "p99_itl_ms", "median_e2el_ms", "tokens_per_chunk")}
            save_partial(startup_s=startup, runs=dict(runs))
        compiles_after = _scrape_compiles(base)
        server_compiles = {k: compiles_after[k] - compiles_before.get(k, 0.0) for k in compiles_after}
        combined["plots"] = plots.serve_plots(combined, out.parent, f"{label}_serve")
        combined_file.write_text(json.dumps(combined, indent=1))
        return {"startup_s": startup, "bench_rc": max(rcs), "runs": runs,
                "server_compile_metrics_delta": server_compiles or None,
                "result_file": combined_file.name, "server_cmd": shlex.join(server_cmd)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        save_partial(server_log_tail=Path(logf.name).read_text(errors="replace")[-3000:])


def _scrape_compiles(base: str) -> dict:
    """Prometheus samples on the server's /metrics whose name mentions compil(e/ation), when it
    exports any (the serving runs' recompile count is their change)."""
    import urllib.request
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if line.startswith("#") or "compil" not in line.split("{")[0].split(" ")[0]:
            continue
        name, _, value = line.rpartition(" ")
        try:
            found[name] = float(value)
        except ValueError:
            pass
    return found


def stage_pax_serve(spec: dict, out: Path) -> dict:
    d = write_dummy_model_dir(spec["preset"], out.parent / "dummy_model")
    e = spec["engine"]
    cmd = [sys.executable, "-m", "serving.cli", "--model", f"dummy:{spec['preset']}",
           "--tokenizer", str(d), "--dtype", spec["dtype"], "--served-model-name", "dummy",
           "--max-num-seqs", str(e["max_num_seqs"]),
           "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
           "--max-model-len", str(e["max_model_len"]), "--port", str(_free_port()),
           "--host", "127.0.0.1", "--log-level", "warning"]
    if "num_kv_blocks" in e:
        cmd += ["--num-kv-blocks", str(e["num_kv_blocks"])]
    for key in ("token_buckets", "seq_buckets"):
        if key in e:
            cmd += [f"--{key.replace('_', '-')}", ",".join(map(str, e[key]))]
    if "gpu_memory_utilization" in e:
        cmd += ["--gpu-memory-utilization", str(e["gpu_memory_utilization"])]
    return _serve_stage(spec, out, cmd, "pax", dict(os.environ))


def stage_vllm_serve(spec: dict, out: Path) -> dict:
    d = write_dummy_model_dir(spec["preset"], out.parent / "dummy_model")
    e = spec["engine"]
    exe = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(d)]
    cmd = exe + ["--load-format", "dummy", "--dtype", spec["dtype"], "--served-model-name", "dummy",
                 "--max-num-seqs", str(e["max_num_seqs"]),
                 "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
                 "--max-model-len", str(e["max_model_len"]), "--port", str(_free_port()),
                 "--host", "127.0.0.1", "--gpu-memory-utilization",
                 str(e.get("gpu_memory_utilization", 0.9))]
    return _serve_stage(spec, out, cmd, "vllm", dict(os.environ))


def stage_hf(spec: dict, out: Path) -> dict:
    """HF transformers on the same dummy weights' shapes (random init on the device): batch-1
    ITL eager and compiled (static cache + torch.compile, reduce-overhead), batched generate."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    hs = spec["hf"]
    d = write_dummy_model_dir(spec["preset"], out.parent / "dummy_model")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    t = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), torch_dtype=dtype)
    model.eval()
    res = {"load_s": time.perf_counter() - t, "torch_version": torch.__version__, "device": dev}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def generate(batch: int, in_len: int, n: int, **kw) -> float:
        ids = torch.randint(2, vocab, (batch, in_len), generator=gen).to(dev)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
        sync()
        assert out.shape == (batch, in_len + n), out.shape
        return time.perf_counter() - t

    def itl(**kw) -> float:
        """Mean gap between consecutive decode tokens of one batch-1 generate, from a streamer
        stamping each token as generate hands it out (generate syncs on every step). One
        generate length only: a static cache is sized by it, and a second length would compile
        a second graph inside the timed run."""
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            def __init__(self):
                self.t: list[float] = []

            def put(self, value):          # first call: the prompt; then one per new token
                self.t.append(time.perf_counter())

            def end(self):
                pass

        generate(1, hs["input_len"], hs["n2"], **kw)                    # warm-up (and compile)
        st = Stamps()
        generate(1, hs["input_len"], hs["n2"], streamer=st, **kw)
        # gaps after the first token (the prefill), the first n1 of them left out as warm-up
        gaps = [b - a for a, b in zip(st.t[1:], st.t[2:])][hs["n1"]:]
        assert len(gaps) >= 1, len(st.t)
        return 1e3 * sum(gaps) / len(gaps)

    res["itl_method"] = ("mean gap between consecutive streamed tokens of one generate of n2 "
                         "tokens, the first n1 gaps left out")
    res["itl_batch1_eager_ms"] = itl()
    # the earlier method, (generate n2 - generate n1) / (n2 - n1), as a cross-check (eager only:
    # with a static cache each length compiles its own graph)
    t1 = generate(1, hs["input_len"], hs["n1"])
    t2 = generate(1, hs["input_len"], hs["n2"])
    res["itl_batch1_eager_two_lengths_ms"] = 1e3 * (t2 - t1) / (hs["n2"] - hs["n1"])
    log(f"HF batch-1 ITL eager {res['itl_batch1_eager_ms']:.2f} ms "
        f"(two lengths: {res['itl_batch1_eager_two_lengths_ms']:.2f} ms)")
    save_partial(**res)
    w = hs["batched"]
    el = generate(w["num_prompts"], w["input_len"], w["output_len"])
    res["batched"] = {"name": w["name"], "elapsed_s": el,
                      "output_tok_s": w["num_prompts"] * w["output_len"] / el}
    log(f"HF batched generate {w['name']}: {res['batched']['output_tok_s']:,.0f} output tok/s")
    save_partial(**res)
    if hs.get("compile"):
        # transformers compiles the forward itself when generate runs on a static cache on CUDA
        # (CompileConfig: inductor, reduce-overhead = CUDA graphs). Wrapping model.forward in our
        # own torch.compile as well made two graph trees fight over the cache: on the H200 one
        # run died with "output of CUDAGraphs overwritten", one with a segfault.
        from transformers import CompileConfig
        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if dev != "cuda":
            cc._compile_all_devices = True     # CPU smoke runs take the same path
        res["itl_batch1_compiled_ms"] = itl(cache_implementation="static", compile_config=cc)
        res["compiled_with"] = "generate(cache_implementation='static', compile_config=CompileConfig(fullgraph=True, mode='reduce-overhead'))"
        log(f"HF batch-1 ITL static cache + torch.compile {res['itl_batch1_compiled_ms']:.2f} ms")
    return res


STAGES = {"roofline": stage_roofline, "pax-offline": stage_pax_offline, "pax-serve": stage_pax_serve,
          "vllm-offline": stage_vllm_offline, "vllm-serve": stage_vllm_serve, "hf": stage_hf}


# ----------------------------------------------------------------------------- driver

_PARTIAL: dict = {}
_PARTIAL_FILE: Path | None = None


def save_partial(**kv) -> None:
    """Record finished measurements at once, so a stage cut off by its time limit keeps them."""
    from benchmarks.bench.serve import finite
    _PARTIAL.update(kv)
    if _PARTIAL_FILE is not None:
        _PARTIAL_FILE.write_text(json.dumps(finite({"ok": False, "partial": True, **_PARTIAL}),
                                            indent=1, allow_nan=False))


def run_stage_inproc(name: str, spec: dict, out_dir: Path, deadline: float | None = None) -> int:
    global _PARTIAL_FILE, _DEADLINE
    _DEADLINE = deadline
    out = out_dir / f"stage_{name}.json"
    _PARTIAL_FILE = out
    t = time.perf_counter()
    try:
        res = STAGES[name](spec, out)
        res = {"ok": True, **_PARTIAL, **res}
    except Exception as e:  # noqa: BLE001 - recorded, the driver goes on
        import traceback
        traceback.print_exc()
        res = {**_PARTIAL, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}
    res["stage_wall_s"] = time.perf_counter() - t
    from benchmarks.bench.serve import finite
    out.write_text(json.dumps(finite(res), indent=1, allow_nan=False))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if res["ok"] else 1)   # no slow teardown; the driver ends what is left of the group


# vLLM 0.26.0 bf16 on one H200, Llama-3.1-8B shapes, dummy weights, measured 2026-11-29
# (../shared/gpu/VLLM-PEER.md; its engine settings and ITL method were vLLM's defaults, not ours).
VLLM_PEER = {
    "itl_batch1_ms": "4.74", "itl_batch8_ms": "4.84",
    "offline 256x(1024,128)": "3,962", "offline 300x(1000,1000)": "9,853",
    "serve c1": ("194", "47 / 77", "4.82 / 4.83"), "serve c16": ("1,989", "255 / 399", "5.87 / 8.03"),
    "serve c64": ("3,746", "504 / 1110", "13.6 / 18.5"),
}


def summary_rows(merged: dict) -> list[tuple[str, ...]]:
    """(metric, paxengine, vLLM this run, vLLM reference, roofline bound) rows."""
    st = merged["stages"]
    roof = (st.get("roofline") or {}).get("floors", {})
    pax_o, vl_o = st.get("pax-offline") or {}, st.get("vllm-offline") or {}
    pax_s, vl_s = st.get("pax-serve") or {}, st.get("vllm-serve") or {}
    ref = VLLM_PEER if merged["spec"].get("preset") == "llama-3.1-8b" else {}

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    def off(stage, n):
        e = (stage.get("offline") or {}).get(n, {})
        return "skipped (time)" if "skipped" in e else f(e.get("output_tok_s"), ",.0f")

    def pair(r, a, b, fmt):
        return "-" if not r else f"{f(r.get(a), fmt)} / {f(r.get(b), fmt)}"

    rows = []
    for b in merged["spec"]["itl"]["batches"]:
        k = f"itl_batch{b}_ms"
        rows.append((f"batch-{b} ITL (ms)", f(pax_o.get(k), ".2f"), f(vl_o.get(k), ".2f"),
                     ref.get(k, "-"), f(roof.get(k), ".2f")))
    for w in merged["spec"]["offline"]:
        n = w["name"]
        rows.append((f"offline {n} output tok/s", off(pax_o, n), off(vl_o, n),
                     ref.get(f"offline {n}", "-"), f(roof.get(f"offline_{n}_output_tok_s"), ",.0f")))
    for c in merged["spec"]["serve"]["concurrency"]:
        p, v = (pax_s.get("runs") or {}).get(f"c{c}", {}), (vl_s.get("runs") or {}).get(f"c{c}", {})
        r = ref.get(f"serve c{c}", ("-", "-", "-"))
        rows.append((f"serve c={c} output tok/s", f(p.get("output_throughput"), ",.0f"),
                     f(v.get("output_throughput"), ",.0f"), r[0],
                     f(roof.get(f"serve_c{c}_output_tok_s"), ",.0f")))
        rows.append((f"serve c={c} TTFT mean / p99 (ms)", pair(p, "mean_ttft_ms", "p99_ttft_ms", ".0f"),
                     pair(v, "mean_ttft_ms", "p99_ttft_ms", ".0f"), r[1], ""))
        rows.append((f"serve c={c} TPOT median / p99 (ms)", pair(p, "median_tpot_ms", "p99_tpot_ms", ".2f"),
                     pair(v, "median_tpot_ms", "p99_tpot_ms", ".2f"), r[2],
                     f(roof.get(f"serve_c{c}_tpot_ms"), ".2f")))
    sc = pax_s.get("server_compile_metrics_delta")
    pax_c = f(pax_o.get("jax_compiles_during_timed_runs"), "d") + " offline"
    if sc:
        pax_c += f", {sum(sc.values()):.0f} serving (server /metrics)"
    rows.append(("JAX compiles during timed runs (must be 0)", pax_c, "", "", ""))
    rows.append(("start-up: offline / server (s)",
                 f"{f(pax_o.get('startup_s'), '.0f')} / {f(pax_s.get('startup_s'), '.0f')}",
                 f"{f(vl_o.get('startup_s'), '.0f')} / {f(vl_s.get('startup_s'), '.0f')}",
                 "150 / 57 (cold / warm compile cache)" if ref else "-", ""))
    return rows


def _copy_out(work: Path, out_dir: Path) -> None:
    """The files worth bringing back (the device returns at most 8)."""
    import shutil
    if work == out_dir:
        return
    names = ["gpu_bench.json"] + [f"{lab}_serve{suf}" for lab in ("pax", "vllm")
                                  for suf in (".json", "_sweep.png", "_latency_cdf.png")]
    for n in names:
        if (work / n).is_file():
            shutil.copy2(work / n, out_dir / n)


def _kill_group(proc: subprocess.Popen) -> None:
    """End the process group the stage leads (a stage started with start_new_session)."""
    import signal
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            if proc.poll() is None:
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.5)
        else:
            continue
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        return


def markdown_table(merged: dict) -> str:
    st = merged["stages"].get("roofline") or {}
    env = merged.get("environment", {})
    lines = [f"Device: {env.get('device')}; jax {env.get('jax_version')}; commit "
             f"{(env.get('commit') or '?')[:10]}{' (dirty)' if env.get('commit_dirty') else ''}; "
             f"model {merged['spec']['preset']} ({merged['spec']['dtype']}, dummy weights); "
             f"{merged.get('date', '')}"]
    if st.get("copy_bandwidth_Bps"):
        lines.append(f"Measured ceilings: copy {st['copy_bandwidth_Bps'] / 1e12:.3g} TB/s, matmul "
                     f"{st['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s ({st.get('dtype')}) on "
                     f"{st.get('device')}.")
    lines += ["", "| workload | paxengine | vLLM (this run) | vLLM 0.26 (VLLM-PEER.md) | roofline bound |",
              "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in summary_rows(merged)]
    hf = merged["stages"].get("hf") or {}
    if hf.get("ok"):
        def ms(k):
            return "-" if hf.get(k) is None else f"{hf[k]:.2f} ms"
        b = hf.get("batched") or {}
        lines += ["", f"HF transformers {hf.get('torch_version', '')} (this run): batch-1 ITL eager "
                  f"{ms('itl_batch1_eager_ms')}, static cache + torch.compile "
                  f"{ms('itl_batch1_compiled_ms')}; batched generate {b.get('name', '')} "
                  f"{b.get('output_tok_s', 0):,.0f} output tok/s (VLLM-PEER.md: 81.7 ms, 7.22 ms, 1,710)."]
    bad = [(k, v) for k, v in merged["stages"].items() if v and not v.get("ok")]
    failed = [f"{k}: {v.get('error', '')[:200]}" for k, v in bad if not v.get("skipped")]
    skipped = [f"{k} ({v.get('error', '')})" for k, v in bad if v.get("skipped")]
    if failed:
        lines += ["", "Failed stages: " + "; ".join(failed)]
    if skipped:
        lines += ["", "Skipped stages: " + "; ".join(skipped)]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        for path in argv[1:]:
            print(markdown_table(json.loads(Path(path).read_text())))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/gpu",
                   help="where the results are copied (at most 8 files: the device's limit)")
    p.add_argument("--work", default="/tmp/paxengine_gpu_bench",
                   help="scratch: stage results, server logs, the dummy model dir; kept between "
                        "calls on a warm machine, so a later call's stages merge with earlier ones")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget for all stages (each stage's limit shrinks to fit)")
    p.add_argument("--stages", default="roofline,pax-offline,pax-serve",
                   help=f"comma-separated, from {','.join(ALL_STAGES)}; 'all' = every one, vLLM "
                        f"stages skipped when vllm is not importable")
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized workloads (smoke test)")
    p.add_argument("--stage-timeout", type=float, default=540.0, help="seconds per stage")
    p.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH", "/tmp/vsite"),
                   help="PYTHONPATH for the vLLM stages (vLLM pins its own fastapi/pydantic)")
    p.add_argument("--_stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reserve-s", type=float, default=150.0,
                   help="with --budget-s: seconds kept back for each stage still to run")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    out_dir = Path(args.out).resolve()
    work = Path(args.work).resolve()
    spec = QUICK if args.quick else FULL
    if args._stage:
        work.mkdir(parents=True, exist_ok=True)
        return run_stage_inproc(args._stage, json.loads(args._spec) if args._spec else spec, work,
                                args._deadline)
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    stages = list(ALL_STAGES) if args.stages == "all" else [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        p.error(f"unknown stages {bad}; choose from {ALL_STAGES}")
    base_env = dict(os.environ)
    merged = {"benchmark": "gpu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m benchmarks.gpu.main " + shlex.join(argv), "spec": spec,
              "stages": {}}
    from benchmarks.bench.serve import environment, finite
    merged["environment"] = environment()
    prev = work / "gpu_bench.json"
    if prev.is_file():   # stages of an earlier call on this machine (e.g. vLLM run later) are kept
        try:
            old = json.loads(prev.read_text())
            if old.get("spec") == spec:
                merged["stages"].update(old.get("stages", {}))
        except (OSError, ValueError):
            pass
    for idx, name in enumerate(stages):
        env = dict(base_env)
        if name.startswith("vllm"):
            pp = [args.vllm_pythonpath, str(ROOT)]
            env["PYTHONPATH"] = os.pathsep.join(x for x in pp if x)
            env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
            probe = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True)
            if probe.returncode != 0:
                log(f"skip {name}: vllm is not importable with PYTHONPATH={env['PYTHONPATH']}")
                merged["stages"][name] = {"ok": False, "skipped": True, "error": "vllm not importable"}
                continue
        log(f"stage {name} ...")
        t = time.perf_counter()
        limit = args.stage_timeout
        if args.budget_s:
            later = len(stages) - idx - 1
            limit = min(limit, args.budget_s - (t - t_start) - 10 - args.reserve_s * later)
            if limit < 30:
                log(f"skip {name}: the budget is spent")
                merged["stages"][name] = {"ok": False, "skipped": True, "error": "no time left in the budget"}
                continue
        (work / f"stage_{name}.json").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.gpu.main", "--work", str(work), "--_stage", name,
               "--_spec", json.dumps(spec), "--_deadline", str(time.time() + limit)]
        # its own process group: on a timeout the stage's server goes down with it
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        _kill_group(proc)   # the stage, or what it left behind (a server, vLLM's engine process)
        f = work / f"stage_{name}.json"
        if f.is_file():
            merged["stages"][name] = json.loads(f.read_text())
            if rc == "timeout":
                merged["stages"][name].update(ok=False, error=f"stage cut off after {limit:.0f} s")
        else:
            merged["stages"][name] = {"ok": False, "error": f"stage process ended with {rc} and no result"}
        log(f"stage {name} done in {time.perf_counter() - t:.0f} s (rc {rc})")
        prev.write_text(json.dumps(finite(merged), indent=1, allow_nan=False))
        _copy_out(work, out_dir)
    print(markdown_table(merged), flush=True)
    return 0 if all(v.get("ok") or v.get("skipped") for v in merged["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
