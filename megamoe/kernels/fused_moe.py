"""The MoE forward megakernel: pull dispatch, GEMM1+SwiGLU, GEMM2 and the combine in one persistent kernel.

Shape legend: W world size, T tokens on this rank, H hidden, I expert intermediate, E_l local experts, k top-k,
R rows this rank receives (device value offs[E_l]), R_cap its worst case, BM rows of a block (128 on GPUs),
NB blocks: expert e's rows offs[e]:offs[e+1] cut into cdiv(n_e, BM) blocks, in expert order (NB <= NB_MAX =
cdiv(R_cap, BM) + E_l), T1 = cdiv(I, BN1) GEMM1 column tiles, T2 = cdiv(H, BN2) GEMM2 column tiles.

Before the kernel (stream order, no host sync): stage x and top-k ids into the symmetric heap and publish
READY (comm/signals.stage), then the device-side schedule (comm/schedule.py: offs, and for every received row
its (source rank, token, slot)).

Work items (one program runs one item at a time; items are taken in order from one atomic counter):

    step s = 0, 1, ... covers blocks sG .. sG + G - 1 (G = ``group``):
        [PULL(b, p) of its blocks, GEMM1(b, j) of step s - L1's blocks, GEMM2(b, j) of step s - L1 - L2's
         blocks], the GEMM items j-major (tile j of every block of the group, then j + 1), so the tiles that
         read one weight tile run side by side and share it in L2 (split's GROUP_M swizzle, measured below)
    PULL(b, p):  part p (of PULL_SPLIT) of block b's x rows from their owners' ``tok`` regions (NVLink) ->
                 xbuf slot of b; ready[b] += 1
    GEMM1(b, j): wait ready[b] == PULL_SPLIT; act[:, j-th BN1 cols] = silu(x @ w13g^T) * (x @ w13u^T)
                 (and h when STORE_H); g1[b] += 1
    GEMM2(b, j): wait g1[b] == T1; out = act @ w2[e]^T (cols j*BN2..); push (default): each row r = (src, t,
                 slot) is stored straight into rank src's ``slots`` region at [t, slot, cols]; PULL_COMBINE: stored
                 at its receive row in this rank's symmetric ``rows`` region; g2[b] += 1
    then:        the last program to finish publishes DONE; every program waits for DONE from every rank
                 (every rank's GEMM2 rows are final) and sums its tokens: y[t] = sum_j topk_w[t, j] * out_j(t)
                 in j order, fp32, out_j(t) read from the local slots (push) or pulled from its expert rank's
                 ``rows`` over NVLink (PULL_COMBINE); SAVE also copies the rows out for the backward's d(topk_w).

Why this is deadlock-free: an item only waits on items with a smaller index (taken earlier by a program
that is running, since only running programs take items) or on peers' READY / DONE, and the ring (below)
only makes PULL(b) wait on GEMM1(b - NS) and GEMM1(b) on GEMM2(b - NS), both earlier items when NS > L1 + L2.
No program needs another to be resident, so no occupancy assumption; under the interpreter, where programs
run one after another, a single program runs every item in order.

Macrobatch ring (``NS`` > 0): xbuf / act / h hold NS blocks; block b uses slot b % NS, so memory is NS * BM
rows whatever the routing, and the work cycles through the ring in order. NS = 0 (dense): block b's rows
live at their receive rows (offs[e] + i * BM ...), i.e. the buffers are split's expert-grouped layout and the
backward can reuse them.

Communication programs vs compute programs: there is no static split. Every program takes the next item,
PULL or GEMM, so the share of SMs moving rows follows the work (about one pull per 1 + T1 + T2 items);
the lookahead L1 (pull to GEMM1, in steps) is the knob (default: at least 8 steps, from per-item timelines).
With ``prologue`` the first L1 steps, whose GEMM items have no blocks yet, use all their items as pull parts
(PS / G parts per block instead of PULL_SPLIT), so at the start every program pulls and GEMM1 of step 0 waits for
a fraction of one block's pull; GEMM1 of those blocks waits for that many parts.

Determinism: every output element is computed by one tile in a fixed k order and every y row sums its k
slots in j order, so results are bitwise reproducible whatever program takes which item.

Backward (``BWD``, :func:`fused_backward`, dense buffers only): the same items and waits with the roles
mirrored: PULL brings w * dy rows (dy and the gates staged in the owners' ``tok`` / ``w`` regions) into g_out,
GEMM1'(b, j) computes dact = g_out @ w2[e] (w2 read as [H, I]) and the SwiGLU backward from the forward's h
into dh [rows, 2I], GEMM2'(b, j) computes d_recv = dh @ w13[e] (w13 read as [2I, H]) and pushes each row
into its owner's slot (or, PULL_COMBINE, keeps it), and every rank sums its tokens' k rows without gates: dx.
g_out and dh stay for the weight gradients (split's deterministic wgrad kernels run after). Bitwise equal to
split's backward on CPU ranks; timed on 2x H200 (slower than split's backward kernels, see backends/fused.py).

Visibility: generic-proxy stores (the pull, the SwiGLU epilogue) are released with a CTA barrier and a
release atomic; the consumer acquires the counter and issues ``fence.proxy.async`` before its TMA loads.

``FusedConfig.kernel = "gluon"`` (forward only): the same items, in the same order with the same waits, run in
kernels/gluon_fused.py (warp-specialised: a TMA loader warp and two consumer warpgroups), then the tail above (DONE,
the tokens' sums) runs as :func:`_fused_tail_kernel`. The outputs are bitwise this kernel's (one H200, 2026-12-02).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.comm.combine import stage_grad
from megamoe.comm.dispatch import (
    DispatchHandle,
    fp8_row_layout,
    fp8_row_views,
    fp8_rows_fit,
    pack_fp8_rows,
    stage_and_schedule,
)
from megamoe.comm.signals import (
    ARRIVE_WORK,
    DONE,
    OP_FUSED,
    READY,
    REG_ROWS,
    arrive_last,
    current_call,
    error_set,
    now_ns,
    publish,
    wait_flags,
)
from megamoe.kernels.fp8_quant import _scale_of, _to_e4m3
from megamoe.kernels.fused_parts import (
    _locate,
    _pull_block,
    _pull_block_pf,
    _push_epilogue,
    _push_rows,
    fence_proxy_async,
    signal_counter,
    wait_counter,
)
from megamoe.kernels.gemm_config import interpreting, num_sms, record, tma_ok
from megamoe.kernels.gluon_fused import gluon_fused_reason, launch_gluon_fused
from megamoe.kernels.grouped_gemm import _epilogue, _expert_tiles, _load_a, _load_b


@triton.jit
def _fp8_gemm1_half(x_desc, xq_ptr, xs_ptr, stride_xq, stride_xs, w13_desc, w13_ptr, ws1_ptr, h_ptr, e, base, nrows,
                    off_n, H, I, BM: tl.constexpr, BN: tl.constexpr, STORE_H: tl.constexpr, DOT_F32: tl.constexpr,
                    USE_TMA: tl.constexpr, UNI: tl.constexpr):
    """FP8 GEMM1 of one [BM, BN] column slice (gate columns off_n.., up columns I + off_n..): per 128 of K, acc +=
    (xq @ wq^T) * (x_scale[r] * w_scale[n]) (as the Triton FP8 grouped GEMM; UNI: I % 64 == 0, so each slice's
    columns share one weight scale per k-step and the promotion is one FMA per element); h = (g, u) stored in bf16
    (STORE_H); returns act = silu(g) * u rounded to bf16 (as the split layer's GEMM1 stores it), 0 at rows >= nrows
    and columns >= I."""
    kbh = tl.cdiv(H, 128)
    lm = tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    mm = lm < nrows
    sw = ws1_ptr + e.to(tl.int64) * (tl.cdiv(2 * I, 128) * kbh)
    sa_p = xs_ptr + (base + lm).to(tl.int64) * stride_xs
    g = tl.zeros((BM, BN), dtype=tl.float32)
    u = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(kbh):
        off_k = ki * 128
        a = _load_a(x_desc, xq_ptr, base, off_k, base + nrows, H, stride_xq, BM, 128, USE_TMA)
        bg = _load_b(w13_desc, w13_ptr, e, off_n, off_k, I, H, 2 * I * H, H, BN, 128, False, USE_TMA)
        bu = _load_b(w13_desc, w13_ptr, e, I + off_n, off_k, 2 * I, H, 2 * I * H, H, BN, 128, False, USE_TMA)
        sa = tl.load(sa_p + ki, mask=mm, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        if UNI:  # both halves inside one 128-row weight block: one scale per k-step, one FMA per element
            sg = tl.load(sw + (off_n // 128) * kbh + ki, mask=off_n < I, other=0.0)
            su = tl.load(sw + ((I + off_n) // 128) * kbh + ki, mask=off_n < I, other=0.0)
            g += tl.dot(a, bg) * (sa * sg)[:, None]
            u += tl.dot(a, bu) * (sa * su)[:, None]
        else:  # (I % 64 != 0: the up half can straddle two weight blocks) a scale per column
            sg = tl.load(sw + (rn // 128) * kbh + ki, mask=rn < I, other=0.0)
            su = tl.load(sw + ((I + rn) // 128) * kbh + ki, mask=rn < I, other=0.0)
            g += tl.dot(a, bg) * (sa[:, None] * sg[None, :])
            u += tl.dot(a, bu) * (sa[:, None] * su[None, :])
    return _swiglu_h(g, u, h_ptr, base, nrows, off_n, I, BM, BN, STORE_H)


@triton.jit
def _swiglu_h(g, u, h_ptr, base, nrows, off_n, I, BM: tl.constexpr, BN: tl.constexpr, STORE_H: tl.constexpr):
    """h = (g, u) in bf16 (STORE_H); returns act = silu(g) * u rounded to bf16, 0 at rows >= nrows, columns >= I."""
    lm = tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    mask = (lm < nrows)[:, None] & (rn < I)[None, :]
    if STORE_H:
        h_base = h_ptr + base.to(tl.int64) * (2 * I)
        h_offs = lm[:, None] * (2 * I) + rn[None, :]
        tl.store(h_base + h_offs, g.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(h_base + I + h_offs, u.to(h_ptr.dtype.element_ty), mask=mask)
    return tl.where(mask, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16), 0.0)


@triton.jit
def _act_quant_store(act0, act1, off_m, off_n, row_end, j, I, aq_ptr, as_ptr, BM: tl.constexpr, HALF: tl.constexpr,
                     RNE: tl.constexpr):
    """Quantise act's 1x128 block j (its two bf16 halves, 0 outside the block's rows and I) as quantize_act does:
    s[r] = amax / 448 over the 128 columns, aq = e4m3(act / s); store both (rows < row_end, columns < I)."""
    lm = tl.arange(0, BM)
    rm = off_m + lm
    mm = rm < row_end
    a0 = act0.to(tl.float32)
    a1 = act1.to(tl.float32)
    s = _scale_of(tl.maximum(tl.max(tl.abs(a0), axis=1), tl.max(tl.abs(a1), axis=1)), False)
    base = aq_ptr + off_m.to(tl.int64) * I
    _q_store(a0, s, base, lm, off_n, mm, I, HALF, RNE)
    _q_store(a1, s, base, lm, off_n + HALF, mm, I, HALF, RNE)
    tl.store(as_ptr + rm.to(tl.int64) * tl.cdiv(I, 128) + j, s, mask=mm)


@triton.jit
def _q_store(a, s, base, lm, off_n, mm, I, NP: tl.constexpr, RNE: tl.constexpr):
    rn = off_n + tl.arange(0, NP)
    q = _to_e4m3(tl.clamp(tl.div_rn(a, s[:, None]), -448.0, 448.0), RNE)
    tl.store(base + (lm[:, None] * I + rn[None, :]), q, mask=mm[:, None] & (rn < I)[None, :])


@triton.jit
def _done_wait(tab, W, rank, call, timeout_ns, P, WP2: tl.constexpr):
    """After this program's items: count it; the last of the P programs publishes DONE to every rank (unless a wait
    failed); then wait for every rank's DONE (every GEMM2 row of the call is final). True when all arrived."""
    last = arrive_last(tab, W, rank, ARRIVE_WORK, P)
    if last:
        if error_set(tab, W, rank) == 0:
            publish(tab, W, rank, DONE, call, WP2)
    return wait_flags(tab, W, rank, DONE, 0, W, call, OP_FUSED, timeout_ns, WP2)


