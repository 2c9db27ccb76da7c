"""The forward megakernel's work items in Gluon, warp-specialised: the fused backend's items on Hopper.

The Triton items (fused_moe.py) refill their pipeline from empty after every claim, wait and fence, and their
epilogue's stores stop the tensor cores; here the same items, in the same order and with the same waits and results,
run with the structure of the warp-specialised GEMMs (kernels/gluon/bf16.py):

    loader     1 warp: claims the items (fused_moe's atomic queue and order), waits for each item's inputs (the
               per-block counters, bounded, acquire + ``fence.proxy.async``), issues its GEMM k-steps' TMA loads into a
               STAGES-deep ring (GEMM1: x rows + the gate and up tiles; GEMM2: act rows + a w2 tile) or, for a PULL
               item, TMA loads of the part's token rows from their owners' ``tok`` regions (fused_io.issue_pull: one
               descriptor per rank, a stage holding RA + RB whole rows; the loader waits for READY itself), and hands
               the item to the consumers through a QD-deep queue: a message in shared memory behind an mbarrier
               (fused_io.pack: the item decoded and its block located; "go" off at the end, "fine" off when a wait
               failed: every partition stops there). Items with no block (the schedule's padding) are dropped.
    consumer 0 4 warps (the default partition): rows 0..63 of the item's block
    consumer 1 4 warps (a worker partition):    rows 64..127
               PULL: the stages the loader filled, TMA-stored into the receive buffer (fused_io.store_pull: even stages
               by consumer 0, odd by consumer 1, each freed once read, the writes waited for before the signal); where
               fused_io.bulk_pull_plan has none (H % 64, more than 8 boxes per row or 8 ranks) half of the part's rows
               through its registers (fused_io.pull_rows). GEMM1: 64 x (128 gate + 128 up) async wgmmas, SwiGLU
               epilogue through common.put (TMA stores into act / h where every row is the block's); GEMM2: 64 x BN2,
               epilogue pushing each row into its owner's slot. On a GEMM item of a block of <= 64 rows consumer 1
               only frees the ring stages as they land (common.ring_skip): consumer 0 has the tensor cores to itself.
               Each consumer posts the item's counter into the signaller's SQ-deep queue once its stores are done.
    signaller  1 warp: once both consumers posted an item, ``counter += 2`` (release, GPU scope: cumulative, so it
               publishes the consumers' stores, which reached this warp through the mbarrier), in posting order; the
               targets are 2x the Triton kernel's. A release waits until the stores before it are performed: done here
               it holds no consumer's next item back.

Deadlock freedom is the Triton kernel's argument (fused_moe.py). Within a program the consumers run the items in
claim order; the loader hands an item over as soon as its inputs are ready, then issues its loads, and waits for the
next item's inputs only after all of them are issued, so a loader waiting on a counter never waits on a consumer that
waits on that loader. The loader does every wait (the consumers wait only on mbarriers that the loader or the
signaller always completes; the signaller only on the consumers' posts, and each consumer posts an end message however
its loop ends), so a timeout cannot leave one partition stopped while another waits for it. DONE and the tail are
fused_moe.py's launches.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.comm.signals import SEQ
from megamoe.kernels.gemm_config import interpreting, record
from megamoe.kernels.gluon.common import (
    REG_POOL,
    epi_tile,
    nvmma_desc,
    ring,
    ring_done,
    ring_skip,
    schedule,
    slices,
    stages_reason,
)
from megamoe.kernels.gluon.fused_io import (
    MSG,
    bulk_pull_plan,
    bulk_writes_done,
    ctrl_of,
    fence_proxy_async,
    issue_pull,
    pack,
    post,
    pull_rows,
    push_pair,
    push_rows_base,
    push_rows_idx,
    push_rows_ptrs,
    rd,
    signaller,
    store_pull,
    wait_counter,
    wait_ready,
)

# depth of the loader -> consumers item queue. An item is bound to its program when claimed, so claim late: with 4 the
# loader claimed pulls and then a GEMM1 tile that waited ~100 us behind them while other programs' GEMM2 items of its
# block waited for it
QD = 1
# 1: consumer 1 idles (frees the ring stages, no wgmma, no epilogue) on the items of blocks of <= 64 rows (an expert's
# last block), so consumer 0 runs their k-loops with the tensor cores to itself; 0: it runs its empty half
IDLE_HALF = 1
# depth of the consumers -> signaller queue of counter signals (the signaller's atomics take ~1 us, items >= 8 us)
SQ = 4
# elements of one register-pull chunk per consumer warpgroup (ROWS_P x BLOCK_H; each thread holds two chunks' 1 / 128):
# the pulls are latency-bound, so bigger chunks keep more reads in flight (a 128-row item: 42.7 us at 4096, 24.6 at
# 16384 on an H200)
PULL_ELEMS = 16384
# registers per thread of each consumer warpgroup (the loader gets the rest of REG_POOL): on sm_90a 224 left the loader
# 56 and 28 B of spills (8 experts); 208 leaves 88: 0 B at 8 and 16 experts, 20 B at 128 (the loader's schedule
# vectors); the consumers do not spill at 208
CONSUMER_REGS = 208


# ------------------------------------------------------------------------------------------ item bookkeeping
@gluon.jit
def _decode(item, PS, T1, L1, L2, GB: gl.constexpr):
    """item -> (step, kind 0 PULL / 1 GEMM1 / 2 GEMM2, block, column tile; 0 for a PULL): fused_moe's order."""
    s = (item // PS).to(gl.int32)
    sub = (item % PS).to(gl.int32)
    is_pull = sub < GB
    is_g1 = (sub >= GB) & (sub < GB * (1 + T1))
    q1 = gl.maximum(sub - GB, 0)
    q2 = gl.maximum(sub - GB * (1 + T1), 0)
    b = gl.where(is_pull, s * GB + sub, gl.where(is_g1, (s - L1) * GB + q1 % GB, (s - L1 - L2) * GB + q2 % GB))
    kind = gl.where(is_pull, 0, gl.where(is_g1, 1, 2))
    j = gl.where(is_pull, 0, gl.where(is_g1, q1 // GB, q2 // GB))
    return s, kind, b, j


@gluon.jit
def _locate_block(b, e_idx, starts, cnts, nblk, cum, NS, BM: gl.constexpr):
    """fused_parts.locate: block b -> (expert, first receive row, valid rows, first buffer row)."""
    e = gl.sum((cum <= b).to(gl.int32), axis=0)
    sel = e_idx == e
    first_blk = gl.sum(gl.where(sel, cum, 0), axis=0) - gl.sum(gl.where(sel, nblk, 0), axis=0)
    row0 = gl.sum(gl.where(sel, starts, 0), axis=0) + (b - first_blk) * BM
    nrows = gl.minimum(gl.sum(gl.where(sel, cnts, 0), axis=0) - (b - first_blk) * BM, BM)
    base = gl.where(NS > 0, (b % gl.maximum(NS, 1)) * BM, row0)
    return e, row0, nrows, base


@gluon.jit
def _issue_loads(x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, kind, e, base, j, H, I, k1, k2, it,
                 BN1: gl.constexpr, BN2: gl.constexpr, STAGES: gl.constexpr):
    """The TMA loads of GEMM item (kind 1 / 2, expert e, first buffer row base, column tile j) into the ring from ring
    count it on (each stage once the consumers have freed it); returns the new ring count."""
    BK: gl.constexpr = 64
    nbytes1: gl.constexpr = x_desc.block_type.nbytes + 2 * w13_desc.block_type.nbytes
    nbytes2: gl.constexpr = act_desc.block_type.nbytes + w2_desc.block_type.nbytes
    fence_proxy_async()
    if kind == 1:
        wrow = e * (2 * I) + j * BN1
        for ki in range(k1):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), nbytes1)
            tma.async_copy_global_to_shared(x_desc, [base, ki * BK], ready.index(st), a_smem.index(st))
            tma.async_copy_global_to_shared(w13_desc, [wrow, ki * BK], ready.index(st), b_smem.index(st).slice(0, BN1))
            tma.async_copy_global_to_shared(w13_desc, [wrow + I, ki * BK], ready.index(st),
                                            b_smem.index(st).slice(BN1, BN1))
            it += 1
    else:
        wrow = e * H + j * BN2
        for ki in range(k2):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), nbytes2)
            tma.async_copy_global_to_shared(act_desc, [base, ki * BK], ready.index(st), a_smem.index(st))
            tma.async_copy_global_to_shared(w2_desc, [wrow, ki * BK], ready.index(st), b_smem.index(st).slice(0, BN2))
            it += 1
    return it


