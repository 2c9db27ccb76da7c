"""Pull dispatch: every rank copies the token rows its experts need straight out of the peers' memory.

Shape legend: W world size, T tokens on this rank (<= T_max), H hidden, k top-k, E experts, E_l = E / W
local experts, R rows this rank receives, R_cap = W * T_max * min(k, E_l).

    recv, handle = dispatch(x_TH, topk_idx_Tk, heap)

1. stage (signals._stage_kernel): x -> heap ``tok`` (skipped when x already is ``heap.tokens_buffer()[:T]``),
   topk_idx -> heap ``idx``, T -> ``meta``; publish READY for call s.
2. schedule (schedule.py): every rank reads all W routing tables and computes the same placement.
3. pull (_pull_kernel below): for each (source s, token t) with at least one local expert, the row
   x_s[t] is loaded over NVLink ONCE and stored into each of its receive rows (one per local expert slot).
   The last program to finish publishes DONE for call s (peers may then reuse their ``tok`` buffers).

recv_RH [R_cap, H]: rows ordered by (local expert, source rank, token, slot); expert e's rows are
recv[offs[e]:offs[e+1]]. Rows >= offs[E_l] are not written. Nothing on the host waits for the device.

Measured 2026-11-29 (4x H200, 4096 tokens/GPU, top-8, 24 programs, CUDA-graph replay; docs/perf-notes.md):
deepseek-v3 782 us (160 MB of remote rows, 204 GB/s; NCCL all_to_all on the same rows 641 us, DeepEP 522
us), qwen3-30b-a3b 435 us (NCCL 236, DeepEP 207). The pull is latency-bound per program (bandwidth grows
with programs and with bytes per step); eager calls add ~0.3 ms of Python launch time for the 6 kernels.

The backward of dispatch is a combine of gradients (sum over the k copies, unweighted): see
:func:`dispatch_backward`, which shares combine's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import signals as S
from .heap import SymmetricHeap
from .schedule import Schedule, build_schedule
from .signals import (
    ARRIVE_WORK,
    DONE,
    OP_COMBINE_BWD,
    OP_PULL,
    READY,
    REG_DW,
    REG_W,
    arrive_last,
    current_call,
    error_set,
    publish,
    wait_flags,
)


@dataclass
class DispatchHandle:
    """What one dispatch call leaves for combine and for both backward passes.

    heap: the :class:`SymmetricHeap` the call ran on.
    num_tokens: T, this rank's tokens in the call (host int, known before the call).
    schedule: the device-side :class:`~megamoe.comm.schedule.Schedule` (recv_row, dest_row, dest_rank,
        offs, counts, row_src/tok/slot, tokens_per_rank).
    offs: int32 [E_l + 1] expert offsets into the receive buffer (= schedule.offs), for the grouped GEMMs.
    num_sms: programs the communication kernels of this call used.
    row_gate: fp32 [R_cap] gate of every received row (only when dispatch was given ``topk_w``): what the
        pre-summing combine (``combine(..., presum=True)``) weights the expert outputs with.
    """

    heap: SymmetricHeap
    num_tokens: int
    schedule: Schedule
    offs: torch.Tensor
    num_sms: int
    row_gate: torch.Tensor | None = None


@triton.jit
def _pull_kernel(
    tab, W, rank,
    src_reg,  # heap region the rows come from: tok [T_max, H] of every source rank
    recv_row_ptr,  # int32 [W, T_max, K] row of (s, t, j) here, -1 elsewhere
    ntok_ptr,  # int64 [W] T_s per source
    dst_ptr,  # [R_cap, H] out: receive buffer (dispatch) or grad of expert outputs (combine backward)
    out_ptr,  # [R_cap, H] expert outputs (combine backward only)
    gate_ptr,  # fp32 [R_cap] out (HAS_GATE): gate w_s[t, j] of every received row (from the owner's w region)
    T_max, H, timeout_ns,
    OP: tl.constexpr,
    HAS_W: tl.constexpr,  # combine backward: dst = w * src row, dw[s][t, j] = <src row, out row>
    HAS_GATE: tl.constexpr,  # dispatch with gates: also record each received row's gate (for presum combine)
    K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr,  # H * itemsize % 16 == 0: rows start on 16-byte boundaries
    WP2: tl.constexpr,
):
    """grid (P,): persistent programs over items i in [0, W*T_max), ROWS items per step.

        t = i // W; s = (rank + 1 + i % W) % W          # neighbouring items hit different peers
        if t < T_s and any(recv_row[s, t, :] >= 0):
            v = tok_s[t, :]                              # one NVLink read per (s, t)
            for j < K with r = recv_row[s, t, j] >= 0:   # one local write per local expert slot
                dst[r] = v                               # (HAS_W: dst[r] = w_s[t, j] * v,
                                                         #  dw_s[t, j] = <v, out[r]> written to rank s)
                gate[r] = w_s[t, j]                      # (HAS_GATE)
        last program: publish DONE = call
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP, timeout_ns, WP2)
    if ok:
        n_items = W * T_max
        jj = tl.arange(0, KP2)
        DT = dst_ptr.dtype.element_ty
        i0 = pid * ROWS
        while i0 < n_items:
            ii = i0 + tl.arange(0, ROWS)
            t = ii // W
            s = (rank + 1 + ii % W) % W
            inb = ii < n_items
            # three independent local loads, then the remote row: a short dependency chain per step
            T_s = tl.load(ntok_ptr + s, mask=inb, other=0)
            rows = tl.load(recv_row_ptr + ((s * T_max + t) * K)[:, None] + jj[None, :],
                           mask=inb[:, None] & (jj < K)[None, :], other=-1)
            src_addr = tl.load(tab + src_reg * W + s, mask=inb, other=0)
            valid = inb & (t < T_s)
            rows = tl.where(valid[:, None], rows, -1)
            need = valid & (tl.max(rows, axis=1) >= 0)
            src_addr = src_addr + t.to(tl.int64) * H * DT.primitive_bitwidth // 8
            src = src_addr.to(tl.pointer_type(DT))
            if ALIGNED:
                src = tl.multiple_of(src, 16)
            if HAS_W or HAS_GATE:
                w_addr = tl.load(tab + REG_W * W + s, mask=need, other=0).to(tl.pointer_type(tl.float32))
                wv = tl.load(w_addr[:, None] + (t * K)[:, None] + jj[None, :], mask=need[:, None] & (rows >= 0),
                             other=0.0)
            if HAS_GATE:
                tl.store(gate_ptr + rows, wv, mask=need[:, None] & (rows >= 0))
            if HAS_W:
                dw = tl.zeros([ROWS, KP2], tl.float32)
            h0 = tl.program_id(0) * 0
            while h0 < H:
                oh = h0 + tl.arange(0, BLOCK_H)
                mh = oh < H
                v = tl.load(src[:, None] + oh[None, :], mask=need[:, None] & mh[None, :])
                for j in tl.static_range(K):
                    rj = tl.sum(tl.where(jj[None, :] == j, rows, 0), axis=1)
                    mj = need & (rj >= 0)
                    m2 = mj[:, None] & mh[None, :]
                    o2 = rj.to(tl.int64)[:, None] * H + oh[None, :]
                    if HAS_W:
                        wj = tl.sum(tl.where(jj[None, :] == j, wv, 0.0), axis=1)
                        vf = v.to(tl.float32)
                        ov = tl.load(out_ptr + o2, mask=m2, other=0.0).to(tl.float32)
                        dj = tl.sum(vf * ov, axis=1)
                        dw += tl.where(jj[None, :] == j, dj[:, None], 0.0)
                        tl.store(dst_ptr + o2, (vf * wj[:, None]).to(DT), mask=m2)
                    else:
                        tl.store(dst_ptr + o2, v, mask=m2)
                h0 += BLOCK_H
            if HAS_W:
                dw_addr = tl.load(tab + REG_DW * W + s, mask=need, other=0).to(tl.pointer_type(tl.float32))
                tl.store(dw_addr[:, None] + (t * K)[:, None] + jj[None, :], dw, mask=need[:, None] & (rows >= 0))
            i0 += P * ROWS
    last = arrive_last(tab, W, rank, ARRIVE_WORK, P)
    if last:
        if error_set(tab, W, rank) == 0:
            publish(tab, W, rank, DONE, call, WP2)


