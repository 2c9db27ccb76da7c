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

2026-11-30: the pull loop is software-pipelined (``PULL_PIPELINE``, ``pull_rows(pipeline=...)``; see
_pull_kernel): the remote row of the next unit is in flight while the current one is stored, rows move as
32-bit words, and steps past the largest T_s are not walked. Checked on sm_90a SASS (no move of a pending
load in the loop; ptxas spills <= 20 bytes at the pull_pipe tiles); NOT yet timed on a GPU:
``torchrun --nproc_per_node 4 benchmarks/pull_sweep.py`` compares both loops, tiles and program counts and
checks that the outputs are bitwise equal. ``pull_rows(scale_only=True)`` is combine backward's pull without
d(topk_w) (dst = w * dy rows, no ``out``), for a backend that computes d(topk_w) elsewhere.

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


#: default of ``pull_rows(pipeline=None)``: software-pipelined pull loop (see :func:`_pull_kernel`).
PULL_PIPELINE = True


@triton.jit
def _per_source(vals, s, WP2: tl.constexpr):
    """vals[s] for every lane of s ([ROWS] ints in [0, W)), from a [WP2] vector held in registers."""
    wo = tl.arange(0, WP2)
    return tl.sum(tl.where(wo[None, :] == s[:, None], vals[None, :], 0), axis=1)


