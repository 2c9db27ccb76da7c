"""Device-side pieces of the MoE megakernel (kernels/fused_moe.py, whose shape legend applies): tile counters
with bounded waits, block bookkeeping, the pipelined row pull and the combine push."""

from __future__ import annotations

import triton
import triton.language as tl

from megamoe.comm.signals import (
    ERR_LOCAL,
    INTERPRET,
    OP_FUSED,
    REG_CTRL,
    REG_SLOTS,
    REG_TOK,
    fail_stop,
    ld_acquire,
    now_ns,
    record_timeout,
    region_ptr,
)
from megamoe.kernels.tiles import col_slices

PURPOSE_TILE = tl.constexpr(3)

if INTERPRET:

    @triton.jit
    def fence_proxy_async():
        """No-op under the interpreter (no async proxy there)."""
        return 0

else:

    @triton.jit
    def fence_proxy_async():
        """``fence.proxy.async.global``: make generic-proxy writes seen via an acquire visible to TMA loads."""
        return tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)


@triton.jit
def wait_counter(ptr, target, tab, W, rank, call, timeout_ns):
    """Wait until the local int64 counter ``*ptr >= target``, bounded and fail-stop like signals.wait_flags (a timeout
    records op 'fused', purpose TILE, peer = this rank). Returns True when reached."""
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    seen = ld_acquire(ptr)
    errv = tl.load(ctrl + ERR_LOCAL, volatile=True)
    if (seen < target) & (errv == 0):
        t0 = now_ns()
        elapsed = now_ns() - t0
        while (seen < target) & (errv == 0) & (elapsed <= timeout_ns):
            seen = ld_acquire(ptr)
            errv = tl.load(ctrl + ERR_LOCAL, volatile=True)
            elapsed = now_ns() - t0
        if (seen < target) & (errv == 0):
            record_timeout(tab, W, rank, OP_FUSED, call, rank, target, seen, PURPOSE_TILE)
    if seen < target:  # this wait timed out, or an earlier one did
        fail_stop(tab, W, rank)
    tl.debug_barrier()
    return seen >= target


