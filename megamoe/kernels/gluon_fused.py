"""The MoE forward megakernel's work items in Gluon, warp-specialised (``FusedConfig(kernel="gluon")``).

Why (2026-12-02): the Triton megakernel (fused_moe.py) runs its GEMM items about 1.1-1.2x slower than split's
GEMMs, which since 2026-12-01 are warp-specialised Gluon kernels (gluon_bf16_ws.py: a TMA loader warp running ahead
across tiles, two consumer warpgroups, an asynchronous TMA-store epilogue). In a Triton work-queue kernel every
item refills its pipeline from empty after the claim, the wait and the fence, and the epilogue's stores stop the
tensor cores. Here the same items run with gluon_bf16_ws's structure:

    loader     1 warp: claims the items (the same atomic queue and item order as fused_moe.py), waits for each item's
               inputs (the per-block counters, bounded, acquire + ``fence.proxy.async``), issues its GEMM k-steps' TMA
               loads into a STAGES-deep ring (GEMM1: x rows + the gate and up tiles; GEMM2: act rows + a w2 tile) or,
               for a PULL item (BULK_PULL, since 2026-12-02), TMA loads of the part's token rows from their owners'
               ``tok`` regions into the ring's stages (_issue_pull: one descriptor per rank, a stage holding RA + RB
               whole rows; the loader waits for READY itself), and hands the item to the consumers through a QD-deep
               queue: a message in shared memory behind an mbarrier (_pack: the item decoded and its block located, so a
               consumer spends no global load or cross-warp reduction on it; "go" off at the end, "fine" off when a wait
               failed: every partition stops there; the item index also goes to global memory, for
               benchmarks/gluon_fused_debug.py). QD = 1: it claims an item only once the consumers have taken the one
               before (a claimed item is bound to this program, and items queued behind pulls held other programs' GEMM2
               items back); items with no block (the schedule's padding) are claimed and dropped, never handed over
    consumer 0 4 warps (the default partition): rows 0..63 of the item's block
    consumer 1 4 warps (a worker partition):    rows 64..127
               PULL: the stages the loader filled, TMA-stored into the receive buffer (_store_pull: even stages by
               consumer 0, odd by consumer 1, each stage freed once its stores have read it, the writes waited for
               before the signal); where _bulk_pull_plan has no plan (FP8's packed rows, H % 64, more than 8 boxes per
               row or 8 ranks) half of the part's rows through its registers (_pull_rows); GEMM1: 64 x (128 gate + 128
               up) async wgmmas, SwiGLU epilogue through gluon_fp8_ws._put (TMA stores into act / h where every row is
               the block's); GEMM2: 64 x BN2 (256), epilogue pushing each row into its owner's slot (or, combine "pull",
               TMA / masked stores into this rank's ``rows`` region). On a GEMM item of a block of <= 64 rows consumer 1
               only frees the ring stages as they land (gluon_fp8_ws._ring_skip, IDLE_HALF), so consumer 0 has the
               tensor cores to itself (qwen3 EP 1 items 0.742 -> 0.720 ms, one H200, 2026-12-03). Each consumer posts
               the item's counter into the signaller's SQ-deep queue once its stores are done (a barrier of its
               threads, then an mbarrier arrival, release at CTA scope) and goes on to its next item
    signaller  1 warp: once both consumers posted an item, ``counter += 2`` (release, GPU scope: cumulative, so it
               publishes the consumers' stores, which reached this warp through the mbarrier), in posting order.
               The targets are 2x the Triton kernel's (2 per pull part, 2 per GEMM tile). A release waits until the
               stores before it are performed; done by the consumers (before 2026-12-02), it held each one's next
               item back (qwen3 EP 1, one H200: items kernel 0.776 ms that way, 0.763 with the signaller).

Deadlock freedom is the Triton kernel's argument: every wait is on an earlier item, and items are taken only by
running programs. Within a program the consumers run the items in claim order; the loader hands an item over as soon
as its inputs are ready and then issues its loads (the consumers free the ring's stages only once they know the
item), and it waits for the next item's inputs only after all of this item's loads are issued, so a loader waiting
on a counter never waits on a consumer that waits on that loader. The
loader does every wait (the consumers wait only on mbarriers that the loader or the signaller always completes; the
signaller waits only on the consumers' posts, and each consumer posts an end message however its loop ends), so a
timeout cannot leave one partition stopped while another waits for it.

The tail (after every item: DONE, then each token's k rows summed with the gates; SAVE) is the Triton kernel's,
launched right after this one with ``ITEMS=False`` (fused_moe._launch): this kernel ends when its items are done, and
stream order makes every push complete before the tail publishes DONE. Backward, the prologue, the prefetching pull
and the ablations stay on the Triton kernel (ValueError here); ``FusedConfig.timeline`` works on both.

FP8 (``FP8``, ``fused:kernel=gluon:fp8=1``; bitwise the Triton FP8 megakernel's on one H200, 2026-12-02): the Triton FP8
megakernel's arithmetic on this structure. The pull moves packed FP8 rows (HP words each); GEMM1 runs each 128-column
tile as two 64-column halves (a stage: 128 x rows of e4m3 x and the gate and up halves' 64 weight rows, 128 of K), every
product a fresh wgmma that its consumer waits for before the promotion acc += P * (x_scale * w_scale) (the other
consumer's wgmma runs meanwhile, as in gluon_fp8_ws), h in bf16 by TMA, act rounded to bf16 and quantised per row over
the tile's 128 columns into e4m3 with its 1x128 scale; GEMM2 on e4m3 act and w2 in 128-column tiles (one weight scale
block), promoted likewise, rows pushed in bf16. I must be a multiple of 128.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.comm.signals import (
    ERR_CALL,
    ERR_EXPECTED,
    ERR_FLAG,
    ERR_LOCAL,
    ERR_LOCAL_CLAIM,
    ERR_OP,
    ERR_PEER,
    ERR_PURPOSE,
    ERR_RANK,
    ERR_SEEN,
    OP_FUSED,
    READY,
    REG_CTRL,
    REG_ERR,
    REG_FLAGS,
    REG_SLOTS,
    REG_TOK,
    SEQ,
)
from megamoe.kernels.gemm_config import interpreting, record
from megamoe.kernels.gluon_bf16 import SMEM_LIMIT, _slices
from megamoe.kernels.gluon_fp8 import _schedule
from megamoe.kernels.gluon_fp8_ws import REG_POOL, _epi_swiglu_slice, _put, _ring_skip

PURPOSE_TILE = gl.constexpr(3)
#: the last launch's queue counter and per-block counters (``ctr``: int64 [1 + 3 * nb_max]: items claimed, ready[],
#: g1[], g2[]), item queue (``q``: int64 [P * QD]) and sizes, for diagnostics (benchmarks/gluon_fused_debug.py)
LAST_LAUNCH: dict = {}
# depth of the loader -> consumers item queue: how many items the loader may claim before the consumers start them. 4
# let it claim up to 4 pulls (no loads to issue) and then a GEMM1 tile, which waited ~100 us behind them while the
# GEMM2 items of its block, claimed on other programs, waited for it (qwen3 EP 1 timeline, 2026-12-02: 364 of 4438
# GEMM items waited > 10 us for their inputs); an item is bound to its program when claimed, so claim late
QD = 1
# timing probe only (benchmarks/fused_probe.py; results may be wrong): bit 1: GEMM1 does not wait for its TMA stores to
# land before signalling
PROBE = 0
# 1: consumer 1 idles (frees the ring stages, no wgmma, no epilogue) on the items of blocks of <= 64 rows (an expert's
# last block), so consumer 0 runs their k-loops with the tensor cores to itself; 0: it runs its empty half
IDLE_HALF = 1
# depth of the consumers -> signaller queue of counter signals (the signaller's atomics take ~1 us, items >= 8 us)
SQ = 4
# elements of one pull chunk per consumer warpgroup (ROWS_P x BLOCK_H; each thread holds two chunks' 1 / 128): the
# pulls are latency-bound (qwen3 EP 1 timeline, one H200, 2026-12-02: a 128-row pull item took 42.7 us at 4096, 27.8
# at 8192, 24.6 at 16384; the items kernel 0.757 -> 0.748 ms from 8192 to 16384)
PULL_ELEMS = 16384
# pulls by TMA through the ring (_issue_pull / _store_pull) where the rows allow it (bf16, H % 64 == 0): the loader
# loads each row from its owner's ``tok`` region into a ring stage, a consumer stores the stage's rows into the
# receive buffer; 0: every pull in the consumers' registers (_pull_rows, the FP8 items' path)
BULK_PULL = 1
# registers per thread of each consumer warpgroup (the loader gets the rest of REG_POOL): on sm_90a 224 left the loader
# 56 and 28 B of spills (8 experts); 208 leaves 88: 0 B at 8 and 16 experts, 20 B at 128 (the loader's schedule
# vectors); the consumers do not spill at 208
CONSUMER_REGS = 208
CONSUMER_REGS_FP8 = 216  # the FP8 items (serial promotion in 64-column halves): on sm_90a (qwen3, 8 experts) 36 B
#                          of spills in all; 208 gave 84, 224 60 (the loader short), 232 128


# ----------------------------------------------------------------------------------------- signals (Gluon)
@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _ld_acq(ptr, GPU_SCOPE: gl.constexpr):
    if GPU_SCOPE:
        v = gl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptr], dtype=gl.int64,
                                      is_pure=False, pack=1)
    else:
        v = gl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=gl.int64,
                                      is_pure=False, pack=1)
    return v


@gluon.jit
def _fence_proxy_async():
    """``fence.proxy.async.global`` (fused_parts.fence_proxy_async)."""
    return gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _bulk_writes_done():
    """``cp.async.bulk.wait_group 0``: this thread's TMA stores have written global memory (``tma.store_wait`` lowers
    to the ``.read`` form, which only says their shared-memory sources were read)."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _ctrl(tab, W, rank):
    return gl.load(tab + REG_CTRL * W + rank).to(gl.pointer_type(gl.int64))


