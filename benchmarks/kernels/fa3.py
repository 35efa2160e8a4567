"""vLLM's FlashAttention-3 paged attention on the decode and prefill shapes of `attention.py`, so
our kernel and the one vLLM serves with are timed on the same card in the same device call.

  PYTHONPATH=/tmp/vsite python -m benchmarks.kernels.fa3 [--out DIR] [--only NAMES]

Same shapes (Llama-3.1-8B attention: 32 q / 8 kv heads, d=128, page 16, bf16), same row names,
same byte and FLOP counts (the KV pages each call must read; causal QK and PV). Timed as 20
eager calls per synchronization (median of the repetitions), as 20 calls replayed from a CUDA
graph with the schedule planned once (how vLLM decodes), and both under torch.profiler for the
attention kernel's own device time and the device span of a call (`decode_trace.py` measures
ours the same ways; `compare.py` puts them side by side). Needs torch with CUDA and vLLM 0.26
(`../shared/gpu/VLLM-PEER.md`); writes kernels_fa3_<device>.json under --out (default $OUT).
A separate process from attention.py: JAX and torch would each claim the GPU's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

from benchmarks.measure import time_per_call  # imports no JAX: this process holds torch

HQ, HKV, D, BS = 32, 8, 128, 16
DECODE_SHAPES = [(b, ctx) for b in (1, 8, 64, 256) for ctx in (512, 2048, 8192)]
# one sequence: (query tokens, KV length); the queries are the sequence's last tokens
PREFILL_SHAPES = {
    "prefill_512": (1, 512, 512),
    "prefill_2048": (1, 2048, 2048),  # (B, q, ctx)
    "chunk_512_ctx4096": (1, 512, 4096),
    "prefill_8192": (1, 8192, 8192),
    "prefill_4x2048": (4, 2048, 2048),
}
CALLS, REPS = 20, 7


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * HKV * D * 2  # K and V pages, bf16


def attn_flops(q_len: int, ctx: int) -> int:
    """Causal QK and PV FLOPs of one sequence whose last q_len tokens are the queries."""
    return 4 * HQ * D * sum(ctx - q_len + i + 1 for i in range(q_len))


def kernel_us(run, torch) -> dict:
    """One run() of CALLS calls under torch.profiler, per call: device time of the largest
    kernel (the attention kernel) and of every kernel, and the device span (first kernel start
    to last kernel end: gaps between kernels included, the host's start-up not)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {}
    per = defaultdict(float)
    for e in kernels:
        per[e["name"]] += float(e.get("dur", 0.0))
    name, us = max(per.items(), key=lambda kv: kv[1])
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in kernels)
    return {
        "kernel_us": us / CALLS,
        "device_us": sum(per.values()) / CALLS,
        "span_us": (end - start) / CALLS,
        "kernel": name[:120],
        "kernels_per_call": len(kernels) / CALLS,
    }


def median_us(run, torch) -> float:
    """Median microseconds per call over REPS syncs of run() (CALLS calls)."""
    return 1e6 * time_per_call(run, CALLS, REPS, sync=lambda _: torch.cuda.synchronize())


