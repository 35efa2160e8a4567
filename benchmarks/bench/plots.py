"""PNG plots for the benchmarks (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _run_label(run: dict) -> str:
    c = run.get("max_concurrency")
    rate = run.get("request_rate")
    if c:
        return f"concurrency {c}"
    if rate not in (None, "inf") and rate != float("inf"):
        return f"{rate:g} req/s"
    return "all at once"


def _sweep_axis(runs: list[dict]) -> tuple[str, str] | None:
    """What a sweep varied: the Poisson request rate or the concurrency; None if not a sweep."""
    if len(runs) < 2:
        return None
    rates = [r.get("request_rate") for r in runs]
    if all(isinstance(x, (int, float)) and math.isfinite(x) for x in rates) and len(set(rates)) > 1:
        return "request_rate", "request rate (req/s)"
    concs = [r.get("max_concurrency") for r in runs]
    if all(concs) and len(set(concs)) > 1:
        return "max_concurrency", "max concurrency"
    return None


def _title(result: dict) -> str:
    env = result.get("environment", {})
    srv = result.get("server", {})
    d = result.get("dataset", {})
    data = d.get("name", "")
    if data == "random":
        data += f" {d.get('random_input_len')}/{d.get('random_output_len')}"
    parts = [result.get("label") or srv.get("model") or "", data, env.get("device") or ""]
    return " | ".join(p for p in parts if p)


def serve_plots(result: dict, out_dir: str | Path, stem: str = "serve") -> list[str]:
    """Latency CDFs (TTFT, TPOT, ITL, E2E; one line per run) and, for a sweep of two or more
    concurrencies, throughput and latency against concurrency. Returns the files written."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    written = []

    if any(r.get("requests") for r in runs):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        for ax, (key, name) in zip(
            axes.flat,
            (
                ("ttft", "Time to first token"),
                ("tpot", "Time per output token"),
                ("itl", "Inter-token latency"),
                ("latency", "End-to-end latency"),
            ),
        ):
            for run in runs:
                recs = [q for q in run.get("requests") or [] if q["success"]]
                if key == "itl":
                    v = [x for q in recs for x in q["itl"]]
                else:
                    v = [q[key] for q in recs if q[key] is not None]
                if not v:
                    continue
                v = np.sort(np.asarray(v, dtype=float))
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=_run_label(run))
            ax.set_title(name)
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of " + ("chunks" if key == "itl" else "requests"))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle("Latency CDFs: " + _title(result), fontsize=10)
        fig.tight_layout()
        p = out_dir / f"{stem}_latency_cdf.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))

    axis = _sweep_axis(runs)
    if axis is not None:
        key, label = axis
        sweep = runs
        c = [r[key] for r in sweep]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        ax = axes[0]
        ax.plot(c, [r["output_throughput"] for r in sweep], "o-", label="output tok/s")
        ax.plot(c, [r["total_token_throughput"] for r in sweep], "s--", label="total tok/s")
        ax.set_ylabel("tokens / s")
        ax2 = ax.twinx()
        ax2.plot(c, [r["request_throughput"] for r in sweep], "^:", color="gray", label="req/s")
        ax2.set_ylabel("requests / s")
        ax.set_title("Throughput")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        for ax, metric, name in (
            (axes[1], "ttft", "Time to first token"),
            (axes[2], "tpot", "Time per output token"),
        ):
            for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
                key = f"{stat}_{metric}_ms"
                if all(r.get(key) is not None for r in sweep):
                    ax.plot(c, [r[key] for r in sweep], style, label=stat)
            ax.set_ylabel("ms")
            ax.set_title(name)
            ax.legend(fontsize=8)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(c)
            ax.set_xticklabels([f"{x:g}" for x in c])
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        fig.suptitle(f"Against {label}: " + _title(result), fontsize=10)
        fig.tight_layout()
        p = out_dir / f"{stem}_sweep.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    return written


def bar_plot(
    path: str | Path, labels: list[str], values: list[float], ylabel: str, title: str
) -> str:
    """One bar per system (e.g. paxengine vs HF transformers output tok/s)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(
        labels, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(values)]
    )
    for b, v in zip(bars, values):
        ax.annotate(
            f"{v:,.1f}",
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