@triton.jit
def _sum_tokens(tab, W, pid, P, gate_ptr, y_ptr, save_ptr, slots_ptr, dest_rank_ptr, dest_row_ptr, T, H,
                K: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_HC: tl.constexpr, SAVE: tl.constexpr,
                ALIGNED: tl.constexpr, BWD: tl.constexpr, PULL_COMBINE: tl.constexpr):
    """y[t] = sum_j topk_w[t, j] * out_j(t) in j order, fp32 (BWD: without the gates), for this program's tokens;
    out_j(t) from the local slots (push) or pulled from its expert rank's ``rows`` (PULL_COMBINE); SAVE copies
    the rows out."""
    DT = y_ptr.dtype.element_ty
    for t0 in range(pid * ROWS_C, T, P * ROWS_C):
        t = t0 + tl.arange(0, ROWS_C)
        mt = t < T
        for h0 in range(0, H, BLOCK_HC):
            oh = h0 + tl.arange(0, BLOCK_HC)
            m2 = mt[:, None] & (oh < H)[None, :]
            acc = tl.zeros((ROWS_C, BLOCK_HC), dtype=tl.float32)
            for jk in tl.static_range(K):
                o2 = (t.to(tl.int64) * K + jk)[:, None] * H + oh[None, :]
                if PULL_COMBINE:  # the row of slot (t, jk) on its expert rank, over NVLink
                    drank = tl.load(dest_rank_ptr + t * K + jk, mask=mt, other=0)
                    drow = tl.load(dest_row_ptr + t * K + jk, mask=mt, other=0)
                    src = tl.load(tab + REG_ROWS * W + drank, mask=mt, other=0).to(tl.pointer_type(DT))
                    rp = src + drow.to(tl.int64) * H
                    if ALIGNED:
                        rp = tl.multiple_of(rp, 16)
                    v = tl.load(rp[:, None] + oh[None, :], mask=m2, other=0.0)
                else:
                    v = tl.load(slots_ptr + o2, mask=m2, other=0.0)
                if SAVE:
                    tl.store(save_ptr + o2, v, mask=m2)
                if BWD:  # dx[t] = sum_j d_recv rows (unweighted)
                    acc += v.to(tl.float32)
                else:
                    wj = tl.load(gate_ptr + t * K + jk, mask=mt, other=0.0)
                    acc += wj[:, None] * v.to(tl.float32)
            tl.store(y_ptr + t.to(tl.int64)[:, None] * H + oh[None, :], acc.to(DT), mask=m2)