@triton.jit
def _pull_items(recv_row_ptr, T_all, src_all, w_all, rank, W, i0, n_items, T_max, H,
                K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, LOAD_W: tl.constexpr, DT: tl.constexpr,
                WP2: tl.constexpr):
    """Index loads of the step of items [i0, i0 + ROWS), issued without waiting for them: the rows this rank
    writes for each item (int32 [ROWS, KP2], -1 for none: item out of range, t >= T_s, slot elsewhere), the
    address of each item's source row (int64 [ROWS], this process's view of x_s[t]; from registers) and
    (LOAD_W) the gates w_s[t, :] (fp32 [ROWS, KP2]; meaningful where rows >= 0 only).

    T_all, src_all, w_all: [WP2] per-source T_s and region addresses of ``tok`` and ``w``, loaded once. Every
    mask comes from registers, so nothing here waits on a load: the consumer (one pipeline stage later) does.
    """
    jj = tl.arange(0, KP2)
    ii = i0 + tl.arange(0, ROWS)
    t = ii // W
    s = (rank + 1 + ii % W) % W
    valid = (ii < n_items) & (t < _per_source(T_all, s, WP2))
    m2 = valid[:, None] & (jj < K)[None, :]
    rows = tl.load(recv_row_ptr + ((s * T_max + t) * K)[:, None] + jj[None, :], mask=m2, other=-1)
    src_addr = _per_source(src_all, s, WP2) + t.to(tl.int64) * H * (DT.primitive_bitwidth // 8)
    if LOAD_W:
        w_addr = (_per_source(w_all, s, WP2) + (t * K).to(tl.int64) * 4).to(tl.pointer_type(tl.float32))
        wv = tl.load(w_addr[:, None] + jj[None, :], mask=m2, other=0.0)
    else:
        wv = tl.zeros([ROWS, KP2], tl.float32)
    return rows, src_addr, wv


@triton.jit
def _pull_load(rows, src_addr, h0, HW, BLOCK_W: tl.constexpr, ALIGNED: tl.constexpr, WT: tl.constexpr):
    """Remote load of words [h0, h0 + BLOCK_W) of every needed item's source row: [ROWS, BLOCK_W] WT."""
    need = tl.max(rows, axis=1) >= 0
    src = src_addr.to(tl.pointer_type(WT))
    if ALIGNED:
        src = tl.multiple_of(src, 16)
    oh = h0 + tl.arange(0, BLOCK_W)
    return tl.load(src[:, None] + oh[None, :], mask=need[:, None] & (oh < HW)[None, :])


@triton.jit
def _scale_words(v, wj, DT: tl.constexpr, EPW: tl.constexpr):
    """(v * wj) rounded to DT, elementwise, with v [ROWS, BLOCK_W] words of EPW elements of DT (EPW = 2: two
    16-bit elements in an int32, low half first) and wj [ROWS] fp32; bitwise (x.to(fp32) * w).to(DT)."""
    if EPW == 2:
        lo = v.to(tl.int16).to(DT, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
        plo = (lo * wj[:, None]).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        phi = (hi * wj[:, None]).to(DT).to(tl.int16, bitcast=True).to(tl.int32)
        return plo | (phi << 16)
    else:
        return (v.to(tl.float32) * wj[:, None]).to(DT)


@triton.jit
def _pull_store(dst_w, gate_ptr, rows, wv, v, h0, HW,
                HAS_W: tl.constexpr, HAS_GATE: tl.constexpr, K: tl.constexpr, KP2: tl.constexpr,
                BLOCK_W: tl.constexpr, DT: tl.constexpr, EPW: tl.constexpr):
    """Local stores of one loaded chunk v [ROWS, BLOCK_W] (words): dst[r_j, h0:h0+BLOCK_W] = v (HAS_W:
    w_j * v) for every slot j with a row here; HAS_GATE: gate[r_j] = w_j (on the first chunk of a row)."""
    jj = tl.arange(0, KP2)
    oh = h0 + tl.arange(0, BLOCK_W)
    mh = oh < HW
    if HAS_GATE:
        tl.store(gate_ptr + rows, wv, mask=(rows >= 0) & (h0 == 0))
    for j in tl.static_range(K):
        rj = tl.sum(tl.where(jj[None, :] == j, rows, 0), axis=1)
        m2 = (rj >= 0)[:, None] & mh[None, :]
        o2 = rj.to(tl.int64)[:, None] * HW + oh[None, :]
        if HAS_W:
            wj = tl.sum(tl.where(jj[None, :] == j, wv, 0.0), axis=1)
            tl.store(dst_w + o2, _scale_words(v, wj, DT, EPW), mask=m2)
        else:
            tl.store(dst_w + o2, v, mask=m2)


@triton.jit(do_not_specialize=["rank"])
def _pull_kernel(
    tab, W, rank,
    src_reg,  # heap region the rows come from: tok [T_max, H] of every source rank
    recv_row_ptr,  # int32 [W, T_max, K] row of (s, t, j) here, -1 elsewhere
    ntok_ptr,  # int64 [W] T_s per source
    dst_ptr,  # [R_cap, H] out: receive buffer (dispatch) or grad of expert outputs (combine backward)
    out_ptr,  # [R_cap, H] expert outputs (HAS_OUT only)
    gate_ptr,  # fp32 [R_cap] out (HAS_GATE): gate w_s[t, j] of every received row (from the owner's w region)
    T_max, H, timeout_ns,
    HP,  # elements moved per row (<= H, the source rows' stride): dst is [R_cap, HP] (a narrower packed payload)
    OP: tl.constexpr,
    HAS_W: tl.constexpr,  # combine backward: dst = w_s[t, j] * src row (gates from the owner's w region)
    HAS_OUT: tl.constexpr,  # with HAS_W: also dw_s[t, j] = <src row, out row>, written into rank s's dw region
    HAS_GATE: tl.constexpr,  # dispatch with gates: also record each received row's gate (for presum combine)
    PIPELINE: tl.constexpr,  # software-pipelined loop (not with HAS_OUT)
    K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr,  # H * itemsize % 16 == 0: rows start on 16-byte boundaries
    EPW: tl.constexpr,  # PIPELINE: elements per moved word (2: 16-bit dtype and H even, else 1)
    WP2: tl.constexpr,
):
    """grid (P,): persistent programs over items i in [0, W*max_s T_s), ROWS items per step.

        t = i // W; s = (rank + 1 + i % W) % W          # neighbouring items hit different peers
        if t < T_s and any(recv_row[s, t, :] >= 0):
            v = tok_s[t, :]                              # one NVLink read per (s, t)
            for j < K with r = recv_row[s, t, j] >= 0:   # one local write per local expert slot
                dst[r] = v                               # (HAS_W: dst[r] = w_s[t, j] * v;
                                                         #  HAS_OUT: dw_s[t, j] = <v, out[r]> written to rank s)
                gate[r] = w_s[t, j]                      # (HAS_GATE)
        last program: publish DONE = call

    Items t >= max_s T_s are never walked (whole empty steps skipped when every rank has < T_max tokens).
    PIPELINE: the program's (step, H-chunk) units u = 0, 1, ... are software-pipelined in registers:

        load row(0); indices(1)
        for u = 0, 2, 4, ...:   load row(u+1); store(u); indices(u+2); load row(u+2); store(u+1); indices(u+3)

    so a remote row is in flight while the previous one is stored and while index loads are waited for (the
    loop without it waits for the index loads, then for the remote row, then stores, at every step). T_s and
    the peer addresses of every source are loaded once, so a step's index loads depend on no earlier load.
    Rows move as 32-bit words (EPW elements). Every dst row has one writer either way: bitwise the same output.
    """
    tl.static_assert(not (PIPELINE and HAS_OUT), "the pipelined pull has no d(topk_w) path")
    tl.static_assert(HAS_W or not HAS_OUT, "HAS_OUT needs HAS_W")
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    # READY from *every* peer, not only those pulled from: backends/split.dgrad_buffer relies on it (after this
    # kernel no peer still reads this rank's ``rows`` from an earlier call)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP, timeout_ns, WP2)
    if ok:
        wo = tl.arange(0, WP2)
        T_all = tl.load(ntok_ptr + wo, mask=wo < W, other=0)
        T_hi = tl.max(T_all, axis=0).to(tl.int32)
        n_items = W * T_hi
        DT = dst_ptr.dtype.element_ty
        LOAD_W: tl.constexpr = HAS_W or HAS_GATE
        if PIPELINE:
            src_all = tl.load(tab + src_reg * W + wo, mask=wo < W, other=0)
            w_all = tl.load(tab + REG_W * W + wo, mask=wo < W, other=0)
            # rows move as words of EPW elements (int32 pairs for 16-bit types): a word loaded in one iteration
            # and stored in the next stays packed in its register (16-bit elements would be unpacked and
            # repacked there, and those moves wait for the load)
            WT: tl.constexpr = tl.int32 if EPW == 2 else DT
            BLOCK_W: tl.constexpr = BLOCK_H // EPW
            HW = HP // EPW
            dst_w = dst_ptr.to(tl.pointer_type(WT), bitcast=True)
            NH = tl.cdiv(HW, BLOCK_W)
            n_units = tl.cdiv(tl.maximum(tl.cdiv(n_items, ROWS) - pid, 0), P) * NH  # this program's units
            # unit u: step pid + (u // NH) * P (items from its * ROWS), chunk h0 = (u % NH) * BLOCK_W words.
            # Two units per iteration, so that a row loaded in one half is stored in the next half from the
            # register it was loaded into (a loop-carried copy of a pending load would wait for it). Each index
            # load is issued where its buffer was freed and waited for while a remote row is in flight.
            ra, aa, wa = _pull_items(recv_row_ptr, T_all, src_all, w_all, rank, W, pid * ROWS, n_items, T_max, H,
                                     K, KP2, ROWS, LOAD_W, DT, WP2)
            rb, ab, wb = _pull_items(recv_row_ptr, T_all, src_all, w_all, rank, W, (pid + (1 // NH) * P) * ROWS,
                                     n_items, T_max, H, K, KP2, ROWS, LOAD_W, DT, WP2)
            va = _pull_load(ra, aa, 0, HW, BLOCK_W, ALIGNED, WT)
            u = pid * 0
            while u < n_units:  # entry: row of unit u in flight (va), indices of u (ra) and u+1 (rb)
                vb = _pull_load(rb, ab, ((u + 1) % NH) * BLOCK_W, HW, BLOCK_W, ALIGNED, WT)
                _pull_store(dst_w, gate_ptr, ra, wa, va, (u % NH) * BLOCK_W, HW, HAS_W, HAS_GATE, K, KP2,
                            BLOCK_W, DT, EPW)
                ra, aa, wa = _pull_items(recv_row_ptr, T_all, src_all, w_all, rank, W,
                                         (pid + ((u + 2) // NH) * P) * ROWS, n_items, T_max, H, K, KP2, ROWS,
                                         LOAD_W, DT, WP2)
                va = _pull_load(ra, aa, ((u + 2) % NH) * BLOCK_W, HW, BLOCK_W, ALIGNED, WT)
                _pull_store(dst_w, gate_ptr, rb, wb, vb, ((u + 1) % NH) * BLOCK_W, HW, HAS_W, HAS_GATE, K, KP2,
                            BLOCK_W, DT, EPW)  # unit u+1 (masked off past the last unit)
                rb, ab, wb = _pull_items(recv_row_ptr, T_all, src_all, w_all, rank, W,
                                         (pid + ((u + 3) // NH) * P) * ROWS, n_items, T_max, H, K, KP2, ROWS,
                                         LOAD_W, DT, WP2)
                u += 2
        else:  # the loop as measured 2026-11-29 (one step at a time; the only one with d(topk_w))
            jj = tl.arange(0, KP2)
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
                if LOAD_W:
                    w_addr = tl.load(tab + REG_W * W + s, mask=need, other=0).to(tl.pointer_type(tl.float32))
                    wv = tl.load(w_addr[:, None] + (t * K)[:, None] + jj[None, :],
                                 mask=need[:, None] & (rows >= 0), other=0.0)
                if HAS_GATE:
                    tl.store(gate_ptr + rows, wv, mask=need[:, None] & (rows >= 0))
                if HAS_OUT:
                    dw = tl.zeros([ROWS, KP2], tl.float32)
                h0 = tl.program_id(0) * 0
                while h0 < HP:
                    oh = h0 + tl.arange(0, BLOCK_H)
                    mh = oh < HP
                    v = tl.load(src[:, None] + oh[None, :], mask=need[:, None] & mh[None, :])
                    for j in tl.static_range(K):
                        rj = tl.sum(tl.where(jj[None, :] == j, rows, 0), axis=1)
                        mj = need & (rj >= 0)
                        m2 = mj[:, None] & mh[None, :]
                        o2 = rj.to(tl.int64)[:, None] * HP + oh[None, :]
                        if HAS_W:
                            wj = tl.sum(tl.where(jj[None, :] == j, wv, 0.0), axis=1)
                            vf = v.to(tl.float32)
                            if HAS_OUT:
                                ov = tl.load(out_ptr + o2, mask=m2, other=0.0).to(tl.float32)
                                dj = tl.sum(vf * ov, axis=1)
                                dw += tl.where(jj[None, :] == j, dj[:, None], 0.0)
                            tl.store(dst_ptr + o2, (vf * wj[:, None]).to(DT), mask=m2)
                        else:
                            tl.store(dst_ptr + o2, v, mask=m2)
                    h0 += BLOCK_H
                if HAS_OUT:
                    dw_addr = tl.load(tab + REG_DW * W + s, mask=need, other=0).to(tl.pointer_type(tl.float32))
                    tl.store(dw_addr[:, None] + (t * K)[:, None] + jj[None, :], dw,
                             mask=need[:, None] & (rows >= 0))
                i0 += P * ROWS
    last = arrive_last(tab, W, rank, ARRIVE_WORK, P)
    if last:
        if error_set(tab, W, rank) == 0:
            publish(tab, W, rank, DONE, call, WP2)


def pull_rows(heap: SymmetricHeap, sched: Schedule, dst: torch.Tensor, programs: int,
              out: torch.Tensor | None = None, gate: torch.Tensor | None = None, scale_only: bool = False,
              pipeline: bool | None = None, width: int | None = None) -> None:
    """Launch :func:`_pull_kernel`: dst[r] = x_s[t] for every received row r = (s, t, j) (dispatch).

    ``out`` [R_cap, H] (combine backward): dst[r] = w_s[t, j] * dy_s[t] and d(topk_w)_s[t, j] = <dy_s[t],
    out[r]> (fp32) written into rank s's ``dw`` region (the owner then runs ``signals.finish``); dy and the
    gates must be staged in ``tok`` / ``w``.
    ``scale_only``: the same dst[r] = w_s[t, j] * dy_s[t] (bitwise equal to the ``out`` path's dst) without
    d(topk_w): no ``out``, no ``dw`` writes, no finish needed.
    ``gate``: fp32 [R_cap] filled with each received row's gate (dispatch with gates staged in ``w``).
    ``pipeline``: software-pipelined loop (default :data:`PULL_PIPELINE`); ignored with ``out``.
    ``width``: elements moved per row (default the heap's H): dst [R_cap, width] gets the first ``width`` elements of
    each source row (a packed payload staged narrower than H: dispatch_fp8); plain pulls only.
    """
    sh = heap.shape
    has_out = out is not None
    hp = sh.hidden if width is None else int(width)
    if not 0 < hp <= sh.hidden or (hp != sh.hidden and (has_out or scale_only)):
        raise ValueError(f"pull_rows: width must be in (0, H={sh.hidden}] and is for the plain pull, got {width}")
    if tuple(dst.shape[1:]) != (hp,) or dst.stride(-1) != 1:
        raise ValueError(f"pull_rows: dst must be [R_cap, {hp}] with unit inner stride, got {tuple(dst.shape)}")
    if has_out and scale_only:
        raise ValueError("pull_rows: scale_only computes no d(topk_w), so it takes no out")
    has_w = has_out or scale_only
    if has_w and gate is not None:
        raise ValueError("pull_rows: gate is for dispatch (unscaled rows); not with out / scale_only")
    # default: the pipelined loop for the plain pull; the scale-only pull measured faster unpipelined
    # (2x H200, 132 programs, 2026-11-30: qwen3 183 vs 208 us, deepseek 390 vs 429 us; pull_sweep.json)
    if pipeline is None:
        pipeline = PULL_PIPELINE and not scale_only
    pipe = bool(pipeline) and not has_out
    op = "pull_bwd" if has_out else ("pull_scale" if scale_only else ("pull_pipe" if pipe else "pull"))
    rows, block_h, warps = S.launch_config(sh.hidden, op)
    _pull_kernel[(programs,)](
        heap.tab, heap.world, heap.rank, S.REG_TOK.value, sched.recv_row, sched.tokens_per_rank, dst,
        out if has_out else dst, gate if gate is not None else dst, sh.max_tokens, sh.hidden, heap.timeout_ns, hp,
        OP=OP_COMBINE_BWD.value if has_w else OP_PULL.value, HAS_W=has_w, HAS_OUT=has_out,
        HAS_GATE=gate is not None, PIPELINE=pipe,
        K=sh.topk, KP2=triton.next_power_of_2(sh.topk), ROWS=rows, BLOCK_H=block_h,
        ALIGNED=(sh.hidden * sh.dtype.itemsize) % 16 == 0,
        EPW=2 if sh.dtype.itemsize == 2 and sh.hidden % 2 == 0 and hp % 2 == 0 else 1, WP2=heap.wp2,
        num_warps=warps,
    )
    heap.after_launch()


def _check_inputs(heap: SymmetricHeap, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_w: torch.Tensor | None = None) -> int:
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
    if topk_w is not None and tuple(topk_w.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_w must be [T={T}, k={sh.topk}], got {tuple(topk_w.shape)}")
    if x.device != heap.device or topk_idx.device != heap.device:
        raise ValueError(f"inputs must live on {heap.device}")
    return T


def stage_and_schedule(heap: SymmetricHeap, x: torch.Tensor, topk_idx: torch.Tensor, programs: int,
                       topk_w: torch.Tensor | None = None):
    """Stage x [T, H] (skipped when x already is the heap's tokens buffer), the top-k ids (and gates) into the
    symmetric heap, publish READY, and build the device-side schedule; returns it. The first half of
    :func:`dispatch`, also the fused megakernel's preamble (inputs checked by the caller)."""
    T = x.shape[0]
    tok = heap.tokens_buffer()
    in_place = T > 0 and x.data_ptr() == tok.data_ptr() and x.stride() == (heap.shape.hidden, 1)
    w32 = None if topk_w is None else topk_w.to(torch.float32).contiguous().view(torch.int32)
    S.stage(heap, act=None if in_place else x.contiguous(), act_reg=S.REG_TOK.value,
            small=topk_idx.to(torch.int32).contiguous(), small_reg=S.REG_IDX.value, ntok=T, programs=programs,
            small2=w32, small2_reg=S.REG_W.value)
    return build_schedule(heap)


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
    T = _check_inputs(heap, x, topk_idx, topk_w)
    return _stage_and_pull(heap, x, T, topk_idx, topk_w, num_sms, recv)


def _stage_and_pull(heap: SymmetricHeap, payload: torch.Tensor, T: int, topk_idx: torch.Tensor,
                    topk_w: torch.Tensor | None, num_sms: int | None,
                    recv: torch.Tensor | None = None) -> tuple[torch.Tensor, DispatchHandle]:
    """The rest of :func:`dispatch` and :func:`dispatch_fp8` after their checks: stage ``payload`` [T, width]
    (x, or the packed FP8 rows) with the routing, build the schedule, pull the rows into recv [R_cap, width]."""
    sh = heap.shape
    P = max(1, int(num_sms or heap.num_sms))
    sched = stage_and_schedule(heap, payload, topk_idx, P, topk_w)
    width = payload.shape[1]
    if recv is None:
        recv = torch.empty(sh.rows_cap, width, dtype=sh.dtype, device=heap.device)
    gate = None if topk_w is None else torch.empty(sh.rows_cap, dtype=torch.float32, device=heap.device)
    pull_rows(heap, sched, recv, P, gate=gate, width=width)
    return recv, DispatchHandle(heap=heap, num_tokens=T, schedule=sched, offs=sched.offs, num_sms=P,
                                row_gate=gate)


def fp8_row_layout(hidden: int) -> tuple[int, int, int]:
    """Byte layout of one packed FP8 row (dispatch_fp8): (scale offset, row bytes, 16-bit words per row). e4m3
    values in bytes [0, H), the 1x128 block scales (fp32, cdiv(H, 128) of them) from the 16-byte boundary after
    them, the row padded to 16 bytes (TMA row strides); e.g. qwen3 H = 2048: 2112 B, deepseek 7168: 7392 B."""
    so = -(-hidden // 16) * 16
    row = -(-(so + 4 * triton.cdiv(hidden, 128)) // 16) * 16
    return so, row, row // 2


def fp8_rows_fit(hidden: int) -> bool:
    """Whether a packed FP8 row (:func:`fp8_row_layout`) fits in a 16-bit row of ``hidden`` elements, the symmetric
    heap's token rows it is staged in (H >= 32 always fits; so do 16 and 24-31)."""
    return fp8_row_layout(hidden)[2] <= hidden


def fp8_row_views(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [n, H], fp32 scales [n, cdiv(H, 128)]): row-strided views of packed FP8 rows (``rows`` [n, words]
    of a 16-bit dtype, :func:`fp8_row_layout`)."""
    so = fp8_row_layout(hidden)[0]
    rb = rows.view(torch.uint8)
    return rb[:, :hidden].view(torch.float8_e4m3fn), rb[:, so:so + 4 * triton.cdiv(hidden, 128)].view(torch.float32)


def pack_fp8_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H] quantised per row (1x128 blocks, quantize_act) into packed FP8 rows [T, words] of the 16-bit
    ``dtype`` (:func:`fp8_row_layout`; the padding bytes are never read as data)."""
    from megamoe.kernels.fp8_quant import quantize_act  # lazy: comm does not need the GEMM kernels otherwise

    packed = torch.empty(x.shape[0], fp8_row_layout(x.shape[1])[2], dtype=dtype, device=x.device)
    quantize_act(x, out=fp8_row_views(packed, x.shape[1]))
    return packed


def dispatch_fp8(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    heap: SymmetricHeap,
    num_sms: int | None = None,
    topk_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """:func:`dispatch` of x quantised once per token on its home rank: (aq [R_cap, H] float8_e4m3fn, a_s [R_cap,
    cdiv(H, 128)] fp32, handle), row-strided views of one receive buffer of packed rows (fp8_row_layout), ready
    for the FP8 GEMM1 (megamoe.experts: 1x128 activation scales). Each token's row is quantised once (T rows,
    not its up to k received copies) and moves ~H + H / 32 bytes instead of 2H; aq and a_s are bitwise what
    quantize_act gives on :func:`dispatch`'s rows (the quantisation is per row). The heap must be 16-bit (bf16)
    with H large enough that a packed row fits in a tok row (H >= 32). Rows >= offs[E_l] are not written."""
    T = _check_inputs(heap, x, topk_idx, topk_w)
    sh = heap.shape
    H = sh.hidden
    if sh.dtype.itemsize != 2 or not fp8_rows_fit(H):
        raise ValueError(f"dispatch_fp8: needs a 16-bit heap whose rows hold a packed FP8 row "
                         f"({fp8_row_layout(H)[1]} bytes), got {sh.dtype} with H = {H}")
    recv, handle = _stage_and_pull(heap, pack_fp8_rows(x, sh.dtype), T, topk_idx, topk_w, num_sms)
    return (*fp8_row_views(recv, H), handle)


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


__all__ = ["DispatchHandle", "dispatch", "dispatch_fp8", "dispatch_backward", "fp8_row_layout", "fp8_row_views",
           "fp8_rows_fit", "pack_fp8_rows", "pull_rows",
           "stage_and_schedule", "READY"]
