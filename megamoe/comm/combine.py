"""Combine: the token owner pulls its k expert outputs and sums them with the gates, in fixed order.

Shape legend: W world size, T tokens on this rank, H hidden, k top-k, R_cap rows a rank can receive.

    y_TH = combine(out_RH, topk_w_Tk, handle)      # y[t] = sum_{j=0..k-1} topk_w[t, j] * out_j(t)

out_RH: expert outputs in receive order on every rank (row r is (row_src[r], row_tok[r], row_slot[r])'s). Stage
out into the heap's ``rows`` (unless the expert GEMM wrote it there) and publish READY; then each owner loads its
tokens' k rows over NVLink, accumulates w * row in fp32 in j order and writes y[t] once. No atomics, no [T, k, H]
buffer; bitwise deterministic.

Why the owner pulls: pushing needs a [T_max, k, H] slot buffer on every owner (470 MB for deepseek-v3 at 4096
tokens) and a second pass to sum it; pulling reads each row once and sums in registers. (The megakernel pushes: its
GEMM2 epilogue stores each row into the owner's slots, with no second launch over the rows.) presum.py sends one row
per remote rank instead of one per slot.

Backward: :func:`pull_grad` and :func:`send_gate_grad` (around the dgrad GEMM: backends/common.py);
:func:`dispatch_backward` is the gather-sum without gates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.kernels.interpreter import row_buffer

from . import signals as S
from .dispatch import DispatchHandle, pull_rows
from .presum import presum_gather
from .signals import ARRIVE_WORK, DONE, DW_DONE, READY, REG_DW, arrive_publish, current_call, wait_flags


@triton.jit(do_not_specialize=["rank"])
def _gather_sum_kernel(
    tab, W, rank,
    src_reg,  # heap region holding the rows on every rank: rows [R_cap, H]
    dest_row_ptr,  # int32 [T_max, K] row of own (t, j) on its expert rank
    dest_rank_ptr,  # int32 [T_max, K] that rank
    w_ptr,  # [T, K] gates (any float dtype), HAS_W only
    y_ptr,  # [T, H] out
    T, H, timeout_ns,
    OP: tl.constexpr, HAS_W: tl.constexpr,
    K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr, WP2: tl.constexpr,
    SRC_DT: tl.constexpr,  # dtype of the rows (the heap dtype)
):
    """grid (P,): own tokens, ROWS per step: y[t] = sum_j w[t, j] * rows_{dest_rank[t, j]}[dest_row[t, j]] (fp32, j
    order); the last program publishes DONE = call."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP, timeout_ns, WP2)
    if ok:
        jj = tl.arange(0, KP2)
        DT = y_ptr.dtype.element_ty
        SRC_PTR = tl.pointer_type(SRC_DT)
        ITEM: tl.constexpr = SRC_DT.primitive_bitwidth // 8
        t0 = pid * ROWS
        while t0 < T:
            t = t0 + tl.arange(0, ROWS)
            mt = t < T
            mk = mt[:, None] & (jj < K)[None, :]
            toff = (t * K)[:, None] + jj[None, :]
            drow = tl.load(dest_row_ptr + toff, mask=mk, other=0)
            drank = tl.load(dest_rank_ptr + toff, mask=mk, other=0)
            addr = tl.load(tab + src_reg * W + drank, mask=mk, other=0) + drow.to(tl.int64) * H * ITEM
            if HAS_W:
                wv = tl.load(w_ptr + toff, mask=mk, other=0.0).to(tl.float32)
            h0 = tl.program_id(0) * 0
            while h0 < H:
                oh = h0 + tl.arange(0, BLOCK_H)
                mh = oh < H
                m2 = mt[:, None] & mh[None, :]
                acc = tl.zeros([ROWS, BLOCK_H], tl.float32)
                for j in tl.static_range(K):
                    aj = tl.sum(tl.where(jj[None, :] == j, addr, 0), axis=1)
                    pj = aj.to(SRC_PTR)
                    if ALIGNED:
                        pj = tl.multiple_of(pj, 16)
                    v = tl.load(pj[:, None] + oh[None, :], mask=m2, other=0.0).to(tl.float32)
                    if HAS_W:
                        wj = tl.sum(tl.where(jj[None, :] == j, wv, 0.0), axis=1)
                        acc += wj[:, None] * v
                    else:
                        acc += v
                tl.store(y_ptr + t.to(tl.int64)[:, None] * H + oh[None, :], acc.to(DT), mask=m2)
                h0 += BLOCK_H
            t0 += P * ROWS
    arrive_publish(tab, W, rank, ARRIVE_WORK, P, DONE, call, WP2)


