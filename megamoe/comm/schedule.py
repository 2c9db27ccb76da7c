"""Device-side schedule: where every routed (source rank, token, k-slot) lands, computed without the host.

Shape legend: W world size, T_s tokens on rank s (<= T_max, may be 0), k top-k, E experts, E_l = E / W local experts
(expert e on rank e // E_l), CH tokens per chunk, NCH = ceil(T_max / CH) chunks, R rows this rank receives (<= R_cap).

Global order: expert e's rows are the entries (s, t, j) with topk_idx_s[t, j] == e, ordered by
(source rank s, token t, slot j); an expert rank stores its experts' segments one after another. Every rank
computes the same counts from all W routing tables (the peers' ``idx`` regions). Row of entry (s, t, j) with expert
e on rank q = e // E_l:

    row = segoff[e]                       # rows of q's experts before e (all sources)
        + sum_{s' < s} tot[s', e]         # rows of e from earlier source ranks
        + pref[s, c, e]                   # rows of e from earlier chunks of rank s (c = t // CH)
        + #{(t', j') < (t, j) in chunk c with idx == e}

Example (W=2, E=4, E_l=2, k=2): rank 0 routes t0->(1,2), t1->(1,0); rank 1 routes t0->(1,3).
Rank 0 holds experts 0,1: expert 0 rows [(0,1,1)], expert 1 rows [(0,0,0), (0,1,0), (1,0,0)], so
offs = [0, 1, 4]; rank 1 holds expert 2 [(0,0,1)] and 3 [(1,0,1)], offs = [0, 1, 2].

Kernels (launched in order on the stream, no host reads):
    _hist_kernel   grid (W, NCH):  wait READY of rank s; cnt[s, c, e] = #entries of chunk c with expert e
    _prefix_kernel grid (W, ceil(E / EB)): cnt[s, c, e] <- exclusive prefix over c; tot[s, e]
    _base_kernel   grid (1,):      base[s, e] = segoff[e] + sum_{s'<s} tot[s', e]; offs, counts, ntok
    _place_kernel  grid (W, NCH):  recv_row[s, t, j] (local entries, else -1; readers mask t < T_s: one rank
                                   alone writes only the call's chunks), row_src/tok/slot[row],
                                   and for s == rank: dest_row[t, j], dest_rank[t, j]
or, where W * NCH <= ONE_LAUNCH_ITEMS (small batches, where each launch costs more than its work), all four in
one program: _schedule_kernel, grid (1,).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .signals import OP_SCHEDULE, READY, REG_IDX, REG_META, current_call, error_set, region_ptr, wait_flags


@dataclass
class Schedule:
    """Placement of one dispatch call (all int32 device tensors unless said otherwise).
    recv_row  [W, T_max, k]: row of entry (s, t, j) in this rank's receive buffer, -1 when its expert lives
              on another rank (rows for t >= T_s are undefined).
    dest_row  [T_max, k]: for this rank's own token t, slot j: the row on the expert rank that holds it.
    dest_rank [T_max, k]: that expert rank (topk_idx // E_l).
    offs      [E_l + 1]: local expert e's rows are recv[offs[e]:offs[e+1]]; offs[0] = 0, offs[E_l] = R.
    counts    [E_l]: offs[e+1] - offs[e].
    row_src, row_tok, row_slot [R_cap]: (source rank, token, k-slot) of each received row (rows < R).
    tokens_per_rank [W] int64: T_s of every rank for this call."""

    recv_row: torch.Tensor
    dest_row: torch.Tensor
    dest_rank: torch.Tensor
    offs: torch.Tensor
    counts: torch.Tensor
    row_src: torch.Tensor
    row_tok: torch.Tensor
    row_slot: torch.Tensor
    tokens_per_rank: torch.Tensor
    scratch: tuple = ()  # the kernels' working tables (cnt [W, NCH, E], tot [W, E], base [W, E])


@triton.jit
def _hist(tab, W, s, c, T_s, cnt_ptr, NCH, E, K: tl.constexpr, KP2: tl.constexpr, CH: tl.constexpr,
          EP2: tl.constexpr):
    """cnt[s, c, e] = #{(t, j): t in chunk c, t < T_s, topk_idx_s[t, j] == e}."""
    t = c * CH + tl.arange(0, CH)
    jj = tl.arange(0, KP2)
    m = (t[:, None] < T_s) & (jj[None, :] < K)
    idx = region_ptr(tab, REG_IDX, W, s, tl.int32)
    e = tl.load(idx + t[:, None] * K + jj[None, :], mask=m, other=-1)
    e = tl.where((e >= 0) & (e < E), e, -1)  # ids outside [0, E) are ignored (caller's contract)
    e = tl.reshape(e, [CH * KP2])
    eb = tl.arange(0, EP2)
    hist = tl.sum((e[:, None] == eb[None, :]).to(tl.int32), axis=0)
    tl.store(cnt_ptr + (s * NCH + c) * E + eb, hist, mask=eb < E)


@triton.jit(do_not_specialize=["rank"])
def _hist_kernel(
    tab, W, rank,
    cnt_ptr,  # int32 [W, NCH, E] per-chunk expert counts (out)
    T_max, NCH, E, timeout_ns,
    K: tl.constexpr, KP2: tl.constexpr, CH: tl.constexpr, EP2: tl.constexpr, WP2: tl.constexpr,
):
    """grid (W, NCH): _hist of chunk c of rank s, once rank s is READY."""
    s = tl.program_id(0)
    c = tl.program_id(1)
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, s, s + 1, call, OP_SCHEDULE, timeout_ns, WP2)
    T_s = tl.load(region_ptr(tab, REG_META, W, s, tl.int64), volatile=True)
    _hist(tab, W, s, c, tl.where(ok, T_s, 0), cnt_ptr, NCH, E, K, KP2, CH, EP2)