def pull_rows(heap: SymmetricHeap, sched: Schedule, dst: torch.Tensor, programs: int,
              out: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> None:
    """Launch :func:`_pull_kernel` (dispatch when ``out`` is None, else combine backward).

    ``gate``: fp32 [R_cap] filled with each received row's gate (dispatch with gates staged in ``w``).
    """
    sh = heap.shape
    has_w = out is not None
    rows, block_h, warps = S.launch_config(sh.hidden, "pull_bwd" if has_w else "pull")
    _pull_kernel[(programs,)](
        heap.tab, heap.world, heap.rank, S.REG_TOK.value, sched.recv_row, sched.tokens_per_rank, dst,
        out if has_w else dst, gate if gate is not None else dst, sh.max_tokens, sh.hidden, heap.timeout_ns,
        OP=OP_COMBINE_BWD.value if has_w else OP_PULL.value, HAS_W=has_w, HAS_GATE=gate is not None,
        K=sh.topk, KP2=triton.next_power_of_2(sh.topk), ROWS=rows, BLOCK_H=block_h,
        ALIGNED=(sh.hidden * sh.dtype.itemsize) % 16 == 0, WP2=heap.wp2, num_warps=warps,
    )
    heap.after_launch()


def _check_inputs(heap: SymmetricHeap, x: torch.Tensor, topk_idx: torch.Tensor) -> int:
    sh = heap.shape
    if x.dim() != 2 or x.shape[1] != sh.hidden:
        raise ValueError(f"x must be [T, H={sh.hidden}], got {tuple(x.shape)}")
    T = x.shape[0]
    if T > sh.max_tokens:
        raise ValueError(f"T={T} exceeds the heap's max_tokens={sh.max_tokens}")
    if x.dtype != sh.dtype:
        raise ValueError(f"x dtype {x.dtype} != heap dtype {sh.dtype}")
    if tuple(topk_idx.shape) != (T, sh.topk):
        raise ValueError(f"topk_idx must be [T={T}, k={sh.topk}], got {tuple(topk_idx.shape)}")
    if x.device != heap.device or topk_idx.device != heap.device:
        raise ValueError(f"inputs must live on {heap.device}")
    return T


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    heap: SymmetricHeap,
    num_sms: int | None = None,
    recv: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, DispatchHandle]:
    """Route x_TH to the ranks owning its experts; returns (recv_RH [R_cap, H], handle).

    x: [T, H] heap dtype, T <= heap.shape.max_tokens (T may be 0). topk_idx: [T, k] integer ids in [0, E).
    num_sms: programs for the pull and staging kernels (default heap.num_sms). recv: optional preallocated
    [R_cap, H] output. Rows of expert e are recv[offs[e]:offs[e+1]] with ``handle.offs`` on the device.
    topk_w: optional [T, k] gates; they travel with the rows (``handle.row_gate``) so that the combine can
    pre-sum each token's rows on the expert rank (``combine(..., presum=True)``).
    """
    T = _check_inputs(heap, x, topk_idx)
    if topk_w is not None and tuple(topk_w.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_w must be [T={T}, k={heap.shape.topk}], got {tuple(topk_w.shape)}")
    sh = heap.shape
    P = max(1, int(num_sms or heap.num_sms))
    tok = heap.tokens_buffer()
    in_place = T > 0 and x.data_ptr() == tok.data_ptr() and x.stride() == (sh.hidden, 1)
    idx32 = topk_idx.to(torch.int32).contiguous()
    w32 = None if topk_w is None else topk_w.to(torch.float32).contiguous().view(torch.int32)
    S.stage(heap, act=None if in_place else x.contiguous(), act_reg=S.REG_TOK.value, small=idx32,
            small_reg=S.REG_IDX.value, ntok=T, programs=P, small2=w32, small2_reg=S.REG_W.value)
    sched = build_schedule(heap)
    if recv is None:
        recv = torch.empty(sh.rows_cap, sh.hidden, dtype=sh.dtype, device=heap.device)
    gate = None if topk_w is None else torch.empty(sh.rows_cap, dtype=torch.float32, device=heap.device)
    pull_rows(heap, sched, recv, P, gate=gate)
    return recv, DispatchHandle(heap=heap, num_tokens=T, schedule=sched, offs=sched.offs, num_sms=P,
                                row_gate=gate)


def dispatch_backward(grad_recv: torch.Tensor, handle: DispatchHandle, num_sms: int | None = None,
                      out_dtype: torch.dtype | None = None, presum: bool = False) -> torch.Tensor:
    """grad_x[t] = sum_j grad_recv[row(t, j)] on its expert rank, in fixed j order, fp32 accumulation.

    grad_recv: [R_cap, H] (rows >= offs[E_l] are ignored); it is staged into the heap's ``rows`` buffer
    unless it already is ``heap.rows_buffer()``. Returns grad_x [T, H] in ``out_dtype`` (default: heap dtype).
    presum: each expert rank first sums a token's rows it holds (see combine.py), the owner then sums one
    row per expert rank, in rank order.
    """
    from .combine import _gather_sum, _presum_gather

    if presum:
        return _presum_gather(grad_recv, False, handle, num_sms, out_dtype)
    return _gather_sum(grad_recv, None, handle, num_sms, out_dtype)


__all__ = ["DispatchHandle", "dispatch", "dispatch_backward", "pull_rows", "READY"]
