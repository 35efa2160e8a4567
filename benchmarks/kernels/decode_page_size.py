"""Decode KV read rate against the page size: the Triton kernel and the Mosaic GPU decode kernel
(attention_mgpu_decode.py, one TMA copy per page) side by side, on the GPU.

    python -m benchmarks.kernels.decode_page_size [--page-sizes 16,64,128] [--out DIR]

At page 16 a TMA copy moves 4 KB (two 2 KB boxes under the 128-byte swizzle); the question is
whether small copies are what holds the Mosaic kernel below the Triton one. Each variant is a
jitted loop of 20 calls (median of 5 runs, 2 interleaved rounds), checked against the oracle
first. Writes $OUT/decode_page_size.json.
"""

from __future__ import annotations

import argparse
import os

import benchmarks.kernels.harness as K

SHAPES = {
    "decode_b64_ctx2048": ([(1, 2048)] * 64, 64, 64),
    "decode_b256_ctx512": ([(1, 512)] * 256, 256, 256),
}


def variants(bs):
    out = {"triton": {}}
    k = max(128, bs)
    out[f"mosaic_k{k}_s2_p132"] = dict(
        mosaic_decode=True, mosaic_block_k=k, mosaic_stages=2, mosaic_persistent=132
    )
    if bs <= 64:  # (4 x 128-row blocks would not fit in SMEM)
        out["mosaic_k64_s4_p132"] = dict(
            mosaic_decode=True, mosaic_block_k=64, mosaic_stages=4, mosaic_persistent=132
        )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-sizes", default="16,64,128")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    rows, fns = [], {}
    for bs in [int(x) for x in args.page_sizes.split(",")]:
        K.BS = bs  # build() reads the module's page size
        for name, (seqs, T, S) in SHAPES.items():
            q, kc, vc, md = K.build(seqs, T, S, 7)
            n = sum(ql for ql, _ in seqs)
            ref = K.oracle(q, kc, vc, md)
            for var, tun in variants(bs).items():
                row = dict(
                    page_size=bs, shape=name, variant=var, overrides=tun, kv_bytes=K.kv_bytes(seqs)
                )
                f = K.timed_variant(row, tun, (q, kc, vc, md), ref, n)
                if f is not None:
                    fns[len(rows)] = (f, (q, kc, vc, md))
                rows.append(row)
                print(row, flush=True)
    K.more_rounds(rows, fns, 1)
    print("\n| page | shape | variant | us | TB/s | rel err |\n|---|---|---|---|---|---|")
    for r in rows:
        if "us" in r:
            r["TBps"] = r["kv_bytes"] / r["us"] / 1e6
            print(
                f"| {r['page_size']} | {r['shape']} | {r['variant']} | {r['us']:.1f} | "
                f"{r['TBps']:.2f} | {r['rel_err']:.1e} |"
            )
    K.write_rows(args.out, "decode_page_size", rows)


if __name__ == "__main__":
    main()