@triton.jit
def _prefix(cnt_ptr, tot_ptr, s, ee, NCH, E, CB: tl.constexpr):
    """Experts ee of rank s: cnt[s, c, e] <- sum_{c' < c} cnt[s, c', e]; tot[s, e] = sum_c cnt[s, c, e]."""
    me = ee < E
    carry = tl.zeros(ee.shape, tl.int32)
    c0 = s * 0
    while c0 < NCH:  # while, not range: range() with tensor bounds fails in the interpreter on numpy >= 2.4
        cc = c0 + tl.arange(0, CB)
        m = (cc[:, None] < NCH) & me[None, :]
        p = cnt_ptr + (s * NCH + cc[:, None]) * E + ee[None, :]
        h = tl.load(p, mask=m, other=0)
        incl = tl.cumsum(h, axis=0)
        tl.store(p, incl - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
        c0 += CB
    tl.store(tot_ptr + s * E + ee, carry, mask=me)


@triton.jit
def _prefix_kernel(
    cnt_ptr,  # int32 [W, NCH, E] in: counts, out: exclusive prefix over chunks
    tot_ptr,  # int32 [W, E] out: rows of expert e from rank s
    NCH, E,
    CB: tl.constexpr, EB: tl.constexpr,
):
    """grid (W, ceil(E / EB)): _prefix of EB experts of rank s."""
    _prefix(cnt_ptr, tot_ptr, tl.program_id(0), tl.program_id(1) * EB + tl.arange(0, EB), NCH, E, CB)


@triton.jit
def _base(tab, W, rank, tot_ptr, base_ptr, offs_ptr, counts_ptr, ntok_ptr, E, E_l, EP2: tl.constexpr,
          WP2: tl.constexpr):
    """Segment offsets of every expert inside its rank's receive buffer, and this rank's offs.
        etot[e] = sum_s tot[s, e];  segoff[e] = sum of etot over experts e' < e on the same rank
        base[s, e] = segoff[e] + sum_{s' < s} tot[s', e]
        offs[le] = segoff[rank*E_l + le], offs[E_l] = rows this rank receives"""
    ss = tl.arange(0, WP2)
    ee = tl.arange(0, EP2)
    ms = ss < W
    me = ee < E
    m = ms[:, None] & me[None, :]
    tot = tl.load(tot_ptr + ss[:, None] * E + ee[None, :], mask=m, other=0)
    etot = tl.sum(tot, axis=0)
    excl = tl.cumsum(etot, axis=0) - etot
    q_e = ee // E_l
    # rows of all experts of ranks < q, for each rank q
    rank_start = tl.sum(tl.where(ee[None, :] < ss[:, None] * E_l, etot[None, :], 0), axis=1)
    seg_start = tl.sum(tl.where(ss[:, None] == q_e[None, :], rank_start[:, None], 0), axis=0)
    segoff = excl - seg_start
    base = segoff[None, :] + tl.cumsum(tot, axis=0) - tot
    tl.store(base_ptr + ss[:, None] * E + ee[None, :], base, mask=m)
    local = me & (q_e == rank)
    le = ee - rank * E_l
    tl.store(offs_ptr + le, segoff, mask=local)
    tl.store(counts_ptr + le, etot, mask=local)
    tl.store(offs_ptr + E_l, tl.sum(tl.where(local, etot, 0), axis=0))
    meta = tl.load(tab + REG_META * W + ss, mask=ms, other=0).to(tl.pointer_type(tl.int64))
    T_all = tl.load(meta, mask=ms, other=0, volatile=True)
    T_all = tl.where(error_set(tab, W, rank) == 0, T_all, 0)
    tl.store(ntok_ptr + ss, T_all, mask=ms)


@triton.jit(do_not_specialize=["rank"])
def _base_kernel(
    tab, W, rank,
    tot_ptr,  # int32 [W, E]
    base_ptr,  # int32 [W, E] out
    offs_ptr,  # int32 [E_l + 1] out
    counts_ptr,  # int32 [E_l] out
    ntok_ptr,  # int64 [W] out: T_s of every rank
    E, E_l,
    EP2: tl.constexpr, WP2: tl.constexpr,
):
    """grid (1,): _base."""
    _base(tab, W, rank, tot_ptr, base_ptr, offs_ptr, counts_ptr, ntok_ptr, E, E_l, EP2, WP2)


@triton.jit
def _place(tab, W, rank, s, c, cnt_ptr, base_ptr, ntok_ptr, recv_row_ptr, dest_row_ptr, dest_rank_ptr, row_src_ptr,
           row_tok_ptr, row_slot_ptr, T_max, NCH, E, E_l, R_b, K: tl.constexpr, KP2: tl.constexpr,
           CH: tl.constexpr):
    """Rows of the entries of chunk c of rank s (see the module docstring)."""
    N: tl.constexpr = CH * KP2
    T_s = tl.load(ntok_ptr + s)
    t2 = c * CH + tl.arange(0, CH)[:, None] + tl.zeros([CH, KP2], tl.int32)
    j2 = tl.arange(0, KP2)[None, :] + tl.zeros([CH, KP2], tl.int32)
    m2 = (t2 < T_s) & (j2 < K)
    idx = region_ptr(tab, REG_IDX, W, s, tl.int32)
    e2 = tl.load(idx + t2 * K + j2, mask=m2, other=0)
    m2 = m2 & (e2 >= 0) & (e2 < E)
    t = tl.reshape(t2, [N])
    j = tl.reshape(j2, [N])
    e = tl.reshape(e2, [N])
    m = tl.reshape(m2, [N])
    i = tl.arange(0, N)
    same = (e[None, :] == e[:, None]) & (i[None, :] < i[:, None]) & m[None, :]
    rk = tl.sum(same.to(tl.int32), axis=1)
    pref = tl.load(cnt_ptr + (s * NCH + c) * E + e, mask=m, other=0)
    base = tl.load(base_ptr + s * E + e, mask=m, other=0)
    row = base + pref + rk
    q = e // E_l
    m = m & (row >= 0) & (row < R_b)  # only after a timed-out wait could counts disagree; never write out of bounds
    local = m & (q == rank)
    in_tab = (t < T_max) & (j < K)
    tl.store(recv_row_ptr + (s * T_max + t) * K + j, tl.where(local, row, -1), mask=in_tab)
    tl.store(row_src_ptr + row, s + tl.zeros([N], tl.int32), mask=local)
    tl.store(row_tok_ptr + row, t, mask=local)
    tl.store(row_slot_ptr + row, j, mask=local)
    own = m & (s == rank)
    tl.store(dest_row_ptr + t * K + j, row, mask=own)
    tl.store(dest_rank_ptr + t * K + j, q, mask=own)


@triton.jit(do_not_specialize=["rank"])
def _place_kernel(
    tab, W, rank,
    cnt_ptr,  # int32 [W, NCH, E] exclusive prefix over chunks
    base_ptr,  # int32 [W, E]
    ntok_ptr,  # int64 [W]
    recv_row_ptr,  # int32 [W, T_max, K] out
    dest_row_ptr,  # int32 [T_max, K] out
    dest_rank_ptr,  # int32 [T_max, K] out
    row_src_ptr, row_tok_ptr, row_slot_ptr,  # int32 [R_b] out (R_b: the call's row bound, <= R_cap)
    T_max, NCH, E, E_l, R_b,
    K: tl.constexpr, KP2: tl.constexpr, CH: tl.constexpr,
):
    """grid (W, NCH): _place of chunk c of rank s."""
    _place(tab, W, rank, tl.program_id(0), tl.program_id(1), cnt_ptr, base_ptr, ntok_ptr, recv_row_ptr,
           dest_row_ptr, dest_rank_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr, T_max, NCH, E, E_l, R_b, K, KP2, CH)


@triton.jit(do_not_specialize=["rank"])
def _schedule_kernel(
    tab, W, rank, cnt_ptr, tot_ptr, base_ptr, offs_ptr, counts_ptr, ntok_ptr, recv_row_ptr, dest_row_ptr,
    dest_rank_ptr, row_src_ptr, row_tok_ptr, row_slot_ptr,  # as the four kernels'
    T_max, NCH, E, E_l, R_b, timeout_ns,
    K: tl.constexpr, KP2: tl.constexpr, CH: tl.constexpr, EP2: tl.constexpr, WP2: tl.constexpr, CB: tl.constexpr,
):
    """grid (1,): the four kernels' work in one program, phase after phase (a CTA barrier between them makes each
    phase's stores visible to the next's loads), for few (rank, chunk) pairs: small T_max."""
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP_SCHEDULE, timeout_ns, WP2)
    s = rank * 0
    while s < W:  # (while loops: the interpreter's range() takes no tensor bounds)
        T_s = tl.where(ok, tl.load(region_ptr(tab, REG_META, W, s, tl.int64), volatile=True), 0)
        c = s * 0
        while c < NCH:
            _hist(tab, W, s, c, T_s, cnt_ptr, NCH, E, K, KP2, CH, EP2)
            c += 1
        s += 1
    tl.debug_barrier()
    s = rank * 0
    while s < W:
        _prefix(cnt_ptr, tot_ptr, s, tl.arange(0, EP2), NCH, E, CB)
        s += 1
    tl.debug_barrier()
    _base(tab, W, rank, tot_ptr, base_ptr, offs_ptr, counts_ptr, ntok_ptr, E, E_l, EP2, WP2)
    tl.debug_barrier()
    s = rank * 0
    while s < W:
        c = s * 0
        while c < NCH:
            _place(tab, W, rank, s, c, cnt_ptr, base_ptr, ntok_ptr, recv_row_ptr, dest_row_ptr, dest_rank_ptr,
                   row_src_ptr, row_tok_ptr, row_slot_ptr, T_max, NCH, E, E_l, R_b, K, KP2, CH)
            c += 1
        s += 1


