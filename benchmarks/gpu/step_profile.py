"""Where a decode step's device time goes: greedy decoding of `--batch` sequences through `LLM`
under the JAX profiler, then the GPU's kernels summed by the HLO op that launched them (a fused
computation, a custom call such as a Pallas kernel, a cuBLAS GEMM), per decode step.

    python3 -m benchmarks.gpu.step_profile --model dummy:CONFIG --batch 1 8 [--json OUT]

XLA's command buffers (CUDA graphs) are turned off here (`XLA_FLAGS`), or the profile shows
one graph per step instead of its kernels: run it as
`XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m benchmarks.gpu.step_profile ...`.
Buckets are narrowed (token 1 / 64 / 512, sequences 8 / --max-seqs, and the buckets the engine's
GPU defaults decode each --batch in: `profile_buckets`) so the start fits one device call. The ITL printed beside each profile is
the same run's (steps timed from the host, profiler off), not a benchmark number. Kernel times
are per decode step: a profiled run of 8 tokens subtracted from one of 8 + --steps. With
--hlo-dir, each top op's shape and kind beside it (`top_ops_hlo`: call 1 of gpu_2026-12-07f
left a 1.2 ms "custom-call.241" and a 0.47 ms "copy.4" unnamed) and its source lines.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import tempfile
import time

import numpy as np


def kernel_times(xplane: str) -> tuple[dict, float]:
    """-> ({op: total ns}, span ns) over the GPU planes of a profile."""
    from jax.profiler import ProfileData

    per: dict = collections.defaultdict(float)
    lo, hi = float("inf"), 0.0
    for plane in ProfileData.from_file(xplane).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                stats = dict(e.stats)
                op = stats.get("hlo_op") or e.name
                per[op] += e.duration_ns
                lo, hi = min(lo, e.start_ns), max(hi, e.start_ns + e.duration_ns)
    return dict(per), max(hi - lo, 0.0)


def big_copies(compiled: dict, hlo_dir: str) -> tuple[dict, dict]:
    """Each executable's HLO written to hlo_dir; -> ({bucket: the copies of over 1 MiB},
    {bucket: its GEMMs by kind, cuBLAS or XLA's Triton})."""
    import os

    from benchmarks.gpu import gemm_probe

    os.makedirs(hlo_dir, exist_ok=True)
    res, gemms = {}, {}
    for key, exe in compiled.items():
        txt = exe.as_text()
        with open(f"{hlo_dir}/step_{key[0]}_{key[1]}.hlo.txt", "w") as f:
            f.write(txt)
        found = []
        for m in re.finditer(r"(%\S+) = (\w+)\[([\d,]*)\]\S* copy\((\S+)\)", txt):
            dims = [int(x) for x in m.group(3).split(",") if x]
            n = int(np.prod(dims)) if dims else 1
            if n * 2 > 1 << 20:
                found.append(f"{m.group(1)} {m.group(2)}{dims} <- {m.group(4)}")
        res[f"{key[0]}x{key[1]}"] = found[:40]
        gemms[f"{key[0]}x{key[1]}"] = gemm_probe.kinds(txt)
    return res, gemms


_META = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*metadata=\{([^}]*)\}")
_ROW = re.compile(r"^(\d+) (.*)$")


def _tables(hlo_text: str) -> dict:
    """The optimized HLO's trailing FileNames / FileLocations / StackFrames tables, by id."""
    tables: dict = {}
    cur = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = tables.setdefault(line, {})
        elif cur is not None and (m := _ROW.match(line)):
            cur[int(m.group(1))] = m.group(2)
        elif not line.strip():
            cur = None
    return tables


def sources(hlo_text: str) -> dict:
    """-> {HLO instruction: "file:line < caller file:line op"} from the optimized HLO's
    metadata: which lines of the model launched a fusion (a kernel's `hlo_op` is its fusion)."""
    t = _tables(hlo_text)
    # folder/file: paxengine/attention.py and kernels_pallas/attention.py are both attention.py
    files = {k: "/".join(v.strip('"').split("/")[-2:]) for k, v in t.get("FileNames", {}).items()}

    def where(frame: int) -> tuple[str, int]:
        row = dict(re.findall(r"(\w+)=(\d+)", t.get("StackFrames", {}).get(frame, "")))
        loc = dict(
            re.findall(
                r"(\w+)=(\d+)",
                t.get("FileLocations", {}).get(int(row.get("file_location_id", 0)), ""),
            )
        )
        name = files.get(int(loc.get("file_name_id", 0)), "?")
        return f"{name}:{loc.get('line', '?')}", int(row.get("parent_frame_id", 0))

    out = {}
    for line in hlo_text.splitlines():
        m = _META.match(line)
        if not m:
            continue
        meta = dict(re.findall(r'(\w+)=("[^"]*"|\d+)', m.group(2)))
        op = meta.get("op_name", "").strip('"').rsplit("/", 1)[-1]
        frame = int(meta.get("stack_frame_id", 0))
        inner, parent = where(frame) if frame else ("?", 0)
        outer = where(parent)[0] if parent and parent != frame else ""
        out[m.group(1)] = f"{inner}{' < ' + outer if outer else ''} {op}"
    return out


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")