def time_fa3(batch: int, ctx: int, fa, torch, q_len: int = 1) -> dict:
    """FA3 on one shape, three ways (microseconds per call):
    fa3_us: CALLS eager calls per sync, each planning its own schedule (the earlier runs' method);
    fa3_graph_us: as vLLM decodes, the schedule planned once (get_scheduler_metadata, per step
      in vLLM; vLLM's CUDA graphs also cap the number of splits, left to FA3's heuristic here)
      and CALLS calls replayed from one CUDA graph, checked against an eager call's output;
    fa3_eager_trace / fa3_graph_trace: the same under torch.profiler (kernel_us: the attention
      kernel alone; device_us: every kernel; span_us: the device's span, gaps included)."""
    flash_attn_varlen_func, get_scheduler_metadata = fa
    dev = "cuda"
    pages = -(-ctx // BS)
    num_blocks = batch * pages + 1
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch * q_len, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    # every sequence's pages scattered over the pool, as in a served cache
    table = torch.randperm(num_blocks - 1, device=dev, generator=g)[: batch * pages]
    table = table.view(batch, pages).to(torch.int32)
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len
    used = torch.full((batch,), ctx, device=dev, dtype=torch.int32)

    def call(**kw):
        return flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            max_seqlen_q=q_len,
            cu_seqlens_q=cu_q,
            max_seqlen_k=ctx,
            seqused_k=used,
            block_table=table,
            softmax_scale=D**-0.5,
            causal=True,
            fa_version=3,
            **kw,
        )

    def eager():
        for _ in range(CALLS):
            call()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    res = {"fa3_us": median_us(eager, torch), "fa3_eager_trace": kernel_us(eager, torch)}
    try:
        meta = get_scheduler_metadata(
            batch_size=batch,
            max_seqlen_q=q_len,
            max_seqlen_k=ctx,
            num_heads_q=HQ,
            num_heads_kv=HKV,
            headdim=D,
            cache_seqlens=used,
            qkv_dtype=torch.bfloat16,
            cu_seqlens_q=cu_q,
            page_size=BS,
            causal=True,
        )
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                call(scheduler_metadata=meta)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [call(scheduler_metadata=meta) for _ in range(CALLS)]
        graph.replay()
        torch.cuda.synchronize()
        # the planned schedule must give the eager call's output (else the timing means nothing)
        res["fa3_graph_max_abs_diff"] = float((outs[-1].float() - call().float()).abs().max())
        if not res["fa3_graph_max_abs_diff"] < 1e-2:
            raise ValueError(f"graph output differs from eager: {res['fa3_graph_max_abs_diff']}")
        res["fa3_graph_us"] = median_us(graph.replay, torch)
        res["fa3_graph_trace"] = kernel_us(graph.replay, torch)
    except Exception as e:  # noqa: BLE001 -- recorded; the eager numbers stand
        res["fa3_graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma list of row names, e.g. decode_b64_ctx2048")
    args = ap.parse_args(argv)
    import torch
    import vllm
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    fa = (flash_attn_varlen_func, get_scheduler_metadata)
    only = {s for s in args.only.split(",") if s}
    dev_name = torch.cuda.get_device_name(0)
    rows = []
    for b, ctx in DECODE_SHAPES:
        name = f"decode_b{b}_ctx{ctx}"
        if only and name not in only:
            continue
        r = time_fa3(b, ctx, fa, torch)
        nb = kv_bytes(b, ctx)
        rows.append(
            {
                "name": name,
                "B": b,
                "ctx": ctx,
                "kv_bytes": nb,
                **r,
                "fa3_TBps": nb / r["fa3_us"] / 1e6,
            }
        )
        tr = r.get("fa3_graph_trace") or r["fa3_eager_trace"]
        print(
            f"{name:22s} FA3 eager {r['fa3_us']:8.1f} us ({rows[-1]['fa3_TBps']:.2f} TB/s), "
            f"graph {r.get('fa3_graph_us', float('nan')):8.1f} us; kernel "
            f"{tr.get('kernel_us', float('nan')):8.1f} us, span {tr.get('span_us', float('nan')):8.1f} "
            f"us, {tr.get('kernels_per_call', 0):.0f} kernels a call  {tr.get('kernel', '')[:50]}",
            flush=True,
        )
    for name, (b, q_len, ctx) in PREFILL_SHAPES.items():
        if only and name not in only:
            continue
        r = time_fa3(b, ctx, fa, torch, q_len=q_len)
        us = r["fa3_us"]
        fl = b * attn_flops(q_len, ctx)
        rows.append(
            {
                "name": name,
                "q_len": q_len,
                "ctx": ctx,
                "flops": fl,
                **r,
                "fa3_TFLOPs": fl / us / 1e6,
            }
        )
        print(f"{name:22s} FA3 {us:8.1f} us  {rows[-1]['fa3_TFLOPs']:.0f} TFLOP/s", flush=True)
    res = {
        "device": dev_name,
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "timing": f"{CALLS} calls per sync, median of {REPS}; eager and CUDA-graph replay; "
        "kernel times from torch.profiler",
        "command": "python -m benchmarks.kernels.fa3 " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
    }
    tag = "h200" if "H200" in dev_name else dev_name.lower().replace(" ", "_")
    with open(os.path.join(args.out, f"kernels_fa3_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
