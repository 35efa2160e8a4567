"""Static launch choices of ragged paged attention: the tuning of each launch, picked from the
bucket shape (tokens T, sequence slots S, heads, head_dim, page size) alone, so a bucket
compiles once. The numbers behind each choice are H200 measurements (kernels_pallas/README.md,
benchmarks/results/)."""

from __future__ import annotations

import dataclasses

from kernels_pallas import attention_mgpu


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Tuning:
    block_q: int  # query tokens per tile (M = block_q * next_pow2(G) rows)
    block_k: int  # KV positions per inner step (a multiple of the page size is best)
    k_splits: int  # split-K partitions
    num_warps: int
    num_stages: int
    pv_split: bool = True  # P as hi + lo parts in the PV product: bf16, or fp16 over fp16 V pages
    # KV blocks that no query row of the tile masks (all causal-visible, inside the window,
    # below kv_len) run a loop without masks, with V going straight to the dot; only the
    # boundary blocks pay for the masks. False: one masked loop (the run-3 kernel).
    split_mask: bool = True
    # Launch tiles in reverse order: a sequence's last tiles have the longest causal KV range,
    # so the longest programs start first (LPT) instead of forming the tail of the grid.
    reverse_tiles: bool = True
    # bf16 only: the PV product in fp16 (P and V; V clamped to +-65280, exact for |v| in
    # [6e-5, 65280]): 11 mantissa bits of P in ONE dot, instead of pv_split's two bf16 dots.
    pv_fp16: bool = False
    # Mixed buckets (T > 2 S, k_splits 1): sequences with <= decode block_q query tokens go to a
    # first launch with decode tiles (decode default tuning, one tile per sequence slot, M = 16),
    # the rest to a second launch with this tuning, writing into the first one's output.
    mixed_split: bool = False
    # The main launch through the Mosaic GPU kernel (attention_mgpu.py: TMA, wgmma, warp
    # specialisation) where it applies (bf16/fp16, no window / soft cap / fp8, jax >= 0.11),
    # with its own KV block and pipeline depth; else the fields above (Triton) apply.
    mosaic: bool = False
    mosaic_block_k: int = 128
    mosaic_stages: int = 2
    # > 0: that many CTAs loop over the valid tiles (prefill: the default, 2 per SM), else a CTA
    # per tile the bucket could need, empty ones included; decode: over the (head, tile, split)
    # items.
    mosaic_persistent: int = 0
    # The Mosaic prefill kernel's ping-pong schedule (attention_mgpu: one compute warpgroup's
    # softmax under the other's matmuls) on items of at least this many KV blocks; 0: never.
    mosaic_schedule: int = 0
    # Decode launches (a decode bucket's only one, a mixed bucket's first one when its main
    # launch is Triton) through the Mosaic GPU decode kernel (attention_mgpu_decode.py: TMA
    # page copies in a warpgroup of their own), with mosaic_block_k / mosaic_stages of the
    # decode tuning (and mosaic_persistent), where eligible; else the Triton fields apply.
    # Opt-in: on the H200 it measured 0-11% slower than the Triton decode launch.
    mosaic_decode: bool = False
    mosaic_decode_wgs: int = 2  # compute warpgroups of the decode kernel (1 or 2)
    # Triton: a KV block is one page (block_k == block_size): its id read once, K / V loaded as
    # contiguous tiles instead of gathered rows.
    page_block: bool = False


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tuning))


def default_tuning(
    T: int,
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    block_size: int,
    num_sms: int = 132,
    kv_itemsize: int = 2,
    v_t: bool = False,
) -> Tuning:
    """Static choice from the bucket shape, the KV pages' item size (1: fp8) and whether V pages
    are stored [D, bs] (`v_t`, layout.v_transposed); the engine may override any field."""
    tun = _default_16bit(T, S, Hq, Hkv, D, block_size, num_sms)
    if v_t:
        # [D, bs] V pages are read a page per KV block (the kernel's only way to read them).
        # Decode stages, H200, fp8, 64-token pages, 2 / 3 / 4 stages, us: B=64 ctx 2048 104.3 /
        # 98.2 / 95.7, B=1 ctx 8192 22.7 / 31.3 / 24.4 (gpu_2026-12-03f_page_blocks/); 100.9 /
        # 97.7 / 101.3 and 31.5 / 28.2 / 30.0 a day later (gpu_2026-12-04_fp8_pages/): noise.
        # Split-K twice the 16-bit choice where that splits at all (fewer programs than SMs):
        # a 64-position block halves a program's work between loads, and one program per SM
        # left long contexts at small batch slower than 16-token pages. H200, us, default / 2x
        # splits / 16-token pages (gpu_2026-12-04_fp8_pages/page_blocks_splits.json): B=8 ctx
        # 8192 77.8 / 63.6 / 73.0; B=1 ctx 8192 28.5 / 24.4 / 25.1; where it does not split
        # (B=64 ctx 2048), 2 splits cost 96.8 -> 106.5.
        tun = dataclasses.replace(tun, page_block=True, block_k=block_size)
        if is_decode_bucket(T, S):
            splits = min(2 * tun.k_splits, 32) if tun.k_splits > 1 else 1
            # 2 warps a program from FP8_DECODE_TWO_WARP_PROGRAMS programs on (below, 4).
            warps = 2 if Hkv * S >= FP8_DECODE_TWO_WARP_PROGRAMS else tun.num_warps
            return dataclasses.replace(
                tun,
                pv_split=False,
                split_mask=True,
                num_stages=4,
                k_splits=splits,
                num_warps=warps,
            )
        return dataclasses.replace(tun, pv_split=False)
    if kv_itemsize != 1:
        return tun
    # fp8 pages: V holds 3 mantissa bits, so P's second (lo) PV dot buys nothing, and a KV byte
    # costs compute (two e4m3 -> fp16 conversions and the dots) more than bandwidth. H200, one
    # call each, decode, us (gpu_2026-12-01_fp8_decode/): B=256 ctx 1024 276 -> 206 (one PV dot,
    # mask-free interior blocks, 2 stages); B=64 ctx 2048 150 -> 114; B=8 ctx 8192 96 -> 71;
    # B=1 ctx 8192 28 -> 24 (8 warps there: 24.2, 2 stages 25.5, within the spread).
    if is_decode_bucket(T, S):
        return dataclasses.replace(tun, pv_split=False, split_mask=True, num_stages=2)
    return dataclasses.replace(tun, pv_split=False)