@gluon.jit
def _record_timeout(tab, W, rank, call, peer, expected, seen, purpose):
    """signals.record_timeout (op 'fused'): the first timeout of this rank claims the record and writes it."""
    ctrl = _ctrl(tab, W, rank)
    zero = gl.load(ctrl + SEQ, volatile=True) * 0
    claimed = gl.atomic_cas(ctrl + ERR_LOCAL_CLAIM, zero, zero + 1, sem="acq_rel", scope="gpu")
    if claimed == 0:
        err = gl.load(tab + REG_ERR * W + rank).to(gl.pointer_type(gl.int64))
        gl.store(err + ERR_OP, zero + OP_FUSED)
        gl.store(err + ERR_CALL, call)
        gl.store(err + ERR_RANK, zero + rank)
        gl.store(err + ERR_PEER, zero + peer)
        gl.store(err + ERR_EXPECTED, zero + expected)
        gl.store(err + ERR_SEEN, seen)
        gl.store(err + ERR_PURPOSE, zero + purpose)
        gl.atomic_xchg(err + ERR_FLAG, zero + 1, sem="release", scope="sys")
        gl.atomic_xchg(ctrl + ERR_LOCAL, zero + 1, sem="release", scope="gpu")


@gluon.jit
def _wait_counter(ptr, target, tab, W, rank, call, timeout_ns, GPU_SCOPE: gl.constexpr):
    """fused_parts.wait_counter: until the local int64 counter ``*ptr >= target``, bounded; True when reached."""
    ctrl = _ctrl(tab, W, rank)
    seen = _ld_acq(ptr, GPU_SCOPE)
    errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
    if (seen < target) & (errv == 0):
        t0 = _now()
        elapsed = _now() - t0
        while (seen < target) & (errv == 0) & (elapsed <= timeout_ns):
            seen = _ld_acq(ptr, GPU_SCOPE)
            errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
            elapsed = _now() - t0
        if (seen < target) & (errv == 0):
            _record_timeout(tab, W, rank, call, rank, target, seen, PURPOSE_TILE)
    return seen >= target


@gluon.jit
def _wait_ready(tab, W, rank, call, timeout_ns, WP2: gl.constexpr, lay: gl.constexpr):
    """signals.wait_flags for READY of every rank (this call), bounded; True when all arrived."""
    flags = gl.load(tab + REG_FLAGS * W + rank).to(gl.pointer_type(gl.int64)) + READY * W
    ctrl = _ctrl(tab, W, rank)
    offs = gl.arange(0, WP2, layout=lay)
    valid = offs < W
    p = flags + gl.where(valid, offs, rank)
    seen = gl.where(valid, _ld_acq(p, False), call)
    errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
    t0 = _now()
    elapsed = _now() - t0
    while (gl.min(seen, axis=0) < call) & (errv == 0) & (elapsed <= timeout_ns):
        seen = gl.where(valid, _ld_acq(p, False), call)
        errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
        elapsed = _now() - t0
    ok = gl.min(seen, axis=0) >= call
    if (gl.min(seen, axis=0) < call) & (errv == 0):
        peer = gl.min(gl.where(seen < call, offs, WP2), axis=0)
        got = gl.sum(gl.where(offs == peer, seen, 0), axis=0)
        _record_timeout(tab, W, rank, call, peer, call, got, READY)
    return ok