def _gather(rows: torch.Tensor, topk_w: torch.Tensor | None, handle: DispatchHandle, num_sms: int | None,
            out_dtype: torch.dtype | None, presum: bool, gated: bool) -> torch.Tensor:
    """:func:`combine` / :func:`dispatch_backward` after their own checks: y [T, H] from the rows [<= R_cap, H]."""
    heap, sh, T, P = handle.op_args(num_sms)
    if rows.dim() != 2 or rows.shape[1] != sh.hidden or rows.shape[0] > sh.rows_cap or rows.dtype != sh.dtype:
        raise ValueError(f"expert rows must be [<= R_cap={sh.rows_cap}, H={sh.hidden}] {sh.dtype}, "
                         f"got {tuple(rows.shape)} {rows.dtype}")
    if topk_w is not None and tuple(topk_w.shape) != (T, sh.topk):
        raise ValueError(f"topk_w must be [T={T}, k={sh.topk}], got {tuple(topk_w.shape)}")
    if presum and gated and handle.row_gate is None:
        raise ValueError("a pre-summing combine needs the gates at dispatch: call dispatch(..., topk_w=...)")
    y = torch.empty(T, sh.hidden, dtype=out_dtype or sh.dtype, device=heap.device)  # before READY is published
    y_arg = y if T > 0 else heap.tab.new_empty(1).view(sh.dtype)
    op = S.OP_COMBINE.value if gated else S.OP_DISPATCH_BWD.value
    if presum:  # presum.py: each expert rank sums (with the gates dispatch brought) a token's rows it holds
        presum_gather(rows, handle.row_gate if gated else None, handle, P, y_arg, op)
    else:
        sched = handle.schedule
        w = topk_w.contiguous() if gated else sched.dest_row  # gated: topk_w given (combine's check)
        in_place = rows.data_ptr() == heap.rows_buffer().data_ptr() and rows.stride() == (sh.hidden, 1)
        # only rows < offs[E_l] hold data; that count lives on the device, so the kernel reads it there
        S.stage(heap, act=None if in_place else rows.contiguous(), act_reg=S.REG_ROWS.value, programs=P,
                nrows=handle.offs[-1:])
        _gather_sum_kernel[(P,)](
            heap.tab, heap.world, heap.rank, S.REG_ROWS.value, sched.dest_row, sched.dest_rank, w, y_arg, T,
            sh.hidden, heap.timeout_ns, OP=op, HAS_W=gated, SRC_DT=S.TL_DTYPES[sh.dtype], **S.tile_args(heap, "gather"))
    heap.rows_busy = True  # the peers read this rank's rows until their DONE of this call
    heap.after_launch()
    return y


def combine(out: torch.Tensor, topk_w: torch.Tensor | None, handle: DispatchHandle, num_sms: int | None = None,
            out_dtype: torch.dtype | None = None, presum: bool = False) -> torch.Tensor:
    """y[t] = sum_j topk_w[t, j] * out_j(t) in j order with fp32 accumulation; returns y [T, H].
    out: [R_cap, H] (or its first rows) expert outputs in receive order, heap dtype; pass ``heap.rows_buffer()`` to
    skip the staging copy. topk_w: [T, k] any float dtype. out_dtype: dtype of y (default the heap dtype).
    presum: presum.py's path; topk_w must then be None (the gates given to ``dispatch(..., topk_w=...)`` are used,
    never a second copy that could differ) and ``out`` is read locally, never staged."""
    if presum and topk_w is not None:
        raise ValueError("combine(presum=True) weights with the gates given to dispatch; pass topk_w=None")
    if not presum and topk_w is None:
        raise ValueError("combine needs topk_w (or presum=True with gates given to dispatch)")
    return _gather(out, topk_w, handle, num_sms, out_dtype, presum, gated=True)


def dispatch_backward(grad_recv: torch.Tensor, handle: DispatchHandle, num_sms: int | None = None,
                      out_dtype: torch.dtype | None = None, presum: bool = False) -> torch.Tensor:
    """grad_x[t] = sum_j grad_recv[row(t, j)] on its expert rank, in fixed j order, fp32 accumulation.
    grad_recv: [R_b, H], the call's rows (rows >= offs[E_l] ignored), staged unless it is ``heap.rows_buffer()``.
    Returns grad_x [T, H] in ``out_dtype`` (default: heap dtype). presum: as :func:`combine`'s (rank order)."""
    return _gather(grad_recv, None, handle, num_sms, out_dtype, presum, gated=False)


