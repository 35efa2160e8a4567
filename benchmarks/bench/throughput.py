"""`paxengine bench throughput`: offline engine throughput, vLLM `bench throughput` style.

N random token-id prompts of (input len, output len), `ignore_eos`, greedy, all handed to
`LLM.generate` at once; reports requests/s, output tokens/s and total tokens/s, counted from the
returned outputs. `--baseline hf` runs HF transformers batched `generate` on the same model, the
same prompts, in the same process, and prints the ratio.

    paxengine bench throughput --num-prompts 32 --input-len 64 --output-len 64 --baseline hf
    paxengine bench throughput --model dummy:llama-3.1-8b --dtype bfloat16 \\
        --num-prompts 256 --input-len 1024 --output-len 128

Every EngineConfig field is a flag (`--max-num-seqs`, `--max-num-batched-tokens`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
import typing
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.bench import datasets as ds
from benchmarks.measure import CompileCounter
from benchmarks.record import environment, finite

_ENGINE_FLAG_PREFIX = "engine_"


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, defaulting to 'not given' (the engine's own default)."""
    from paxengine.config import EngineConfig

    g = p.add_argument_group("engine (EngineConfig fields; default: the engine's own)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "seed":  # --seed seeds both the prompts and the engine
            continue
        flag = "--" + f.name.replace("_", "-")
        dest = _ENGINE_FLAG_PREFIX + f.name
        hint = str(hints[f.name])
        mv = f.name.upper()
        if "bool" in hint:
            g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        elif "list" in hint:
            g.add_argument(
                flag,
                dest=dest,
                default=None,
                metavar="N,N,...",
                type=lambda s: [int(x) for x in s.split(",") if x.strip()],
            )
        elif "int" in hint:
            g.add_argument(flag, dest=dest, type=int, default=None, metavar=mv)
        elif "float" in hint:
            g.add_argument(flag, dest=dest, type=float, default=None, metavar=mv)
        else:
            g.add_argument(flag, dest=dest, default=None, metavar=mv)
    g.add_argument("--config", default=None, help="engine YAML (server keys in it are ignored)")


def engine_config(args):
    from paxengine.config import EngineConfig, load_yaml

    kw = {}
    if args.config:
        kw = {k: v for k, v in load_yaml(args.config).items() if k in EngineConfig.fields()}
    for k, v in vars(args).items():
        if k.startswith(_ENGINE_FLAG_PREFIX) and v is not None:
            kw[k[len(_ENGINE_FLAG_PREFIX) :]] = v
    kw.setdefault("show_progress", not args.disable_tqdm)
    kw["seed"] = args.seed
    return EngineConfig.from_dict(kw)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="paxengine bench throughput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)] (0 with --baseline hf)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-iters",
        type=int,
        default=1,
        help="timed repetitions (fresh prompts each); the median is reported",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed warm-up generate (fresh prompts, same shapes)",
    )
    p.add_argument("--baseline", choices=("none", "hf"), default="none")
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="HF generate batch size (default: all prompts in one batch)",
    )
    p.add_argument("--result-file", default=None)
    p.add_argument("--plot", default=None, help="PNG bar chart of output tok/s (with --baseline)")
    p.add_argument("--disable-tqdm", action="store_true")
    _add_engine_flags(p)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- paxengine


def token_prompts(reqs):
    """The requests' token-id prompts as LLM.generate takes them."""
    return [{"prompt_token_ids": list(r.prompt)} for r in reqs]


def greedy_params(reqs):
    """Greedy sampling of exactly each request's output length (ignore_eos)."""
    from paxengine import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]


class System:
    """One system under test: `generate(reqs) -> list of output token-id lists`, plus facts."""

    name: str
    info: dict

    def generate(self, reqs):  # pragma: no cover - interface
        raise NotImplementedError

    def close(self):
        pass