@triton.jit
def signal_counter(ptr):
    """All threads' stores of this program so far, then ``*ptr += 1`` with release semantics."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def locate(b, e_idx, starts, cnts, nblk, cum, NS, BM: tl.constexpr):
    """block b -> (expert, first receive row, valid rows, first buffer row); the per-expert vectors come from
    tiles.expert_tiles with N = BLOCK_N = 1 (so its tiles are BM-row blocks)."""
    e = tl.sum((cum <= b).to(tl.int32), axis=0)
    sel = e_idx == e
    first_blk = tl.sum(tl.where(sel, cum, 0), axis=0) - tl.sum(tl.where(sel, nblk, 0), axis=0)
    row0 = tl.sum(tl.where(sel, starts, 0), axis=0) + (b - first_blk) * BM
    nrows = tl.minimum(tl.sum(tl.where(sel, cnts, 0), axis=0) - (b - first_blk) * BM, BM)
    if NS > 0:
        base = (b % NS) * BM
    else:
        base = row0
    return e, row0, nrows, base


@triton.jit
def _pull_rows_ptrs(tab, W, row0, r_lo, rr, nrows, base, row_src_ptr, row_tok_ptr, x_ptr, H, HP,
                    DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Source (row stride H) and destination (row stride HP) row pointers of block rows r_lo + rr (valid: < nrows)."""
    r = r_lo + rr
    valid = r < nrows
    src = tl.load(row_src_ptr + row0 + r, mask=valid, other=0)
    tok = tl.load(row_tok_ptr + row0 + r, mask=valid, other=0)
    addr = tl.load(tab + REG_TOK * W + src, mask=valid, other=0) + tok.to(tl.int64) * H * (DT.primitive_bitwidth // 8)
    sp = addr.to(tl.pointer_type(DT))
    if ALIGNED:
        sp = tl.multiple_of(sp, 16)
    dp = x_ptr + (base + r).to(tl.int64) * HP
    return sp, dp, valid


@triton.jit
def pull_block(tab, W, row0, nrows, base, r_lo, r_hi, row_src_ptr, row_tok_ptr, x_ptr, H, HP,
                ROWS_P: tl.constexpr, BLOCK_H: tl.constexpr, ALIGNED: tl.constexpr):
    """xbuf[base + r] = tok_{src(r)}[tok(r)][:HP] (source rows of H elements, HP <= H: packed FP8 rows are
    narrower) for block rows r in [r_lo, min(r_hi, nrows)), in [ROWS_P, BLOCK_H] chunks, software-pipelined:
    chunk c + 1 is loaded before chunk c is stored, so two chunks of NVLink reads are in flight per program."""
    DT = x_ptr.dtype.element_ty
    rr = tl.arange(0, ROWS_P)
    hh = tl.arange(0, BLOCK_H)
    n_h = tl.cdiv(HP, BLOCK_H)
    r_end = tl.minimum(r_hi, nrows)
    n_chunks = tl.cdiv(r_end - r_lo, ROWS_P) * n_h
    if n_chunks > 0:
        sp, dp, valid = _pull_rows_ptrs(tab, W, row0, r_lo, rr, r_end, base, row_src_ptr, row_tok_ptr, x_ptr, H,
                                        HP, DT, ALIGNED)
        m = valid[:, None] & (hh < HP)[None, :]
        v = tl.load(sp[:, None] + hh[None, :], mask=m)
        for c in range(1, n_chunks):
            ri = c // n_h
            oh = (c % n_h) * BLOCK_H + hh
            sp2, dp2, valid2 = _pull_rows_ptrs(tab, W, row0, r_lo + ri * ROWS_P, rr, r_end, base, row_src_ptr,
                                               row_tok_ptr, x_ptr, H, HP, DT, ALIGNED)
            m2 = valid2[:, None] & (oh < HP)[None, :]
            v2 = tl.load(sp2[:, None] + oh[None, :], mask=m2)
            oh_prev = ((c - 1) % n_h) * BLOCK_H + hh
            tl.store(dp[:, None] + oh_prev[None, :], v, mask=m)
            v = v2
            m = m2
            dp = dp2
        oh_last = ((n_chunks - 1) % n_h) * BLOCK_H + hh
        # dp recomputed: the loop-carried one has lost its alignment for the compiler (2-byte stores)
        dp = x_ptr + (base + r_lo + ((n_chunks - 1) // n_h) * ROWS_P + rr).to(tl.int64) * HP
        tl.store(dp[:, None] + oh_last[None, :], v, mask=m)


@triton.jit
def push_rows(row0, nrows, tab, W, row_src_ptr, row_tok_ptr, row_slot_ptr, H, K: tl.constexpr, BM: tl.constexpr,
               DT: tl.constexpr, ALIGNED: tl.constexpr):
    """(row pointers [BM], valid [BM]): each block row's destination, its owner's ``slots[tok, slot]`` row. ALIGNED:
    the 16-byte alignment hint the compiler cannot see through a loaded pointer (else 2-byte stores). Two dependent
    loads per row: call it once per item before the k-loop, so their latency hides under it."""
    rr = tl.arange(0, BM)
    valid = rr < nrows
    src = tl.load(row_src_ptr + row0 + rr, mask=valid, other=0)
    tok = tl.load(row_tok_ptr + row0 + rr, mask=valid, other=0)
    slot = tl.load(row_slot_ptr + row0 + rr, mask=valid, other=0)
    addr = tl.load(tab + REG_SLOTS * W + src, mask=valid, other=0) + (tok * K + slot).to(tl.int64) * H * (
        DT.primitive_bitwidth // 8)
    rp = addr.to(tl.pointer_type(DT))
    if ALIGNED:
        rp = tl.multiple_of(rp, 16)
    return rp, valid


@triton.jit
def _push_part(acc, off_n, rp, valid, H, NP: tl.constexpr, DT: tl.constexpr):
    """Store a [BM, NP] slice of GEMM2's output rows at the rows' owner addresses ``rp`` (see push_rows)."""
    rn = off_n + tl.arange(0, NP)
    ptrs = rp[:, None] + rn[None, :]
    tl.store(ptrs, acc.to(DT), mask=valid[:, None] & (rn < H)[None, :])


@triton.jit
def push_epilogue(acc, off_n, rp, valid, H, BM: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
                   EPI_SPLIT: tl.constexpr):
    """GEMM2's [BM, BN] tile pushed in EPI_SPLIT column slices (1, 2 or 4; fewer live registers)."""
    NP: tl.constexpr = BN // EPI_SPLIT
    parts = col_slices(acc, BM, BN, EPI_SPLIT)
    for c in tl.static_range(EPI_SPLIT):
        _push_part(parts[c], off_n + c * NP, rp, valid, H, NP, DT)