#: at most this many (rank, chunk) pairs (W * NCH) take _schedule_kernel's one launch instead of four
ONE_LAUNCH_ITEMS = 4


def chunk_tokens(topk: int) -> int:
    """CH: tokens per schedule chunk (CH * next_pow2(k) = 128 entries)."""
    return max(1, 128 // triton.next_power_of_2(topk))


def schedule_buffers(heap, tokens: int | None = None) -> Schedule:
    """The tables of one call's schedule, allocated (unwritten): before the call is staged, so that running out of
    memory cannot leave a published call without its kernels. Row tables of ``heap.shape.rows_for(tokens)`` rows."""
    sh = heap.shape
    W, T_max, K, E, E_l = sh.world, sh.max_tokens, sh.topk, sh.num_experts, sh.local_experts
    dev = heap.device
    NCH = triton.cdiv(T_max, chunk_tokens(K))
    R = sh.rows_for(tokens)
    i32 = dict(dtype=torch.int32, device=dev)
    return Schedule(
        recv_row=torch.empty(W, T_max, K, **i32),
        dest_row=torch.empty(T_max, K, **i32),
        dest_rank=torch.empty(T_max, K, **i32),
        offs=torch.empty(E_l + 1, **i32),
        counts=torch.empty(E_l, **i32),
        row_src=torch.empty(R, **i32),
        row_tok=torch.empty(R, **i32),
        row_slot=torch.empty(R, **i32),
        tokens_per_rank=torch.empty(W, dtype=torch.int64, device=dev),
        scratch=(torch.empty(W, NCH, E, **i32), torch.empty(W, E, **i32), torch.empty(W, E, **i32)),
    )


def build_schedule(heap, sched: Schedule, T: int) -> Schedule:
    """Launch the schedule kernels into ``sched`` (:func:`schedule_buffers`) for the call the last
    :func:`signals.stage` opened (ids in ``idx``); ``T``: this rank's tokens in the call."""
    cnt, tot, base = sched.scratch
    W, NCH, E = cnt.shape  # as schedule_buffers sized them
    T_max, K, E_l = heap.shape.max_tokens, heap.shape.topk, heap.shape.local_experts
    KP2, CH, EP2 = triton.next_power_of_2(K), chunk_tokens(K), triton.next_power_of_2(E)
    if W == 1:  # alone, the call's chunks are known on the host (peers' T_s are not)
        NCH = max(1, min(NCH, triton.cdiv(T, CH)))  # cnt read as [W, NCH, E] by every kernel of the call
    if W * NCH <= ONE_LAUNCH_ITEMS:
        _schedule_kernel[(1,)](
            heap.tab, W, heap.rank, cnt, tot, base, sched.offs, sched.counts, sched.tokens_per_rank, sched.recv_row,
            sched.dest_row, sched.dest_rank, sched.row_src, sched.row_tok, sched.row_slot, T_max, NCH, E, E_l,
            sched.row_src.shape[0], heap.timeout_ns, K=K, KP2=KP2, CH=CH, EP2=EP2, WP2=heap.wp2,
            CB=triton.next_power_of_2(NCH), num_warps=4,
        )
        heap.after_launch()
        return sched
    _hist_kernel[(W, NCH)](
        heap.tab, W, heap.rank, cnt, T_max, NCH, E, heap.timeout_ns,
        K=K, KP2=KP2, CH=CH, EP2=EP2, WP2=heap.wp2, num_warps=4,
    )
    heap.after_launch()
    EB = min(EP2, 64)
    _prefix_kernel[(W, triton.cdiv(E, EB))](cnt, tot, NCH, E, CB=64, EB=EB, num_warps=4)
    _base_kernel[(1,)](
        heap.tab, W, heap.rank, tot, base, sched.offs, sched.counts, sched.tokens_per_rank, E, E_l,
        EP2=EP2, WP2=heap.wp2, num_warps=4,
    )
    _place_kernel[(W, NCH)](
        heap.tab, W, heap.rank, cnt, base, sched.tokens_per_rank, sched.recv_row, sched.dest_row,
        sched.dest_rank, sched.row_src, sched.row_tok, sched.row_slot, T_max, NCH, E, E_l, sched.row_src.shape[0],
        K=K, KP2=KP2, CH=CH, num_warps=4,
    )
    return sched


__all__ = ["Schedule", "build_schedule", "chunk_tokens", "schedule_buffers"]