@triton.jit(do_not_specialize=["W", "T", "rank"])
def _fused_tail_kernel(tab, W, rank, gate_ptr, y_ptr, save_ptr, slots_ptr, dest_rank_ptr, dest_row_ptr, T, H,
                       timeout_ns, K: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_HC: tl.constexpr, SAVE: tl.constexpr,
                       ALIGNED: tl.constexpr, PULL_COMBINE: tl.constexpr, WP2: tl.constexpr):
    """The forward megakernel's tail alone (DONE, then the tokens' sums), launched after the items of
    kernels/gluon_fused.py (FusedConfig.kernel "gluon"); grid (P,)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    ok = _done_wait(tab, W, rank, call, timeout_ns, P, WP2)
    if ok:
        _sum_tokens(tab, W, pid, P, gate_ptr, y_ptr, save_ptr, slots_ptr, dest_rank_ptr, dest_row_ptr, T, H, K, ROWS_C,
                    BLOCK_HC, SAVE, ALIGNED, False, PULL_COMBINE)


# W, E_l, T: an int argument equal to 1 would be specialised to a constexpr, a different compile with no gain
# that spilled (48 B/thread at W = 1, 4 B at E_l = 1; megamoe/sm90.py); for the same reason the launcher passes
# WP2 >= 2 (the peer loops mask lanes >= W). rank: so that every rank compiles the same kernel (1 was a constexpr,
# 0 a multiple of 16: a compile per rank; 2026-12-03)
@triton.jit(do_not_specialize=["W", "E_l", "T", "rank"])
def _fused_fwd_kernel(
    tab, W, rank,
    x_desc, x_ptr,          # xbuf [NROWS, H] bf16 (ring: NS * BM rows; dense: R_cap rows)
    w13_desc, w13_ptr,      # w13 [E_l, 2I, H] bf16
    act_desc, act_ptr,      # act [NROWS, I] bf16
    w2_desc, w2_ptr,        # w2 [E_l, H, I] bf16
    h_ptr,                  # h [NROWS, 2I] bf16 (STORE_H)
    xq_ptr, xs_ptr,         # FP8: e4m3 rows [NROWS, H] and their 1x128 scales fp32 [NROWS, cdiv(H, 128)], row-strided
                            # views (stride_xq bytes, stride_xs floats) of xbuf's packed rows (HP 16-bit words each)
    ws1_ptr, acs_ptr, ws2_ptr,  # FP8: w13's 128x128 block scales, act's 1x128 scales [NROWS, cdiv(I, 128)], w2's
    offs_ptr,               # int32 [E_l + 1] (schedule)
    row_src_ptr, row_tok_ptr, row_slot_ptr,  # int32 [R_cap] (schedule): (source rank, token, slot) per row
    dest_rank_ptr, dest_row_ptr,  # int32 [T_max, K] (schedule): expert rank and receive row of own (t, j)
    gate_ptr,               # fp32 [T, K] this rank's gates
    y_ptr,                  # [T, H] out
    save_ptr,               # [T, K, H] out (SAVE): un-gated expert outputs of this rank's slots
    rows_ptr, slots_ptr,    # this rank's own symmetric ``rows`` [R_cap, H] and ``slots`` [T_max, K, H] regions,
                            # passed as arguments (not read from the table) so the compiler sees their 16-byte
                            # alignment and stores/loads them 16 bytes at a time
    ctr_ptr,                # int64 [1 + 3 * NB_MAX] zeroed: queue, ready[NB_MAX], g1[NB_MAX], g2[NB_MAX]
    tl_ptr,                 # int64 [items, 8] (TIMELINE): per item pid, kind, block, then %globaltimer stamps
    tlp_ptr,                # int64 [P, 8] (TIMELINE): per program entry, READY seen, items done, DONE seen, end
    T, H, I, K2, E_l, NB_MAX, NS, L1, L2, timeout_ns, HP, stride_xq, stride_xs,
    K: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
    BLOCK_E: tl.constexpr, EPI_SPLIT1: tl.constexpr, EPI_SPLIT2: tl.constexpr,
    GB: tl.constexpr, ABLATE: tl.constexpr, PULL_SPLIT: tl.constexpr, ROWS_P: tl.constexpr,
    BLOCK_H: tl.constexpr, ROWS_C: tl.constexpr, BLOCK_HC: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, STORE_H: tl.constexpr, SAVE: tl.constexpr,
    ALIGNED: tl.constexpr, WP2: tl.constexpr, BWD: tl.constexpr, PULL_COMBINE: tl.constexpr,
    TIMELINE: tl.constexpr, ACQ_GPU: tl.constexpr, PROLOGUE: tl.constexpr, PULL_PF: tl.constexpr,
    FP8: tl.constexpr, RNE: tl.constexpr, W_UNI: tl.constexpr,
):
    """grid (P,): see the module docstring. BWD: the backward pass through the same item structure (x -> g_out
    pulled with gates, act -> dh, w13 -> w2 and w2 -> w13 read transposed, y -> dx summed without gates)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    if TIMELINE:
        t_entry = now_ns()
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP_FUSED, timeout_ns, WP2)
    if TIMELINE:
        t_ready = now_ns()
    DT = y_ptr.dtype.element_ty
    e_idx, starts, cnts, nblk, cum, nb = _expert_tiles(offs_ptr, E_l, 1, BM, 1, BLOCK_E)  # BM-row blocks
    T1 = tl.cdiv(I, BN1)
    T2 = tl.cdiv(H, BN2)
    PS = GB * (PULL_SPLIT + T1 + T2)
    n_steps = tl.where(nb > 0, tl.cdiv(nb, GB) + L1 + L2, 0)
    ready = ctr_ptr + 1
    g1 = ready + NB_MAX
    g2 = g1 + NB_MAX
    go = ok
    while go:
        if TIMELINE:
            t_claim = now_ns()
        item = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
        s = (item // PS).to(tl.int32)
        sub = (item % PS).to(tl.int32)
        go = s < n_steps
        if go:
            if TIMELINE:
                t_got = now_ns()
                t_wait = t_got   # stamps: wait (+ fence) done, k-loop (pull: copy) done
                t_loop = t_got
                kind = tl.full((), 3, tl.int32)  # 0 PULL, 1 GEMM1, 2 GEMM2, 3 no block (warm-up / drain steps)
                b_tl = tl.full((), -1, tl.int32)
            if PROLOGUE:  # steps s < L1 have no GEMM items: every item of theirs is a pull part (PS / GB per block)
                pro = s < L1
                is_pull = (sub < GB * PULL_SPLIT) | pro
                b = tl.where(pro, s * GB + sub % GB, s * GB + sub // PULL_SPLIT)
                part_i = tl.where(pro, sub // GB, sub % PULL_SPLIT)
                nparts = tl.where(pro, PS // GB, PULL_SPLIT)
            else:
                is_pull = sub < GB * PULL_SPLIT
                b = s * GB + sub // PULL_SPLIT
                part_i = sub % PULL_SPLIT
                nparts = PULL_SPLIT
            if is_pull:  # PULL(b, part) for the GB blocks of step s
                if b < nb:
                    if TIMELINE:
                        kind = tl.full((), 0, tl.int32)
                        b_tl = b
                    e, row0, nrows, base = _locate(b, e_idx, starts, cnts, nblk, cum, NS, BM)
                    free = b >= 0
                    if NS > 0:
                        if b >= NS:  # the slot's previous block has been read by all its GEMM1 tiles
                            free = wait_counter(g1 + b - NS, T1, tab, W, rank, call, timeout_ns, ACQ_GPU)
                    if TIMELINE:
                        t_wait = now_ns()
                    if free & ((ABLATE & 1) == 0):
                        part = (BM + nparts - 1) // nparts
                        if PULL_PF:
                            _pull_block_pf(tab, W, row0, nrows, base, part_i * part, part_i * part + part,
                                           row_src_ptr, row_tok_ptr, row_slot_ptr, x_ptr, H, HP, K, BM, ROWS_P, BLOCK_H,
                                           ALIGNED, BWD)
                        else:
                            _pull_block(tab, W, row0, nrows, base, part_i * part, part_i * part + part,
                                        row_src_ptr, row_tok_ptr, row_slot_ptr, x_ptr, H, HP, K, ROWS_P, BLOCK_H,
                                        ALIGNED, BWD)
                    if TIMELINE:
                        t_loop = now_ns()
                    signal_counter(ready + b)
                    go = free
            elif sub < GB * (PULL_SPLIT + T1):  # GEMM1(b, j) for the blocks of step s - L1, j-major
                q = sub - GB * PULL_SPLIT
                b = (s - L1) * GB + q % GB
                j = q // GB
                if (b >= 0) & (b < nb):
                    if TIMELINE:
                        kind = tl.full((), 1, tl.int32)
                        b_tl = b
                    e, row0, nrows, base = _locate(b, e_idx, starts, cnts, nblk, cum, NS, BM)
                    if PROLOGUE:  # the first L1 steps' blocks were pulled in PS / GB parts
                        fine = wait_counter(ready + b, tl.where(b < L1 * GB, PS // GB, PULL_SPLIT), tab, W, rank,
                                            call, timeout_ns, ACQ_GPU)
                    else:
                        fine = wait_counter(ready + b, PULL_SPLIT, tab, W, rank, call, timeout_ns, ACQ_GPU)
                    if NS > 0:
                        if b >= NS:  # act slot: GEMM2 of the slot's previous block is done
                            fine = fine & wait_counter(g2 + b - NS, T2, tab, W, rank, call, timeout_ns, ACQ_GPU)
                    if fine:
                        fence_proxy_async()
                        if TIMELINE:
                            t_wait = now_ns()
                        off_n = j * BN1
                        acc = tl.zeros((BM, BN1), dtype=tl.float32)
                        if BWD:  # dact = g_out @ w2[e] (w2 [E_l, H, I] read as [K = H, N = I]); dh via SwiGLU'
                            for ki in range(tl.cdiv(H, BK)):
                                off_k = ki * BK
                                a = _load_a(x_desc, x_ptr, base, off_k, base + nrows, H, H, BM, BK, USE_TMA)
                                bw = _load_b(w13_desc, w13_ptr, e, off_n, off_k, I, H, H * I, I, BN1, BK, True,
                                             USE_TMA)
                                if DOT_F32:
                                    a = a.to(tl.float32)
                                    bw = bw.to(tl.float32)
                                acc = tl.dot(a, bw, acc)
                            if TIMELINE:
                                t_loop = now_ns()
                            _epilogue(acc, acc, base, off_n, base + nrows, j, 0, I, act_ptr, 2 * I, h_ptr, 2 * I,
                                      gate_ptr, gate_ptr, gate_ptr, BM, BN1, 2, False, False,
                                      EPI_SPLIT1)
                        elif FP8:  # e4m3 x rows @ e4m3 w13 gate / up, promoted per 128 of K with both scales, in
                            # two 64-column halves (a 128-column pair of fp32 tiles plus the scaled products spilled
                            # 1.1 KB per thread); act's 1x128 block = the two halves, quantised together
                            HALF: tl.constexpr = BN1 // 2
                            act0 = _fp8_gemm1_half(x_desc, xq_ptr, xs_ptr, stride_xq, stride_xs, w13_desc, w13_ptr,
                                                   ws1_ptr, h_ptr, e, base, nrows, off_n, H, I, BM, HALF, STORE_H,
                                                   DOT_F32, USE_TMA, W_UNI)
                            act1 = _fp8_gemm1_half(x_desc, xq_ptr, xs_ptr, stride_xq, stride_xs, w13_desc, w13_ptr,
                                                   ws1_ptr, h_ptr, e, base, nrows, off_n + HALF, H, I, BM, HALF,
                                                   STORE_H, DOT_F32, USE_TMA, W_UNI)
                            if TIMELINE:
                                t_loop = now_ns()
                            _act_quant_store(act0, act1, base, off_n, base + nrows, j, I, act_ptr, acs_ptr, BM, HALF,
                                             RNE)
                        else:
                            acc2 = tl.zeros((BM, BN1), dtype=tl.float32)
                            for ki in range(tl.cdiv(H, BK)):
                                off_k = ki * BK
                                a = _load_a(x_desc, x_ptr, base, off_k, base + nrows, H, H, BM, BK, USE_TMA)
                                bg = _load_b(w13_desc, w13_ptr, e, off_n, off_k, I, H, 2 * I * H, H, BN1, BK, False,
                                             USE_TMA)
                                bu = _load_b(w13_desc, w13_ptr, e, I + off_n, off_k, 2 * I, H, 2 * I * H, H, BN1,
                                             BK, False, USE_TMA)
                                if DOT_F32:
                                    a = a.to(tl.float32)
                                    bg = bg.to(tl.float32)
                                    bu = bu.to(tl.float32)
                                acc = tl.dot(a, bg, acc)
                                acc2 = tl.dot(a, bu, acc2)
                            if TIMELINE:
                                t_loop = now_ns()
                            _epilogue(acc, acc2, base, off_n, base + nrows, j, 0, I, act_ptr, I, h_ptr, 2 * I,
                                      gate_ptr, gate_ptr, gate_ptr, BM, BN1, 1, False, STORE_H, EPI_SPLIT1)
                    signal_counter(g1 + b)
                    go = fine
            else:  # GEMM2(b, j) for the blocks of step s - L1 - L2, j-major
                q = sub - GB * (PULL_SPLIT + T1)
                b = (s - L1 - L2) * GB + q % GB
                j = q // GB
                if (b >= 0) & (b < nb):
                    if TIMELINE:
                        kind = tl.full((), 2, tl.int32)
                        b_tl = b
                    e, row0, nrows, base = _locate(b, e_idx, starts, cnts, nblk, cum, NS, BM)
                    fine = wait_counter(g1 + b, T1, tab, W, rank, call, timeout_ns, ACQ_GPU)
                    if fine:
                        fence_proxy_async()
                        if TIMELINE:
                            t_wait = now_ns()
                        if not PULL_COMBINE:  # the rows' owner addresses, loaded under the k-loop
                            rp, rvalid = _push_rows(row0, nrows, tab, W, row_src_ptr, row_tok_ptr, row_slot_ptr, H,
                                                    K, BM, DT, ALIGNED)
                        off_n = j * BN2
                        acc = tl.zeros((BM, BN2), dtype=tl.float32)
                        if FP8:  # e4m3 act (quantised by GEMM1's epilogue) @ e4m3 w2 tiles, promoted per 128 of K
                            # (the tile's BN2 <= 128 columns lie in one 128-row block of w2: one weight scale per
                            # k-step, the promotion one FMA per element)
                            kbi = tl.cdiv(I, 128)
                            sa_p = acs_ptr + (base + tl.arange(0, BM)).to(tl.int64) * kbi
                            sw_p = ws2_ptr + e.to(tl.int64) * (tl.cdiv(H, 128) * kbi) + (off_n // 128) * kbi
                            mm = tl.arange(0, BM) < nrows
                            for ki in range(kbi if (ABLATE & 4) == 0 else 0):  # ablate bit 4: no k-loop
                                off_k = ki * 128
                                a = _load_a(act_desc, act_ptr, base, off_k, base + nrows, I, I, BM, 128, USE_TMA)
                                bw = _load_b(w2_desc, w2_ptr, e, off_n, off_k, H, I, H * I, I, BN2, 128, False, USE_TMA)
                                sa = tl.load(sa_p + ki, mask=mm, other=0.0)
                                sb = tl.load(sw_p + ki)
                                if DOT_F32:
                                    a = a.to(tl.float32)
                                    bw = bw.to(tl.float32)
                                acc += tl.dot(a, bw) * (sa * sb)[:, None]
                        elif (ABLATE & 4) == 0:
                            for ki in range(tl.cdiv(K2, BK)):  # K2 = I (act @ w2^T) or 2I (BWD: dh @ w13)
                                off_k = ki * BK
                                a = _load_a(act_desc, act_ptr, base, off_k, base + nrows, K2, K2, BM, BK, USE_TMA)
                                bw = _load_b(w2_desc, w2_ptr, e, off_n, off_k, H, K2, H * K2, H if BWD else K2, BN2,
                                             BK, BWD, USE_TMA)
                                if DOT_F32:
                                    a = a.to(tl.float32)
                                    bw = bw.to(tl.float32)
                                acc = tl.dot(a, bw, acc)
                        if TIMELINE:
                            t_loop = now_ns()
                        # ablate bit 2 skips the store at run time (never < 0): a compile-time skip let the
                        # compiler delete GEMM2 itself as dead code, which an earlier ablation mistook for the store
                        if ((ABLATE & 2) == 0) | (timeout_ns < 0):  # timeout_ns: never specialised to 1
                            if PULL_COMBINE:  # keep the rows here, at their receive rows; owners pull them later
                                _epilogue(acc, acc, row0, off_n, row0 + nrows, j, 0, H, rows_ptr, H, rows_ptr, H,
                                          gate_ptr, gate_ptr, gate_ptr, BM, BN2, 0, False, False, EPI_SPLIT2)
                            else:
                                _push_epilogue(acc, off_n, rp, rvalid, H, BM, BN2, DT, EPI_SPLIT2)
                    signal_counter(g2 + b)
                    go = fine
            if TIMELINE:
                t_end = now_ns()
                rec = tl_ptr + item * 8
                tl.store(rec, pid.to(tl.int64))
                tl.store(rec + 1, kind.to(tl.int64))
                tl.store(rec + 2, b_tl.to(tl.int64))
                tl.store(rec + 3, t_claim)
                tl.store(rec + 4, t_got)
                tl.store(rec + 5, t_wait)
                tl.store(rec + 6, t_loop)
                tl.store(rec + 7, t_end)
    # every push of this rank has been issued: the last program tells every rank
    if TIMELINE:
        t_items = now_ns()
    ok = _done_wait(tab, W, rank, call, timeout_ns, P, WP2)
    if TIMELINE:
        t_done = now_ns()
    if ok:
        _sum_tokens(tab, W, pid, P, gate_ptr, y_ptr, save_ptr, slots_ptr, dest_rank_ptr, dest_row_ptr, T, H, K, ROWS_C,
                    BLOCK_HC, SAVE, ALIGNED, BWD, PULL_COMBINE)
    if TIMELINE:
        t_fin = now_ns()
        prec = tlp_ptr + pid * 8
        tl.store(prec, t_entry)
        tl.store(prec + 1, t_ready)
        tl.store(prec + 2, t_items)
        tl.store(prec + 3, t_done)
        tl.store(prec + 4, t_fin)


@triton.jit
def _dgate_kernel(dy_ptr, save_ptr, dw_ptr, T, H, K: tl.constexpr, KP2: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """grid (cdiv(T, ROWS),): dw[t, j] = sum_h dy[t, h] * save[t, j, h] (fp32, fixed order)."""
    pid = tl.program_id(0)
    t = pid * ROWS + tl.arange(0, ROWS)
    mt = t < T
    jj = tl.arange(0, KP2)
    acc = tl.zeros((ROWS, KP2), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        oh = h0 + tl.arange(0, BLOCK_H)
        m2 = mt[:, None] & (oh < H)[None, :]
        d = tl.load(dy_ptr + t.to(tl.int64)[:, None] * H + oh[None, :], mask=m2, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            o = save_ptr + (t.to(tl.int64) * K + j)[:, None] * H + oh[None, :]
            v = tl.load(o, mask=m2, other=0.0).to(tl.float32)
            acc += tl.where(jj[None, :] == j, tl.sum(d * v, axis=1)[:, None], 0.0)
    tl.store(dw_ptr + (t * K)[:, None] + jj[None, :], acc, mask=mt[:, None] & (jj < K)[None, :])


# ------------------------------------------------------------------------------------------------ launcher
@dataclass(frozen=True)
class FusedConfig:
    """Launch config of :func:`_fused_fwd_kernel` (see the module docstring for L1 / L2 and the ring).

    block_m: rows of a block (BM); bn1: GEMM1 columns per tile (gate and up each); bn2: GEMM2 columns per
    tile; programs: persistent programs (None: the device's SM count; 1 under the interpreter);
    lookahead: L1 in steps (None: dense buffers max(programs in flight / items per step + 1, 8), a ring the
    same capped by the ring); lag: L2 in steps (None: 3 with dense buffers, 1 with a ring). The dense defaults
    are from per-item timelines on 2x H200 (2026-12-01, docs/perf-notes.md): at L1 = 3, L2 = 1 qwen3's GEMM
    items waited on pulls (NVLink row gathers, ~40-50 us per 128-row block) and on their blocks' GEMM1 tiles.
    """

    block_m: int = 128
    bn1: int = 128
    bn2: int = 256
    block_k: int = 64
    num_stages: int = 4     # 3 until 2026-11-30: 4 (as split's GEMM1) took deepseek's kernel 6.91 -> 6.53 ms (2x H200)
    num_warps: int = 8
    epi_split1: int = 2
    epi_split2: int = 4
    programs: int | None = None
    lookahead: int | None = None
    lag: int | None = None
    pull_elems: int = 16384  # ROWS_P x BLOCK_H of one pull step
    pull_split: int = 1      # pull items per block (each moves block rows / pull_split rows)
    group: int = 8           # blocks per step; GEMM items of a step go j-major over them, so the tiles that read one
                             # weight tile run at the same time (L2 reuse, like split's GROUP_M swizzle)
    combine: str = "push"    # "push" (measured faster): GEMM2 stores rows into the owners' ``slots`` region;
                             # "pull" (no slot buffer): rows stay in this rank's ``rows`` region and owners pull
                             # their k rows after DONE (split's gather, in-kernel)
    ablate: int = 0          # diagnostics only, results are WRONG: bit 1 skips the pull copy, 2 GEMM2's store (local
                             # rows or the push; GEMM2 still runs), 4 GEMM2's k-loop
    use_tma: bool | None = None
    counter_scope: str = "sys"  # scope of the tile-counter acquire loads: "sys" (ld.acquire.sys, as the cross-rank
                                # flags) or "gpu" (enough: only this GPU's programs write them)
    pull_prefetch: bool = False  # pull items load every row's source address up front (_pull_block_pf), so the
                                 # chunk loop waits only for NVLink reads (not timed yet: the timeline had one
                                 # 128-row pull at 38-52 us on qwen3, 122 us on deepseek, ~2-3 us per chunk)
    prologue: bool = False   # the first L1 steps (which have no GEMM items) pull their blocks in (items per step /
                             # G) parts, so every program helps and GEMM1 starts after a fraction of a pull (not timed
                             # yet: the 2026-12-01 timeline showed deepseek's programs waiting ~100 us at the start)
    kernel: str = "triton"   # "gluon": the forward's items in kernels/gluon_fused.py (warp-specialised: a TMA loader
                             # warp, two consumer warpgroups, TMA-store epilogue; Hopper; bf16 and FP8), then
                             # _fused_tail_kernel; the backward megakernel stays on this kernel
    timeline: bool = False   # diagnostics: every item's program, kind, block and %globaltimer stamps (claim, claimed,
                             # wait done, loop done, end) into LAST_TIMELINE (benchmarks/fused_probe.py --timeline)

    def with_(self, **kw) -> FusedConfig:
        return replace(self, **kw)


#: the last launch's item records when FusedConfig.timeline: {"items": int64 [n, 8] (pid, kind 0 PULL / 1 GEMM1 /
#: 2 GEMM2 / 3 no block, block, then ns stamps: before the claim, claimed, wait done, loop done, end; rows of items
#: never taken stay 0), "per_program": int64 [P, 8] (ns stamps: entry, READY of every rank seen, items done, DONE of
#: every rank seen, end), "programs": P, "group": G, "lookahead": L1, "lag": L2, "bwd": bool}
LAST_TIMELINE: dict = {}


def default_fused_config(device: torch.device, fp8: bool = False) -> FusedConfig:
    """The launch config of a layer; ``fp8``: the FP8 forward's (GEMM1 tiles of 128 columns, act's scale blocks)."""
    if interpreting():  # lookahead 2 / lag 1: the GPU defaults (8 / 3) triple the empty items the interpreter walks
        # (tests/test_fused_backend.py runs one case with them)
        return FusedConfig(block_m=32, bn1=128 if fp8 else 32, bn2=32, block_k=32, num_stages=1, num_warps=4,
                           epi_split1=1, epi_split2=1, programs=1, pull_elems=4096, lookahead=2, lag=1)
    if fp8:  # GEMM2 on 128 columns: a 256-column fp32 tile plus its scaled per-k products do not fit the registers
        return FusedConfig(bn2=128)
    return FusedConfig()


@dataclass
class FusedState:
    """What one fused forward leaves for the backward (see megamoe/backends/fused.py)."""

    handle: DispatchHandle
    xbuf: torch.Tensor           # [NROWS, H] received rows (dense: receive-row layout); FP8: packed rows [NROWS, HP]
    act: torch.Tensor            # [NROWS, I] (FP8: e4m3)
    h: torch.Tensor | None       # [NROWS, 2I] (dense + store_h)
    saved: torch.Tensor | None   # [T, k, H] un-gated expert outputs of this rank's slots (save)
    xq: tuple | None = None      # FP8: (e4m3 rows [NROWS, H], their scales [NROWS, cdiv(H, 128)]), views of xbuf


def plan_lag(cfg: FusedConfig, ring_blocks: int) -> int:
    """L2 (GEMM1 -> GEMM2 distance in steps) of a launch: the config's, else 3 dense / 1 with a ring."""
    return cfg.lag if cfg.lag is not None else (1 if ring_blocks else 3)


def _plan(cfg: FusedConfig, device: torch.device, H: int, I: int, ring_blocks: int) -> tuple[int, int, int, int]:
    """(programs, blocks per step G, lookahead L1, lag L2) for a launch; with a ring, G and L1 shrink so that
    every wait is on an earlier item (PULL(b) on GEMM1(b - NS), GEMM1(b) on GEMM2(b - NS): NS // G > L1 + L2)."""
    P = cfg.programs if cfg.programs is not None else num_sms(device)
    G, L2 = cfg.group, plan_lag(cfg, ring_blocks)
    steps_items = G * (cfg.pull_split + triton.cdiv(I, cfg.bn1) + triton.cdiv(H, cfg.bn2))
    L1 = cfg.lookahead if cfg.lookahead is not None else max(triton.cdiv(P, steps_items) + 1, 8)
    if ring_blocks:
        G = max(1, min(G, ring_blocks // (L2 + 3)))
        if ring_blocks < G * (L2 + 3):
            raise ValueError(f"ring of {ring_blocks} blocks is too small: needs >= lag + 3 = {L2 + 3} blocks")
        L1 = max(1, min(L1, ring_blocks // G - L2 - 2))
    return P, G, L1, L2


@dataclass
class Fp8Operands:
    """The FP8 forward's operands besides the launch's a / w1 / act / w2 (then: the packed rows [NROWS, HP] bf16
    words, q(w13), act's e4m3 buffer [NROWS, I], q(w2)): xq / xs the e4m3 rows and their scales (views of the
    packed rows), s13 / s2 the weights' 128x128 block scales, acs act's 1x128 scales [NROWS, cdiv(I, 128)]."""

    xq: torch.Tensor
    xs: torch.Tensor
    s13: torch.Tensor
    acs: torch.Tensor
    s2: torch.Tensor


def _launch(heap, cfg: FusedConfig, sched, P: int, *, a, w1, act, w2, h, gate, y, save, T: int, I: int, k2: int,
            nb_max: int, ring_blocks: int, group: int, lookahead: int, lag: int, bwd: bool,
            fp8: Fp8Operands | None = None) -> None:
    """Launch :func:`_fused_fwd_kernel` on P programs. Forward: a = received rows [NROWS, H], w1 = w13, act =
    act [NROWS, I], w2 = w2 (both weights read [N, K]). Backward (``bwd``): a = g_out, w1 = w2 and w2 = w13 read
    transposed ([K, N]), act = dh [NROWS, 2I], h read; k2 is GEMM2's reduction length (I, or 2I backward).
    FP8 forward (``fp8``): a = the packed rows the pull fills [NROWS, HP], w1 / w2 / act e4m3 (see Fp8Operands);
    every GEMM k-step is 128 wide (one scale pair), and GEMM1's tiles are 128 columns (one act scale block)."""
    sh = heap.shape
    H, k, E_l = sh.hidden, sh.topk, sh.local_experts
    BM, BK = cfg.block_m, cfg.block_k
    if BM % cfg.pull_split:
        raise ValueError(f"pull_split={cfg.pull_split} must divide the block's {BM} rows")
    if fp8 is not None and bwd:
        raise ValueError("the FP8 megakernel is forward only")
    if cfg.kernel not in ("triton", "gluon"):
        raise ValueError(f"FusedConfig.kernel must be 'triton' or 'gluon', got {cfg.kernel!r}")
    gluon_items = cfg.kernel == "gluon" and not bwd  # (the backward megakernel runs on this kernel with either)
    ka = 128 if fp8 is not None else BK  # k-step of the GEMMs (TMA boxes)
    a_gemm = fp8.xq if fp8 is not None else a  # GEMM1's A operand
    # (the Gluon items build their own descriptors)
    use_tma = not gluon_items and (cfg.use_tma if cfg.use_tma is not None else tma_ok([a_gemm, act, w1, w2]))
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(a_gemm, [BM, ka])
        act_desc = TensorDescriptor.from_tensor(act, [BM, ka])
        # (FP8: GEMM1 runs a tile as two halves of bn1 / 2 columns, see _fp8_gemm1_half)
        w1_desc = TensorDescriptor.from_tensor(w1, [1, ka, cfg.bn1] if bwd else
                                               [1, cfg.bn1 // 2 if fp8 is not None else cfg.bn1, ka])
        w2_desc = TensorDescriptor.from_tensor(w2, [1, ka, cfg.bn2] if bwd else [1, cfg.bn2, ka])
    else:
        a_desc = act_desc = w1_desc = w2_desc = None
    hp = a.shape[1]  # elements the pull moves per row (H; the packed FP8 rows: fewer)
    block_h = min(triton.next_power_of_2(hp), 2048)
    block_hc = min(triton.next_power_of_2(H), 1024)
    if cfg.counter_scope not in ("sys", "gpu"):
        raise ValueError(f"FusedConfig.counter_scope must be 'sys' or 'gpu', got {cfg.counter_scope!r}")
    ctr = torch.zeros(1 + 3 * nb_max, dtype=torch.int64, device=heap.device)
    if cfg.timeline:  # every item index the kernel can take: steps <= cdiv(nb_max, G) + L1 + lag
        per_step = group * (cfg.pull_split + triton.cdiv(I, cfg.bn1) + triton.cdiv(H, cfg.bn2))
        n_items = (triton.cdiv(nb_max, group) + lookahead + lag) * per_step
        tl_buf = torch.zeros(n_items, 8, dtype=torch.int64, device=heap.device)
        tlp_buf = torch.zeros(P, 8, dtype=torch.int64, device=heap.device)
        LAST_TIMELINE.clear()
        LAST_TIMELINE.update(items=tl_buf, per_program=tlp_buf, programs=P, group=group, lookahead=lookahead,
                             lag=lag, bwd=bwd)
    else:
        tl_buf = tlp_buf = ctr
    if gluon_items:  # the items in Gluon, then the tail (DONE, the tokens' sums) in Triton
        timeline = None
        if cfg.timeline:  # the same items / per-program records (consumer 0's view) and the loader's
            timeline = (tl_buf, tlp_buf, torch.zeros(tl_buf.shape[0], 4, dtype=torch.int64, device=heap.device))
            LAST_TIMELINE.update(kernel="gluon", loader=timeline[2])
        launch_gluon_fused(heap, cfg, sched, P, a=a, w1=w1, act=act, w2=w2, h=h, ctr=ctr, I=I, nb_max=nb_max,
                           ring_blocks=ring_blocks, group=group, lookahead=lookahead, lag=lag, timeline=timeline,
                           fp8=fp8)
        compiled = _fused_tail_kernel[(P,)](
            heap.tab, heap.world, heap.rank, gate, y if T > 0 else heap.rows_buffer(),
            save if save is not None else act, heap.buffer("slots") if sh.slots else heap.rows_buffer(),
            sched.dest_rank, sched.dest_row, T, H, heap.timeout_ns, K=k, ROWS_C=max(1, 4096 // block_hc),
            BLOCK_HC=block_hc, SAVE=save is not None, ALIGNED=(H * 2) % 16 == 0, PULL_COMBINE=cfg.combine == "pull",
            WP2=max(2, heap.wp2), num_warps=16)  # 4 warps: 0.122 ms on qwen3 EP 1 (one H200), 8: 0.052, 16: 0.049
        # (the sum reads k rows of H per token: 150 MB there, ~35 us at HBM speed; one program per SM)
        record("_fused_tail_kernel", compiled)
        heap.after_launch()
        return
    compiled = _fused_fwd_kernel[(P,)](
        heap.tab, heap.world, heap.rank,
        a_desc, a, w1_desc, w1, act_desc, act, w2_desc, w2, h if h is not None else act,
        *((fp8.xq, fp8.xs, fp8.s13, fp8.acs, fp8.s2) if fp8 is not None else (a, a, a, a, a)),
        sched.offs, sched.row_src, sched.row_tok, sched.row_slot, sched.dest_rank, sched.dest_row, gate,
        y if T > 0 else heap.rows_buffer(), save if save is not None else act,  # y's dtype: the pushed rows'
        heap.rows_buffer(), heap.buffer("slots") if sh.slots else heap.rows_buffer(), ctr, tl_buf, tlp_buf,
        T, H, I, k2, E_l, nb_max, ring_blocks, lookahead, lag, heap.timeout_ns, hp,
        fp8.xq.stride(0) if fp8 is not None else H, fp8.xs.stride(0) if fp8 is not None else 1,
        K=k, BM=BM, BN1=cfg.bn1, BN2=cfg.bn2, BK=BK, BLOCK_E=triton.next_power_of_2(max(E_l, 2)),
        EPI_SPLIT1=cfg.epi_split1, EPI_SPLIT2=cfg.epi_split2, GB=group, ABLATE=cfg.ablate,
        PULL_SPLIT=cfg.pull_split, ROWS_P=max(1, min(BM // cfg.pull_split, cfg.pull_elems // block_h)),
        BLOCK_H=block_h, ROWS_C=max(1, 4096 // block_hc), BLOCK_HC=block_hc, USE_TMA=use_tma,
        DOT_F32=interpreting(), STORE_H=h is not None and not bwd, SAVE=save is not None,
        ALIGNED=(H * 2) % 16 == 0 and (hp * 2) % 16 == 0, WP2=max(2, heap.wp2), BWD=bwd,
        PULL_COMBINE=cfg.combine == "pull",
        TIMELINE=cfg.timeline, ACQ_GPU=cfg.counter_scope == "gpu", PROLOGUE=cfg.prologue,
        PULL_PF=cfg.pull_prefetch, FP8=fp8 is not None, RNE=interpreting(), W_UNI=I % 64 == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    record("_fused_fwd_kernel", compiled)
    heap.after_launch()


def _check_combine(cfg: FusedConfig, shape) -> None:
    if cfg.combine not in ("push", "pull"):
        raise ValueError(f"FusedConfig.combine must be 'push' or 'pull', got {cfg.combine!r}")
    if cfg.combine == "push" and not shape.slots:
        raise ValueError("combine='push' needs a heap built with CommShape(slots=True) (the owners' slot buffers)")


def _check_fp8(cfg: FusedConfig, wq: tuple, E_l: int, H: int, I: int) -> None:
    """ValueError unless the config and the FP8 weights (q13, s13, _, _, q2, s2, ...) suit the FP8 megakernel."""
    if cfg.bn1 != 128 or 128 % cfg.bn2:
        raise ValueError(f"the FP8 megakernel needs 128-column GEMM1 tiles (act's 1x128 scale blocks) and GEMM2 tiles "
                         f"inside one 128-row weight block (bn2 dividing 128), got bn1={cfg.bn1}, bn2={cfg.bn2} "
                         f"(default_fused_config(device, fp8=True) gives a suitable config)")
    if not fp8_rows_fit(H):
        raise ValueError(f"the FP8 megakernel needs a packed FP8 row ({fp8_row_layout(H)[1]} bytes) to fit in a bf16 "
                         f"row of H = {H} elements")
    fp8, f32 = torch.float8_e4m3fn, torch.float32
    want = [(0, fp8, (E_l, 2 * I, H)), (1, f32, (E_l, triton.cdiv(2 * I, 128), triton.cdiv(H, 128))),
            (4, fp8, (E_l, H, I)), (5, f32, (E_l, triton.cdiv(H, 128), triton.cdiv(I, 128)))]
    for i, dtype, shape in want:
        t = wq[i]
        if t is None or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            got = None if t is None else (t.dtype, tuple(t.shape))
            raise ValueError(f"fused_forward: wq[{i}] must be a contiguous {dtype} {shape} (q13, s13, _, _, q2, s2, "
                             f"... as Fp8WeightCache.fp8_weights gives them), got {got}")


def fused_forward(heap, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, cfg: FusedConfig, ring_blocks: int = 0, store_h: bool = False,
                  save: bool = False, comm_programs: int | None = None,
                  wq: tuple | None = None) -> tuple[torch.Tensor, FusedState]:
    """y [T, H] = the MoE layer's expert part for this rank's tokens (gates applied), via the megakernel.

    ring_blocks: 0 = dense buffers (R_cap rows, split's layout); else the ring's slots (>= lag + 3 blocks).
    store_h: keep the SwiGLU input h (dense only, for the backward). save: keep the un-gated expert outputs of
    this rank's (token, slot) pairs [T, k, H] (for d(topk_w)).
    wq: FP8 (q13, s13, _, _, q2, s2, _, _ as Fp8WeightCache.fp8_weights gives them): x is quantised once per token
    on its home rank into packed rows (dispatch_fp8's layout, comm.dispatch.fp8_row_layout), the pull moves those,
    GEMM1 runs on them and the e4m3 w13, its epilogue quantises act (1x128 blocks), GEMM2 runs on that and the e4m3
    w2; the state's xbuf is then the packed rows and ``xq`` their (e4m3 rows, scales) views.
    """
    sh = heap.shape
    _check_combine(cfg, sh)
    T = x.shape[0]
    H, k, E_l = sh.hidden, sh.topk, sh.local_experts
    I = w2.shape[2]
    if tuple(w13.shape) != (E_l, 2 * I, H) or tuple(w2.shape) != (E_l, H, I):
        raise ValueError(f"w13 must be [E_l={E_l}, 2I, H={H}] and w2 [E_l, H, I]; got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError("fused_forward takes bf16 x, w13, w2 (FP8: their e4m3 copies in wq)")
    if tuple(topk_idx.shape) != (T, k) or tuple(topk_w.shape) != (T, k):
        raise ValueError(f"topk_idx and topk_w must be [T={T}, k={k}]")
    if wq is not None:  # everything checked before anything is staged (a staged call must be followed by a kernel)
        _check_fp8(cfg, wq, E_l, H, I)
    if cfg.kernel == "gluon":
        why = gluon_fused_reason(cfg, H=H, I=I, device=heap.device, fp8=wq is not None)
        if why is not None:
            raise ValueError(f"fused_forward (kernel='gluon'): {why}")
    BM = cfg.block_m
    dev = heap.device
    P, GB, L1, L2 = _plan(cfg, dev, H, I, ring_blocks)
    # 1. stage x and the routing, publish READY; 2. schedule (device-side, no host reads)
    Pc = max(1, int(comm_programs or heap.num_sms))
    nrows = ring_blocks * BM if ring_blocks else sh.rows_cap
    if wq is not None:  # x quantised once per token, packed rows [e4m3 H bytes | fp32 scales] staged and pulled
        x = pack_fp8_rows(x, x.dtype)
        xbuf = torch.empty(nrows, x.shape[1], dtype=x.dtype, device=dev)
        xq = fp8_row_views(xbuf, H)
        act = torch.empty(nrows, I, dtype=torch.float8_e4m3fn, device=dev)
        ops = Fp8Operands(xq=xq[0], xs=xq[1], s13=wq[1], acs=torch.empty(nrows, triton.cdiv(I, 128),
                                                                          dtype=torch.float32, device=dev), s2=wq[5])
        w13, w2 = wq[0], wq[4]
    else:
        xq = ops = None
        xbuf = torch.empty(nrows, H, dtype=x.dtype, device=dev)
        act = torch.empty(nrows, I, dtype=x.dtype, device=dev)
    sched = stage_and_schedule(heap, x, topk_idx, Pc)
    handle = DispatchHandle(heap=heap, num_tokens=T, schedule=sched, offs=sched.offs, num_sms=Pc)
    # 3. the megakernel
    nb_max = triton.cdiv(sh.rows_cap, BM) + E_l + GB
    h = torch.empty(nrows, 2 * I, dtype=torch.bfloat16, device=dev) if (store_h and not ring_blocks) else None
    y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    saved = torch.empty(T, k, H, dtype=torch.bfloat16, device=dev) if save else None
    gate = topk_w.to(torch.float32).contiguous()
    _launch(heap, cfg, sched, P, a=xbuf, w1=w13, act=act, w2=w2, h=h, gate=gate, y=y, save=saved, T=T, I=I,
            k2=I, nb_max=nb_max, ring_blocks=ring_blocks, group=GB, lookahead=L1, lag=L2, bwd=False, fp8=ops)
    return y, FusedState(handle=handle, xbuf=xbuf, act=act, h=h, saved=saved, xq=xq)


def dgate(dy: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """d(topk_w) [T, k] fp32 = <dy[t], saved[t, j]> (fixed order, fp32)."""
    T, k, H = saved.shape
    out = torch.empty(T, k, dtype=torch.float32, device=dy.device)
    if T == 0:
        return out
    rows = 16
    _dgate_kernel[(triton.cdiv(T, rows),)](dy.contiguous(), saved, out, T, H, K=k, KP2=triton.next_power_of_2(k),
                                           ROWS=rows, BLOCK_H=min(triton.next_power_of_2(H), 128))  # 512 spilled 456 B
    return out


def fused_backward(heap, dy: torch.Tensor, topk_w: torch.Tensor, state: FusedState, w13: torch.Tensor,
                   w2: torch.Tensor, cfg: FusedConfig, comm_programs: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward megakernel (dense buffers only): returns (dx [T, H], g_out [R_cap, H], dh [R_cap, 2I]).

    Same item structure as the forward (``BWD``): PULL(b) brings w * dy rows to the expert rank (dy and the
    gates staged in the owners' ``tok`` / ``w`` regions), GEMM1'(b, j) dact = g_out @ w2[e] with the SwiGLU
    backward epilogue reading h -> dh, GEMM2'(b, j) d_recv = dh @ w13[e] kept local (pull) or pushed into the
    owners' slots (push), and every rank sums its tokens' k rows: dx. g_out and dh stay for the weight
    gradients (split's wgrad kernels).
    """
    sh = heap.shape
    _check_combine(cfg, sh)
    if state.h is None:
        raise ValueError("fused_backward needs the forward's h (dense buffers, store_h=True)")
    T = dy.shape[0]
    H, E_l = sh.hidden, sh.local_experts
    I = w2.shape[2]
    sched = state.handle.schedule
    BM = cfg.block_m
    dev = heap.device
    P, GB, L1, L2 = _plan(cfg, dev, H, I, 0)
    stage_grad(heap, dy, topk_w, max(1, int(comm_programs or heap.num_sms)))
    nrows = sh.rows_cap
    nb_max = triton.cdiv(nrows, BM) + E_l + GB
    g_out = torch.empty(nrows, H, dtype=dy.dtype, device=dev)
    dh = torch.empty(nrows, 2 * I, dtype=dy.dtype, device=dev)
    dx = torch.empty(T, H, dtype=dy.dtype, device=dev)
    _launch(heap, cfg, sched, P, a=g_out, w1=w2, act=dh, w2=w13, h=state.h, gate=topk_w, y=dx, save=None, T=T,
            I=I, k2=2 * I, nb_max=nb_max, ring_blocks=0, group=GB, lookahead=L1, lag=L2, bwd=True)
    return dx, g_out, dh