def instructions(hlo_text: str) -> dict:
    """-> {HLO instruction: "its result's shape, its opcode and what it calls"}: a profile's
    kernel (named by its instruction) told apart where no source line names it (a cuBLAS GEMM,
    a copy XLA inserted: "bf16[256,4096] custom-call __cublas$gemm")."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        shape = re.sub(r"\{[^}]*\}", "", shape)  # the layouts
        what = re.search(r'custom_call_target="([^"]+)"|calls=%?([\w.\-]+)', rest)
        out[name] = " ".join(x for x in (shape, opcode, what and (what[1] or what[2])) if x)
    return out


def step_key(compiled: dict, batch: int):
    """The executable a decode step of `batch` rows runs: the smallest bucket that holds it."""
    fits = [k for k in compiled if k[0] >= batch and k[1] >= batch]
    return min(fits) if fits else None


def family(op: str) -> str:
    """Ops with the same role but a numbered name (fusion.12, gemm_fusion_dot.3) together."""
    return re.sub(r"[._]\d+$", "", re.sub(r"\.\d+(\.clone)*$", "", op))


def profile_buckets(batches, max_seqs: int) -> tuple[list, list]:
    """(token buckets, sequence buckets): 1 / 64 / 512 tokens and 8 sequences for the prompts'
    prefill and a small step, plus the buckets the engine's GPU defaults decode each batch in
    (device_defaults' ladders at 8,192 / max_seqs: 300 sequences in 320 tokens x 512 rows), so a
    profiled step pads as the engine's does."""
    from paxengine.device_defaults import gpu_seq_buckets, gpu_token_buckets

    ladder_t = gpu_token_buckets(8192, max_seqs)
    ladder_s = gpu_seq_buckets(max_seqs)
    tokens, seqs = {1, 64, 512, max_seqs}, {8, max_seqs}
    for b in batches:
        tokens.add(min([t for t in ladder_t if t >= b], default=max_seqs))
        seqs.add(min([s for s in ladder_s if s >= b], default=max_seqs))
    return sorted(t for t in tokens if t <= max(512, max_seqs)), sorted(seqs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-seqs", type=int, default=64, help="the largest sequence bucket")
    p.add_argument("--hlo-dir", help="write each step executable's optimized HLO here")
    a = p.parse_args(argv)
    import jax

    from paxengine import LLM, SamplingParams

    t0 = time.perf_counter()
    tokens, seqs = profile_buckets(a.batch, a.max_seqs)
    llm = LLM(
        model=a.model,
        max_model_len=4096,
        max_num_seqs=a.max_seqs,
        max_num_batched_tokens=max(512, a.max_seqs),
        token_buckets=tokens,
        seq_buckets=seqs,
        show_progress=False,
        **(
            {"gpu_memory_utilization": a.gpu_memory_utilization} if a.gpu_memory_utilization else {}
        ),
    )
    out = {"startup_s": round(time.perf_counter() - t0, 1)}
    from paxengine.kv_memory import largest_temporaries

    temp = largest_temporaries(llm.engine.runner.compiled)
    if temp is not None:  # XLA's temporaries of the largest step (the activation reserve)
        out["step_temp_gib"], out["step_temp_bucket"] = round(temp[0] / 2**30, 2), list(temp[1])
    out["state_pools_gib"] = round(
        sum(a.nbytes for a in jax.tree.leaves(llm.engine.runner.state)) / 2**30, 2
    )
    if a.hlo_dir:
        out["big_copies"], out["gemm_kinds"] = big_copies(llm.engine.runner.compiled, a.hlo_dir)
    print(json.dumps(out), flush=True)
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size

    def gen(b, n_out):
        prompts = [rng.integers(10, min(30000, vocab), 128).tolist() for _ in range(b)]
        sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    for b in a.batch:
        gen(b, 8)  # warm
        itl = (gen(b, 8 + a.steps) - gen(b, 8)) / a.steps
        # two profiled runs, 8 and 8 + steps tokens: their difference is `steps` decode steps
        # alone (the prefill and the first tokens cancel out)
        runs = []
        for n_out in (8, 8 + a.steps):
            d = tempfile.mkdtemp()
            with jax.profiler.trace(d):
                gen(b, n_out)
            runs.append(kernel_times(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]))
        (short, short_span), (long, long_span) = runs
        per = {op: ns - short.get(op, 0.0) for op, ns in long.items()}
        span = long_span - short_span
        steps = a.steps
        fams: dict = collections.defaultdict(float)
        for op, ns in per.items():
            fams[family(op)] += ns
        by_src: dict = collections.defaultdict(float)
        key = step_key(llm.engine.runner.compiled, b) if a.hlo_dir else None
        what: dict = {}
        if key is not None:
            hlo = llm.engine.runner.compiled[key].as_text()
            src, what = sources(hlo), instructions(hlo)
            for op, ns in per.items():
                by_src[src.get(op, family(op))] += ns
        total = sum(per.values())  # per decode step from here on
        row = {
            "batch": b,
            "itl_ms": round(1e3 * itl, 3),
            "gpu_busy_ms_per_step": round(total / steps / 1e6, 3),
            "span_ms_per_step": round(span / steps / 1e6, 3),
            "top_ops_us_per_step": {
                k: round(v / steps / 1e3, 1)
                for k, v in sorted(per.items(), key=lambda kv: -kv[1])[: a.top]
            },
            "families_us_per_step": {
                k: round(v / steps / 1e3, 1)
                for k, v in sorted(fams.items(), key=lambda kv: -kv[1])[: a.top]
            },
        }
        if what:  # the top ops' shapes and kinds: "custom-call.241" alone names nothing
            row["top_ops_hlo"] = {k: what.get(k, "?") for k in row["top_ops_us_per_step"]}
        if by_src:
            row["by_source_us_per_step"] = {
                k: round(v / steps / 1e3, 1)
                for k, v in sorted(by_src.items(), key=lambda kv: -kv[1])[: 2 * a.top]
            }
        out[f"batch{b}"] = row
        print(json.dumps(row, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
