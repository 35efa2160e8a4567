"""vLLM's FlashAttention-3 paged attention on the decode and prefill shapes of
`benchmarks/kernels.py`, so our kernel and the one vLLM serves with are timed on the same card in
the same device call.

  PYTHONPATH=/tmp/vsite python -m benchmarks.kernels_fa3 [--out DIR] [--only NAMES]

Same shapes (Llama-3.1-8B attention: 32 q / 8 kv heads, d=128, page 16, bf16), same row names,
same byte and FLOP counts (the KV pages each call must read; causal QK and PV), same timing
method (20 calls per synchronization, median of the repetitions). Needs torch with CUDA and vLLM 0.26
(`../shared/gpu/VLLM-PEER.md`); writes kernels_fa3_<device>.json under --out (default $OUT).
A separate process from kernels.py: JAX and torch would each claim the GPU's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HQ, HKV, D, BS = 32, 8, 128, 16
DECODE_SHAPES = [(b, ctx) for b in (1, 8, 64, 256) for ctx in (512, 2048, 8192)]
# one sequence: (query tokens, KV length); the queries are the sequence's last tokens
PREFILL_SHAPES = {"prefill_512": (1, 512, 512), "prefill_2048": (1, 2048, 2048),   # (B, q, ctx)
                  "chunk_512_ctx4096": (1, 512, 4096), "prefill_8192": (1, 8192, 8192),
                  "prefill_4x2048": (4, 2048, 2048)}
CALLS, REPS = 20, 7


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * HKV * D * 2          # K and V pages, bf16


def attn_flops(q_len: int, ctx: int) -> int:
    """Causal QK and PV FLOPs of one sequence whose last q_len tokens are the queries."""
    return 4 * HQ * D * sum(ctx - q_len + i + 1 for i in range(q_len))


def time_fa3(batch: int, ctx: int, flash_attn_varlen_func, torch, q_len: int = 1) -> float:
    """Median microseconds per call over REPS syncs of CALLS back-to-back calls."""
    dev = "cuda"
    pages = -(-ctx // BS)
    num_blocks = batch * pages + 1
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(num_blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch * q_len, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    # every sequence's pages scattered over the pool, as in a served cache
    table = torch.randperm(num_blocks - 1, device=dev, generator=g)[:batch * pages]
    table = table.view(batch, pages).to(torch.int32)
    cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len
    used = torch.full((batch,), ctx, device=dev, dtype=torch.int32)

    def call():
        return flash_attn_varlen_func(q=q, k=k, v=v, max_seqlen_q=q_len, cu_seqlens_q=cu_q,
                                      max_seqlen_k=ctx, seqused_k=used, block_table=table,
                                      softmax_scale=D ** -0.5, causal=True, fa_version=3)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / CALLS * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma list of row names, e.g. decode_b64_ctx2048")
    args = ap.parse_args(argv)
    import torch
    import vllm
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    only = {s for s in args.only.split(",") if s}
    dev_name = torch.cuda.get_device_name(0)
    rows = []
    for b, ctx in DECODE_SHAPES:
        name = f"decode_b{b}_ctx{ctx}"
        if only and name not in only:
            continue
        us = time_fa3(b, ctx, flash_attn_varlen_func, torch)
        rows.append({"name": name, "B": b, "ctx": ctx, "kv_bytes": kv_bytes(b, ctx),
                     "fa3_us": us, "fa3_TBps": kv_bytes(b, ctx) / us / 1e6})
        print(f"{name:22s} FA3 {us:8.1f} us  {rows[-1]['fa3_TBps']:.2f} TB/s", flush=True)
    for name, (b, q_len, ctx) in PREFILL_SHAPES.items():
        if only and name not in only:
            continue
        us = time_fa3(b, ctx, flash_attn_varlen_func, torch, q_len=q_len)
        fl = b * attn_flops(q_len, ctx)
        rows.append({"name": name, "q_len": q_len, "ctx": ctx, "flops": fl, "fa3_us": us,
                     "fa3_TFLOPs": fl / us / 1e6})
        print(f"{name:22s} FA3 {us:8.1f} us  {rows[-1]['fa3_TFLOPs']:.0f} TFLOP/s", flush=True)
    res = {"device": dev_name, "torch": torch.__version__, "vllm": vllm.__version__,
           "timing": f"{CALLS} calls per sync, median of {REPS}",
           "command": "python -m benchmarks.kernels_fa3 " + " ".join(argv or sys.argv[1:]),
           "rows": rows}
    tag = "h200" if "H200" in dev_name else dev_name.lower().replace(" ", "_")
    with open(os.path.join(args.out, f"kernels_fa3_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
