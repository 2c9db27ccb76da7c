"""Pre-summing combine: each expert rank sums a token's rows it holds, the owner pulls one row per rank. W world size,
T_max max tokens per rank, T tokens on this rank, H hidden, k top-k, R_cap receive rows.

The plain combine (combine.py) pulls all k rows of each token, so a token whose k experts sit on fewer than k ranks
crosses NVLink several times from one rank (k = 8 on 4 ranks: 6 remote rows per token, ~2.7 remote ranks). Here:

    presum stage (expert rank q, opens call c):   wait DONE >= c-1 from all       # my rows region is free
        for every (s, t) that has rows here:       part = sum_{j: slot on q} g[r_j] * out[r_j]   (fp32, j order)
                                                   rows_q[s * T_max + t] = part     (heap dtype)
        last program: publish READY = c
    gather (owner s):                              wait READY >= c from all
        for own token t:                           y[t] = sum_{q = 0..W-1 holding a slot of t} rows_q[s*T_max + t]
        last program: publish DONE = c

Gates g: each received row's gate from ``dispatch(..., topk_w=...)`` (handle.row_gate); dispatch's backward uses
g = 1. Both orders (j within a rank, ranks 0..W-1) are fixed, so results are bitwise deterministic; they differ from
the plain combine's strict j order by rounding (the per-rank partial is rounded to the heap dtype). The expert
outputs are read locally, so no staging copy is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import signals as S
from .dispatch import DispatchHandle
from .signals import DONE, READY, REG_CTRL, REG_ROWS, SEQ, arrive_publish, current_call, publish, region_ptr, wait_flags


@triton.jit(do_not_specialize=["rank"])
def _presum_stage_kernel(
    tab, W, rank,
    out_ptr,  # [R_cap, H] expert outputs (or gradients of received rows), local, heap dtype
    gate_ptr,  # fp32 [R_cap] gate of every received row (HAS_GATE)
    recv_row_ptr,  # int32 [W, T_max, K] row of (s, t, j) here, -1 elsewhere
    ntok_ptr,  # int64 [W] T_s of every source
    T_max, H, timeout_ns,
    HAS_GATE: tl.constexpr, K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr, WP2: tl.constexpr,
):
    """grid (P,): items i = s * T_max + t over [0, W * T_max), ROWS per step. E.g. this rank holds slots 0 and 1 of
    token (s=1, t=5) in rows 7 and 9: rows[1 * T_max + 5] = g[7] * out[7] + g[9] * out[9]."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    prev = tl.load(ctrl + SEQ, volatile=True)
    ok = wait_flags(tab, W, rank, DONE, 0, W, prev, S.OP_STAGE, timeout_ns, WP2)
    if ok:
        DT = out_ptr.dtype.element_ty
        dst = region_ptr(tab, REG_ROWS, W, rank, DT)
        jj = tl.arange(0, KP2)
        n_items = W * T_max
        i0 = pid * ROWS
        while i0 < n_items:
            ii = i0 + tl.arange(0, ROWS)
            inb = ii < n_items
            s = ii // T_max
            t = ii % T_max
            T_s = tl.load(ntok_ptr + s, mask=inb, other=0)
            valid = inb & (t < T_s)
            rows = tl.load(recv_row_ptr + (ii * K)[:, None] + jj[None, :],
                           mask=valid[:, None] & (jj < K)[None, :], other=-1)
            rows = tl.where(valid[:, None], rows, -1)
            need = valid & (tl.max(rows, axis=1) >= 0)
            if HAS_GATE:
                g = tl.load(gate_ptr + rows, mask=need[:, None] & (rows >= 0), other=0.0)
            drow = dst + ii.to(tl.int64) * H
            if ALIGNED:
                drow = tl.multiple_of(drow, 16)
            h0 = tl.program_id(0) * 0
            while h0 < H:
                oh = h0 + tl.arange(0, BLOCK_H)
                mh = oh < H
                acc = tl.zeros([ROWS, BLOCK_H], tl.float32)
                for j in tl.static_range(K):
                    rj = tl.sum(tl.where(jj[None, :] == j, rows, 0), axis=1)
                    mj = need & (rj >= 0)
                    v = tl.load(out_ptr + rj.to(tl.int64)[:, None] * H + oh[None, :],
                                mask=mj[:, None] & mh[None, :], other=0.0).to(tl.float32)
                    if HAS_GATE:
                        gj = tl.sum(tl.where(jj[None, :] == j, g, 0.0), axis=1)
                        acc += gj[:, None] * v
                    else:
                        acc += v
                tl.store(drow[:, None] + oh[None, :], acc.to(DT), mask=need[:, None] & mh[None, :])
                h0 += BLOCK_H
            i0 += P * ROWS
    last = S.arrive_last(tab, W, rank, S.ARRIVE_STAGE, P)
    if last:
        if S.error_set(tab, W, rank) == 0:
            publish(tab, W, rank, READY, prev + 1, WP2)
        tl.store(ctrl + SEQ, prev + 1)