class PaxSystem(System):
    name = "paxengine"

    def __init__(self, args):
        from paxengine import LLM

        self.cfg = engine_config(args)
        t = time.perf_counter()
        self.llm = LLM(config=self.cfg)
        self.info = {
            "startup_s": time.perf_counter() - t,
            "engine_config": _jsonable(dataclasses.asdict(self.cfg)),
        }
        self.show = not args.disable_tqdm

    def generate(self, reqs):
        outs = self.llm.generate(token_prompts(reqs), greedy_params(reqs), use_tqdm=self.show)
        if len(outs) != len(reqs):
            raise RuntimeError(f"engine returned {len(outs)} outputs for {len(reqs)} prompts")
        bad = [
            i for i, (o, r) in enumerate(zip(outs, reqs)) if len(o.prompt_token_ids) != r.prompt_len
        ]
        if bad:
            raise RuntimeError(
                f"prompt {bad[0]}: the engine saw {len(outs[bad[0]].prompt_token_ids)} "
                f"prompt tokens, {reqs[bad[0]].prompt_len} were sent"
            )
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self):
        shutdown = getattr(self.llm, "shutdown", None) or getattr(self.llm, "close", None)
        if callable(shutdown):
            shutdown()


def hf_model_source(model: str | None) -> tuple[str, dict]:
    """(path, from_pretrained kwargs) for the same model in transformers."""
    from paxengine.models.loader import resolve_source

    src = resolve_source(model)
    if src.startswith("dummy:"):
        raise ValueError("--baseline hf needs real weights, not a dummy model")
    p = Path(src).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    return str(p), {}


class HFSystem(System):
    """HF transformers batched greedy `generate`, left-padded, exactly output_len new tokens."""

    name = "hf_transformers"

    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        path, kw = hf_model_source(args.engine_model)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            args.engine_dtype or "auto", torch.float32
        )
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        t = time.perf_counter()
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(self.dev).eval()
        )
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            eos = self.model.generation_config.eos_token_id
            pad = (eos[0] if isinstance(eos, list) else eos) or 0
        self.pad, self.batch_size = pad, args.hf_batch_size
        self.info = {
            "load_s": time.perf_counter() - t,
            "model_path": path,
            **kw,
            "torch_dtype": str(dtype),
            "device": self.dev,
            "torch_threads": torch.get_num_threads(),
            "batch_size": args.hf_batch_size,
        }

    def generate(self, reqs):
        torch = self.torch
        bs = self.batch_size or len(reqs)
        outs = []
        for i in range(0, len(reqs), bs):
            batch = reqs[i : i + bs]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, r in enumerate(batch):  # left padding
                ids[j, width - r.prompt_len :] = torch.tensor(r.prompt)
                mask[j, width - r.prompt_len :] = 1
            n = batch[0].output_len
            with torch.inference_mode():
                seq = self.model.generate(
                    ids.to(self.dev),
                    attention_mask=mask.to(self.dev),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=self.pad,
                )
            outs += [s[width:].tolist() for s in seq]
        return outs


def _measure(reqs, outs, elapsed) -> dict:
    n_in = sum(r.prompt_len for r in reqs)
    n_out = sum(len(o) for o in outs)
    want = sum(r.output_len for r in reqs)
    if n_out != want:
        raise RuntimeError(f"{n_out} output tokens, {want} asked for (ignore_eos)")
    return {
        "elapsed_s": elapsed,
        "num_requests": len(reqs),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "requests_per_s": len(reqs) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
    }