@gluon.jit
def _post(s_full, s_empty, s_smem, ns, off, ml: gl.constexpr, SQ: gl.constexpr, WG: gl.constexpr):
    """Consumer WG's part of signalling counter ``ctr_ptr[off]`` (off < 0: the end) through the signaller: slot ns % SQ
    of its queue once free; WG 0 writes off; each WG's arrival (after a barrier of its threads, release at CTA scope)
    says its stores so far are done; the signaller adds 2 once both arrived (_signaller)."""
    ss = ns % SQ
    mbarrier.wait(s_empty.index(ss), ((ns // SQ) & 1) ^ 1)  # (the first pass finds every slot free)
    if WG == 0:
        s_smem.index(ss).store(gl.where(gl.arange(0, MSG, layout=ml) == 0, off, 0))
    gl.thread_barrier()
    mbarrier.arrive(s_full.index(ss), count=1)


@gluon.jit
def _signaller(s_full, s_empty, s_smem, ctr_ptr, E_l, SQ: gl.constexpr):
    """1 warp: the consumers' counter signals, in order: ``ctr_ptr[off] += 2`` (release, GPU scope: the consumers'
    stores reached this warp through the slot's mbarrier, acquire at CTA scope, and a release is cumulative) until
    the end (off < 0). The release waits until those stores are performed; here it does not hold the consumers'
    next item back (qwen3 timeline, one H200, 2026-12-02: the GEMM items' epilogues 0.4-0.8 us shorter without it)."""
    ml: gl.constexpr = gl.BlockedLayout([MSG], [32], [1], [0])
    n = 0
    go = E_l >= 0  # (a runtime True)
    while go:
        ss = n % SQ
        mbarrier.wait(s_full.index(ss), (n // SQ) & 1)
        off = _word(s_smem.index(ss).load(ml), 0, ml)
        gl.thread_barrier()
        mbarrier.arrive(s_empty.index(ss), count=1)
        go = off >= 0
        if go:
            gl.atomic_add(ctr_ptr + off, 2, sem="release", scope="gpu")
        n += 1


# ------------------------------------------------------------------------------------------ item bookkeeping
@gluon.jit
def _decode(item, PS, T1, L1, L2, GB: gl.constexpr, PULL_SPLIT: gl.constexpr):
    """item -> (step, kind 0 PULL / 1 GEMM1 / 2 GEMM2, block, pull part or column tile): fused_moe's order."""
    s = (item // PS).to(gl.int32)
    sub = (item % PS).to(gl.int32)
    is_pull = sub < GB * PULL_SPLIT
    is_g1 = (sub >= GB * PULL_SPLIT) & (sub < GB * (PULL_SPLIT + T1))
    q1 = gl.maximum(sub - GB * PULL_SPLIT, 0)
    q2 = gl.maximum(sub - GB * (PULL_SPLIT + T1), 0)
    b = gl.where(is_pull, s * GB + sub // PULL_SPLIT, gl.where(is_g1, (s - L1) * GB + q1 % GB,
                                                               (s - L1 - L2) * GB + q2 % GB))
    kind = gl.where(is_pull, 0, gl.where(is_g1, 1, 2))
    j = gl.where(is_pull, sub % PULL_SPLIT, gl.where(is_g1, q1 // GB, q2 // GB))
    return s, kind, b, j


@gluon.jit
def _locate_block(b, e_idx, starts, cnts, nblk, cum, NS, BM: gl.constexpr):
    """fused_parts._locate: block b -> (expert, first receive row, valid rows, first buffer row)."""
    e = gl.sum((cum <= b).to(gl.int32), axis=0)
    sel = e_idx == e
    first_blk = gl.sum(gl.where(sel, cum, 0), axis=0) - gl.sum(gl.where(sel, nblk, 0), axis=0)
    row0 = gl.sum(gl.where(sel, starts, 0), axis=0) + (b - first_blk) * BM
    nrows = gl.minimum(gl.sum(gl.where(sel, cnts, 0), axis=0) - (b - first_blk) * BM, BM)
    base = gl.where(NS > 0, (b % gl.maximum(NS, 1)) * BM, row0)
    return e, row0, nrows, base


MSG = gl.constexpr(16)  # int32 words of an item message in shared memory (10 used)


@gluon.jit
def _pack(item, go, fine, kind, b, j, e, row0, nrows, base, ml: gl.constexpr):
    """The loader's message for one item: [item, go, fine, kind, block, part / tile, expert, first receive row, rows,
    first buffer row] as int32, every thread of the partition holding all MSG words (ml: [MSG] per thread)."""
    w = gl.arange(0, MSG, layout=ml)
    v = gl.where(w == 0, item.to(gl.int32), 0)
    v = gl.where(w == 1, go.to(gl.int32), v)
    v = gl.where(w == 2, fine.to(gl.int32), v)
    v = gl.where(w == 3, kind, v)
    v = gl.where(w == 4, b, v)
    v = gl.where(w == 5, j, v)
    v = gl.where(w == 6, e, v)
    v = gl.where(w == 7, row0, v)
    v = gl.where(w == 8, nrows, v)
    return gl.where(w == 9, base, v)


@gluon.jit
def _word(v, i: gl.constexpr, ml: gl.constexpr):
    """Word i of a message held whole by every thread (a reduction in registers: no shared memory, no barrier)."""
    return gl.sum(gl.where(gl.arange(0, MSG, layout=ml) == i, v, 0), axis=0)


@gluon.jit
def _rd(m, i: gl.constexpr, lay: gl.constexpr):
    """Word i of message m in shared memory, every thread loading it (one broadcast ld.shared)."""
    return gl.sum(m.slice(i, 1).load(lay), axis=0)


# ------------------------------------------------------------------------------------------------- loader
@gluon.jit
def _pull_views(a_smem, b_smem, st, RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr):
    """Ring stage st as the pull's row buffers: RA rows in its A tile, RB in its weight tile, each token row RV x C
    bf16 (unswizzled: a row is one TMA box)."""
    lay_p: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    AV: gl.constexpr = a_smem.shape[1] * a_smem.shape[2] // C  # (the whole tile: shapes are powers of 2)
    BV: gl.constexpr = b_smem.shape[1] * b_smem.shape[2] // C
    av = a_smem.index(st)._reinterpret(gl.bfloat16, [AV, C], lay_p)
    bv = b_smem.index(st)._reinterpret(gl.bfloat16, [BV, C], lay_p)
    return av, bv


@gluon.jit
def _issue_pull(tok_descs, a_smem, b_smem, ready, empty, row_src_ptr, row_tok_ptr, row0, r_lo, r_end, it,
                RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr,
                NP: gl.constexpr, BR: gl.constexpr):
    """The loads of PULL rows [r_lo, r_end) of the block at receive row row0: RA + RB rows per ring stage, each row
    RV / BR TMA loads from its owner's ``tok`` region (tok_descs[src], src < NP: [T_max * RV, C] views, box [BR, C]);
    a stage's slots past the part's last row get a load too (the barrier expects a constant byte count). Returns the
    new ring count."""
    R: gl.constexpr = RA + RB
    nbytes: gl.constexpr = R * RV * C * 2
    vl: gl.constexpr = gl.BlockedLayout([16], [32], [1], [0])  # (R <= 16 row indices, every lane holding all)
    qq = gl.arange(0, 16, layout=vl)
    _fence_proxy_async()  # (the rows were published to the generic proxy: READY, acquired before)
    # each stage's row indices in one load, the next stage's issued before this one's copies: one at a time, each
    # row's load before its copy, the loads' latency (~0.12 us each) was the pull's (qwen3 EP 1, one H200,
    # 2026-12-02: 16.9 us per 128-row item with 12 rows per stage, 23.9 for mixtral's 8 KB rows at 6 per stage)
    # (slots past the part's last row: row 0 of rank 0's tokens, loaded into slots nobody stores)
    m = (r_lo + qq < r_end) & (qq < R)
    toks = gl.load(row_tok_ptr + row0 + r_lo + qq, mask=m, other=0)
    srcs = toks
    if NP > 1:
        srcs = gl.load(row_src_ptr + row0 + r_lo + qq, mask=m, other=0)
    for r_c in range(r_lo, r_end, R):
        st = it % STAGES
        cur_t = toks
        cur_s = srcs
        m = (r_c + R + qq < r_end) & (qq < R)
        toks = gl.load(row_tok_ptr + row0 + r_c + R + qq, mask=m, other=0)
        if NP > 1:
            srcs = gl.load(row_src_ptr + row0 + r_c + R + qq, mask=m, other=0)
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), nbytes)
        av, bv = _pull_views(a_smem, b_smem, st, RA, RB, RV, C)
        for q in gl.static_range(R):
            tok = gl.sum(gl.where(qq == q, cur_t, 0), axis=0)  # (in registers: no shuffle)
            if NP > 1:
                src = gl.sum(gl.where(qq == q, cur_s, 0), axis=0)
            for i in gl.static_range(RV // BR):  # (a row: RV / BR boxes of [BR, C])
                if q < RA:
                    dst = av.slice(q * RV + i * BR, BR)
                else:
                    dst = bv.slice((q - RA) * RV + i * BR, BR)
                if NP == 1:
                    tma.async_copy_global_to_shared(tok_descs[0], [tok * RV + i * BR, 0], ready.index(st), dst)
                else:
                    for p in gl.static_range(NP):
                        if src == p:
                            tma.async_copy_global_to_shared(tok_descs[p], [tok * RV + i * BR, 0], ready.index(st),
                                                            dst)
        it += 1
    return it


@gluon.jit
def _issue_loads(x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, kind, e, base, j, H, I, k1, k2, it,
                 BN1: gl.constexpr, BN2: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr):
    """The TMA loads of GEMM item (kind 1 / 2, expert e, first buffer row base, column tile j) into the ring from ring
    count it on (each stage once the consumers have freed it); returns the new ring count."""
    BK: gl.constexpr = 128 if FP8 else 64
    nbytes1: gl.constexpr = x_desc.block_type.nbytes + 2 * w13_desc.block_type.nbytes
    nbytes2: gl.constexpr = act_desc.block_type.nbytes + w2_desc.block_type.nbytes
    _fence_proxy_async()
    if kind == 1:
        # FP8: two 64-column halves, each its own k-loop (w13_desc's block is [BN1 / 2, 128] then)
        TN: gl.constexpr = BN1 // 2 if FP8 else BN1
        for hf in gl.static_range(2 if FP8 else 1):
            wrow = e * (2 * I) + j * BN1 + hf * TN
            for ki in range(k1):
                st = it % STAGES
                mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(st), nbytes1)
                tma.async_copy_global_to_shared(x_desc, [base, ki * BK], ready.index(st), a_smem.index(st))
                tma.async_copy_global_to_shared(w13_desc, [wrow, ki * BK], ready.index(st),
                                                b_smem.index(st).slice(0, TN))
                tma.async_copy_global_to_shared(w13_desc, [wrow + I, ki * BK], ready.index(st),
                                                b_smem.index(st).slice(TN, TN))
                it += 1
    else:
        wrow = e * H + j * BN2
        for ki in range(k2):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), nbytes2)
            tma.async_copy_global_to_shared(act_desc, [base, ki * BK], ready.index(st), a_smem.index(st))
            tma.async_copy_global_to_shared(w2_desc, [wrow, ki * BK], ready.index(st),
                                            b_smem.index(st).slice(0, BN2))
            it += 1
    return it


@gluon.jit
def _loader(tab, W, rank, x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, q_full, q_empty, q_ptr,
            q_smem, offs_ptr, ctr_ptr, H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns,
            BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, BLOCK_E: gl.constexpr, GB: gl.constexpr,
            PULL_SPLIT: gl.constexpr, STAGES: gl.constexpr, QD_: gl.constexpr, ACQ_GPU: gl.constexpr,
            tll_ptr, TIMELINE: gl.constexpr, FP8: gl.constexpr, tok_descs, row_src_ptr, row_tok_ptr,
            BULK: gl.constexpr, RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr,
            WP2: gl.constexpr, NP: gl.constexpr, BR: gl.constexpr):
    """Claims the items, waits for their inputs, hands them over, then issues their loads. TIMELINE: per item [claim,
    claimed, inputs ready and handed over, loads issued] into tll_ptr [items, 4]. FP8: the descriptors are the e4m3
    operands' and a k-step is 128 deep (one scale block). BULK: the PULL items' loads too (_issue_pull), after READY
    of every rank (the peers' tokens staged)."""
    BK: gl.constexpr = 128 if FP8 else 64
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    ml: gl.constexpr = gl.BlockedLayout([MSG], [32], [1], [0])
    e_idx, starts, cnts, nblk, cum, nb = _schedule(offs_ptr, E_l, 1, BM, 1, BLOCK_E, lay)
    T1 = gl.cdiv(I, BN1)
    T2 = gl.cdiv(H, BN2)
    PS = GB * (PULL_SPLIT + T1 + T2)
    n_steps = gl.where(nb > 0, gl.cdiv(nb, GB) + L1 + L2, 0)
    rdy = ctr_ptr + 1
    g1 = rdy + NB_MAX
    g2 = g1 + NB_MAX
    call = gl.load(_ctrl(tab, W, rank) + SEQ, volatile=True)
    k1 = gl.cdiv(H, BK)
    k2 = gl.cdiv(I, BK)
    qp = q_ptr + gl.program_id(0) * QD_
    rok = nb >= 0  # (a runtime True)
    if BULK:
        rok = _wait_ready(tab, W, rank, call, timeout_ns, WP2, lay)
    n = 0
    it = 0
    go = nb >= 0  # (a runtime True: the loop-carried flags must not start as constexprs)
    while go:
        qs = n % QD_
        if TIMELINE:  # (before the wait: a full queue, the consumers' back-pressure, counts as claim time)
            t_claim = _now()
        mbarrier.wait(q_empty.index(qs), ((n // QD_) & 1) ^ 1)  # (the first pass finds every slot free)
        item = gl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
        if TIMELINE:
            t_claimed = _now()
        s, kind, b, j = _decode(item, PS, T1, L1, L2, GB, PULL_SPLIT)
        go = s < n_steps
        fine = nb >= 0
        live = go & (b >= 0) & (b < nb)
        if live:  # the item's inputs
            if kind == 0:  # PULL(b): the ring slot's previous block has been read by all its GEMM1 tiles
                fine = rok
                if (NS > 0) & (b >= NS):
                    fine = fine & _wait_counter(g1 + b - NS, 2 * T1, tab, W, rank, call, timeout_ns, ACQ_GPU)
            elif kind == 1:  # GEMM1(b, j): b pulled; with a ring, the act slot's previous block's GEMM2 done
                fine = _wait_counter(rdy + b, 2 * PULL_SPLIT, tab, W, rank, call, timeout_ns, ACQ_GPU)
                if (NS > 0) & (b >= NS):
                    fine = fine & _wait_counter(g2 + b - NS, 2 * T2, tab, W, rank, call, timeout_ns, ACQ_GPU)
            else:  # GEMM2(b, j): every GEMM1 tile of b done
                fine = _wait_counter(g1 + b, 2 * T1, tab, W, rank, call, timeout_ns, ACQ_GPU)
        # hand the item over before its loads: the consumers free the ring's stages only once they know the item
        # (publishing after the loads deadlocked as soon as an item had more k-steps than the ring has stages). An
        # item with no block (the schedule's padding) is not handed over: the consumers have nothing to do for it
        hand = live | (go == 0) | (fine == 0)
        # the consumers read the decoded item from shared memory (the global copy is for diagnostics:
        # benchmarks/gluon_fused_debug.py): a global load and the schedule's cross-warp reductions cost each consumer
        # ~1-2 us per item (qwen3 timeline, one H200, 2026-12-02); here the reductions are in one warp
        e, row0, nrows, base = _locate_block(b, e_idx, starts, cnts, nblk, cum, NS, BM)
        if hand:
            gl.store(qp + qs, gl.where(fine, item, -1 - item))
            q_smem.index(qs).store(_pack(item, go, fine, kind, b, j, e, row0, nrows, base, ml))
            gl.thread_barrier()
            mbarrier.arrive(q_full.index(qs), count=1)
        if TIMELINE:
            t_handed = _now()
        if live & fine & (kind != 0):
            it = _issue_loads(x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, kind, e, base, j, H,
                              I, k1, k2, it, BN1, BN2, STAGES, FP8)
        if BULK:
            if live & fine & (kind == 0):
                part: gl.constexpr = BM // PULL_SPLIT
                it = _issue_pull(tok_descs, a_smem, b_smem, ready, empty, row_src_ptr, row_tok_ptr, row0, j * part,
                                 gl.minimum(j * part + part, nrows), it, RA, RB, RV, C, STAGES, NP, BR)
        if TIMELINE:
            if go:
                lrec = tll_ptr + item * 4
                gl.store(lrec, t_claim)
                gl.store(lrec + 1, t_claimed)
                gl.store(lrec + 2, t_handed)
                gl.store(lrec + 3, _now())
        go = go & fine
        n += hand.to(gl.int32)


# ----------------------------------------------------------------------------------------------- consumers
@gluon.jit
def _row_src(tab, W, row0, r, valid, row_src_ptr, row_tok_ptr, H, ALIGNED: gl.constexpr):
    """Source pointers of block rows r (valid: to be read): row tok(r) of rank src(r)'s ``tok`` region (rows of H
    bf16 elements; fused_parts._pull_rows_ptrs)."""
    src = gl.load(row_src_ptr + row0 + r, mask=valid, other=0)
    tok = gl.load(row_tok_ptr + row0 + r, mask=valid, other=0)
    sp = (gl.load(tab + REG_TOK * W + src, mask=valid, other=0) + tok.to(gl.int64) * H * 2).to(
        gl.pointer_type(gl.bfloat16))
    if ALIGNED:
        sp = gl.multiple_of(sp, 16)
    return sp


@gluon.jit
def _pull_rows(tab, W, row0, r_lo, r_end, base, row_src_ptr, row_tok_ptr, x_ptr, H, HP, ROWS_P: gl.constexpr,
               BLOCK_H: gl.constexpr, ALIGNED: gl.constexpr, pl: gl.constexpr):
    """xbuf[base + r][:HP] = tok_{src(r)}[tok(r)][:HP] (source rows of H elements, destination rows of HP: the packed
    FP8 rows are narrower) for block rows r in [r_lo, r_end): [ROWS_P, BLOCK_H] chunks, the next chunk's (NVLink)
    loads issued before the current chunk's stores (fused_parts._pull_block)."""
    rr = gl.arange(0, ROWS_P, layout=gl.SliceLayout(1, pl))
    hh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, pl))
    n_h = gl.cdiv(HP, BLOCK_H)
    n_chunks = gl.cdiv(r_end - r_lo, ROWS_P) * n_h
    if n_chunks > 0:
        r = r_lo + rr
        valid = r < r_end
        sp = _row_src(tab, W, row0, r, valid, row_src_ptr, row_tok_ptr, H, ALIGNED)
        m = valid[:, None] & (hh < HP)[None, :]
        v = gl.load(sp[:, None] + hh[None, :], mask=m)
        for c in range(1, n_chunks):
            ri = c // n_h
            oh = (c % n_h) * BLOCK_H + hh
            r2 = r_lo + ri * ROWS_P + rr
            valid2 = r2 < r_end
            sp2 = _row_src(tab, W, row0, r2, valid2, row_src_ptr, row_tok_ptr, H, ALIGNED)
            m2 = valid2[:, None] & (oh < HP)[None, :]
            v2 = gl.load(sp2[:, None] + oh[None, :], mask=m2)
            cp = c - 1
            dp = x_ptr + (base + r_lo + (cp // n_h) * ROWS_P + rr).to(gl.int64) * HP
            gl.store(dp[:, None] + ((cp % n_h) * BLOCK_H + hh)[None, :], v, mask=m)
            v = v2
            m = m2
        cl = n_chunks - 1
        dp = x_ptr + (base + r_lo + (cl // n_h) * ROWS_P + rr).to(gl.int64) * HP
        gl.store(dp[:, None] + ((cl % n_h) * BLOCK_H + hh)[None, :], v, mask=m)


@gluon.jit
def _store_pull(xv_desc, a_smem, b_smem, ready, empty, base, r_lo, r_end, it, RA: gl.constexpr, RB: gl.constexpr,
                RV: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, BR: gl.constexpr):
    """Consumer WG's part of PULL rows [r_lo, r_end) loaded by _issue_pull: every stage's rows stored by TMA into the
    receive buffer at rows base + r (xv_desc: [NROWS * RV, C], box [BR, C]), the even stages by consumer 0, the odd
    ones by consumer 1; a stage is freed once its stores have read it. On return this WG's stores are written and
    ordered before the async proxy's later reads. Returns the new ring count."""
    R: gl.constexpr = RA + RB
    c = 0
    for r_c in range(r_lo, r_end, R):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        if c % 2 == WG:
            nr = gl.minimum(r_end - r_c, R)
            av, bv = _pull_views(a_smem, b_smem, st, RA, RB, RV, C)
            for q in gl.static_range(R):
                if q < nr:
                    for i in gl.static_range(RV // BR):
                        if q < RA:
                            tma.async_copy_shared_to_global(xv_desc, [(base + r_c + q) * RV + i * BR, 0],
                                                            av.slice(q * RV + i * BR, BR))
                        else:
                            tma.async_copy_shared_to_global(xv_desc, [(base + r_c + q) * RV + i * BR, 0],
                                                            bv.slice((q - RA) * RV + i * BR, BR))
            tma.store_wait(0)
        gl.thread_barrier()  # (the stores' issuing thread has seen them read)
        mbarrier.arrive(empty.index(st), count=1)
        it += 1
        c += 1
    _bulk_writes_done()
    _fence_proxy_async()
    return it


@gluon.jit
def _push_rows_idx(row0, nrows, row_src_ptr, row_tok_ptr, row_slot_ptr, HM: gl.constexpr, WG: gl.constexpr,
                   store_l: gl.constexpr):
    """Consumer WG's 64 rows of a block (fused_parts._push_rows), first part: (src, tok, slot, valid) loads issued, in
    SliceLayout(1, store_l). The GEMM2 items issue them before their k-loop and call _push_rows_base under the first
    wgmma (bf16) or after the k-loop (FP8), and _push_rows_ptrs after it, so no load's latency stops the wgmmas."""
    rloc = WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, store_l))
    rvalid = rloc < nrows
    src = gl.load(row_src_ptr + row0 + rloc, mask=rvalid, other=0)
    tok = gl.load(row_tok_ptr + row0 + rloc, mask=rvalid, other=0)
    slot = gl.load(row_slot_ptr + row0 + rloc, mask=rvalid, other=0)
    return src, tok, slot, rvalid


@gluon.jit
def _push_rows_base(tab, W, src, tok, slot, rvalid, K: gl.constexpr):
    """Second part: (the owner's ``slots`` region address (a load), the row's index in it tok * K + slot)."""
    return gl.load(tab + REG_SLOTS * W + src, mask=rvalid, other=0), tok * K + slot  # (int32: < T_max * k rows)


@gluon.jit
def _push_rows_ptrs(sbase, sidx, H, ALIGNED: gl.constexpr):
    """Last part: each row's owner ``slots[tok, slot]`` row pointer."""
    rp = (sbase + sidx.to(gl.int64) * H * 2).to(gl.pointer_type(gl.bfloat16))
    if ALIGNED:
        rp = gl.multiple_of(rp, 16)
    return rp


@gluon.jit
def _push_slice(val, rp, rvalid, col, H, epi_smem, buf, HM: gl.constexpr, store_l: gl.constexpr):
    """A [HM, 64] bf16 slice of GEMM2's rows -> each row's owner slot at column col (rp: row pointers in
    SliceLayout(1, store_l)), through staging buffer buf (16-byte stores, 8 columns per thread)."""
    b = epi_smem.index(buf)
    gl.thread_barrier()
    b.store(val)
    gl.thread_barrier()
    v = b.load(store_l)
    rn = col + gl.arange(0, 64, layout=gl.SliceLayout(0, store_l))
    gl.store(rp[:, None] + rn[None, :], v, mask=rvalid[:, None] & (rn < H)[None, :])


@gluon.jit
def _push_pair(v0, v1, rp, rvalid, col, H, epi_smem, b0, HM: gl.constexpr, store_l: gl.constexpr):
    """_push_slice for two adjacent slices (columns col .. col + 127) through both of the WG's staging buffers: two
    barriers where two _push_slice calls take four (the WG's other buffer is b0 ^ 1). The GEMM2 items push in pairs
    (one H200, 2026-12-02: bitwise the same, the epilogue 2.74 us against 2.85 with single slices)."""
    gl.thread_barrier()
    epi_smem.index(b0).store(v0)
    epi_smem.index(b0 ^ 1).store(v1)
    gl.thread_barrier()
    rn = col + gl.arange(0, 64, layout=gl.SliceLayout(0, store_l))
    w0 = epi_smem.index(b0).load(store_l)
    w1 = epi_smem.index(b0 ^ 1).load(store_l)
    gl.store(rp[:, None] + rn[None, :], w0, mask=rvalid[:, None] & (rn < H)[None, :])
    gl.store(rp[:, None] + (rn + 64)[None, :], w1, mask=rvalid[:, None] & (rn + 64 < H)[None, :])


@gluon.jit
def _gemm1_half(a_smem, b_smem, ready, empty, epi_smem, act_st_desc, hg_desc, hu_desc, act_ptr, h_ptr, base, nrows, j,
                I, k1, it, nst, BM: gl.constexpr, BN1: gl.constexpr, STAGES: gl.constexpr, STORE_H: gl.constexpr,
                EPI_TMA: gl.constexpr, WG: gl.constexpr, TIMELINE: gl.constexpr, PROBE_: gl.constexpr = 0):
    """Consumer WG's half of GEMM1(b, j): 64 x (BN1 gate + BN1 up) async wgmmas over the ring, then the SwiGLU
    epilogue (act, and h with STORE_H) through the staging buffers; returns the ring and staged-store counts. The
    stores are complete (and ordered before the async proxy's later reads) on return. TIMELINE: also the times the
    first stage landed and the k-loop ended (else 0)."""
    HM: gl.constexpr = BM // 2
    mma1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN1, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    NSL1: gl.constexpr = BN1 // 64
    acc = gl.zeros((HM, BN1), dtype=gl.float32, layout=mma1)
    acc2 = acc
    t_first = (it * 0).to(gl.int64)
    t_loop = t_first
    for ki in range(k1):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        if TIMELINE:
            if ki == 0:
                t_first = _now()
        a_v = a_smem.index(st).slice(WG * HM, HM)
        acc = warpgroup_mma(a_v, b_smem.index(st).slice(0, BN1).permute((1, 0)), acc, is_async=True)
        acc2 = warpgroup_mma(a_v, b_smem.index(st).slice(BN1, BN1).permute((1, 0)), acc2, is_async=True)
        acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
        if ki > 0:  # the previous k-step's products are done: its stage can be refilled
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        it += 1
    acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    if TIMELINE:
        t_loop = _now()
    off_m = base + WG * HM
    row_end = base + nrows
    tma_ok = off_m + HM <= row_end
    off_n = j * BN1
    b0 = 2 * WG + (nst & 1)
    a0, a1, a2, a3 = _slices(acc, HM, BN1, mma_s)
    u0, u1, u2, u3 = _slices(acc2, HM, BN1, mma_s)
    _epi_swiglu_slice(a0, u0, off_m, off_n, row_end, I, act_st_desc, hg_desc, hu_desc, act_ptr, I, h_ptr, 2 * I,
                      epi_smem, b0, tma_ok, HM, STORE_H, EPI_TMA, store_l)
    if NSL1 > 1:
        _epi_swiglu_slice(a1, u1, off_m, off_n + 64, row_end, I, act_st_desc, hg_desc, hu_desc, act_ptr, I, h_ptr,
                          2 * I, epi_smem, b0 ^ 1, tma_ok, HM, STORE_H, EPI_TMA, store_l)
    nst += NSL1 * (3 if STORE_H else 1)
    if EPI_TMA and (PROBE_ & 1) == 0:  # act / h written before the counter says so (GEMM2, maybe on another SM,
        _bulk_writes_done()  # reads them by TMA)
    _fence_proxy_async()
    return it, nst, t_first, t_loop


@gluon.jit
def _gemm2_half(tab, W, a_smem, b_smem, ready, empty, epi_smem, rows_desc, rows_ptr, row_src_ptr, row_tok_ptr,
                row_slot_ptr, row0, base, nrows, j, H, k2, it, nst, K: gl.constexpr, BM: gl.constexpr,
                BN2: gl.constexpr, STAGES: gl.constexpr, EPI_TMA: gl.constexpr, PULL_COMBINE: gl.constexpr,
                ALIGNED: gl.constexpr, WG: gl.constexpr, TIMELINE: gl.constexpr):
    """Consumer WG's half of GEMM2(b, j): 64 x BN2 async wgmmas over the ring, then each row pushed into its owner's
    slot (16-byte stores from a staging buffer) or, PULL_COMBINE, stored at its receive row of this rank's ``rows``
    region (TMA where every row is the block's); returns the ring and staged-store counts."""
    HM: gl.constexpr = BM // 2
    mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN2, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros((HM, BN2), dtype=gl.float32, layout=mma2)
    t_first = (it * 0).to(gl.int64)
    t_loop = t_first
    if not PULL_COMBINE:  # the rows' owner addresses: two dependent loads, their latency under the first wgmma (made
        # before the loop, they held the first wgmma back ~1.4 us per item: qwen3 timeline, one H200, 2026-12-02)
        src, tok, slot, rvalid = _push_rows_idx(row0, nrows, row_src_ptr, row_tok_ptr, row_slot_ptr, HM, WG,
                                                store_l)
    # k-step 0 peeled
    st = it % STAGES
    mbarrier.wait(ready.index(st), (it // STAGES) & 1)
    if TIMELINE:
        t_first = _now()
    acc = warpgroup_mma(a_smem.index(st).slice(WG * HM, HM), b_smem.index(st).slice(0, BN2).permute((1, 0)), acc,
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # (none older in flight: waits for nothing)
    it += 1
    if not PULL_COMBINE:
        sbase, sidx = _push_rows_base(tab, W, src, tok, slot, rvalid, K)
    for _ki in range(1, k2):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        a_v = a_smem.index(st).slice(WG * HM, HM)
        acc = warpgroup_mma(a_v, b_smem.index(st).slice(0, BN2).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    if TIMELINE:
        t_loop = _now()
    off_n = j * BN2
    a0, a1, a2, a3 = _slices(acc, HM, BN2, mma_s)
    b0 = 2 * WG + (nst & 1)
    if PULL_COMBINE:  # at the rows' receive rows of this rank's ``rows`` region
        off_m = row0 + WG * HM
        row_end = row0 + nrows
        tma_ok = off_m + HM <= row_end
        _put(a0.to(gl.bfloat16), rows_desc, rows_ptr, H, off_m, off_n, row_end, H, epi_smem, b0, tma_ok, HM, EPI_TMA,
             store_l)
        if BN2 > 64:
            _put(a1.to(gl.bfloat16), rows_desc, rows_ptr, H, off_m, off_n + 64, row_end, H, epi_smem, b0 ^ 1, tma_ok,
                 HM, EPI_TMA, store_l)
        if BN2 > 128:
            _put(a2.to(gl.bfloat16), rows_desc, rows_ptr, H, off_m, off_n + 128, row_end, H, epi_smem, b0, tma_ok,
                 HM, EPI_TMA, store_l)
            _put(a3.to(gl.bfloat16), rows_desc, rows_ptr, H, off_m, off_n + 192, row_end, H, epi_smem, b0 ^ 1,
                 tma_ok, HM, EPI_TMA, store_l)
        if EPI_TMA:
            tma.store_wait(0)
    else:
        rp = _push_rows_ptrs(sbase, sidx, H, ALIGNED)
        if BN2 > 64:
            _push_pair(a0.to(gl.bfloat16), a1.to(gl.bfloat16), rp, rvalid, off_n, H, epi_smem, b0, HM, store_l)
            if BN2 > 128:
                _push_pair(a2.to(gl.bfloat16), a3.to(gl.bfloat16), rp, rvalid, off_n + 128, H, epi_smem, b0, HM,
                           store_l)
        else:
            _push_slice(a0.to(gl.bfloat16), rp, rvalid, off_n, H, epi_smem, b0, HM, store_l)
    nst += BN2 // 64
    return it, nst, t_first, t_loop


@gluon.jit
def _fp8_g1_half(a_smem, b_smem, ready, empty, sa_row, mmask, sg_p, su_p, k1, it, WG: gl.constexpr,
                 HM: gl.constexpr, HN: gl.constexpr, STAGES: gl.constexpr, TIMELINE: gl.constexpr):
    """One 64-column half of an FP8 GEMM1 tile for consumer WG's rows: per 128 of K, g += (xq @ q13g^T) *
    (x_scale[r] * w_scale) and u likewise, each product a fresh wgmma waited for before its promotion (the other
    consumer's wgmma runs meanwhile, as in gluon_fp8_ws). Stage: the x rows, then the gate and up halves' rows at
    [0, HN) and [HN, 2 HN) of the weight buffer. Returns (g, u, ring count, time the first stage landed)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
    zero = gl.zeros((HM, HN), dtype=gl.float32, layout=mma)
    g = zero
    u = zero
    t_first = (it * 0).to(gl.int64)
    for ki in range(k1):
        st = it % STAGES
        sa = gl.load(sa_row + ki, mask=mmask, other=0.0)
        sg = gl.load(sg_p + ki)
        su = gl.load(su_p + ki)
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        if TIMELINE:
            if ki == 0:
                t_first = _now()
        a_v = a_smem.index(st).slice(WG * HM, HM)
        p = warpgroup_mma(a_v, b_smem.index(st).slice(0, HN).permute((1, 0)), zero, use_acc=False, is_async=True)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        g = g + p * (sa * sg)[:, None]
        p2 = warpgroup_mma(a_v, b_smem.index(st).slice(HN, HN).permute((1, 0)), zero, use_acc=False, is_async=True)
        p2 = warpgroup_mma_wait(num_outstanding=0, deps=(p2,))
        mbarrier.arrive(empty.index(st), count=1)
        u = u + p2 * (sa * su)[:, None]
        it += 1
    return g, u, it, t_first


@gluon.jit
def _fp8_h_act(g, u, hg_desc, hu_desc, h_ptr, off_m, col, row_end, I, epi_smem, b0, tma_ok, HM: gl.constexpr,
               STORE_H: gl.constexpr, EPI_TMA: gl.constexpr, store_l: gl.constexpr, mma: gl.constexpr):
    """h = (g, u) in bf16 at columns col.. (STORE_H, two staged stores from buffer b0); returns act = silu(g) * u
    rounded to bf16 (as split stores it before quantising), 0 at rows >= row_end and columns >= I, in fp32 (held in
    bf16 instead while the other half runs, sm_90a spilled 4-8x more)."""
    if STORE_H:
        _put(g.to(gl.bfloat16), hg_desc, h_ptr, 2 * I, off_m, col, row_end, I, epi_smem, b0, tma_ok, HM, EPI_TMA,
             store_l)
        _put(u.to(gl.bfloat16), hu_desc, h_ptr + I, 2 * I, off_m, col, row_end, I, epi_smem, b0 ^ 1, tma_ok, HM,
             EPI_TMA, store_l)
    rs = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
    cs = col + gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
    m = (rs < row_end)[:, None] & (cs < I)[None, :]
    return gl.where(m, (g / (1.0 + gl.exp(-g)) * u).to(gl.bfloat16).to(gl.float32), 0.0)


@gluon.jit
def _gemm1_item_fp8(a_smem, b_smem, ready, empty, epi_smem, hg_desc, hu_desc, h_ptr, act_ptr, xs_ptr, stride_xs,
                    s13_ptr, acs_ptr, e, base, nrows, j, H, I, k1, it, nst, BM: gl.constexpr, BN1: gl.constexpr,
                    STAGES: gl.constexpr, STORE_H: gl.constexpr, EPI_TMA: gl.constexpr, WG: gl.constexpr,
                    TIMELINE: gl.constexpr):
    """FP8 GEMM1(b, j), consumer WG's 64 rows, as the Triton FP8 megakernel computes it (fused_moe._fp8_gemm1_half):
    the 128-column tile as two 64-column halves, one k-loop each (I % 128 == 0: one weight scale per half and
    k-step); h in bf16 (STORE_H); act = silu(g) * u rounded to bf16 and quantised per row over the tile's 128 columns
    (act's 1x128 block j: s = amax / 448, e4m3(act / s)) into act_ptr (e4m3 [NROWS, I]) and acs_ptr (fp32 [NROWS,
    cdiv(I, 128)]). The two halves keep two 64 x 64 accumulators and one product live (96 fp32 registers)."""
    HM: gl.constexpr = BM // 2
    HN: gl.constexpr = BN1 // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 32])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ql: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # e4m3 [HM, 64]: 16-byte stores
    kbh = gl.cdiv(H, 128)
    off_m = base + WG * HM
    row_end = base + nrows
    rm = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
    mmask = rm < row_end
    sa_row = xs_ptr + rm.to(gl.int64) * stride_xs
    sw = s13_ptr + e.to(gl.int64) * (gl.cdiv(2 * I, 128) * kbh)
    sg_p = sw + j * kbh                          # the gate tile's 128-row weight block
    su_p = sw + ((I + j * BN1) // 128) * kbh     # the up tile's
    off_n = j * BN1
    tma_ok = off_m + HM <= row_end
    g, u, it, t_first = _fp8_g1_half(a_smem, b_smem, ready, empty, sa_row, mmask, sg_p, su_p, k1, it, WG, HM, HN,
                                     STAGES, TIMELINE)
    a0 = _fp8_h_act(g, u, hg_desc, hu_desc, h_ptr, off_m, off_n, row_end, I, epi_smem, 2 * WG + (nst & 1), tma_ok, HM,
                    STORE_H, EPI_TMA, store_l, mma)
    g, u, it, t_f1 = _fp8_g1_half(a_smem, b_smem, ready, empty, sa_row, mmask, sg_p, su_p, k1, it, WG, HM, HN, STAGES,
                                  TIMELINE)
    t_loop = (it * 0).to(gl.int64)
    if TIMELINE:
        t_loop = _now()
    a1 = _fp8_h_act(g, u, hg_desc, hu_desc, h_ptr, off_m, off_n + HN, row_end, I, epi_smem, 2 * WG + (nst & 1),
                    tma_ok, HM, STORE_H, EPI_TMA, store_l, mma)
    if STORE_H:
        nst += 4
    amax = gl.maximum(gl.max(gl.abs(a0), axis=1), gl.max(gl.abs(a1), axis=1))
    sc = gl.div_rn(gl.maximum(amax, 1e-12), 448.0)
    q0 = gl.minimum(gl.maximum(gl.div_rn(a0, sc[:, None]), -448.0), 448.0).to(gl.float8e4nv)
    q1 = gl.minimum(gl.maximum(gl.div_rn(a1, sc[:, None]), -448.0), 448.0).to(gl.float8e4nv)
    rq = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, ql))
    cq = off_n + gl.arange(0, HN, layout=gl.SliceLayout(0, ql))
    qp = act_ptr + rq.to(gl.int64)[:, None] * I + cq[None, :]
    rqm = (rq < row_end)[:, None]
    gl.store(qp, gl.convert_layout(q0, ql), mask=rqm & (cq < I)[None, :])
    gl.store(qp + HN, gl.convert_layout(q1, ql), mask=rqm & ((cq + HN) < I)[None, :])
    gl.store(acs_ptr + rm.to(gl.int64) * gl.cdiv(I, 128) + j, sc, mask=mmask)
    if EPI_TMA:
        if STORE_H:
            tma.store_wait(0)
    _fence_proxy_async()
    return it, nst, t_first, t_loop


@gluon.jit
def _gemm2_item_fp8(tab, W, a_smem, b_smem, ready, empty, epi_smem, acs_ptr, s2_ptr, row_src_ptr, row_tok_ptr,
                    row_slot_ptr, e, row0, base, nrows, j, H, I, k2, it, nst, K: gl.constexpr, BM: gl.constexpr,
                    BN2: gl.constexpr, STAGES: gl.constexpr, ALIGNED: gl.constexpr, WG: gl.constexpr,
                    TIMELINE: gl.constexpr):
    """FP8 GEMM2(b, j), consumer WG's 64 rows: per 128 of K, acc += (act_q @ q2^T) * (act_scale[r] * w_scale) (BN2 <=
    128: one 128-row weight block per tile), then the rows pushed into their owners' slots as bf16 (as the bf16
    GEMM2)."""
    HM: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN2, 32])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    kbi = gl.cdiv(I, 128)
    rm = base + WG * HM + gl.arange(0, HM, layout=rows_l)
    mmask = rm < base + nrows
    sa_row = acs_ptr + rm.to(gl.int64) * kbi
    sw_p = s2_ptr + e.to(gl.int64) * (gl.cdiv(H, 128) * kbi) + ((j * BN2) // 128) * kbi
    # the rows' owner addresses: the index loads issued here, the dependent slot-base load after the k-loop (the
    # bf16 item's peeled first k-step cost this one 20 B more spills)
    src, tok, slot, rvalid = _push_rows_idx(row0, nrows, row_src_ptr, row_tok_ptr, row_slot_ptr, HM, WG, store_l)
    zero = gl.zeros((HM, BN2), dtype=gl.float32, layout=mma)
    acc = zero
    t_first = (it * 0).to(gl.int64)
    t_loop = t_first
    for ki in range(k2):
        st = it % STAGES
        sa = gl.load(sa_row + ki, mask=mmask, other=0.0)
        sb = gl.load(sw_p + ki)
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        if TIMELINE:
            if ki == 0:
                t_first = _now()
        a_v = a_smem.index(st).slice(WG * HM, HM)
        p = warpgroup_mma(a_v, b_smem.index(st).slice(0, BN2).permute((1, 0)), zero, use_acc=False, is_async=True)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        mbarrier.arrive(empty.index(st), count=1)
        acc = acc + p * (sa * sb)[:, None]
        it += 1
    if TIMELINE:
        t_loop = _now()
    off_n = j * BN2
    a0, a1, a2, a3 = _slices(acc, HM, BN2, mma_s)
    b0 = 2 * WG + (nst & 1)
    sbase, sidx = _push_rows_base(tab, W, src, tok, slot, rvalid, K)
    rp = _push_rows_ptrs(sbase, sidx, H, ALIGNED)
    if BN2 > 64:
        _push_pair(a0.to(gl.bfloat16), a1.to(gl.bfloat16), rp, rvalid, off_n, H, epi_smem, b0, HM, store_l)
    else:
        _push_slice(a0.to(gl.bfloat16), rp, rvalid, off_n, H, epi_smem, b0, HM, store_l)
    nst += BN2 // 64
    return it, nst, t_first, t_loop


@gluon.jit
def _consumer(tab, W, rank, a_smem, b_smem, ready, empty, q_full, q_empty, q_smem, s_full, s_empty, s_smem, epi_smem,
              act_st_desc, hg_desc, hu_desc, rows_desc, x_ptr, act_ptr, h_ptr, rows_ptr,
              offs_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr, ctr_ptr,
              H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns,
              K: gl.constexpr, BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, BLOCK_E: gl.constexpr,
              GB: gl.constexpr, PULL_SPLIT: gl.constexpr, STAGES: gl.constexpr, QD_: gl.constexpr,
              ROWS_P: gl.constexpr, BLOCK_H: gl.constexpr, WP2: gl.constexpr, STORE_H: gl.constexpr,
              EPI_TMA: gl.constexpr, PULL_COMBINE: gl.constexpr, ALIGNED: gl.constexpr, WG: gl.constexpr,
              tl_ptr, tlp_ptr, TIMELINE: gl.constexpr, HP, xs_ptr, stride_xs, s13_ptr, s2_ptr, acs_ptr,
              FP8: gl.constexpr, PROBE_: gl.constexpr, SQ: gl.constexpr, xv_desc, BULK: gl.constexpr,
              RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr, BR: gl.constexpr,
              IDLE_: gl.constexpr):
    """Consumer warpgroup WG: rows WG * 64 .. WG * 64 + 63 of every item's block (module docstring). TIMELINE
    (consumer 0): per item handed over [program, kind, block, asked for it, got it, first stage landed (pull:
    got it), k-loop (pull: copy) done, end] into tl_ptr [items, 8]; per program [entry, READY seen, items done] into
    tlp_ptr [P, 8]."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ml: gl.constexpr = gl.BlockedLayout([MSG], [32], [4], [0])
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    call = gl.load(_ctrl(tab, W, rank) + SEQ, volatile=True)
    if TIMELINE:
        t_entry = _now()
    ok = _wait_ready(tab, W, rank, call, timeout_ns, WP2, lay)  # peers' tokens staged (the pulls read them)
    if TIMELINE:
        t_ready = _now()
    BK: gl.constexpr = 128 if FP8 else 64
    k1 = gl.cdiv(H, BK)
    k2 = gl.cdiv(I, BK)
    n = 0
    it = 0
    nst = 0
    ns = 0  # signals posted to the signaller
    go = E_l >= 0  # (a runtime True)
    while go:
        qs = n % QD_
        if TIMELINE:
            t_ask = _now()
        mbarrier.wait(q_full.index(qs), (n // QD_) & 1)
        m = q_smem.index(qs)  # the loader's message (_pack): only live items, the end, or a failed wait
        item = _rd(m, 0, lay)
        go = (_rd(m, 1, lay) != 0) & (_rd(m, 2, lay) != 0)
        kind = _rd(m, 3, lay)
        b = _rd(m, 4, lay)
        j = _rd(m, 5, lay)
        e = _rd(m, 6, lay)
        row0 = _rd(m, 7, lay)
        nrows = _rd(m, 8, lay)
        base = _rd(m, 9, lay)
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(qs), count=1)
        if TIMELINE:
            t_got = _now()
            t_first = t_got
            t_loop = t_got
        if go:
            if kind == 0:  # PULL(b, part j)
                part: gl.constexpr = BM // PULL_SPLIT
                if BULK:  # the part's rows, loaded by the loader into the ring: stored from there
                    it = _store_pull(xv_desc, a_smem, b_smem, ready, empty, base, j * part,
                                     gl.minimum(j * part + part, nrows), it, RA, RB, RV, C, STAGES, WG, BR)
                else:  # this consumer's half of the part's rows, through its registers
                    half: gl.constexpr = (part + 1) // 2
                    r_lo = j * part + WG * half
                    r_end = gl.minimum(gl.minimum(r_lo + half, j * part + part), nrows)
                    if ok:
                        _pull_rows(tab, W, row0, r_lo, r_end, base, row_src_ptr, row_tok_ptr, x_ptr, H, HP, ROWS_P,
                                   BLOCK_H, ALIGNED, pl)
                if TIMELINE:
                    t_loop = _now()
                off = 1 + b
            elif kind == 1:  # GEMM1(b, j): act[rows, j-th BN1 columns] = silu(x @ wg^T) * (x @ wu^T)
                # (a constexpr False for consumer 0 or IDLE_ 0: the branch is not compiled; FP8: two 64-column
                # halves, each a k-loop)
                if (WG == 1) and (IDLE_ != 0) and (nrows <= BM // 2):
                    it = _ring_skip(ready, empty, it, k1 * 2 if FP8 else k1, STAGES)
                    t_f = (it * 0).to(gl.int64)
                    t_l = t_f
                elif FP8:
                    it, nst, t_f, t_l = _gemm1_item_fp8(a_smem, b_smem, ready, empty, epi_smem, hg_desc, hu_desc,
                                                        h_ptr, act_ptr, xs_ptr, stride_xs, s13_ptr, acs_ptr, e, base,
                                                        nrows, j, H, I, k1, it, nst, BM, BN1, STAGES, STORE_H,
                                                        EPI_TMA, WG, TIMELINE)
                else:
                    it, nst, t_f, t_l = _gemm1_half(a_smem, b_smem, ready, empty, epi_smem, act_st_desc, hg_desc,
                                                    hu_desc, act_ptr, h_ptr, base, nrows, j, I, k1, it, nst, BM, BN1,
                                                    STAGES, STORE_H, EPI_TMA, WG, TIMELINE, PROBE_)
                if TIMELINE:
                    t_first = t_f
                    t_loop = t_l
                off = 1 + NB_MAX + b
            else:  # GEMM2(b, j): out = act @ w2[e]^T (columns j * BN2 ..), pushed to the owners (or kept local)
                if (WG == 1) and (IDLE_ != 0) and (nrows <= BM // 2):
                    it = _ring_skip(ready, empty, it, k2, STAGES)
                    t_f = (it * 0).to(gl.int64)
                    t_l = t_f
                elif FP8:
                    it, nst, t_f, t_l = _gemm2_item_fp8(tab, W, a_smem, b_smem, ready, empty, epi_smem, acs_ptr,
                                                        s2_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr, e, row0, base,
                                                        nrows, j, H, I, k2, it, nst, K, BM, BN2, STAGES, ALIGNED, WG,
                                                        TIMELINE)
                else:
                    it, nst, t_f, t_l = _gemm2_half(tab, W, a_smem, b_smem, ready, empty, epi_smem, rows_desc,
                                                    rows_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr, row0, base,
                                                    nrows, j, H, k2, it, nst, K, BM, BN2, STAGES, EPI_TMA,
                                                    PULL_COMBINE, ALIGNED, WG, TIMELINE)
                if TIMELINE:
                    t_first = t_f
                    t_loop = t_l
                off = 1 + 2 * NB_MAX + b
            _post(s_full, s_empty, s_smem, ns, off, ml, SQ, WG)
            ns += 1
        if TIMELINE:
            if (WG == 0) & go:
                rec = tl_ptr + item.to(gl.int64) * 8
                gl.store(rec, gl.program_id(0).to(gl.int64))
                gl.store(rec + 1, kind.to(gl.int64))
                gl.store(rec + 2, b.to(gl.int64))
                gl.store(rec + 3, t_ask)
                gl.store(rec + 4, t_got)
                gl.store(rec + 5, t_first)
                gl.store(rec + 6, t_loop)
                gl.store(rec + 7, _now())
        n += 1
    _post(s_full, s_empty, s_smem, ns, -1, ml, SQ, WG)
    if EPI_TMA:  # the staging buffers stay allocated until the last store has read them
        tma.store_wait(0)
    if TIMELINE:
        if WG == 0:
            t_done = _now()
            prec = tlp_ptr + gl.program_id(0) * 8
            gl.store(prec, t_entry)
            gl.store(prec + 1, t_ready)
            gl.store(prec + 2, t_done)


@gluon.jit(do_not_specialize=["W", "rank", "E_l", "NS", "L1", "L2"])
def _gluon_fused_fwd_kernel(
    tab, W, rank,
    x_desc,             # xbuf [NROWS, H] bf16, block [BM, 64]
    w13_desc,           # w13 as [E_l * 2I, H], block [BN1, 64]
    act_desc,           # act [NROWS, I] as GEMM2's A, block [BM, 64]
    w2_desc,            # w2 as [E_l * H, I], block [BN2, 64]
    act_st_desc,        # act [NROWS, I], block [64, 64] (EPI_TMA: GEMM1's stores)
    hg_desc, hu_desc,   # h's gate / up halves [NROWS, I] of row stride 2I, block [64, 64] (EPI_TMA and STORE_H)
    rows_desc,          # this rank's ``rows`` region [R_cap, H], block [64, 64] (PULL_COMBINE with EPI_TMA)
    x_ptr, act_ptr, h_ptr, rows_ptr,
    offs_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr,  # the schedule (fused_moe._fused_fwd_kernel)
    ctr_ptr,            # int64 [1 + 3 * NB_MAX] zeroed: queue, ready[NB_MAX], g1[NB_MAX], g2[NB_MAX]
    q_ptr,              # int64 [P * QD]: the item queue of each program (loader -> consumers)
    tl_ptr, tlp_ptr, tll_ptr,  # TIMELINE: int64 [items, 8] (consumer 0), [P, 8], [items, 4] (loader)
    xs_ptr, s13_ptr, s2_ptr, acs_ptr,  # FP8: x's 1x128 scales (row stride stride_xs floats: views of the packed rows),
    #                     the weights' 128x128 block scales, act's 1x128 scales [NROWS, cdiv(I, 128)]
    H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns, HP, stride_xs,
    K: gl.constexpr, BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, BLOCK_E: gl.constexpr,
    GB: gl.constexpr, PULL_SPLIT: gl.constexpr, STAGES: gl.constexpr, QD_: gl.constexpr, ROWS_P: gl.constexpr,
    BLOCK_H: gl.constexpr, WP2: gl.constexpr, STORE_H: gl.constexpr, EPI_TMA: gl.constexpr,
    PULL_COMBINE: gl.constexpr, ALIGNED: gl.constexpr, ACQ_GPU: gl.constexpr,
    CONSUMER_REGS_: gl.constexpr, LOADER_REGS: gl.constexpr, TIMELINE: gl.constexpr, FP8: gl.constexpr,
    PROBE_: gl.constexpr, SQ_: gl.constexpr, xv_desc, tok0, tok1, tok2, tok3, tok4, tok5, tok6, tok7,
    BULK: gl.constexpr, RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr, NP: gl.constexpr,
    BR: gl.constexpr, IDLE_: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (P,): persistent programs of 4 + 4 + 1 warps (module docstring). FP8: x_desc, w13_desc, act_desc, w2_desc
    are the e4m3 operands' (blocks [BM, 128], [BN1, 128], [BM, 128], [BN2, 128]), x_ptr the packed rows (HP words
    each), act_ptr e4m3 act."""
    tok_descs = (tok0, tok1, tok2, tok3, tok4, tok5, tok6, tok7)  # BULK: every rank's ``tok`` view (NP of them)
    BW: gl.constexpr = 2 * BN1 if 2 * BN1 > BN2 else BN2  # weight rows of a stage: GEMM1's gate + up, GEMM2's tile
    if FP8:  # 128 e4m3 bytes of K per row; GEMM1's stage holds a 64-column half (gate + up: BN1 rows)
        BW8: gl.constexpr = BN1 if BN1 > BN2 else BN2
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, 128], x_desc.layout)
        b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BW8, 128], w2_desc.layout)
    else:
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 64], x_desc.layout)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BW, 64], w2_desc.layout)
    epi_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BM // 2, 64], act_st_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)
    q_smem = gl.allocate_shared_memory(gl.int32, [QD_, MSG], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_full = gl.allocate_shared_memory(gl.int64, [QD_, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [QD_, 1], mbarrier.MBarrierLayout())
    for qs in gl.static_range(QD_):
        mbarrier.init(q_full.index(qs), count=1)
        mbarrier.init(q_empty.index(qs), count=2)
    s_smem = gl.allocate_shared_memory(gl.int32, [SQ_, MSG], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    s_full = gl.allocate_shared_memory(gl.int64, [SQ_, 1], mbarrier.MBarrierLayout())
    s_empty = gl.allocate_shared_memory(gl.int64, [SQ_, 1], mbarrier.MBarrierLayout())
    for ss in gl.static_range(SQ_):
        mbarrier.init(s_full.index(ss), count=2)
        mbarrier.init(s_empty.index(ss), count=1)
    # (the partitions' argument lists written out: constexprs packed into a tuple lose their constexpr-ness)
    gl.warp_specialize([
        (_consumer, (tab, W, rank, a_smem, b_smem, ready, empty, q_full, q_empty, q_smem, s_full, s_empty, s_smem,
                     epi_smem, act_st_desc, hg_desc, hu_desc, rows_desc, x_ptr, act_ptr, h_ptr, rows_ptr, offs_ptr,
                     row_src_ptr, row_tok_ptr, row_slot_ptr, ctr_ptr, H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns, K,
                     BM, BN1, BN2, BLOCK_E, GB, PULL_SPLIT, STAGES, QD_, ROWS_P, BLOCK_H, WP2, STORE_H, EPI_TMA,
                     PULL_COMBINE, ALIGNED, 0, tl_ptr, tlp_ptr, TIMELINE, HP, xs_ptr, stride_xs, s13_ptr, s2_ptr,
                     acs_ptr, FP8, PROBE_, SQ_, xv_desc, BULK, RA, RB, RV, C, BR, IDLE_)),
        (_consumer, (tab, W, rank, a_smem, b_smem, ready, empty, q_full, q_empty, q_smem, s_full, s_empty, s_smem,
                     epi_smem, act_st_desc, hg_desc, hu_desc, rows_desc, x_ptr, act_ptr, h_ptr, rows_ptr, offs_ptr,
                     row_src_ptr, row_tok_ptr, row_slot_ptr, ctr_ptr, H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns, K,
                     BM, BN1, BN2, BLOCK_E, GB, PULL_SPLIT, STAGES, QD_, ROWS_P, BLOCK_H, WP2, STORE_H, EPI_TMA,
                     PULL_COMBINE, ALIGNED, 1, tl_ptr, tlp_ptr, TIMELINE, HP, xs_ptr, stride_xs, s13_ptr, s2_ptr,
                     acs_ptr, FP8, PROBE_, SQ_, xv_desc, BULK, RA, RB, RV, C, BR, IDLE_)),
        (_loader, (tab, W, rank, x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, q_full, q_empty,
                   q_ptr, q_smem, offs_ptr, ctr_ptr, H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns, BM, BN1, BN2,
                   BLOCK_E, GB, PULL_SPLIT, STAGES, QD_, ACQ_GPU, tll_ptr, TIMELINE, FP8, tok_descs, row_src_ptr,
                   row_tok_ptr, BULK, RA, RB, RV, C, WP2, NP, BR)),
        (_signaller, (s_full, s_empty, s_smem, ctr_ptr, E_l, SQ_)),
    ], [4, 1, 1], [CONSUMER_REGS_, LOADER_REGS, LOADER_REGS])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))
        mbarrier.invalidate(empty.index(st))
    for qs in gl.static_range(QD_):
        mbarrier.invalidate(q_full.index(qs))
        mbarrier.invalidate(q_empty.index(qs))
    for ss in gl.static_range(SQ_):
        mbarrier.invalidate(s_full.index(ss))
        mbarrier.invalidate(s_empty.index(ss))


# ------------------------------------------------------------------------------------------------- launcher
FP8_MAX_STAGES = 4  # (FP8 stages are 32 KB: GEMM1's 64-column halves, GEMM2's 128-column tiles)


def stages_of(cfg, fp8: bool = False) -> int:
    """Ring stages of a launch: the config's, at most FP8_MAX_STAGES with FP8."""
    return min(cfg.num_stages, FP8_MAX_STAGES) if fp8 else cfg.num_stages


def smem_bytes(cfg, fp8: bool = False) -> int:
    """Shared memory of a launch: the ring (a [BM, 64] bf16 or [BM, 128] e4m3 tile + the weight rows of the wider
    GEMM item per stage: 128 bytes of K per row either way; FP8's GEMM1 stage holds a 64-column half), the
    consumers' staging buffers (4 x [BM / 2, 64] bf16), FP8's conversion scratch, barriers (rounded up)."""
    bw = max(cfg.bn1 if fp8 else 2 * cfg.bn1, cfg.bn2)
    scratch = (cfg.block_m // 2) * 64 * 2 if fp8 else 0
    return stages_of(cfg, fp8) * 128 * (cfg.block_m + bw) + 4 * (cfg.block_m // 2) * 64 * 2 + scratch + 1024


def gluon_fused_reason(cfg, *, H: int, I: int, device: torch.device | None = None, fp8: bool = False) -> str | None:
    """Why ``FusedConfig(kernel="gluon")`` cannot run a forward of these sizes on ``device`` (None: it can); ``fp8``:
    the FP8 forward's items (``fused:fp8=1``)."""
    if interpreting():
        return "Gluon kernels do not run under the Triton interpreter (TRITON_INTERPRET=1)"
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        return (f"the Gluon megakernel is built for Hopper (sm_90: wgmma, TMA), got capability "
                f"{torch.cuda.get_device_capability(device)}")
    if (cfg.block_m, cfg.bn1, cfg.block_k) != (128, 128, 64) or cfg.bn2 not in ((128,) if fp8 else (128, 256)):
        why = "; FP8: one weight scale block per GEMM2 tile" if fp8 else ""
        return (f"needs block_m=128, bn1=128, block_k=64 and bn2 {'128' if fp8 else '128 or 256'} (two 64-row "
                f"consumer warpgroups with at most 128 accumulator registers each{why}), got block_m={cfg.block_m}, "
                f"bn1={cfg.bn1}, block_k={cfg.block_k}, bn2={cfg.bn2}")
    if cfg.num_stages < 2:
        return f"num_stages must be >= 2, got {cfg.num_stages}"
    if smem_bytes(cfg, fp8) > SMEM_LIMIT:
        return (f"{stages_of(cfg, fp8)} stages need ~{smem_bytes(cfg, fp8)} bytes of shared memory, more than "
                f"{SMEM_LIMIT}")
    if H % 8 or I % 8:
        return f"H and I must be multiples of 8 (16-byte TMA row strides), got H={H}, I={I}"
    if fp8 and (H % 16 or I % 128):
        return (f"FP8: H must be a multiple of 16 (e4m3 weight rows for TMA) and I of 128 (GEMM1's up tile inside one "
                f"128-row weight scale block), got H={H}, I={I}")
    off = [n for n in ("prologue", "pull_prefetch") if getattr(cfg, n)]
    if off or cfg.ablate:
        return f"options {off + (['ablate'] if cfg.ablate else [])} exist on the Triton megakernel only"
    if fp8 and cfg.combine != "push":
        return "the FP8 items push their rows (combine='push')"
    return None


def _bulk_pull_plan(heap, cfg, a, fp8: bool):
    """(receive-buffer view descriptor, every rank's ``tok`` view descriptor, rows per stage in the A tile and in the
    weight tile, RV, C) for the TMA pull (BULK_PULL), or None where the register pull runs: FP8 (packed rows of
    2 H + scale bytes are not 128-byte multiples), H % 64 (a row in a stage starts 128-byte aligned), a receive
    buffer that is not dense, more than 8 ranks. A row of H bf16 is RV = H / C rows of C <= 256 elements, loaded
    and stored as RV / BR boxes of [BR, C] (box dimensions are powers of 2 <= 256: deepseek-v3's 7168 is 7 boxes of
    [4, 256]; at most 8 boxes per row)."""
    H = heap.shape.hidden
    if not BULK_PULL or fp8 or heap.world > 8 or H % 64 or not a.is_contiguous() or a.shape[1] != H:
        return None
    c = 256 if H % 256 == 0 else (128 if H % 128 == 0 else 64)
    rv = H // c
    br = rv & -rv  # (a box's rows are a power of 2: a row is rv / br boxes)
    while br > 256 or rv // br > 8:  # (at most 8 boxes per row)
        if br > 256:
            br //= 2
        else:
            return None
    bw = max(2 * cfg.bn1, cfg.bn2)
    ra = min(cfg.block_m * 64 // H, 8)  # (rows of a stage's tiles; at most 16 in all: each is an unrolled TMA issue)
    rb = min(bw * 64 // H, 16 - ra)
    if ra + rb < 1:
        return None
    lay_p = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    xv = TensorDescriptor(a, [a.shape[0] * rv, c], [c, 1], [br, c], lay_p)
    toks = []
    for r in range(heap.world):
        t = heap.peer_buffer("tok", r)
        toks.append(TensorDescriptor(t, [t.shape[0] * rv, c], [c, 1], [br, c], lay_p))
    return xv, toks, ra, rb, rv, c, br


def launch_gluon_fused(heap, cfg, sched, P: int, *, a, w1, act, w2, h, ctr, I: int, nb_max: int, ring_blocks: int,
                       group: int, lookahead: int, lag: int, timeline: tuple | None = None, fp8=None) -> None:
    """The items of one forward (fused_moe._launch calls this, then fused_moe._fused_tail_kernel; fused_forward
    has checked gluon_fused_reason before staging anything). ``timeline``:
    (items [n, 8], per program [P, 8], loader [n, 4]) int64 buffers for FusedConfig.timeline (see _consumer).
    ``fp8`` (fused_moe.Fp8Operands): the FP8 forward; then a = the packed rows [NROWS, HP] the pull fills, w1 / w2
    the e4m3 weights, act e4m3 [NROWS, I]."""
    sh = heap.shape
    H, k, E_l = sh.hidden, sh.topk, sh.local_experts
    BM, BN1, BN2 = cfg.block_m, cfg.bn1, cfg.bn2
    bf = gl.bfloat16
    bw = max(2 * BN1, BN2)
    nrows = a.shape[0]
    hp = a.shape[1]  # elements the pull moves per row (H; the packed FP8 rows: fewer)
    lay_e = gl.NVMMASharedLayout.get_default_for([BM // 2, 64], bf)
    # operands: bf16 with 64 of K per k-step, or e4m3 with 128 (FP8: GEMM1 in 64-column halves); 128 bytes either way
    dt, bk, w1_rows = (gl.float8e4nv, 128, BN1 // 2) if fp8 is not None else (bf, 64, BN1)
    lay_w = gl.NVMMASharedLayout.get_default_for([max(BN1, BN2) if fp8 is not None else bw, bk], dt)
    lay_a = gl.NVMMASharedLayout.get_default_for([BM, bk], dt)
    xa = fp8.xq if fp8 is not None else a  # GEMM1's A: the e4m3 view of the packed rows, or the rows
    x_desc = TensorDescriptor(xa, [nrows, H], [xa.stride(0), 1], [BM, bk], lay_a)
    w13v = w1.view(E_l * 2 * I, H)
    w13_desc = TensorDescriptor(w13v, list(w13v.shape), [H, 1], [w1_rows, bk], lay_w)
    act_desc = TensorDescriptor(act, [nrows, I], [act.stride(0), 1], [BM, bk], lay_a)
    w2v = w2.view(E_l * H, I)
    w2_desc = TensorDescriptor(w2v, list(w2v.shape), [I, 1], [BN2, bk], lay_w)
    if fp8 is not None:  # (no bf16 act: the staging buffers' layout from a descriptor of the packed rows, never stored)
        act_st_desc = TensorDescriptor(a, [nrows, hp], [a.stride(0), 1], [BM // 2, 64], lay_e)
        f8_args = (fp8.xs, fp8.s13, fp8.s2, fp8.acs)
        stride_xs = fp8.xs.stride(0)
    else:
        act_st_desc = TensorDescriptor(act, [nrows, I], [act.stride(0), 1], [BM // 2, 64], lay_e)
        f8_args = (ctr, ctr, ctr, ctr)
        stride_xs = 0
    hg_desc = hu_desc = act_st_desc
    if h is not None:
        hg_desc = TensorDescriptor(h, [nrows, I], [h.stride(0), 1], [BM // 2, 64], lay_e)
        hu_desc = TensorDescriptor(h[:, I:], [nrows, I], [h.stride(0), 1], [BM // 2, 64], lay_e)
    rows = heap.rows_buffer()
    pull = cfg.combine == "pull"
    rows_desc = TensorDescriptor(rows, [rows.shape[0], H], [rows.stride(0), 1], [BM // 2, 64], lay_e) if pull \
        else act_st_desc
    epi_tma = all(t.data_ptr() % 16 == 0 for t in [act] + ([h] if h is not None else []) + ([rows] if pull else []))
    block_h = min(triton.next_power_of_2(hp), 2048)
    q = torch.empty(P * QD, dtype=torch.int64, device=a.device)
    bulk = _bulk_pull_plan(heap, cfg, a, fp8 is not None)
    xv_desc, toks, ra, rb, rv, cw, br = bulk if bulk is not None else (x_desc, (), 0, 0, 1, 64, 1)
    toks8 = tuple(toks) + (xv_desc,) * (8 - len(toks))
    consumer_regs = CONSUMER_REGS_FP8 if fp8 is not None else CONSUMER_REGS
    k_ = _gluon_fused_fwd_kernel[(P,)](
        heap.tab, heap.world, heap.rank, x_desc, w13_desc, act_desc, w2_desc, act_st_desc, hg_desc, hu_desc,
        rows_desc, a, act, h if h is not None else a, rows, sched.offs, sched.row_src, sched.row_tok,
        sched.row_slot, ctr, q, *(timeline if timeline is not None else (ctr, ctr, ctr)), *f8_args, H, I, E_l, nb_max,
        ring_blocks, lookahead, lag, heap.timeout_ns, hp, stride_xs,
        K=k, BM=BM, BN1=BN1, BN2=BN2, BLOCK_E=triton.next_power_of_2(max(E_l, 2)), GB=group,
        PULL_SPLIT=cfg.pull_split, STAGES=stages_of(cfg, fp8 is not None), QD_=QD,
        ROWS_P=max(1, min(BM // 2, PULL_ELEMS // block_h)), BLOCK_H=block_h, WP2=max(2, heap.wp2),
        STORE_H=h is not None,
        EPI_TMA=epi_tma, PULL_COMBINE=pull, ALIGNED=(H * 2) % 16 == 0 and (hp * 2) % 16 == 0,
        ACQ_GPU=cfg.counter_scope == "gpu", CONSUMER_REGS_=consumer_regs, LOADER_REGS=REG_POOL - 2 * consumer_regs,
        TIMELINE=timeline is not None, FP8=fp8 is not None, PROBE_=PROBE, SQ_=SQ, xv_desc=xv_desc,
        tok0=toks8[0], tok1=toks8[1], tok2=toks8[2], tok3=toks8[3], tok4=toks8[4], tok5=toks8[5], tok6=toks8[6],
        tok7=toks8[7], BULK=bulk is not None, RA=ra, RB=rb, RV=rv, C=cw, NP=max(len(toks), 1), BR=br, IDLE_=IDLE_HALF,
        num_warps=4,
        maxnreg=REG_POOL // 3,
    )
    record("_gluon_fused_fwd_kernel", k_)
    LAST_LAUNCH.clear()
    LAST_LAUNCH.update(ctr=ctr, q=q, nb_max=nb_max, programs=P, group=group, lookahead=lookahead, lag=lag)


__all__ = ["gluon_fused_reason", "launch_gluon_fused", "smem_bytes", "stages_of"]
