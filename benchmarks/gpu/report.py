"""The GPU run's report: one row per workload with paxengine, vLLM (this run and the reference
numbers of VLLM-PEER.md) and the roofline floor side by side, as a markdown table.

    python -m benchmarks.gpu.report DIR/gpu_bench.json     # the table for the README
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# vLLM 0.26.0 bf16 on one H200, Llama-3.1-8B shapes, dummy weights, measured 2026-11-29
# (../shared/gpu/VLLM-PEER.md; vLLM's default engine settings, as every stage now runs, and
# vLLM's own ITL method).
VLLM_PEER = {
    "itl_batch1_ms": "4.74",
    "itl_batch8_ms": "4.84",
    "offline 256x(1024,128)": "3,962",
    "offline 300x(1000,1000)": "9,853",
    "serve c1": ("194", "47 / 77", "4.82 / 4.83"),
    "serve c16": ("1,989", "255 / 399", "5.87 / 8.03"),
    "serve c64": ("3,746", "504 / 1110", "13.6 / 18.5"),
}
# vLLM 0.26.0 with quantization="fp8" (online, FP8 weights, bf16 KV), same note.
VLLM_PEER_FP8 = {
    "itl_batch1_ms": "3.33",
    "itl_batch8_ms": "3.47",
    "offline 256x(1024,128)": "5,572",
    "offline 300x(1000,1000)": "10,298",
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
        return _pair(f, r, a, b, fmt)

    rows = []
    for b in merged["spec"]["itl"]["batches"]:
        k = f"itl_batch{b}_ms"
        rows.append(
            (
                f"batch-{b} ITL (ms)",
                f(pax_o.get(k), ".2f"),
                f(vl_o.get(k), ".2f"),
                ref.get(k, "-"),
                f(roof.get(k), ".2f"),
            )
        )
    for w in merged["spec"]["offline"]:
        n = w["name"]
        rows.append(
            (
                f"offline {n} output tok/s",
                off(pax_o, n),
                off(vl_o, n),
                ref.get(f"offline {n}", "-"),
                f(roof.get(f"offline_{n}_output_tok_s"), ",.0f"),
            )
        )
    for c in merged["spec"]["serve"]["concurrency"]:
        p, v = (pax_s.get("runs") or {}).get(f"c{c}", {}), (vl_s.get("runs") or {}).get(f"c{c}", {})
        r = ref.get(f"serve c{c}", ("-", "-", "-"))
        rows.append(
            (
                f"serve c={c} output tok/s",
                f(p.get("output_throughput"), ",.0f"),
                f(v.get("output_throughput"), ",.0f"),
                r[0],
                f(roof.get(f"serve_c{c}_output_tok_s"), ",.0f"),
            )
        )
        rows.append(
            (
                f"serve c={c} TTFT mean / p99 (ms)",
                pair(p, "mean_ttft_ms", "p99_ttft_ms", ".0f"),
                pair(v, "mean_ttft_ms", "p99_ttft_ms", ".0f"),
                r[1],
                "",
            )
        )
        rows.append(
            (
                f"serve c={c} TPOT median / p99 (ms)",
                pair(p, "median_tpot_ms", "p99_tpot_ms", ".2f"),
                pair(v, "median_tpot_ms", "p99_tpot_ms", ".2f"),
                r[2],
                f(roof.get(f"serve_c{c}_tpot_ms"), ".2f"),
            )
        )
    pax_p, vl_p = st.get("pax-poisson") or {}, st.get("vllm-poisson") or {}
    if pax_p or vl_p:
        for rate in merged["spec"].get("poisson", {}).get("rates", []):
            name = f"r{rate:g}"
            p, v = (pax_p.get("runs") or {}).get(name, {}), (vl_p.get("runs") or {}).get(name, {})
            for label, a, b, fmt in (
                ("output tok/s", "output_throughput", None, ",.0f"),
                ("TTFT median / p99 (ms)", "median_ttft_ms", "p99_ttft_ms", ".0f"),
                ("TPOT median / p99 (ms)", "median_tpot_ms", "p99_tpot_ms", ".2f"),
            ):
                cell = (lambda r: f(r.get(a), fmt)) if b is None else (lambda r: pair(r, a, b, fmt))
                rows.append((f"Poisson {rate:g} req/s {label}", cell(p), cell(v), "-", ""))
    rows += variant_rows(merged, f, "fp8", "FP8", VLLM_PEER_FP8)
    rows += variant_rows(merged, f, "tp2", "TP=2", {})
    rows += variant_rows(merged, f, "qwen35", "Qwen3.5-9B", {})
    rows += variant_rows(merged, f, "qwen35-fp8", "Qwen3.5-9B FP8", {})
    rows += variant_rows(merged, f, "qwen3moe", "Qwen3-30B-A3B", {})
    rows += variant_rows(merged, f, "qwen3moe-fp8", "Qwen3-30B-A3B FP8", {})
    sc = pax_s.get("server_compile_metrics_delta")
    pax_c = f(pax_o.get("jax_compiles_during_timed_runs"), "d") + " offline"
    if sc:
        pax_c += f", {sum(sc.values()):.0f} serving (server /metrics)"
    rows.append(("JAX compiles during timed runs (must be 0)", pax_c, "", "", ""))
    rows.append(
        (
            "start-up: offline / server (s)",
            f"{f(pax_o.get('startup_s'), '.0f')} / {f(pax_s.get('startup_s'), '.0f')}",
            f"{f(vl_o.get('startup_s'), '.0f')} / {f(vl_s.get('startup_s'), '.0f')}",
            "150 / 57 (cold / warm compile cache)" if ref else "-",
            "",
        )
    )
    return rows


def variant_rows(merged: dict, f, variant: str, label: str, ref: dict) -> list[tuple[str, ...]]:
    """The rows of a variant's stages (pax-offline-<variant>, vllm-offline-<variant>, and the
    serve ones), when they ran: "fp8" (FP8 weights and KV in both engines), "tp2" (two GPUs),
    "qwen35" (Qwen3.5-9B shapes), "qwen35-fp8", "qwen3moe" (Qwen3-30B-A3B shapes)."""
    st = merged["stages"]
    pax, vl = st.get(f"pax-offline-{variant}") or {}, st.get(f"vllm-offline-{variant}") or {}
    if not any(st.get(f"{e}-{k}-{variant}") for e in ("pax", "vllm") for k in ("offline", "serve")):
        return []
    ref = ref if merged["spec"].get("preset") == "llama-3.1-8b" else {}
    rows = []
    for b in merged["spec"]["itl"]["batches"]:
        k = f"itl_batch{b}_ms"
        rows.append(
            (
                f"{label} batch-{b} ITL (ms)",
                f(pax.get(k), ".2f"),
                f(vl.get(k), ".2f"),
                ref.get(k, "-"),
                "",
            )
        )
    for w in merged["spec"]["offline"]:
        n = w["name"]
        cells = [
            f(((r.get("offline") or {}).get(n) or {}).get("output_tok_s"), ",.0f")
            for r in (pax, vl)
        ]
        rows.append((f"{label} offline {n} output tok/s", *cells, ref.get(f"offline {n}", "-"), ""))
    if pax or vl:
        cells = [f(r.get("startup_s"), ".0f") for r in (pax, vl)]
        rows.append((f"{label} offline start-up (s)", *cells, "-", ""))
    pax_s, vl_s = st.get(f"pax-serve-{variant}") or {}, st.get(f"vllm-serve-{variant}") or {}
    if pax_s or vl_s:
        for c in merged["spec"]["serve"]["concurrency"]:
            runs = [(r.get("runs") or {}).get(f"c{c}", {}) for r in (pax_s, vl_s)]
            for name, a, b, fmt in (
                ("output tok/s", "output_throughput", None, ",.0f"),
                ("TTFT mean / p99 (ms)", "mean_ttft_ms", "p99_ttft_ms", ".0f"),
                ("TPOT median / p99 (ms)", "median_tpot_ms", "p99_tpot_ms", ".2f"),
            ):
                cells = [f(r.get(a), fmt) if b is None else _pair(f, r, a, b, fmt) for r in runs]
                rows.append((f"{label} serve c={c} {name}", *cells, "-", ""))
    return rows


def _pair(f, r, a, b, fmt) -> str:
    """r[a] / r[b], each formatted by f; "-" for a run that did not happen."""
    return "-" if not r else f"{f(r.get(a), fmt)} / {f(r.get(b), fmt)}"


def markdown_table(merged: dict) -> str:
    """The run as the README shows it: device and commit, the measured ceilings, the table of
    summary_rows(), HF's line, failed and skipped stages."""
    st = merged["stages"].get("roofline") or {}
    env = merged.get("environment", {})
    lines = [
        f"Device: {env.get('device')}; jax {env.get('jax_version')}; commit "
        f"{(env.get('commit') or '?')[:10]}{' (dirty)' if env.get('commit_dirty') else ''}; "
        f"model {merged['spec']['preset']} ({merged['spec']['dtype']}, dummy weights); "
        f"{merged.get('date', '')}"
    ]
    if st.get("copy_bandwidth_Bps"):
        lines.append(
            f"Measured ceilings: copy {st['copy_bandwidth_Bps'] / 1e12:.3g} TB/s, matmul "
            f"{st['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s ({st.get('dtype')}) on "
            f"{st.get('device')}."
        )
    lines += [
        "",
        "| workload | paxengine | vLLM (this run) | vLLM 0.26 (VLLM-PEER.md) | roofline bound |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in summary_rows(merged)]
    hf = merged["stages"].get("hf") or {}
    if hf.get("ok"):

        def ms(k):
            return "-" if hf.get(k) is None else f"{hf[k]:.2f} ms"

        b = hf.get("batched") or {}
        lines += [
            "",
            f"HF transformers {hf.get('torch_version', '')} (this run): batch-1 ITL "
            f"eager {ms('itl_batch1_eager_ms')}, static cache + torch.compile "
            f"{ms('itl_batch1_compiled_ms')}; batched generate {b.get('name', '')} "
            f"{b.get('output_tok_s', 0):,.0f} output tok/s "
            "(VLLM-PEER.md: 81.7 ms, 7.22 ms, 1,710).",
        ]
    bad = [(k, v) for k, v in merged["stages"].items() if v and not v.get("ok")]
    failed = [f"{k}: {v.get('error', '')[:200]}" for k, v in bad if not v.get("skipped")]
    skipped = [f"{k} ({v.get('error', '')})" for k, v in bad if v.get("skipped")]
    if failed:
        lines += ["", "Failed stages: " + "; ".join(failed)]
    if skipped:
        lines += ["", "Skipped stages: " + "; ".join(skipped)]
    return "\n".join(lines)


def merge_earlier(merged: dict, path: Path) -> None:
    """Take into `merged` the stages of an earlier gpu_bench.json on this machine when it ran the
    same spec (a later call on a warm machine, e.g. vLLM after paxengine, adds to one table)."""
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if old.get("spec") == merged["spec"]:
        merged["stages"].update(old.get("stages", {}))


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m benchmarks.gpu.report GPU_BENCH_JSON [...]", file=sys.stderr)
        return 2
    for path in paths:
        print(markdown_table(json.loads(Path(path).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
