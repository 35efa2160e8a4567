"""What the attention micro-benchmarks share: Llama-3.1-8B attention shapes, a random paged batch
on the device, the oracle every variant is checked against, the bytes and FLOPs a call must move,
our kernel as a jitted call, and the run record they write.

The batch's caches are built on the device (fast for GBs); the metadata on the host, each
sequence's pages permuted over the pool as in a served cache.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import (
    AttentionMetadata,
    ragged_paged_attention,
    ref_ragged_paged_attention,
    value_cache_dtype,
    value_page_shape,
)

HQ, HKV, D, BS = 32, 8, 128, 16  # q heads, kv heads, head dim, page size (tokens)
DT = jnp.bfloat16
ON_GPU = jax.default_backend() == "gpu"
INTERP = not ON_GPU  # on a CPU the kernels run in Pallas' interpret mode

SHAPES = {  # name: (seqs [(q_len, kv_len)], T, S)
    "decode_b64_ctx2048": ([(1, 2048)] * 64, 64, 64),
    # the batch-1 ITL step: one live row in the engine's (16, 8) bucket, short context; the
    # default launches 8 kv heads x 10 tiles x 8 splits for it (~23 us a layer, launch-bound)
    "engine_b1_ctx256": ([(1, 256)], 16, 8),
    "prefill_2048": ([(2048, 2048)], 2048, 1),
    "decode_b8_ctx8192": ([(1, 8192)] * 8, 8, 8),
    # the decode-heavy offline row's step (300 x (1000, 1000): ~256 rows at 1-2k context)
    "decode_b256_ctx1024": ([(1, 1024)] * 256, 256, 256),
    "chunk_512_ctx4096": ([(512, 4096)], 512, 1),
    "decode_b256_ctx512": ([(1, 512)] * 256, 256, 256),
    "decode_b64_ctx512": ([(1, 512)] * 64, 64, 64),
    "mixed_60dec2048_448pf": ([(1, 2048)] * 60 + [(448, 1024)], 512, 64),
    # a mixed bucket big enough for the 256-row prefill tiles
    "mixed_60dec2048_1988pf": ([(1, 2048)] * 60 + [(1988, 1988)], 2048, 64),
    # the engine's long-prefill step: 8,192 tokens of 4 prompts
    "prefill_4x2048": ([(2048, 2048)] * 4, 8192, 4),
    "prefill_8192": ([(8192, 8192)], 8192, 1),
    "prefill_512": ([(512, 512)], 512, 1),
    "decode_b1_ctx8192": ([(1, 8192)], 1, 1),
    # 8 prompts in one of the GPU engine's long buckets: 256 sequence slots, mostly empty
    "engine_8x1000_s256": ([(1000, 1000)] * 8, 8192, 256),
}
QUICK_SHAPES = {  # CPU smoke sizes (interpret mode)
    "decode_b4_ctx64": ([(1, 64)] * 4, 4, 4),
    "prefill_64": ([(64, 64)], 64, 1),
    "mixed_q": ([(1, 100)] * 3 + [(29, 50)], 32, 4),
}

LOG: list[str] = []  # every line log() printed, saved with the results


def log(*a) -> None:
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def build(seqs, T, S, key, num_blocks=None, kv_dtype=DT, v_dtype=None):
    """Device-side random caches (fast for GBs) + host-built metadata with permuted blocks.
    V pages take the engine's dtype (value_cache_dtype: fp16 under bf16) unless v_dtype says,
    and its layout ([D, bs] for 64-token fp8 pages: value_page_shape). The page size is this
    module's BS, read at call time (decode_page_size.py changes it)."""
    rng = np.random.default_rng(int(key))
    pages = [-(-kv // BS) for _, kv in seqs]
    P = max(pages)
    NB = num_blocks or sum(pages) + 1
    perm = rng.permutation(NB)
    bt = np.zeros((S, P), np.int32)
    sl = np.zeros(S, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    c = 0
    for i, (ql, kv) in enumerate(seqs):
        bt[i, : pages[i]] = perm[c : c + pages[i]]
        c += pages[i]
        sl[i] = kv
        qsl[i + 1] = qsl[i] + ql
    qsl[len(seqs) + 1 :] = qsl[len(seqs)]
    md = AttentionMetadata(
        jnp.full((T,), -1, jnp.int32),
        jnp.asarray(bt),
        jnp.asarray(sl),
        jnp.asarray(qsl),
        jnp.asarray([len(seqs)], jnp.int32),
    )
    k1, k2, k3 = jax.random.split(jax.random.key(int(key)), 3)
    shape = (1, HKV, NB, BS, D)
    kc = jax.random.normal(k1, shape, jnp.float32).astype(kv_dtype)
    v_shape = shape[:3] + value_page_shape(kv_dtype, BS, D)
    vc = jax.random.normal(k2, v_shape, jnp.float32).astype(v_dtype or value_cache_dtype(kv_dtype))
    q = jax.random.normal(k3, (T, HQ, D), jnp.float32).astype(DT)
    return q, kc, vc, md


def kv_bytes(seqs, itemsize=2):
    """Bytes of K and V pages a call must read."""
    return sum(kv for _, kv in seqs) * HKV * D * itemsize * 2


def attn_flops(seqs):
    """Causal QK and PV FLOPs (the queries are each sequence's last q_len tokens)."""
    f = 0
    for ql, kv in seqs:
        f += sum(kv - ql + i + 1 for i in range(ql))
    return 4 * HQ * D * f


# The jnp oracle on a batch from build() (fp32 queries): what every variant is checked against.
oracle = jax.jit(
    lambda q, kc, vc, md: ref_ragged_paged_attention(
        q.astype(jnp.float32), kc, vc, 0, md, sm_scale=D**-0.5
    )
)


def ours_fn(**tun):
    """Our kernel with the tuning overrides `tun`, one jitted call of (q, kc, vc, md)."""
    f = functools.partial(ragged_paged_attention, sm_scale=D**-0.5, interpret=INTERP, **tun)
    return jax.jit(lambda q, kc, vc, md: f(q, kc, vc, jnp.int32(0), md))


def run_record(timing: str) -> dict:
    """The head of a results file: device, versions, command, timing method, shapes."""
    dev = jax.devices()[0]
    log(f"device={dev.device_kind} backend={jax.default_backend()} jax={jax.__version__}")
    return dict(
        device=dev.device_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        python=platform.python_version(),
        command=" ".join(sys.argv),
        timing=timing,
        shapes=dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16"),
    )


def save(result, rows, out, fname="kernels"):
    """Write <fname>_h200.json (or <fname>_<backend>.json) under `out`, with the log so far."""
    result["rows"] = rows
    result["log"] = LOG
    os.makedirs(out, exist_ok=True)
    dev = jax.devices()[0]
    fname = (
        f"{fname}_h200.json"
        if "H200" in dev.device_kind
        else f"{fname}_{jax.default_backend()}.json"
    )
    with open(os.path.join(out, fname), "w") as f:
        json.dump(result, f, indent=1, default=str)