@triton.jit(do_not_specialize=["rank"])
def _send_dw_kernel(tab, W, rank, offs_ptr, E_l, row_src_ptr, row_tok_ptr, row_slot_ptr, ds_ptr,
                    K: tl.constexpr, BLOCK: tl.constexpr, WP2: tl.constexpr):
    """grid (P,): for every received row r < offs[E_l]: dw_{src(r)}[tok(r) * K + slot(r)] = ds[r] (one writer per
    slot); the last program raises DW_DONE = call on every rank. No wait first: every rank staged this call (READY,
    awaited by the pull) after its previous finish had read its ``dw``."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    n = tl.load(offs_ptr + E_l)
    r0 = pid * BLOCK
    while r0 < n:
        r = r0 + tl.arange(0, BLOCK)
        m = r < n
        src = tl.load(row_src_ptr + r, mask=m, other=0)
        tok = tl.load(row_tok_ptr + r, mask=m, other=0)
        slot = tl.load(row_slot_ptr + r, mask=m, other=0)
        dwp = tl.load(tab + REG_DW * W + src, mask=m, other=0).to(tl.pointer_type(tl.float32))
        tl.store(dwp + tok * K + slot, tl.load(ds_ptr + r, mask=m, other=0.0), mask=m)
        r0 += P * BLOCK
    arrive_publish(tab, W, rank, ARRIVE_WORK, P, DW_DONE, call, WP2)


def pull_grad(dy: torch.Tensor, topk_w: torch.Tensor, handle: DispatchHandle,
              num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Open a backward call and pull dy to the expert ranks: (dy_rows [R_b, H] heap dtype, gate [R_b] fp32),
    dy_rows[r] = dy_s[t] (unscaled), gate[r] = topk_w_s[t, j] for every received row r = (s, t, j) (rows >= R
    unwritten). The caller sends d(topk_w) home with :func:`send_gate_grad`, which closes the call."""
    heap, sh, T, P = handle.op_args(num_sms)
    if tuple(dy.shape) != (T, sh.hidden) or dy.dtype != sh.dtype:
        raise ValueError(f"dy must be [T={T}, H={sh.hidden}] {sh.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    if tuple(topk_w.shape) != (T, sh.topk):
        raise ValueError(f"topk_w must be [T={T}, k={sh.topk}], got {tuple(topk_w.shape)}")
    R = handle.schedule.row_src.shape[0]  # the call's row bound (CommShape.rows_for)
    rows = row_buffer((R, sh.hidden), sh.dtype, heap.device)  # before READY is published
    gate = row_buffer((R,), torch.float32, heap.device)
    w32 = topk_w.to(torch.float32).contiguous().view(torch.int32)
    # open a new call: dy into this rank's ``tok`` region, the gates (as fp32) into ``w``
    S.stage(heap, act=dy.contiguous(), act_reg=S.REG_TOK.value, small=w32, small_reg=S.REG_W.value, programs=P)
    pull_rows(heap, handle.schedule, rows, P, gate=gate)
    return rows, gate


def send_gate_grad(ds: torch.Tensor, handle: DispatchHandle, num_sms: int | None = None) -> torch.Tensor:
    """d(topk_w) [T, k] fp32 of this rank's tokens from ds [>= R_cap] fp32 (each received row's value): stored into
    the owners' ``dw`` regions; each owner waits for every DW_DONE and copies its values out. After
    :func:`pull_grad` of the same call, on every rank."""
    heap, sh, T, P = handle.op_args(num_sms)
    sched = handle.schedule
    R = sched.row_src.shape[0]  # the call's row bound (CommShape.rows_for)
    if ds.dtype != torch.float32 or ds.dim() != 1 or not ds.is_contiguous() or ds.shape[0] < R:
        raise ValueError(f"ds must be a contiguous 1-D float32 tensor of >= {R} values (one per receive row), got "
                         f"{tuple(ds.shape)} {ds.dtype}")
    block = 1024
    grad_w = torch.empty(T, sh.topk, dtype=torch.float32, device=heap.device)  # before DW_DONE is published
    _send_dw_kernel[(max(1, min(P, triton.cdiv(R, block))),)](
        heap.tab, heap.world, heap.rank, sched.offs, sh.local_experts, sched.row_src, sched.row_tok, sched.row_slot, ds,
        K=sh.topk, BLOCK=block, WP2=heap.wp2)
    heap.after_launch()
    S.finish(heap, S.REG_DW.value, grad_w if T > 0 else heap.tab.new_empty(1).view(torch.float32), T * sh.topk, P,
             purpose=DW_DONE.value)
    return grad_w


__all__ = ["combine", "dispatch_backward", "pull_grad", "send_gate_grad"]