@gluon.jit
def _loader(tab, W, rank, x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, q_full, q_empty,
            q_smem, offs_ptr, ctr_ptr, H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns,
            BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, BLOCK_E: gl.constexpr, GB: gl.constexpr,
            STAGES: gl.constexpr, QD_: gl.constexpr, tok_descs, row_src_ptr, row_tok_ptr, BULK: gl.constexpr,
            RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr, WP2: gl.constexpr, NP: gl.constexpr,
            BR: gl.constexpr):
    """Claims the items, waits for their inputs, hands them over, then issues their loads. BULK: the PULL items' loads
    too (issue_pull), after READY of every rank (the peers' tokens staged)."""
    BK: gl.constexpr = 64
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    ml: gl.constexpr = gl.BlockedLayout([MSG], [32], [1], [0])
    e_idx, starts, cnts, nblk, cum, nb = schedule(offs_ptr, E_l, 1, BM, 1, BLOCK_E, lay)
    T1 = gl.cdiv(I, BN1)
    T2 = gl.cdiv(H, BN2)
    PS = GB * (1 + T1 + T2)
    n_steps = gl.where(nb > 0, gl.cdiv(nb, GB) + L1 + L2, 0)
    rdy = ctr_ptr + 1
    g1 = rdy + NB_MAX
    g2 = g1 + NB_MAX
    call = gl.load(ctrl_of(tab, W, rank) + SEQ, volatile=True)
    k1 = gl.cdiv(H, BK)
    k2 = gl.cdiv(I, BK)
    rok = nb >= 0  # (a runtime True)
    if BULK:
        rok = wait_ready(tab, W, rank, call, timeout_ns, WP2, lay)
    n = 0
    it = 0
    go = nb >= 0  # (a runtime True: the loop-carried flags must not start as constexprs)
    while go:
        qs = n % QD_
        mbarrier.wait(q_empty.index(qs), ((n // QD_) & 1) ^ 1)  # (the first pass finds every slot free)
        item = gl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
        s, kind, b, j = _decode(item, PS, T1, L1, L2, GB)
        go = s < n_steps
        fine = nb >= 0
        live = go & (b >= 0) & (b < nb)
        if live:  # the item's inputs
            if kind == 0:  # PULL(b): the ring slot's previous block has been read by all its GEMM1 tiles
                fine = rok
                if (NS > 0) & (b >= NS):
                    fine = fine & wait_counter(g1 + b - NS, 2 * T1, tab, W, rank, call, timeout_ns)
            elif kind == 1:  # GEMM1(b, j): b pulled; with a ring, the act slot's previous block's GEMM2 done
                fine = wait_counter(rdy + b, 2, tab, W, rank, call, timeout_ns)
                if (NS > 0) & (b >= NS):
                    fine = fine & wait_counter(g2 + b - NS, 2 * T2, tab, W, rank, call, timeout_ns)
            else:  # GEMM2(b, j): every GEMM1 tile of b done
                fine = wait_counter(g1 + b, 2 * T1, tab, W, rank, call, timeout_ns)
        # hand the item over before its loads: the consumers free the ring's stages only once they know the item
        # (publishing after the loads deadlocked as soon as an item had more k-steps than the ring has stages). An
        # item with no block (the schedule's padding) is not handed over: the consumers have nothing to do for it
        hand = live | (go == 0) | (fine == 0)
        # the consumers read the decoded item from shared memory: a global load and the schedule's cross-warp
        # reductions would cost each consumer ~1-2 us per item; here the reductions are in one warp
        e, row0, nrows, base = _locate_block(b, e_idx, starts, cnts, nblk, cum, NS, BM)
        if hand:
            q_smem.index(qs).store(pack(item, go, fine, kind, b, j, e, row0, nrows, base, ml))
            gl.thread_barrier()
            mbarrier.arrive(q_full.index(qs), count=1)
        if live & fine & (kind != 0):
            it = _issue_loads(x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, kind, e, base, j, H,
                              I, k1, k2, it, BN1, BN2, STAGES)
        if BULK:
            if live & fine & (kind == 0):
                part: gl.constexpr = BM
                it = issue_pull(tok_descs, a_smem, b_smem, ready, empty, row_src_ptr, row_tok_ptr, row0, j * part,
                                 gl.minimum(j * part + part, nrows), it, RA, RB, RV, C, STAGES, NP, BR)
        go = go & fine
        n += hand.to(gl.int32)


@gluon.jit
def _gemm1_half(a_smem, b_smem, ready, empty, epi_smem, act_st_desc, hg_desc, hu_desc, act_ptr, h_ptr, base, nrows, j,
                I, k1, it, nst, BM: gl.constexpr, BN1: gl.constexpr, STAGES: gl.constexpr, STORE_H: gl.constexpr,
                EPI_TMA: gl.constexpr, WG: gl.constexpr):
    """Consumer WG's half of GEMM1(b, j): 64 x (BN1 gate + BN1 up) async wgmmas over the ring, then the SwiGLU
    epilogue (act, and h with STORE_H) through the staging buffers; returns the ring and staged-store counts. The
    stores are complete (and ordered before the async proxy's later reads) on return."""
    HM: gl.constexpr = BM // 2
    mma1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN1, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    NSL1: gl.constexpr = BN1 // 64
    acc = gl.zeros((HM, BN1), dtype=gl.float32, layout=mma1)
    acc2 = acc
    for ki in range(k1):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        a_v = a_smem.index(st).slice(WG * HM, HM)
        acc = warpgroup_mma(a_v, b_smem.index(st).slice(0, BN1).permute((1, 0)), acc, is_async=True)
        acc2 = warpgroup_mma(a_v, b_smem.index(st).slice(BN1, BN1).permute((1, 0)), acc2, is_async=True)
        acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
        if ki > 0:  # the previous k-step's products are done: its stage can be refilled
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        it += 1
    acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    off_m = base + WG * HM
    row_end = base + nrows
    tma_ok = off_m + HM <= row_end
    off_n = j * BN1
    b0 = 2 * WG + (nst & 1)
    epi_tile(acc, acc2, off_m, off_n, row_end, I, act_st_desc, hg_desc, hu_desc, act_ptr, I, h_ptr, 2 * I, act_ptr,
             epi_smem, b0, tma_ok, HM, BN1, True, STORE_H, False, EPI_TMA, mma_s, store_l)
    nst += NSL1 * (3 if STORE_H else 1)
    if EPI_TMA:  # act / h written before the counter says so (GEMM2, maybe on another SM, reads them by TMA)
        bulk_writes_done()
    fence_proxy_async()
    return it, nst


@gluon.jit
def _gemm2_half(tab, W, a_smem, b_smem, ready, empty, epi_smem, row_src_ptr, row_tok_ptr, row_slot_ptr, row0, nrows,
                j, H, k2, it, nst, K: gl.constexpr, BM: gl.constexpr, BN2: gl.constexpr, STAGES: gl.constexpr,
                ALIGNED: gl.constexpr, WG: gl.constexpr):
    """Consumer WG's half of GEMM2(b, j): 64 x BN2 async wgmmas over the ring, then each row pushed into its owner's
    slot (16-byte stores from a staging buffer); returns the ring and staged-store counts."""
    HM: gl.constexpr = BM // 2
    mma2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN2, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros((HM, BN2), dtype=gl.float32, layout=mma2)
    # the rows' owner addresses: two dependent loads, their latency under the first wgmma (made before the loop, they
    # held the first wgmma back ~1.4 us per item)
    src, tok, slot, rvalid = push_rows_idx(row0, nrows, row_src_ptr, row_tok_ptr, row_slot_ptr, HM, WG, store_l)
    # k-step 0 peeled
    st = it % STAGES
    mbarrier.wait(ready.index(st), (it // STAGES) & 1)
    acc = warpgroup_mma(a_smem.index(st).slice(WG * HM, HM), b_smem.index(st).slice(0, BN2).permute((1, 0)), acc,
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # (none older in flight: waits for nothing)
    it += 1
    sbase, sidx = push_rows_base(tab, W, src, tok, slot, rvalid, K)
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
    off_n = j * BN2
    a0, a1, a2, a3 = slices(acc, HM, BN2, mma_s)
    b0 = 2 * WG + (nst & 1)
    rp = push_rows_ptrs(sbase, sidx, H, ALIGNED)
    # (BN2 is 128 or 256: gluon_fused_reason)
    push_pair(a0.to(gl.bfloat16), a1.to(gl.bfloat16), rp, rvalid, off_n, H, epi_smem, b0, HM, store_l)
    if BN2 > 128:
        push_pair(a2.to(gl.bfloat16), a3.to(gl.bfloat16), rp, rvalid, off_n + 128, H, epi_smem, b0, HM, store_l)
    nst += BN2 // 64
    return it, nst


@gluon.jit
def _consumer(tab, W, rank, a_smem, b_smem, ready, empty, q_full, q_empty, q_smem, s_full, s_empty, s_smem, epi_smem,
              act_st_desc, hg_desc, hu_desc, x_ptr, act_ptr, h_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr, H, I, E_l,
              NB_MAX, timeout_ns, K: gl.constexpr, BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr,
              STAGES: gl.constexpr, QD_: gl.constexpr, ROWS_P: gl.constexpr, BLOCK_H: gl.constexpr, WP2: gl.constexpr,
              STORE_H: gl.constexpr, EPI_TMA: gl.constexpr, ALIGNED: gl.constexpr, WG: gl.constexpr, SQ: gl.constexpr,
              xv_desc, BULK: gl.constexpr, RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr,
              BR: gl.constexpr, IDLE_: gl.constexpr):
    """Consumer warpgroup WG: rows WG * 64 .. WG * 64 + 63 of every item's block (module docstring)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ml: gl.constexpr = gl.BlockedLayout([MSG], [32], [4], [0])
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    call = gl.load(ctrl_of(tab, W, rank) + SEQ, volatile=True)
    ok = wait_ready(tab, W, rank, call, timeout_ns, WP2, lay)  # peers' tokens staged (the pulls read them)
    BK: gl.constexpr = 64
    k1 = gl.cdiv(H, BK)
    k2 = gl.cdiv(I, BK)
    n = 0
    it = 0
    nst = 0
    ns = 0  # signals posted to the signaller
    go = E_l >= 0  # (a runtime True)
    while go:
        qs = n % QD_
        mbarrier.wait(q_full.index(qs), (n // QD_) & 1)
        m = q_smem.index(qs)  # the loader's message (pack): only live items, the end, or a failed wait
        go = (rd(m, 1, lay) != 0) & (rd(m, 2, lay) != 0)
        kind, b, j = rd(m, 3, lay), rd(m, 4, lay), rd(m, 5, lay)
        row0, nrows, base = rd(m, 7, lay), rd(m, 8, lay), rd(m, 9, lay)
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(qs), count=1)
        if go:
            if kind == 0:  # PULL(b)
                part: gl.constexpr = BM
                if BULK:  # the part's rows, loaded by the loader into the ring: stored from there
                    it = store_pull(xv_desc, a_smem, b_smem, ready, empty, base, j * part,
                                     gl.minimum(j * part + part, nrows), it, RA, RB, RV, C, STAGES, WG, BR)
                else:  # this consumer's half of the part's rows, through its registers
                    half: gl.constexpr = (part + 1) // 2
                    r_lo = j * part + WG * half
                    r_end = gl.minimum(gl.minimum(r_lo + half, j * part + part), nrows)
                    if ok:
                        pull_rows(tab, W, row0, r_lo, r_end, base, row_src_ptr, row_tok_ptr, x_ptr, H, H, ROWS_P,
                                   BLOCK_H, ALIGNED, pl)
                off = 1 + b
            elif kind == 1:  # GEMM1(b, j): act[rows, j-th BN1 columns] = silu(x @ wg^T) * (x @ wu^T)
                # (a constexpr False for consumer 0 or IDLE_ 0: the branch is not compiled)
                if (WG == 1) and (IDLE_ != 0) and (nrows <= BM // 2):
                    it = ring_skip(ready, empty, it, k1, STAGES)
                else:
                    it, nst = _gemm1_half(a_smem, b_smem, ready, empty, epi_smem, act_st_desc, hg_desc, hu_desc,
                                          act_ptr, h_ptr, base, nrows, j, I, k1, it, nst, BM, BN1, STAGES, STORE_H,
                                          EPI_TMA, WG)
                off = 1 + NB_MAX + b
            else:  # GEMM2(b, j): out = act @ w2[e]^T (columns j * BN2 ..), pushed to the owners
                if (WG == 1) and (IDLE_ != 0) and (nrows <= BM // 2):
                    it = ring_skip(ready, empty, it, k2, STAGES)
                else:
                    it, nst = _gemm2_half(tab, W, a_smem, b_smem, ready, empty, epi_smem, row_src_ptr, row_tok_ptr,
                                          row_slot_ptr, row0, nrows, j, H, k2, it, nst, K, BM, BN2, STAGES, ALIGNED,
                                          WG)
                off = 1 + 2 * NB_MAX + b
            post(s_full, s_empty, s_smem, ns, off, ml, SQ, WG)
            ns += 1
        n += 1
    post(s_full, s_empty, s_smem, ns, -1, ml, SQ, WG)
    if EPI_TMA:  # the staging buffers stay allocated until the last store has read them
        tma.store_wait(0)


@gluon.jit(do_not_specialize=["W", "rank", "E_l", "NS", "L1", "L2"])
def _gluon_fused_fwd_kernel(
    tab, W, rank,
    x_desc,             # xbuf [NROWS, H] bf16, block [BM, 64]
    w13_desc,           # w13 as [E_l * 2I, H], block [BN1, 64]
    act_desc,           # act [NROWS, I] as GEMM2's A, block [BM, 64]
    w2_desc,            # w2 as [E_l * H, I], block [BN2, 64]
    act_st_desc,        # act [NROWS, I], block [64, 64] (EPI_TMA: GEMM1's stores)
    hg_desc, hu_desc,   # h's gate / up halves [NROWS, I] of row stride 2I, block [64, 64] (EPI_TMA and STORE_H)
    x_ptr, act_ptr, h_ptr,
    offs_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr,  # the schedule (fused_moe._fused_fwd_kernel)
    ctr_ptr,            # int64 [1 + 3 * NB_MAX] zeroed: queue, ready[NB_MAX], g1[NB_MAX], g2[NB_MAX]
    H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns,
    K: gl.constexpr, BM: gl.constexpr, BN1: gl.constexpr, BN2: gl.constexpr, BLOCK_E: gl.constexpr,
    GB: gl.constexpr, STAGES: gl.constexpr, QD_: gl.constexpr, ROWS_P: gl.constexpr,
    BLOCK_H: gl.constexpr, WP2: gl.constexpr, STORE_H: gl.constexpr, EPI_TMA: gl.constexpr, ALIGNED: gl.constexpr,
    CONSUMER_REGS_: gl.constexpr, LOADER_REGS: gl.constexpr, SQ_: gl.constexpr,
    xv_desc, tok0, tok1, tok2, tok3, tok4, tok5, tok6, tok7,
    BULK: gl.constexpr, RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr, NP: gl.constexpr,
    BR: gl.constexpr, IDLE_: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (P,): persistent programs of 4 + 4 + 1 warps (module docstring)."""
    tok_descs = (tok0, tok1, tok2, tok3, tok4, tok5, tok6, tok7)  # BULK: every rank's ``tok`` view (NP of them)
    BW: gl.constexpr = 2 * BN1 if 2 * BN1 > BN2 else BN2  # weight rows of a stage: GEMM1's gate + up, GEMM2's tile
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 64], x_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BW, 64], w2_desc.layout)
    epi_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BM // 2, 64], act_st_desc.layout)
    ready, empty = ring(STAGES, 2)  # each stage released by both consumers
    q_smem = gl.allocate_shared_memory(gl.int32, [QD_, MSG], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_full, q_empty = ring(QD_, 2)  # the item queue: filled by the loader, taken by both consumers
    s_smem = gl.allocate_shared_memory(gl.int32, [SQ_, MSG], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    s_full, s_empty = ring(SQ_, 1, 2)  # the signal queue: filled by both consumers, taken by the signaller
    # (the partitions' argument lists written out: constexprs packed into a tuple lose their constexpr-ness)
    gl.warp_specialize([
        (_consumer, (tab, W, rank, a_smem, b_smem, ready, empty, q_full, q_empty, q_smem, s_full, s_empty, s_smem,
                     epi_smem, act_st_desc, hg_desc, hu_desc, x_ptr, act_ptr, h_ptr, row_src_ptr, row_tok_ptr,
                     row_slot_ptr, H, I, E_l, NB_MAX, timeout_ns, K, BM, BN1, BN2, STAGES, QD_, ROWS_P, BLOCK_H, WP2,
                     STORE_H, EPI_TMA, ALIGNED, 0, SQ_, xv_desc, BULK, RA, RB, RV, C, BR, IDLE_)),
        (_consumer, (tab, W, rank, a_smem, b_smem, ready, empty, q_full, q_empty, q_smem, s_full, s_empty, s_smem,
                     epi_smem, act_st_desc, hg_desc, hu_desc, x_ptr, act_ptr, h_ptr, row_src_ptr, row_tok_ptr,
                     row_slot_ptr, H, I, E_l, NB_MAX, timeout_ns, K, BM, BN1, BN2, STAGES, QD_, ROWS_P, BLOCK_H, WP2,
                     STORE_H, EPI_TMA, ALIGNED, 1, SQ_, xv_desc, BULK, RA, RB, RV, C, BR, IDLE_)),
        (_loader, (tab, W, rank, x_desc, w13_desc, act_desc, w2_desc, a_smem, b_smem, ready, empty, q_full, q_empty,
                   q_smem, offs_ptr, ctr_ptr, H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns, BM, BN1, BN2, BLOCK_E, GB,
                   STAGES, QD_, tok_descs, row_src_ptr, row_tok_ptr, BULK, RA, RB, RV, C, WP2, NP, BR)),
        (signaller, (s_full, s_empty, s_smem, ctr_ptr, E_l, SQ_)),
    ], [4, 1, 1], [CONSUMER_REGS_, LOADER_REGS, LOADER_REGS])
    ring_done(ready, empty, STAGES)
    ring_done(q_full, q_empty, QD_)
    ring_done(s_full, s_empty, SQ_)


def gluon_fused_reason(cfg, *, H: int, I: int, device: torch.device | None = None, gpt_oss: bool = False) -> str | None:
    """Why ``FusedConfig(kernel="gluon")`` cannot run a forward of these sizes on ``device`` (None: it can; device
    None: the config and sizes only). ``gpt_oss``: the layer's experts are gpt-oss's (biases, clamped SwiGLU)."""
    if gpt_oss:
        return "gpt-oss's epilogues (biases, clamped SwiGLU) exist in the Triton megakernel's items only"
    if interpreting():
        return "Gluon kernels do not run under the Triton interpreter (TRITON_INTERPRET=1)"
    if device is not None and device.type != "cuda":
        return f"the Gluon megakernel runs on a CUDA device (Hopper), got {device}"
    if device is not None and torch.cuda.get_device_capability(device)[0] != 9:
        return (f"the Gluon megakernel is built for Hopper (sm_90: wgmma, TMA), got capability "
                f"{torch.cuda.get_device_capability(device)}")
    if (cfg.block_m, cfg.bn1, cfg.block_k) != (128, 128, 64) or cfg.bn2 not in (128, 256):
        return (f"needs block_m=128, bn1=128, block_k=64 and bn2 128 or 256 (two 64-row consumer warpgroups with at "
                f"most 128 accumulator registers each), got block_m={cfg.block_m}, bn1={cfg.bn1}, "
                f"block_k={cfg.block_k}, bn2={cfg.bn2}")
    # shared memory (bf16): the ring (a [BM, 64] tile + the weight rows of the wider GEMM item per stage), the
    # consumers' staging buffers (4 x [BM / 2, 64]), barriers (rounded up)
    smem = cfg.num_stages * 128 * (cfg.block_m + max(2 * cfg.bn1, cfg.bn2)) + 4 * (cfg.block_m // 2) * 64 * 2 + 1024
    if (why := stages_reason(cfg, smem)) is not None:
        return why
    if H % 8 or I % 8:
        return f"H and I must be multiples of 8 (16-byte TMA row strides), got H={H}, I={I}"
    return None


def prepare_gluon_fused(heap, cfg, sched, P: int, *, a, w1, act, w2, h, ctr, I: int, nb_max: int, ring_blocks: int,
                        group: int, lookahead: int, lag: int):
    """The function that launches one forward's items, its descriptors built before the call is staged (``sched``'s
    tables are filled later, in stream order). a = received rows [NROWS, H], w1 = w13, act [NROWS, I], w2."""
    H, k, E_l = heap.shape.hidden, heap.shape.topk, heap.shape.local_experts
    BM, BN1, BN2, nrows = cfg.block_m, cfg.bn1, cfg.bn2, a.shape[0]
    x_desc, act_desc = nvmma_desc(a, [BM, 64], shape=[nrows, H]), nvmma_desc(act, [BM, 64], shape=[nrows, I])
    w13_desc, w2_desc = nvmma_desc(w1.view(E_l * 2 * I, H), [BN1, 64]), nvmma_desc(w2.view(E_l * H, I), [BN2, 64])
    act_st_desc = nvmma_desc(act, [BM // 2, 64], shape=[nrows, I])
    hg_desc = hu_desc = act_st_desc
    if h is not None:
        hg_desc, hu_desc = (nvmma_desc(h[:, col:], [BM // 2, 64], shape=[nrows, I]) for col in (0, I))
    epi_tma = all(t.data_ptr() % 16 == 0 for t in [act] + ([h] if h is not None else []))
    block_h = min(triton.next_power_of_2(H), 2048)
    bulk = bulk_pull_plan(heap, cfg, a)
    xv_desc, toks, ra, rb, rv, cw, br = bulk if bulk is not None else (x_desc, (), 0, 0, 1, 64, 1)
    toks8 = tuple(toks) + (xv_desc,) * (8 - len(toks))
    return lambda: record("_gluon_fused_fwd_kernel", _gluon_fused_fwd_kernel[(P,)](
        heap.tab, heap.world, heap.rank, x_desc, w13_desc, act_desc, w2_desc, act_st_desc, hg_desc, hu_desc,
        a, act, h if h is not None else a, sched.offs, sched.row_src, sched.row_tok, sched.row_slot, ctr,
        H, I, E_l, nb_max, ring_blocks, lookahead, lag, heap.timeout_ns,
        K=k, BM=BM, BN1=BN1, BN2=BN2, BLOCK_E=triton.next_power_of_2(max(E_l, 2)), GB=group,
        STAGES=cfg.num_stages, QD_=QD,
        ROWS_P=max(1, min(BM // 2, PULL_ELEMS // block_h)), BLOCK_H=block_h, WP2=max(2, heap.wp2),
        STORE_H=h is not None, EPI_TMA=epi_tma, ALIGNED=(H * 2) % 16 == 0,
        CONSUMER_REGS_=CONSUMER_REGS, LOADER_REGS=REG_POOL - 2 * CONSUMER_REGS, SQ_=SQ, xv_desc=xv_desc,
        **{f"tok{i}": t for i, t in enumerate(toks8)}, BULK=bulk is not None, RA=ra, RB=rb, RV=rv, C=cw,
        NP=max(len(toks), 1), BR=br, IDLE_=IDLE_HALF, num_warps=4, maxnreg=REG_POOL // 3,
    ))
