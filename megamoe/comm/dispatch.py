"""Pull dispatch: every rank copies the token rows its experts need straight out of the peers' memory.

Shape legend: W world size, T tokens on this rank (<= T_max), H hidden, k top-k, E experts, E_l = E / W
local experts, R rows this rank receives, R_cap = W * T_max * min(k, E_l).

    recv, handle = dispatch(x_TH, topk_idx_Tk, heap)

1. stage (signals.stage): x -> heap ``tok`` (skipped when x already is ``heap.tokens_buffer()[:T]``), topk_idx ->
   ``idx``, T -> ``meta``; publish READY.
2. schedule (schedule.py): every rank reads all W routing tables and computes the same placement.
3. pull (_pull_kernel): each needed row x_s[t] is loaded over NVLink once and stored into each of its receive rows
   (one per local expert slot); the last program publishes DONE (peers may then reuse their ``tok`` buffers).

recv_RH [R_cap, H]: rows ordered by (local expert, source rank, token, slot); expert e's rows are
recv[offs[e]:offs[e+1]]; rows >= offs[E_l] are not written. Nothing on the host waits for the device. The backward (an
unweighted sum over the k copies) is combine.dispatch_backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megamoe.kernels.interpreter import row_buffer

from . import signals as S
from .heap import CommShape, SymmetricHeap
from .schedule import Schedule, build_schedule, schedule_buffers
from .signals import ARRIVE_WORK, DONE, OP_PULL, READY, REG_W, arrive_publish, current_call, wait_flags


@dataclass
class DispatchHandle:
    """What one dispatch call leaves for combine and both backward passes. num_tokens: T (host int); schedule: the
    device-side :class:`~megamoe.comm.schedule.Schedule`; offs: schedule.offs, int32 [E_l + 1], for the grouped
    GEMMs; num_sms: programs the call's kernels used; row_gate: fp32 [R_b] gate of every received row (when
    dispatch was given ``topk_w``), for ``combine(..., presum=True)``."""

    heap: SymmetricHeap
    num_tokens: int
    schedule: Schedule
    offs: torch.Tensor
    num_sms: int
    row_gate: torch.Tensor | None = None

    def op_args(self, num_sms: int | None) -> tuple[SymmetricHeap, CommShape, int, int]:
        """(heap, its shape, T, programs: ``num_sms``, default the dispatch's) of an op on this call's rows."""
        return self.heap, self.heap.shape, self.num_tokens, max(1, int(num_sms or self.num_sms))


@triton.jit
def _per_source(vals, s, WP2: tl.constexpr):
    """vals[s] for every lane of s ([ROWS] ints in [0, W)), from a [WP2] vector held in registers."""
    wo = tl.arange(0, WP2)
    return tl.sum(tl.where(wo[None, :] == s[:, None], vals[None, :], 0), axis=1)


@triton.jit
def _pull_items(src, i0, K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, LOAD_W: tl.constexpr,
                DT: tl.constexpr, WP2: tl.constexpr):
    """Index loads of items [i0, i0 + ROWS), issued without waiting: the rows this rank writes per item (int32
    [ROWS, KP2], -1 for none), each item's source row address (int64 [ROWS]) and (LOAD_W) the gates w_s[t, :] (fp32
    [ROWS, KP2], meaningful where rows >= 0). src: the pull's fixed arguments (the tuple _pull_kernel builds); in it
    T_all, src_all, w_all: [WP2] per-source T_s and ``tok`` / ``w`` addresses, loaded once: every mask comes from
    registers, so only the consumer, a stage later, waits."""
    recv_row_ptr, T_all, src_all, w_all, rank, W, n_items, T_max, H = src
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
def _pull_store(dst_w, gate_ptr, rows, wv, v, h0, HW,
                HAS_GATE: tl.constexpr, K: tl.constexpr, KP2: tl.constexpr, BLOCK_W: tl.constexpr):
    """Local stores of one loaded chunk v [ROWS, BLOCK_W] (words): dst[r_j, h0:h0+BLOCK_W] = v for every slot j with
    a row here; HAS_GATE: gate[r_j] = w_j (on the first chunk of a row)."""
    jj = tl.arange(0, KP2)
    oh = h0 + tl.arange(0, BLOCK_W)
    mh = oh < HW
    if HAS_GATE:
        tl.store(gate_ptr + rows, wv, mask=(rows >= 0) & (h0 == 0))
    for j in tl.static_range(K):
        rj = tl.sum(tl.where(jj[None, :] == j, rows, 0), axis=1)
        m2 = (rj >= 0)[:, None] & mh[None, :]
        tl.store(dst_w + rj.to(tl.int64)[:, None] * HW + oh[None, :], v, mask=m2)


@triton.jit(do_not_specialize=["rank"])
def _pull_kernel(
    tab, W, rank,
    src_reg,  # heap region the rows come from: tok [T_max, H] of every source rank
    recv_row_ptr,  # int32 [W, T_max, K] row of (s, t, j) here, -1 elsewhere
    ntok_ptr,  # int64 [W] T_s per source
    dst_ptr,  # [R_cap, HP] out: receive buffer (dispatch) or the backward's dy rows (pull_grad)
    gate_ptr,  # fp32 [R_cap] out (HAS_GATE): gate w_s[t, j] of every received row (from the owner's w region)
    T_max, H, timeout_ns,
    HP,  # elements moved per row (<= H, the source rows' stride): dst is [R_cap, HP] (a narrower packed payload)
    HAS_GATE: tl.constexpr, K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr,  # H * itemsize % 16 == 0: rows start on 16-byte boundaries
    EPW: tl.constexpr,  # elements per moved word (2: 16-bit dtype and H even, else 1)
    WP2: tl.constexpr,
):
    """grid (P,): persistent programs over items i in [0, W * max_s T_s), ROWS items per step.
        t = i // W; s = (rank + 1 + i % W) % W          # neighbouring items hit different peers
        if t < T_s and any(recv_row[s, t, :] >= 0):
            v = tok_s[t, :]                              # one NVLink read per (s, t)
            dst[r] = v; gate[r] = w_s[t, j]              # for each r = recv_row[s, t, j] >= 0 (gate: HAS_GATE)
        last program: publish DONE = call

    The pull is latency-bound per program, so the (step, H-chunk) units u are software-pipelined in registers:
        load row(0); indices(1)
        for u = 0, 2, 4, ...:   load row(u+1); store(u); indices(u+2); load row(u+2); store(u+1); indices(u+3)

    so a remote row is in flight while the previous one is stored and index loads are waited for. One writer per dst
    row: bitwise deterministic."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    # READY from *every* peer, not only those pulled from: backends/common.dgrad_buffer relies on it (after this
    # kernel no peer still reads this rank's ``rows`` from an earlier call)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP_PULL, timeout_ns, WP2)
    if ok:
        wo = tl.arange(0, WP2)
        T_all = tl.load(ntok_ptr + wo, mask=wo < W, other=0)
        T_hi = tl.max(T_all, axis=0).to(tl.int32)
        n_items = W * T_hi
        DT = dst_ptr.dtype.element_ty
        src_all = tl.load(tab + src_reg * W + wo, mask=wo < W, other=0)
        w_all = tl.load(tab + REG_W * W + wo, mask=wo < W, other=0)
        # rows move as words of EPW elements (int32 pairs for 16-bit types): a word loaded in one iteration and
        # stored in the next stays packed in its register (16-bit elements would be repacked, waiting on the load)
        WT: tl.constexpr = tl.int32 if EPW == 2 else DT
        BLOCK_W: tl.constexpr = BLOCK_H // EPW
        HW = HP // EPW
        dst_w = dst_ptr.to(tl.pointer_type(WT), bitcast=True)
        NH = tl.cdiv(HW, BLOCK_W)
        n_units = tl.cdiv(tl.maximum(tl.cdiv(n_items, ROWS) - pid, 0), P) * NH  # this program's units
        # unit u: step pid + (u // NH) * P, chunk h0 = (u % NH) * BLOCK_W words. Two units per iteration, so a row is
        # stored from the register it was loaded into (a loop-carried copy of a pending load would wait for it).
        src = (recv_row_ptr, T_all, src_all, w_all, rank, W, n_items, T_max, H)
        ra, aa, wa = _pull_items(src, pid * ROWS, K, KP2, ROWS, HAS_GATE, DT, WP2)
        rb, ab, wb = _pull_items(src, (pid + (1 // NH) * P) * ROWS, K, KP2, ROWS, HAS_GATE, DT, WP2)
        va = _pull_load(ra, aa, 0, HW, BLOCK_W, ALIGNED, WT)
        u = pid * 0
        while u < n_units:  # entry: row of unit u in flight (va), indices of u (ra) and u+1 (rb)
            vb = _pull_load(rb, ab, ((u + 1) % NH) * BLOCK_W, HW, BLOCK_W, ALIGNED, WT)
            _pull_store(dst_w, gate_ptr, ra, wa, va, (u % NH) * BLOCK_W, HW, HAS_GATE, K, KP2, BLOCK_W)
            ra, aa, wa = _pull_items(src, (pid + ((u + 2) // NH) * P) * ROWS, K, KP2, ROWS, HAS_GATE, DT, WP2)
            va = _pull_load(ra, aa, ((u + 2) % NH) * BLOCK_W, HW, BLOCK_W, ALIGNED, WT)
            _pull_store(dst_w, gate_ptr, rb, wb, vb, ((u + 1) % NH) * BLOCK_W, HW, HAS_GATE, K, KP2,
                        BLOCK_W)  # unit u+1 (masked off past the last unit)
            rb, ab, wb = _pull_items(src, (pid + ((u + 3) // NH) * P) * ROWS, K, KP2, ROWS, HAS_GATE, DT, WP2)
            u += 2
    arrive_publish(tab, W, rank, ARRIVE_WORK, P, DONE, call, WP2)


def check_pull(heap: SymmetricHeap, dst: torch.Tensor, width: int | None = None, rows: int | None = None) -> int:
    """:func:`pull_rows`'s checks (callers run them before staging): the elements moved per row. ``rows``: the
    call's row bound (CommShape.rows_for), which dst must hold."""
    hp = heap.shape.hidden if width is None else int(width)
    if not 0 < hp <= heap.shape.hidden:
        raise ValueError(f"pull_rows: width must be in (0, H={heap.shape.hidden}], got {width}")
    if dst.dim() != 2 or dst.shape[1] != hp or dst.stride(-1) != 1 or dst.shape[0] < (rows or 0):
        raise ValueError(f"pull_rows: dst must be [>= {rows or 'R'}, {hp}] with unit inner stride, got "
                         f"{tuple(dst.shape)}")
    return hp


def pull_rows(heap: SymmetricHeap, sched: Schedule, dst: torch.Tensor, programs: int,
              gate: torch.Tensor | None = None, width: int | None = None) -> None:
    """Launch :func:`_pull_kernel`: dst[r] = tok_s[t][:width] for every received row r = (s, t, j) (x in dispatch,
    dy in pull_grad). gate: fp32 [R_b] (the call's rows) to fill with each row's gate (staged in ``w``). width:
    elements moved per row (default H; dispatch_fp8's packed rows are narrower)."""
    sh = heap.shape
    hp = check_pull(heap, dst, width)
    _pull_kernel[(programs,)](
        heap.tab, heap.world, heap.rank, S.REG_TOK.value, sched.recv_row, sched.tokens_per_rank, dst,
        gate if gate is not None else dst, sh.max_tokens, sh.hidden, heap.timeout_ns, hp, HAS_GATE=gate is not None,
        EPW=2 if sh.dtype.itemsize == 2 and sh.hidden % 2 == 0 and hp % 2 == 0 else 1, **S.tile_args(heap, "pull"))
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
                       sched: Schedule, topk_w: torch.Tensor | None = None):
    """Stage x [T, H] (unless it is the heap's tokens buffer), the top-k ids (and gates), publish READY, and return
    the device-side schedule: the first half of :func:`dispatch` and the megakernel's preamble (inputs checked; the
    caller has allocated everything the call needs, ``sched`` from schedule_buffers included, since an error between
    the READY published here and the call's last kernel would leave every peer waiting for this rank's DONE)."""
    T = x.shape[0]
    tok = heap.tokens_buffer()
    in_place = T > 0 and x.data_ptr() == tok.data_ptr() and x.stride() == (heap.shape.hidden, 1)
    w32 = None if topk_w is None else topk_w.to(torch.float32).contiguous().view(torch.int32)
    act = None if in_place else x.contiguous()
    ids = topk_idx.to(torch.int32).contiguous()
    S.stage(heap, act=act, act_reg=S.REG_TOK.value, small=ids, small_reg=S.REG_IDX.value, ntok=T,
            programs=programs, small2=w32, small2_reg=S.REG_W.value)
    return build_schedule(heap, sched, T)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, heap: SymmetricHeap, num_sms: int | None = None,
             recv: torch.Tensor | None = None,
             topk_w: torch.Tensor | None = None) -> tuple[torch.Tensor, DispatchHandle]:
    """Route x_TH to the ranks owning its experts; returns (recv_RH [R_b, H], handle), R_b = heap.shape.rows_for(T)
    (R_cap; on one rank T * k).
    x: [T, H] heap dtype, T <= heap.shape.max_tokens (T may be 0). topk_idx: [T, k] integer ids in [0, E).
    num_sms: programs (default heap.num_sms). recv: optional preallocated [>= R_b, H] output. topk_w: optional
    [T, k] gates that travel with the rows (``handle.row_gate``), for ``combine(..., presum=True)``."""
    T = _check_inputs(heap, x, topk_idx, topk_w)
    return _stage_and_pull(heap, x, T, topk_idx, topk_w, num_sms, recv)


def _stage_and_pull(heap: SymmetricHeap, payload: torch.Tensor, T: int, topk_idx: torch.Tensor,
                    topk_w: torch.Tensor | None, num_sms: int | None,
                    recv: torch.Tensor | None = None) -> tuple[torch.Tensor, DispatchHandle]:
    """:func:`dispatch` / :func:`dispatch_fp8` after their checks: payload [T, width] -> recv [R_cap, width]."""
    sh = heap.shape
    P = max(1, int(num_sms or heap.num_sms))
    width = payload.shape[1]
    R = sh.rows_for(T)
    if recv is None:  # every allocation and check before the stage publishes READY
        recv = row_buffer((R, width), sh.dtype, heap.device)
    check_pull(heap, recv, width, R)
    gate = None if topk_w is None else row_buffer((R,), torch.float32, heap.device)
    sched = stage_and_schedule(heap, payload, topk_idx, P, schedule_buffers(heap, T), topk_w)
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


def fp8_row_views(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [n, H], fp32 scales [n, cdiv(H, 128)]): row-strided views of packed FP8 rows (``rows`` [n, words]
    of a 16-bit dtype, :func:`fp8_row_layout`)."""
    so = fp8_row_layout(hidden)[0]
    rb = rows.view(torch.uint8)
    return rb[:, :hidden].view(torch.float8_e4m3fn), rb[:, so:so + 4 * triton.cdiv(hidden, 128)].view(torch.float32)


def dispatch_fp8(x: torch.Tensor, topk_idx: torch.Tensor, heap: SymmetricHeap, num_sms: int | None = None,
                 topk_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """:func:`dispatch` of x quantised once per token on its home rank: (aq [R_cap, H] float8_e4m3fn, a_s [R_cap,
    cdiv(H, 128)] fp32, handle), row-strided views of one buffer of packed rows, ready for the FP8 GEMM1. T rows
    are quantised (not up to k received copies) and each moves ~H + H / 32 bytes instead of 2H; bitwise what
    quantize_act gives on :func:`dispatch`'s rows. Needs a 16-bit heap whose token rows hold a packed row (H >= 32
    always fits; so do 16 and 24-31)."""
    from megamoe.kernels.fp8_quant import quantize_act  # lazy: comm does not need the GEMM kernels otherwise

    T = _check_inputs(heap, x, topk_idx, topk_w)
    sh = heap.shape
    H = sh.hidden
    _, row_bytes, words = fp8_row_layout(H)
    if sh.dtype.itemsize != 2 or words > H:
        raise ValueError(f"dispatch_fp8: needs a 16-bit heap whose rows hold a packed FP8 row ({row_bytes} bytes), "
                         f"got {sh.dtype} with H = {H}")
    packed = torch.empty(T, words, dtype=sh.dtype, device=x.device)  # padding bytes never read
    quantize_act(x, out=fp8_row_views(packed, H))  # per row, 1x128 blocks
    recv, handle = _stage_and_pull(heap, packed, T, topk_idx, topk_w, num_sms)
    return (*fp8_row_views(recv, H), handle)


__all__ = ["DispatchHandle", "check_pull", "dispatch", "dispatch_fp8", "fp8_row_layout", "fp8_row_views", "pull_rows",
           "stage_and_schedule"]
