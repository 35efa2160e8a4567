"""Decode tiles of ragged paged attention as a Mosaic GPU kernel (Hopper: TMA, wgmma).

Opt-in (`Tuning.mosaic_decode`): on the H200 it measured 0-11% slower than the Triton decode
launch (benchmarks/results/gpu_2026-11-30g/), which stays the default.

Decode reads every KV byte once and does little math on it, so the kernel is built to keep
HBM busy: one warpgroup only issues TMA copies (one per [block_size, D] page of K and of V,
the block table read in-kernel a block ahead), several pipeline slots deep, while two compute
warpgroups consume alternate slots. Its work decomposition is the Triton kernel's decode
launch (attention.py): an item per (KV head, tile of up to `block_q` query tokens of one
sequence, KV split), whose query rows are all G query heads of that KV head for each token,
so every page loaded serves all G heads. A CTA per item, or (`persistent`) a fixed number of
CTAs looping over them, the pipeline slots running on from item to item and the queries
double-buffered, so the next item's loads start under this one's last blocks.

* Query rows: wgmma needs M = 64 rows; a tile fills `W` rows per token with an 8-row aligned
  window of the flat query [T * Hq, D] that holds its G heads (TMA into the tiled SMEM that
  wgmma reads must start on a multiple of 8 rows). The G real rows of token t sit at
  rows W t + off_t; every other row is computed and never stored (rows of an MMA do not mix).
  Decode is bound by memory, not by the 64 / G-fold wasted MMA work.
* S = Q K^T with wgmma from SMEM; online softmax in registers (exp2 domain); O += P V with P
  from registers as two parts, hi + lo, of V's dtype (bf16 or fp16): one 16-bit P misses the 2e-3 bar
  (1.9-2.3e-3 measured), two keep ~16 bits of it, and the second MMA is free when memory
  bound. Only the blocks that reach past a row's position are masked; the last one's V rows
  at or past kv_len are zeroed in SMEM first (free slots may hold NaN bit patterns, and
  P = 0 would still give 0 * NaN). The second compute warpgroup hands its (acc, m, l) to the
  first through SMEM at the end of an item.
* Split-K (flash-decoding) when there are too few (head, tile) pairs to fill the GPU: each
  split writes its normalised partial output and log2-sum-exp per row (fp32), and a small
  jnp combine merges them (`combine_splits`).
* Output leaves through SMEM by TMA, exactly each token's G rows.

Mosaic GPU's Pallas API changes between jax releases; the kernel targets jax 0.11 and imports
Mosaic GPU only when called (dispatch.py calls it only where attention_mgpu.available()).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import attention_mgpu
from kernels_pallas.softmax import LOG2E, MASK_VALUE, P_LOG2_GAIN

M = 64  # wgmma's M: query rows per CTA
LSE_COLS = 32  # the log2-sum-exp of a row, repeated: 128-byte rows keep every TMA
# store's shared-memory source aligned, whatever the row offset


def rows_per_token(Hq: int, Hkv: int) -> int:
    """W: rows of the 8-aligned window that holds a token's G query heads for every KV head."""
    G = Hq // Hkv
    max_off = max(h * G % 8 for h in range(Hkv)) if Hq % 8 == 0 else 7
    return 8 * -(-(max_off + G) // 8)


def decode_block_q(Hq: int, Hkv: int) -> int:
    """Query tokens per tile (64 rows / W)."""
    return max(1, M // rows_per_token(Hq, Hkv))


def smem_bytes(
    D: int, block_kv: int, stages: int, compute_wgs: int, split: bool, itemsize: int = 2
) -> int:
    """Shared memory the kernel allocates (the buffers of `entry`)."""
    kv = 2 * stages * block_kv * D * itemsize
    q = 2 * M * D * itemsize
    out = (8 * D * 4 if compute_wgs == 2 else M * D * 4) if split else M * D * itemsize
    hand_over = (M * D + 2 * M) * 4 if compute_wgs == 2 else 0
    return kv + q + out + M * LSE_COLS * 4 + hand_over


SMEM_LIMIT = 227 * 1024 - 1024  # Hopper's per-block limit, less room for the barriers


def decode_eligible(
    q_dtype,
    k_dtype,
    v_dtype,
    Hq: int,
    Hkv: int,
    D: int,
    block_size: int,
    block_kv: int,
    stages: int,
    compute_wgs: int,
    k_splits: int = 1,
    *,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
) -> bool:
    """Whether this kernel can serve a decode launch (else the Triton kernel does): what the
    Mosaic prefill kernel needs (dtypes, shapes, no window / soft cap / fp8, jax >= 0.11), and
    the query rows, warpgroups and shared memory of this one."""
    return (
        attention_mgpu.mosaic_eligible(
            q_dtype,
            k_dtype,
            v_dtype,
            D,
            block_size,
            block_kv,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        and rows_per_token(Hq, Hkv) <= M
        and compute_wgs in (1, 2)
        and stages % compute_wgs == 0
        and smem_bytes(D, block_kv, stages, compute_wgs, k_splits > 1) <= SMEM_LIMIT
    )


def combine_splits(o_part, lse_part, k_splits: int, dtype):
    """Merges split-K partials: o_part [k * R, D] (normalised per split), lse_part [k * R, 8]
    (log2-sum-exp, offset by P_LOG2_GAIN in every split alike; MASK_VALUE where a split saw no
    key) -> [R, D]."""
    o = o_part.reshape(k_splits, -1, o_part.shape[-1])
    lse = lse_part.reshape(k_splits, -1, LSE_COLS)[..., 0]
    w = jnp.exp2(lse - jnp.max(lse, axis=0)[None])
    den = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o, axis=0) / den[:, None]
    return out.astype(dtype)


# A jit of its own, lowered once per bucket (see attention_mgpu.mosaic_prefill_attention).
@functools.partial(
    jax.jit,
    static_argnames=(
        "num_tiles",
        "NB",
        "P",
        "Hq",
        "Hkv",
        "sm_scale",
        "block_kv",
        "stages",
        "k_splits",
        "compute_wgs",
        "persistent",
        "interpret",
    ),
)
def mosaic_decode_attention(
    q2,
    k_flat,
    v_flat,
    meta,
    bt_flat,
    kv_base,
    *,
    num_tiles,
    NB,
    P,
    Hq,
    Hkv,
    sm_scale,
    block_kv=64,
    stages=4,
    k_splits=1,
    compute_wgs=2,
    persistent=0,
    interpret=False,
):
    """Attention of the tiles in `meta` ([num_tiles, 8] from tiles.tile_metadata or
    tiles.decode_tile_metadata with block_q = decode_block_q(Hq, Hkv): seq, first token, tokens,
    first position, kv_len).

    q2 [T * Hq, D] (token-major, heads inner); k_flat / v_flat [L * Hkv * NB, block_size, D]
    (one row per page); bt_flat [S * P]; kv_base [1] int32 = layer * Hkv.
    Returns [T * Hq, D] (k_splits == 1; rows of no tile unwritten), else the partials
    (o [k_splits * T * Hq, D] fp32, lse [k_splits * T * Hq, 8] fp32) for `combine_splits`.
    compute_wgs = C (1 or 2): C compute warpgroups take every C-th KV block (stages a multiple
    of C), each with its own online softmax; the first merges the second's at the end.
    persistent = N > 0: N CTAs loop over the (head, tile, split) items, the pipeline slots
    running on from item to item (the next item's pages load under this one's last blocks);
    else a CTA per item.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    R, D = q2.shape
    bs = k_flat.shape[1]
    G = Hq // Hkv
    W = rows_per_token(Hq, Hkv)
    block_q = M // W
    dtype = q2.dtype
    v_dtype = v_flat.dtype  # q2's, or fp16 (value_cache_dtype)
    ppb = block_kv // bs  # pages per KV block
    C = compute_wgs
    assert C in (1, 2) and stages % C == 0, "each pipeline slot belongs to one compute warpgroup"
    copy_regs = 24
    compute_regs = min(240, (512 - copy_regs) // C // 8 * 8)
    scale = float(sm_scale) * LOG2E
    split = k_splits > 1
    out_dtype = jnp.float32 if split else dtype
    n_items = Hkv * num_tiles * k_splits
    # Split-K partials are fp32: with two compute warpgroups they leave through the hand-over
    # buffer (the first warpgroup has read it by then), keeping shared memory under 227 KB.
    alias_out = split and C == 2
    n_ctas = min(persistent, n_items) if persistent else n_items
    # A window may reach past the last row (W > 8, or rows not a multiple of 8): pad, so every
    # copy reads real memory (GPU TMA would zero-fill; interpret mode would shift the window).
    if W > 8 or R % 8:
        q2 = jnp.pad(q2, ((0, W), (0, 0)))

    def kernel(meta_ref, bt_ref, base_ref, q_ref, k_ref, v_ref, out_refs, scoped):
        smem, (q_full, k_full, v_full), (q_free, k_free, v_free), (merged, x_free) = scoped
        q_smem, k_smem, v_smem, o_smem, lse_smem, *x_refs = smem
        x_acc, x_m, x_l = x_refs or (None,) * 3
        if alias_out:
            o_smem = x_acc
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")

        def item_fields(w):
            h = w % Hkv
            sp = (w // Hkv) % k_splits
            j = w // (Hkv * k_splits)
            seq = meta_ref[j, 0]
            q_start = meta_ref[j, 1]
            q_len = meta_ref[j, 2]
            pos0 = meta_ref[j, 3]
            kv_len = meta_ref[j, 4]
            # KV blocks of this split; clamped at 0 so inconsistent metadata cannot hang anything.
            kv_hi = jnp.where(q_len > 0, jnp.clip(pos0 + q_len, 0, kv_len), 0)
            n_blk = (kv_hi + block_kv - 1) // block_kv
            per = (n_blk + k_splits - 1) // k_splits
            b0 = jnp.minimum(sp * per, n_blk)
            n_steps = jnp.minimum(b0 + per, n_blk) - b0
            row0 = lambda t: (q_start + t) * Hq + h * G  # flat row of token t's first head
            return h, sp, seq, q_len, pos0, kv_len, b0, n_steps, row0

        n_mine = (n_items - cta + n_ctas - 1) // n_ctas  # this CTA's items

        def each_item(fn):
            """fn(k, w, g) -> g + the item's KV blocks, over this CTA's items (k-th: item w); g
            counts the KV blocks the CTA has gone through (block g uses slot g % stages). The k-th
            item's queries go to buffer k % 2, so the next item's load under this one's blocks."""
            return lax.fori_loop(0, n_mine, lambda k, g: fn(k, cta + k * n_ctas, g), 0)

        @pl.when(wg < C)
        def _compute():
            plgpu.set_max_registers(compute_regs, action="increase")
            row_layout = plgpu.Layout.WGMMA.reduce(1)

            def compute_item(k_item, w, g):
                h, sp, seq, q_len, pos0, kv_len, b0, n_steps, row0 = item_fields(w)
                qb = lax.rem(k_item, 2)
                # Token 0's barrier completes for every item, with or without queries: an item without
                # them must still wait for the copy warpgroup, or the compute warpgroups could run two
                # items ahead on q_free, whose waits only see a phase's parity (a hang).
                plgpu.barrier_wait(q_full.at[qb * block_q])
                for t in range(1, block_q):
                    pl.when(t < q_len)(
                        functools.partial(plgpu.barrier_wait, q_full.at[qb * block_q + t])
                    )
                m_i = plgpu.layout_cast(jnp.full((M,), MASK_VALUE, jnp.float32), row_layout)
                l_i = plgpu.layout_cast(jnp.full((M,), 0.0, jnp.float32), row_layout)
                acc = plgpu.layout_cast(jnp.full((M, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                # This warpgroup's blocks: i = i0, i0 + C, ... (global block g + i on a slot of its
                # own); those before the tile's first position are visible to every row whole.
                i0 = lax.rem(wg - lax.rem(g, C) + C, C)
                count = lambda n: jnp.maximum(n - i0 + C - 1, 0) // C
                full_steps = jnp.clip((pos0 + 1) // block_kv - b0, 0, n_steps)

                def kv_step(k, carry, masked):
                    acc, m_i, l_i = carry
                    i = i0 + k * C
                    slot = lax.rem(g + i, stages)
                    blk = b0 + i
                    plgpu.barrier_wait(k_full.at[slot])

                    def qk_scope(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[qb], k_smem.at[slot].transpose((1, 0)))
                        return acc_ref[...]

                    s = pl.run_scoped(qk_scope, plgpu.ACC((M, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    s = s * scale
                    if masked:
                        rows = plgpu.broadcasted_iota(
                            jnp.int32, (M, block_kv), 0, layout=plgpu.Layout.WGMMA
                        )
                        cols = plgpu.broadcasted_iota(
                            jnp.int32, (M, block_kv), 1, layout=plgpu.Layout.WGMMA
                        )
                        kv = cols + blk * block_kv
                        s = jnp.where((kv <= rows // W + pos0) & (kv < kv_len), s, MASK_VALUE)
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new - P_LOG2_GAIN, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                    p_hi = p.astype(v_dtype)
                    p_lo = (p - p_hi.astype(jnp.float32)).astype(v_dtype)
                    vs = v_smem.at[slot]
                    plgpu.barrier_wait(v_full.at[slot])
                    if masked:

                        @pl.when((blk + 1) * block_kv > kv_len)
                        def _zero_tail():  # V rows at or past kv_len -> 0 (no 0 * NaN)
                            for r in range(block_kv // M):
                                for c in range(D // 64):
                                    part = vs.at[pl.ds(r * M, M), pl.ds(c * 64, 64)]
                                    row = plgpu.broadcasted_iota(
                                        jnp.int32, (M, 64), 0, layout=plgpu.Layout.WGMMA
                                    )
                                    part[...] = jnp.where(
                                        row + (blk * block_kv + r * M) < kv_len, part[...], 0
                                    )
                            plgpu.commit_smem()

                    if interpret:
                        # The GPU interpreter has neither run_state nor a wgmma with A in registers.
                        v = vs[...]
                        acc = acc + (
                            jnp.dot(p_hi, v, preferred_element_type=jnp.float32)
                            + jnp.dot(p_lo, v, preferred_element_type=jnp.float32)
                        )
                    else:

                        def pv_scope(acc_ref):
                            plgpu.wgmma(acc_ref, p_hi, vs)
                            plgpu.wgmma(acc_ref, p_lo, vs)

                        acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                carry = (acc, m_i, l_i)
                n_unmasked = count(full_steps)
                carry = lax.fori_loop(
                    0, n_unmasked, functools.partial(kv_step, masked=False), carry
                )
                carry = lax.fori_loop(
                    n_unmasked, count(n_steps), functools.partial(kv_step, masked=True), carry
                )
                acc, m_i, l_i = carry
                plgpu.barrier_arrive(q_free.at[qb])  # this buffer may take the item after next

                if C == 2:

                    @pl.when(wg == 1)
                    def _hand_over():  # (acc, m, l) to the first warpgroup, through SMEM
                        # Once the first warpgroup has read the previous item's (an item without query
                        # rows waits for nothing else, so the second warpgroup can get here early).
                        pl.when(k_item > 0)(functools.partial(plgpu.barrier_wait, x_free))
                        x_acc[...] = acc
                        x_m[...] = m_i
                        x_l[...] = l_i
                        plgpu.barrier_arrive(merged)

                @pl.when(wg == 0)
                def _finish():
                    acc_, m_, l_ = acc, m_i, l_i
                    if C == 2:
                        plgpu.barrier_wait(merged)
                        acc1 = plgpu.load(x_acc, (), layout=plgpu.Layout.WGMMA, optimized=False)
                        m1 = plgpu.load(x_m, (), layout=row_layout, optimized=False)
                        l1 = plgpu.load(x_l, (), layout=row_layout, optimized=False)
                        if not alias_out:
                            plgpu.barrier_arrive(x_free)  # the second warpgroup may hand over again
                        m_ = jnp.maximum(m_i, m1)
                        a0 = jnp.exp2(m_i - m_)
                        a1 = jnp.exp2(m1 - m_)
                        acc_ = acc * lax.broadcast_in_dim(
                            a0, acc.shape, [0]
                        ) + acc1 * lax.broadcast_in_dim(a1, acc.shape, [0])
                        l_ = l_i * a0 + l1 * a1
                    has = l_ > 0
                    o = acc_ / lax.broadcast_in_dim(jnp.where(has, l_, 1.0), acc_.shape, [0])
                    plgpu.wait_smem_to_gmem(0)  # the previous item's stores have left o_smem
                    o_smem[...] = o.astype(out_dtype)
                    if split:
                        lse = jnp.where(has, m_ + jnp.log2(jnp.where(has, l_, 1.0)), MASK_VALUE)
                        lse_smem[...] = lax.broadcast_in_dim(lse, (M, LSE_COLS), [0])
                    plgpu.commit_smem()
                    out_base = sp * R if split else 0
                    for t in range(block_q):

                        @pl.when(t < q_len)
                        def _store(t=t):
                            off = t * W + row0(t) % 8
                            dst = out_base + row0(t)
                            plgpu.copy_smem_to_gmem(
                                o_smem.at[pl.ds(off, G)], out_refs[0].at[pl.ds(dst, G)]
                            )
                            if split:
                                plgpu.copy_smem_to_gmem(
                                    lse_smem.at[pl.ds(off, G)], out_refs[1].at[pl.ds(dst, G)]
                                )

                    if alias_out:  # the stores have left the hand-over buffer
                        plgpu.wait_smem_to_gmem(0)
                        plgpu.barrier_arrive(x_free)

                return g + n_steps

            each_item(compute_item)

            @pl.when(wg == 0)
            def _():
                plgpu.wait_smem_to_gmem(0)

            if C == 2:
                pl.when((wg == 1) & (n_mine > 0))(functools.partial(plgpu.barrier_wait, x_free))

        @pl.when(wg == C)
        def _copy():
            plgpu.set_max_registers(copy_regs, action="decrease")

            def copy_item(k_item, w, g):
                h, sp, seq, q_len, pos0, kv_len, b0, n_steps, row0 = item_fields(w)
                page_base = (base_ref[0] + h) * NB
                qb = lax.rem(k_item, 2)

                @pl.when(k_item >= 2)
                def _():  # the item before last is done with this buffer
                    plgpu.barrier_wait(q_free.at[qb])

                for t in range(block_q):

                    @pl.when(t < q_len)
                    def _(t=t):
                        base = row0(t) - row0(t) % 8
                        plgpu.copy_gmem_to_smem(
                            q_ref.at[pl.ds(pl.multiple_of(base, 8), W)],
                            q_smem.at[qb, pl.ds(t * W, W)],
                            q_full.at[qb * block_q + t],
                        )

                @pl.when(q_len == 0)
                def _():  # nothing to load: release the compute warpgroups
                    plgpu.barrier_arrive(q_full.at[qb * block_q])

                def page_ids(blk):  # (the index is clamped: a block past the end is safe)
                    return [
                        jnp.clip(bt_ref[seq * P + jnp.minimum(blk * ppb + c, P - 1)], 0, NB - 1)
                        for c in range(ppb)
                    ]

                def step(i, pages):
                    # The next block's page ids load while this one waits for its slot.
                    nxt = page_ids(b0 + i + 1)
                    slot = lax.rem(g + i, stages)

                    @pl.when(g + i >= stages)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])
                        plgpu.barrier_wait(v_free.at[slot])

                    for ref, smem_, bar in ((k_ref, k_smem, k_full), (v_ref, v_smem, v_full)):
                        for c in range(ppb):
                            plgpu.copy_gmem_to_smem(
                                ref.at[page_base + pages[c]],
                                smem_.at[slot, pl.ds(c * bs, bs)],
                                bar.at[slot],
                            )
                    return nxt

                lax.fori_loop(0, n_steps, step, page_ids(b0))
                return g + n_steps

            total = each_item(copy_item)

            # Observe the last releases too (GPU interpret mode checks every phase was awaited).
            @pl.loop(jnp.maximum(n_mine - 2, 0), n_mine)
            def _(k_item):
                plgpu.barrier_wait(q_free.at[lax.rem(k_item, 2)])

            @pl.loop(jnp.maximum(total - stages, 0), total)
            def _(gi):
                slot = lax.rem(gi, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    def entry(meta_ref, bt_ref, base_ref, q_ref, k_ref, v_ref, *out_refs):
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((2, M, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, block_kv, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, block_kv, D), v_dtype, transforms=tiled),
            plgpu.SMEM((8, D) if alias_out else (M, D), out_dtype),  # (8, D): unused
            plgpu.SMEM((M, LSE_COLS), jnp.float32),
        )
        if C == 2:  # the second warpgroup's (acc, m, l), handed over at the end
            smem += (
                plgpu.SMEM((M, D), jnp.float32),
                plgpu.SMEM((M,), jnp.float32),
                plgpu.SMEM((M,), jnp.float32),
            )
        full = (
            plgpu.Barrier(num_barriers=2 * block_q),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),
            plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),
        )
        free = (
            plgpu.Barrier(num_arrivals=C, num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        )
        pl.run_scoped(
            lambda *scoped: kernel(
                meta_ref, bt_ref, base_ref, q_ref, k_ref, v_ref, out_refs, scoped
            ),
            smem,
            full,
            free,
            (plgpu.Barrier(), plgpu.Barrier()),
            collective_axes="wg",
        )

    if split:
        out_type = (
            jax.ShapeDtypeStruct((k_splits * R, D), jnp.float32),
            jax.ShapeDtypeStruct((k_splits * R, LSE_COLS), jnp.float32),
        )
    else:
        out_type = jax.ShapeDtypeStruct((R, D), dtype)
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(n_ctas,),
        grid_names=("cta",),
        num_threads=C + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(meta, bt_flat, kv_base, q2, k_flat, v_flat)