def _summary(iters: list[dict]) -> dict:
    """The median iteration's numbers (by elapsed time), all iterations kept."""
    med = sorted(iters, key=lambda r: r["elapsed_s"])[len(iters) // 2]
    return {**med, "iterations": iters}


def _jsonable(d):
    return json.loads(json.dumps(d, default=str))


def run_systems(systems: list[System], sets, warm) -> tuple[dict, dict]:
    """Warm every system, then time them in turn on each prompt set (interleaved, so a change in
    machine load during the run falls on all of them alike). Returns per-system results and the
    last set's outputs."""
    for s in systems:
        if warm:
            s.generate(warm)
    compiles = CompileCounter()
    iters: dict[str, list] = {s.name: [] for s in systems}
    outs: dict[str, list] = {}
    for reqs in sets:
        for s in systems:
            t = time.perf_counter()
            outs[s.name] = s.generate(reqs)
            iters[s.name].append(_measure(reqs, outs[s.name], time.perf_counter() - t))
    res = {}
    for s in systems:
        res[s.name] = {**_summary(iters[s.name]), **s.info}
        if s.name == "paxengine":
            res[s.name]["compiles_during_timed_runs"] = compiles.n
            res[s.name]["first_tokens"] = [o[:16] for o in outs[s.name][:8]]
    return res, outs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far greedy outputs agree (a sanity check that both ran the same model; exact equality is
    not expected: different kernels round differently and greedy paths diverge after a near tie)."""
    common = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        common.append(k)
    return {
        "first_token_match": sum(1 for c in common if c > 0) / max(1, len(common)),
        "mean_common_prefix": sum(common) / max(1, len(common)),
        "identical": sum(1 for x, y in zip(a, b) if x == y),
    }


# ----------------------------------------------------------------------------- driver


def _print(res: dict) -> None:
    w = 52
    print(f"{' Offline Throughput ':=^{w}}")

    def row(k, v):
        print(f"{k:<36}{v:>{w - 36}}")

    for name, r in res["systems"].items():
        print(f"{' ' + name + ' ':-^{w}}")
        row("Requests:", r["num_requests"])
        row("Elapsed (s):", f"{r['elapsed_s']:.3f}")
        row("Prompt / output tokens:", f"{r['prompt_tokens']} / {r['output_tokens']}")
        row("Requests/s:", f"{r['requests_per_s']:.2f}")
        row("Output tokens/s:", f"{r['output_tokens_per_s']:.1f}")
        row("Total tokens/s:", f"{r['total_tokens_per_s']:.1f}")
        if "startup_s" in r:
            row("Start-up (load + compile) (s):", f"{r['startup_s']:.1f}")
        if r.get("compiles_during_timed_runs") is not None:
            row("Compiles during timed runs:", r["compiles_during_timed_runs"])
    if "ratio_output_tokens_per_s" in res:
        print("-" * w)
        row("paxengine / HF output tok/s:", f"{res['ratio_output_tokens_per_s']:.2f}x")
        a = res["greedy_agreement"]
        row("Greedy agreement (mean prefix):", f"{a['mean_common_prefix']:.1f} tok")
    print("=" * w, flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.baseline == "hf" and args.range_ratio:
        print(
            "bench throughput: --baseline hf needs --range-ratio 0 (HF generates one output "
            "length per batch)",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = engine_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"bench throughput: {e}", file=sys.stderr)
        return 2
    vocab = _vocab_size(cfg)

    def make(n, seed):
        return ds.random_dataset(
            n, args.input_len, args.output_len, args.range_ratio, vocab_size=vocab, seed=seed
        )

    sets = [make(args.num_prompts, args.seed + 1 + i) for i in range(args.num_iters)]
    warm = None if args.no_warmup else make(args.num_prompts, args.seed + 10_000)
    systems = [PaxSystem(args)]
    try:
        if args.baseline == "hf":
            systems.append(HFSystem(args))
        res, outs = run_systems(systems, sets, warm)
    finally:
        for s in systems:
            s.close()
    result = {
        "benchmark": "throughput",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "paxengine bench throughput " + shlex.join(argv),
        "environment": environment(),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "num_iters": args.num_iters,
            "seed": args.seed,
            "vocab_size": vocab,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "systems": res,
    }
    if args.baseline == "hf":
        pax, hf = res["paxengine"], res["hf_transformers"]
        result["ratio_output_tokens_per_s"] = pax["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["greedy_agreement"] = agreement(outs["paxengine"], outs["hf_transformers"])
    _print(result)
    if args.plot and len(res) > 1:
        from benchmarks.bench.plots import bar_plot

        w = result["workload"]
        result["plots"] = [
            bar_plot(
                args.plot,
                list(res),
                [s["output_tokens_per_s"] for s in res.values()],
                "output tokens / s",
                f"{w['num_prompts']} x ({w['input_len']} in, {w['output_len']} out) | "
                f"{result['environment']['device']}",
            )
        ]
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite(result), indent=1, allow_nan=False))
        print(f"results: {path}")
    return 0


def _vocab_size(cfg) -> int:
    """Random ids stay under the model's vocabulary (and under DEFAULT_VOCAB_SIZE's safe bound
    when the model's size cannot be read without loading it)."""
    from paxengine.models.config import PRESETS

    m = cfg.model or ""
    if m.startswith("dummy:") and m[6:] in PRESETS:
        return PRESETS[m[6:]].vocab_size
    return ds.DEFAULT_VOCAB_SIZE


if __name__ == "__main__":
    sys.exit(main())