@triton.jit(do_not_specialize=["rank"])
def _rank_gather_kernel(
    tab, W, rank,
    dest_rank_ptr,  # int32 [T_max, K] expert rank of own (t, j)
    y_ptr,  # [T, H] out
    T, T_max, H, timeout_ns,
    OP: tl.constexpr, K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr, WP2: tl.constexpr,
    SRC_DT: tl.constexpr,  # heap dtype
):
    """grid (P,): own tokens, ROWS per step: y[t] = sum over ranks q holding a slot of t (q ascending) of
    rows_q[rank * T_max + t]. Example: dest_rank[t] = [2, 0, 2] -> y[t] = rows_0[...] + rows_2[...]."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP, timeout_ns, WP2)
    if ok:
        jj = tl.arange(0, KP2)
        DT = y_ptr.dtype.element_ty
        ITEM: tl.constexpr = SRC_DT.primitive_bitwidth // 8
        row_off = (tl.full([], 0, tl.int64) + rank * T_max) * H * ITEM  # (T_max may be a constexpr 1)
        t0 = pid * ROWS
        while t0 < T:
            t = t0 + tl.arange(0, ROWS)
            mt = t < T
            drank = tl.load(dest_rank_ptr + (t * K)[:, None] + jj[None, :],
                            mask=mt[:, None] & (jj < K)[None, :], other=-1)
            h0 = tl.program_id(0) * 0
            while h0 < H:
                oh = h0 + tl.arange(0, BLOCK_H)
                mh = oh < H
                acc = tl.zeros([ROWS, BLOCK_H], tl.float32)
                for q in tl.static_range(WP2):
                    has_q = mt & (tl.max(tl.where(drank == q, 1, 0), axis=1) > 0)
                    base = tl.load(tab + REG_ROWS * W + q, mask=tl.full([], q, tl.int32) < W, other=0) + row_off
                    p = (base + t.to(tl.int64) * H * ITEM).to(tl.pointer_type(SRC_DT))
                    if ALIGNED:
                        p = tl.multiple_of(p, 16)
                    acc += tl.load(p[:, None] + oh[None, :], mask=has_q[:, None] & mh[None, :],
                                   other=0.0).to(tl.float32)
                tl.store(y_ptr + t.to(tl.int64)[:, None] * H + oh[None, :], acc.to(DT),
                         mask=mt[:, None] & mh[None, :])
                h0 += BLOCK_H
            t0 += P * ROWS
    arrive_publish(tab, W, rank, S.ARRIVE_WORK, P, DONE, call, WP2)


def presum_gather(rows: torch.Tensor, gate: torch.Tensor | None, handle: DispatchHandle, programs: int,
                  y: torch.Tensor, op: int) -> None:
    """y[t] = sum over expert ranks q (ascending) of q's partial sum of t's rows, weighted by ``gate`` (fp32 [R_b],
    each received row's gate; None: 1), for combine.py's ``_gather``, which checked rows [<= R_cap, H] (local, heap
    dtype), allocated y [T, H] (a placeholder when T is 0) and marks ``rows`` busy after. ``op``: the error code."""
    heap, sched, tiles = handle.heap, handle.schedule, S.tile_args(handle.heap, "gather")
    sh = heap.shape
    heap.check()
    rows = rows.contiguous()
    _presum_stage_kernel[(programs,)](
        heap.tab, heap.world, heap.rank, rows, rows if gate is None else gate, sched.recv_row, sched.tokens_per_rank,
        sh.max_tokens, sh.hidden, heap.timeout_ns, HAS_GATE=gate is not None, **tiles)
    heap.rows_busy = False  # a stage kernel (waited for DONE of every earlier call from every peer)
    heap.after_launch()
    _rank_gather_kernel[(programs,)](heap.tab, heap.world, heap.rank, sched.dest_rank, y, handle.num_tokens,
                                     sh.max_tokens, sh.hidden, heap.timeout_ns, OP=op, SRC_DT=S.TL_DTYPES[sh.dtype],
                                     **tiles)
