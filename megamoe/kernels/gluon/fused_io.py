"""Signals and row movement of the Gluon megakernel's items (kernels/gluon/fused.py): bounded waits on the
per-block counters and on READY (recording a timeout as comm/signals.py does), the consumers' counter signals through
the signaller warp, the loader -> consumer item messages, the pull of token rows (by TMA through the ring where the
rows allow it, else through registers) and the GEMM2 epilogue's push of each row into its owner's slot.

Waits and signals follow the Triton items' protocol (fused_parts.py) at the same scopes: acquire loads at system
scope, release atomics at GPU scope, ``fence.proxy.async`` between a generic-proxy acquire and the TMA loads of the
data it guards.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
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

PURPOSE_TILE = gl.constexpr(3)


@gluon.jit
def now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def ld_acq(ptr):
    return gl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def fence_proxy_async():
    """``fence.proxy.async.global`` (fused_parts.fence_proxy_async)."""
    return gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def bulk_writes_done():
    """``cp.async.bulk.wait_group 0``: this thread's TMA stores have written global memory (``tma.store_wait`` lowers
    to the ``.read`` form, which only says their shared-memory sources were read)."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def fail_stop(tab, W, rank):
    """signals.fail_stop: once the error record is complete (its device mirror raised; at most 1 s), trap."""
    ctrl = ctrl_of(tab, W, rank)
    t0 = now()
    errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
    while (errv == 0) & (now() - t0 < 1_000_000_000):
        errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
    return gl.inline_asm_elementwise("membar.sys; trap; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def ctrl_of(tab, W, rank):
    return gl.load(tab + REG_CTRL * W + rank).to(gl.pointer_type(gl.int64))


@gluon.jit
def record_timeout(tab, W, rank, call, peer, expected, seen, purpose):
    """signals.record_timeout (op 'fused'): the first timeout of this rank claims the record and writes it (the
    caller then traps: fail_stop)."""
    ctrl = ctrl_of(tab, W, rank)
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
def wait_counter(ptr, target, tab, W, rank, call, timeout_ns):
    """fused_parts.wait_counter: until the local int64 counter ``*ptr >= target``, bounded; True when reached."""
    ctrl = ctrl_of(tab, W, rank)
    seen = ld_acq(ptr)
    errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
    if (seen < target) & (errv == 0):
        t0 = now()
        elapsed = now() - t0
        while (seen < target) & (errv == 0) & (elapsed <= timeout_ns):
            seen = ld_acq(ptr)
            errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
            elapsed = now() - t0
        if (seen < target) & (errv == 0):
            record_timeout(tab, W, rank, call, rank, target, seen, PURPOSE_TILE)
    if seen < target:  # this wait timed out, or an earlier one did
        fail_stop(tab, W, rank)
    return seen >= target


@gluon.jit
def wait_ready(tab, W, rank, call, timeout_ns, WP2: gl.constexpr, lay: gl.constexpr):
    """signals.wait_flags for READY of every rank (this call), bounded; True when all arrived."""
    flags = gl.load(tab + REG_FLAGS * W + rank).to(gl.pointer_type(gl.int64)) + READY * W
    ctrl = ctrl_of(tab, W, rank)
    offs = gl.arange(0, WP2, layout=lay)
    valid = offs < W
    p = flags + gl.where(valid, offs, rank)
    seen = gl.where(valid, ld_acq(p), call)
    errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
    t0 = now()
    elapsed = now() - t0
    while (gl.min(seen, axis=0) < call) & (errv == 0) & (elapsed <= timeout_ns):
        seen = gl.where(valid, ld_acq(p), call)
        errv = gl.load(ctrl + ERR_LOCAL, volatile=True)
        elapsed = now() - t0
    ok = gl.min(seen, axis=0) >= call
    if (gl.min(seen, axis=0) < call) & (errv == 0):
        peer = gl.min(gl.where(seen < call, offs, WP2), axis=0)
        got = gl.sum(gl.where(offs == peer, seen, 0), axis=0)
        record_timeout(tab, W, rank, call, peer, call, got, READY)
    if ok == 0:
        fail_stop(tab, W, rank)
    return ok


@gluon.jit
def post(s_full, s_empty, s_smem, ns, off, ml: gl.constexpr, SQ: gl.constexpr, WG: gl.constexpr):
    """Consumer WG's part of signalling counter ``ctr_ptr[off]`` (off < 0: the end) through the signaller: slot ns % SQ
    of its queue once free; WG 0 writes off; each WG's arrival (after a barrier of its threads, release at CTA scope)
    says its stores so far are done; the signaller adds 2 once both arrived (signaller)."""
    ss = ns % SQ
    mbarrier.wait(s_empty.index(ss), ((ns // SQ) & 1) ^ 1)  # (the first pass finds every slot free)
    if WG == 0:
        s_smem.index(ss).store(gl.where(gl.arange(0, MSG, layout=ml) == 0, off, 0))
    gl.thread_barrier()
    mbarrier.arrive(s_full.index(ss), count=1)


@gluon.jit
def signaller(s_full, s_empty, s_smem, ctr_ptr, E_l, SQ: gl.constexpr):
    """1 warp: ``ctr_ptr[off] += 2`` (release, GPU scope) per posted signal, in order, until the end (off < 0); why
    here (the GEMM epilogues 0.4-0.8 us shorter than with the release in them): fused.py's module docstring."""
    ml: gl.constexpr = gl.BlockedLayout([MSG], [32], [1], [0])
    n = 0
    go = E_l >= 0  # (a runtime True)
    while go:
        ss = n % SQ
        mbarrier.wait(s_full.index(ss), (n // SQ) & 1)
        off = word(s_smem.index(ss).load(ml), 0, ml)
        gl.thread_barrier()
        mbarrier.arrive(s_empty.index(ss), count=1)
        go = off >= 0
        if go:
            gl.atomic_add(ctr_ptr + off, 2, sem="release", scope="gpu")
        n += 1

MSG = gl.constexpr(16)  # int32 words of an item message in shared memory (10 used)


@gluon.jit
def pack(item, go, fine, kind, b, j, e, row0, nrows, base, ml: gl.constexpr):
    """The loader's message for one item: [item, go, fine, kind, block, part / tile, expert, first receive row, rows,
    first buffer row] as int32, every thread of the partition holding all MSG words (ml: [MSG] per thread)."""
    w = gl.arange(0, MSG, layout=ml)
    v = gl.where(w == 0, item.to(gl.int32), 0)
    words = (go.to(gl.int32), fine.to(gl.int32), kind, b, j, e, row0, nrows, base)
    for i in gl.static_range(9):
        v = gl.where(w == i + 1, words[i], v)
    return v


@gluon.jit
def word(v, i: gl.constexpr, ml: gl.constexpr):
    """Word i of a message held whole by every thread (a reduction in registers: no shared memory, no barrier)."""
    return gl.sum(gl.where(gl.arange(0, MSG, layout=ml) == i, v, 0), axis=0)


@gluon.jit
def rd(m, i: gl.constexpr, lay: gl.constexpr):
    """Word i of message m in shared memory, every thread loading it (one broadcast ld.shared)."""
    return gl.sum(m.slice(i, 1).load(lay), axis=0)


@gluon.jit
def pull_views(a_smem, b_smem, st, RA: gl.constexpr, RB: gl.constexpr, RV: gl.constexpr, C: gl.constexpr):
    """Ring stage st as the pull's row buffers: RA rows in its A tile, RB in its weight tile, each token row RV x C
    bf16 (unswizzled: a row is one TMA box)."""
    lay_p: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    AV: gl.constexpr = a_smem.shape[1] * a_smem.shape[2] // C  # (the whole tile: shapes are powers of 2)
    BV: gl.constexpr = b_smem.shape[1] * b_smem.shape[2] // C
    av = a_smem.index(st)._reinterpret(gl.bfloat16, [AV, C], lay_p)
    bv = b_smem.index(st)._reinterpret(gl.bfloat16, [BV, C], lay_p)
    return av, bv


@gluon.jit
def issue_pull(tok_descs, a_smem, b_smem, ready, empty, row_src_ptr, row_tok_ptr, row0, r_lo, r_end, it,
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
    fence_proxy_async()  # (the rows were published to the generic proxy: READY, acquired before)
    # each stage's row indices in one load, the next stage's issued before this one's copies: loaded one at a time,
    # each row's index before its copy, the loads' latency (~0.12 us each) was the pull's time
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
        av, bv = pull_views(a_smem, b_smem, st, RA, RB, RV, C)
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
                            tma.async_copy_global_to_shared(tok_descs[p], [tok * RV + i * BR, 0], ready.index(st), dst)
        it += 1
    return it


@gluon.jit
def row_src(tab, W, row0, r, valid, row_src_ptr, row_tok_ptr, H, ALIGNED: gl.constexpr):
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
def pull_rows(tab, W, row0, r_lo, r_end, base, row_src_ptr, row_tok_ptr, x_ptr, H, HP, ROWS_P: gl.constexpr,
               BLOCK_H: gl.constexpr, ALIGNED: gl.constexpr, pl: gl.constexpr):
    """xbuf[base + r][:HP] = tok_{src(r)}[tok(r)][:HP] (source rows of H elements, HP <= H) for block rows r in
    [r_lo, r_end): [ROWS_P, BLOCK_H] chunks, the next chunk's (NVLink) loads issued before the current chunk's
    stores (fused_parts.pull_block)."""
    rr = gl.arange(0, ROWS_P, layout=gl.SliceLayout(1, pl))
    hh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, pl))
    n_h = gl.cdiv(HP, BLOCK_H)
    n_chunks = gl.cdiv(r_end - r_lo, ROWS_P) * n_h
    if n_chunks > 0:
        r = r_lo + rr
        valid = r < r_end
        sp = row_src(tab, W, row0, r, valid, row_src_ptr, row_tok_ptr, H, ALIGNED)
        m = valid[:, None] & (hh < HP)[None, :]
        v = gl.load(sp[:, None] + hh[None, :], mask=m)
        for c in range(1, n_chunks):
            ri = c // n_h
            oh = (c % n_h) * BLOCK_H + hh
            r2 = r_lo + ri * ROWS_P + rr
            valid2 = r2 < r_end
            sp2 = row_src(tab, W, row0, r2, valid2, row_src_ptr, row_tok_ptr, H, ALIGNED)
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
def store_pull(xv_desc, a_smem, b_smem, ready, empty, base, r_lo, r_end, it, RA: gl.constexpr, RB: gl.constexpr,
                RV: gl.constexpr, C: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, BR: gl.constexpr):
    """Consumer WG's part of PULL rows [r_lo, r_end) loaded by issue_pull: every stage's rows stored by TMA into the
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
            av, bv = pull_views(a_smem, b_smem, st, RA, RB, RV, C)
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
    bulk_writes_done()
    fence_proxy_async()
    return it


@gluon.jit
def push_rows_idx(row0, nrows, row_src_ptr, row_tok_ptr, row_slot_ptr, HM: gl.constexpr, WG: gl.constexpr,
                   store_l: gl.constexpr):
    """Consumer WG's 64 rows of a block (fused_parts.push_rows), first part: (src, tok, slot, valid) loads issued, in
    SliceLayout(1, store_l). The GEMM2 items issue them before their k-loop and call push_rows_base under the first
    wgmma and push_rows_ptrs after it, so no load's latency stops the wgmmas."""
    rloc = WG * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, store_l))
    rvalid = rloc < nrows
    src = gl.load(row_src_ptr + row0 + rloc, mask=rvalid, other=0)
    tok = gl.load(row_tok_ptr + row0 + rloc, mask=rvalid, other=0)
    slot = gl.load(row_slot_ptr + row0 + rloc, mask=rvalid, other=0)
    return src, tok, slot, rvalid


@gluon.jit
def push_rows_base(tab, W, src, tok, slot, rvalid, K: gl.constexpr):
    """Second part: (the owner's ``slots`` region address (a load), the row's index in it tok * K + slot)."""
    return gl.load(tab + REG_SLOTS * W + src, mask=rvalid, other=0), tok * K + slot  # (int32: < T_max * k rows)


@gluon.jit
def push_rows_ptrs(sbase, sidx, H, ALIGNED: gl.constexpr):
    """Last part: each row's owner ``slots[tok, slot]`` row pointer."""
    rp = (sbase + sidx.to(gl.int64) * H * 2).to(gl.pointer_type(gl.bfloat16))
    if ALIGNED:
        rp = gl.multiple_of(rp, 16)
    return rp


@gluon.jit
def push_pair(v0, v1, rp, rvalid, col, H, epi_smem, b0, HM: gl.constexpr, store_l: gl.constexpr):
    """Two adjacent [HM, 64] bf16 slices of GEMM2's rows -> each row's owner slot at columns col .. col + 127 (rp: row
    pointers in SliceLayout(1, store_l)), through both of the WG's staging buffers (b0, b0 ^ 1; 16-byte stores, 8
    columns per thread): two barriers where a slice at a time takes four: the GEMM2 epilogue 2.74 us against 2.85."""
    gl.thread_barrier()
    epi_smem.index(b0).store(v0)
    epi_smem.index(b0 ^ 1).store(v1)
    gl.thread_barrier()
    rn = col + gl.arange(0, 64, layout=gl.SliceLayout(0, store_l))
    w0 = epi_smem.index(b0).load(store_l)
    w1 = epi_smem.index(b0 ^ 1).load(store_l)
    gl.store(rp[:, None] + rn[None, :], w0, mask=rvalid[:, None] & (rn < H)[None, :])
    gl.store(rp[:, None] + (rn + 64)[None, :], w1, mask=rvalid[:, None] & (rn + 64 < H)[None, :])

# pulls by TMA through the ring (issue_pull / store_pull) where the rows allow it (bf16, H % 64 == 0): the loader
# loads each row from its owner's ``tok`` region into a ring stage, a consumer stores the stage's rows into the
# receive buffer; 0: every pull in the consumers' registers (pull_rows)
BULK_PULL = 1

def bulk_pull_plan(heap, cfg, a):
    """(receive-buffer view descriptor, every rank's ``tok`` view descriptor, rows per stage in the A tile and in the
    weight tile, RV, C, BR) for the TMA pull (BULK_PULL), or None where the register pull runs: H % 64 (a row in a
    stage starts 128-byte aligned), a receive buffer that is not dense, more than 8 ranks. A row of H bf16 is RV =
    H / C rows of C <= 256 elements, loaded and stored as RV / BR boxes of [BR, C] (box dimensions are powers of 2
    <= 256: deepseek-v3's 7168 is 7 boxes of [4, 256]; at most 8 boxes per row)."""
    H = heap.shape.hidden
    if not BULK_PULL or heap.world > 8 or H % 64 or not a.is_contiguous() or a.shape[1] != H:
        return None
    c = 256 if H % 256 == 0 else (128 if H % 128 == 0 else 64)
    rv = H // c
    br = rv & -rv  # (a box's rows are a power of 2: a row is rv / br boxes)
    while br > 256:
        br //= 2
    if rv // br > 8:  # (at most 8 boxes per row)
        return None
    bw = max(2 * cfg.bn1, cfg.bn2)
    ra = min(cfg.block_m * 64 // H, 8)  # (rows of a stage's tiles; at most 16 in all: each is an unrolled TMA issue)
    rb = min(bw * 64 // H, 16 - ra)
    if ra + rb < 1:
        return None
    lay_p = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)

    def view(t):  # rows of H as RV rows of C, in [BR, C] boxes
        return TensorDescriptor(t, [t.shape[0] * rv, c], [c, 1], [br, c], lay_p)

    return view(a), [view(heap.peer_buffer("tok", r)) for r in range(heap.world)], ra, rb, rv, c, br