# fp8 64-token pages, decode: 2 warps a program once there are this many (KV head, sequence)
# programs. H200, us, 4 / 2 warps, two calls (benchmarks/results/gpu_2026-12-04d_f16_gemv/):
# B=300 ctx 1536 (2,400 programs) 281.5 / 266.7 and 278.5 / 262.8; B=256 ctx 1024 (2,048)
# 176.2 / 178.8 and 168.9 / 177.1; B=64 ctx 2048 99.7 / 97.9 and 97.6 / 99.0; 8 warps 1.4-1.6x
# slower everywhere. The FP8 engine with 2 warps in every decode bucket: 300 x (1000, 1000)
# 14,775 against 14,537 output tok/s, 256 x (1024, 128) 5,669 against 5,852 (call 3).
FP8_DECODE_TWO_WARP_PROGRAMS = 2400


def _default_16bit(
    T: int, S: int, Hq: int, Hkv: int, D: int, block_size: int, num_sms: int
) -> Tuning:
    g_pad = next_pow2(Hq // Hkv)
    if is_decode_bucket(T, S):
        block_q = max(1, 16 // g_pad)
        programs = Hkv * max(S, 1)
        k_splits = 1
        while programs * k_splits < num_sms and k_splits < 16:
            k_splits *= 2
        # H200 sweeps (benchmarks/results/kernels_h200.json, kernels_tune_h200.json): block_k 128,
        # 4 warps; one masked loop (split_mask off: 151 vs 170 us at B=64 ctx 2048, 87 vs 96 us at
        # B=8 ctx 8192). 3 stages (5 runs, 3 shapes: 1-11% faster than 2, e.g. 151 vs 165 us at
        # B=64 ctx 2048). Split-K to one program per SM, not two (B=8 ctx 8192, 4 vs 8 splits:
        # 88.7 vs 103.4 us; an earlier run 87.6 vs 95.6).
        return Tuning(
            block_q,
            max(128, block_size),
            k_splits,
            4,
            3,
            split_mask=False,
            reverse_tiles=False,
            mosaic_block_k=64,
            mosaic_stages=4,
            mosaic_decode=_MOSAIC_DECODE_DEFAULT and attention_mgpu.available(),
        )
    # Prefill: mask-free interior blocks and longest tiles first (206 vs 246 us, 2048 tokens);
    # mixed buckets split decode rows into their own launch (196 vs 265 us, 60 decodes + 448).
    # Long prefills take 256-row tiles (each K/V block loaded serves 4x the query rows): 8 warps,
    # 3 stages and the fp16 PV product (pv_split's second dot spills at this size: 373 us).
    # H200, 2,048 tokens: 156.5 vs 206.1 us (256 programs). They need a program per SM at
    # least: a 512-token chunk (64 programs) ran at 237 vs 195 us.
    # Where jax has Mosaic GPU (0.11), buckets of 512+ tokens take the Mosaic kernel instead,
    # with a persistent grid of 2 CTAs per SM looping over the valid tiles only. H200, one call
    # (gpu_2026-11-30g/kernels_tune_decode_persistent_2.json), us, Mosaic vs Triton: 8,192
    # tokens of one prompt 1,198 vs 1,832; 2,048 123 vs 154; 512 32.6 vs 41.0; a 512 chunk at
    # ctx 4096 95.7 vs 184; 60 decodes + a 1,988 prefill in (2048, 64) 263 vs 302; 8 x 1,000
    # in an engine bucket (8192, 256) 308 vs 422 (a CTA per tile there: 477).
    mosaic = attention_mgpu.available() and T >= 512
    mosaic_kw = dict(
        mosaic=mosaic, mosaic_persistent=2 * num_sms, mosaic_schedule=_MOSAIC_SCHEDULE_MIN_BLOCKS
    )
    big_q = max(1, 256 // g_pad)
    # (head_dim <= 128 only: at Qwen3.5's 256 the 256-row tile's Q block and 3-stage K / V
    # buffers ask for 262,400 bytes of shared memory, over the H100's 232,448, and the engine
    # failed to start; gpu_2026-12-06c_qwen35_defaults/)
    if D <= 128 and Hkv * -(-T // big_q) >= num_sms:
        return Tuning(
            big_q, max(64, block_size), 1, 8, 3, pv_fp16=True, mixed_split=True, **mosaic_kw
        )
    block_q = max(1, 64 // g_pad)
    return Tuning(block_q, max(64, block_size), 1, 4, 2, mixed_split=True, **mosaic_kw)


# The ping-pong schedule on items of 8+ KV blocks vs never, H200, fp16 V pages, one call
# (gpu_2026-11-30h/kernels_tune_sched_4.json), us: 8,192 tokens 1,095 vs 1,172; 4 x 2,048 428 vs
# 445; 2,048 109.5 vs 114.7; 60 decodes + 1,988 prefill 268 vs 268. On every item (1) or 4+:
# within noise of 8+ (e.g. 8,192: 1,119 / 1,127). The kernel alone, 8 x 1,000 in (8192, 256):
# 261-268 vs 262 (mosaic_knobs_5.json). Short items have little to overlap, so they skip it.
_MOSAIC_SCHEDULE_MIN_BLOCKS = 8


# H200, Mosaic decode kernel (best variant) vs Triton, one call: B=64 ctx 2048 160.5 vs 159.7
# us, B=8 ctx 8192 99.9 vs 92.0, B=256 ctx 512 176.0 vs 167.1, B=1 ctx 8192 32.0 vs 28.8
# (benchmarks/results/gpu_2026-11-30g/kernels_tune_decode_3.json). Kernel alone (device trace,
# gpu_2026-11-30i/decode_trace_5bdb89b_*.json): 133 vs 131 us, 70.5 vs 69.1, 142 vs 137, 11.1 vs
# 11.6. So Triton keeps decode.
_MOSAIC_DECODE_DEFAULT = False


def parse_tuning_spec(var: str, spec: str, fields, signed: bool = True) -> dict:
    """An A/B knob's "name=int,name=int" (the environment variable `var`'s value) -> {name: int}
    over `fields`; an unknown name or a value not an integer (not a non-negative one where
    signed is False) is a ValueError naming the variable and the item."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        digits = value.lstrip("-") if signed else value
        if name not in fields or not digits.isdigit():
            raise ValueError(f"{var}: bad item {item!r}")
        out[name] = int(value)
    return out


def is_decode_bucket(T: int, S: int) -> bool:
    """Buckets of at most 2 tokens per sequence slot run one decode-shaped launch."""
    return T <= 2 * S


def resolve_tuning(
    T: int,
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    block_size: int,
    num_sms: int = 132,
    kv_itemsize: int = 2,
    v_t: bool = False,
    **overrides,
) -> Tuning:
    """default_tuning with the fields given (not None) replaced."""
    tun = default_tuning(T, S, Hq, Hkv, D, block_size, num_sms, kv_itemsize, v_t)
    bad = set(overrides) - set(TUNING_FIELDS)
    if bad:
        raise TypeError(f"unknown tuning fields {sorted(bad)}")
    return dataclasses.replace(tun, **{k: v for k, v in overrides.items() if v is not None})


def plan_launches(
    T: int,
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    block_size: int,
    num_sms: int = 132,
    kv_itemsize: int = 2,
    v_t: bool = False,
    **overrides,
) -> tuple[Tuning, Tuning | None]:
    """The tunings of one call's launches: (main, decode), decode None unless a mixed bucket
    splits its decode rows into a first launch (`mixed_split`). The decode launch takes the
    decode defaults of an (S, S) bucket without split-K, and the main launch's PV product and
    mask-loop choices: measured on the H200, that beats the pure decode defaults there (60
    decodes at ctx 2048 + a 448-token chunk: 194.7 vs 210.6 us; + a 1,988-token prefill with the
    256-row tiles' fp16 PV: 299.7 vs 324.9 us)."""
    tun = resolve_tuning(T, S, Hq, Hkv, D, block_size, num_sms, kv_itemsize, v_t, **overrides)
    if not (tun.mixed_split and T > 2 * S and S > 1 and tun.k_splits == 1):
        return tun, None
    dtun = dataclasses.replace(
        default_tuning(S, S, Hq, Hkv, D, block_size, num_sms, kv_itemsize, v_t),
        k_splits=1,
        pv_split=tun.pv_split,
        pv_fp16=tun.pv_fp16,
        split_mask=tun.split_mask,
        mosaic_decode=tun.mosaic_decode,
        mosaic_decode_wgs=tun.mosaic_decode_wgs,
        page_block=tun.page_block,
    )
    if tun.page_block:  # (a block is one page in both launches)
        dtun = dataclasses.replace(dtun, block_k=tun.block_k)
    return tun, dtun
