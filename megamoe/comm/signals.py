"""Cross-rank signals on single-writer slots, with bounded waits (W world size, P programs of a launch).

Every rank's symmetric heap holds ``flags`` int64 [3, W]: ``flags[purpose, s]`` (READY, DONE, DW_DONE) is written
only by rank ``s`` and carries the call number ``ctrl[SEQ]``, which the stage kernel bumps once per op. Why single
writers and growing call numbers, and what each flag's wait guards: docs/design.md, "The communication protocol".

Protocol of one op (call s), every rank running the same sequence of ops:

    stage  (P programs): wait flags[DONE, p] >= s-1 for all p   # every peer finished reading my sources
                         copy the op's local inputs into my symmetric source buffers
                         last program to arrive: publish READY=s into every peer's flags[READY, me]
    work   (P programs): wait flags[READY, p] >= s for the peers it reads, pull, compute
                         last program to arrive: publish DONE=s into every peer's flags[DONE, me]
    finish (optional):   wait flags[DONE, p] >= s (only where peers *write* into my memory)

Polling: ``ld.acquire.sys`` on the GPU, a volatile ``tl.load`` in the interpreter, never a read-modify-write.
Publishing: one ``atomic_xchg(sem="release", scope="sys")`` per peer slot.

Bounded waits read ``%globaltimer`` (the interpreter: a Python helper that also sleeps 100 us per poll so spinning
ranks leave the CPU to the others); after ``timeout_ns`` the waiter claims the error record (pinned host memory, or
the ``host`` backend's shared segment: SymmetricHeap.check reads it, no sync) and never lets its kernel go on: on a
GPU :func:`fail_stop` traps once the record is complete, under the interpreter the launcher raises
(SymmetricHeap.after_launch). Why: docs/design.md, "Fail-stop".
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl

# flag rows (DW_DONE: every gate gradient of this call has been written into the owners' ``dw`` regions)
READY, DONE, DW_DONE = (tl.constexpr(i) for i in range(3))
# ctrl slots (int64, local only)
SEQ, ARRIVE_STAGE, ARRIVE_WORK = (tl.constexpr(i) for i in range(3))
ERR_LOCAL = tl.constexpr(4)  # device-memory mirror of the error flag (cheap to poll; the record is host memory)
ERR_LOCAL_CLAIM = tl.constexpr(5)
# error record slots (int64; 7 unused)
ERR_FLAG, ERR_OP, ERR_CALL, ERR_RANK, ERR_PEER, ERR_EXPECTED, ERR_SEEN = (tl.constexpr(i) for i in range(7))
ERR_PURPOSE = tl.constexpr(8)
ERR_SLOTS = 16

#: heap regions (heap.py) in the order of their rows in the pointer table tab [NUM_REGIONS, W]
REGIONS = ("flags", "ctrl", "meta", "idx", "w", "dw", "tok", "rows", "err", "slots")
NUM_REGIONS = len(REGIONS)
REG_FLAGS, REG_CTRL, REG_META, REG_IDX, REG_W, REG_DW, REG_TOK, REG_ROWS, REG_ERR, REG_SLOTS = (
    tl.constexpr(i) for i in range(NUM_REGIONS))

#: torch dtype -> triton dtype of the heap's activation regions
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

#: op codes written into the error record (the OP_* constants, in this order)
OPS = {1: "stage", 2: "schedule", 3: "dispatch", 4: "combine", 5: "dispatch_backward", 6: "finish", 8: "fused"}
OP_STAGE, OP_SCHEDULE, OP_PULL, OP_COMBINE, OP_DISPATCH_BWD, OP_FINISH, OP_FUSED = (tl.constexpr(c) for c in OPS)
PURPOSES = {0: "READY", 1: "DONE", 2: "DW_DONE", 3: "TILE"}  # TILE: a local tile counter of the fused kernel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class CommTimeoutError(RuntimeError):
    """A device-side wait ran out: names the op, call number, rank, and the peer that never signalled."""


def _host_now_ns():
    # called from interpreted kernels only: yield the CPU while polling, then read the clock
    time.sleep(1e-4)
    return time.monotonic_ns()


if INTERPRET:

    @triton.jit
    def now_ns():
        """Nanoseconds from the host's monotonic clock (interpreter path)."""
        return _host_now_ns()

    @triton.jit
    def ld_acquire(ptr):
        """Acquire load of int64 ``ptr`` (interpreter: a volatile load; programs run one by one)."""
        return tl.load(ptr, volatile=True)

    @triton.jit
    def trap():
        """Interpreter: nothing here; the launcher raises once the launch returns (SymmetricHeap.after_launch)."""
        return 0

else:

    @triton.jit
    def now_ns():
        """Nanoseconds from %globaltimer."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def ld_acquire(ptr):
        """``ld.acquire.sys`` of int64 ``ptr`` (a block of pointers; every lane must be valid)."""
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def trap():
        """``membar.sys; trap``: this thread's writes (the error record) leave the SM, then the kernel aborts and the
        CUDA context is lost: no later kernel of this process runs."""
        return tl.inline_asm_elementwise("membar.sys; trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                         is_pure=False, pack=1)


@triton.jit
def region_ptr(tab, reg, W, peer, dtype: tl.constexpr):
    """This process's address of ``peer``'s copy of heap region ``reg`` as a pointer to ``dtype``."""
    return tl.load(tab + reg * W + peer).to(tl.pointer_type(dtype))


@triton.jit
def error_set(tab, W, rank):
    """This rank's error flag (0: no wait has timed out), read from the device-memory mirror."""
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    return tl.load(ctrl + ERR_LOCAL, volatile=True)


@triton.jit
def wait_flags(tab, W, rank, purpose, lo, hi, expected, op, timeout_ns, WP2: tl.constexpr):
    """Wait until flags[purpose, p] >= expected for every peer p in [lo, hi), polling local memory; bounded by
    timeout_ns. True when all arrived, False on a timeout (recorded) or when the error record is already set."""
    flags = region_ptr(tab, REG_FLAGS, W, rank, tl.int64) + purpose * W
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    offs = tl.arange(0, WP2)
    valid = (offs >= lo) & (offs < hi)
    p = flags + tl.where(valid, offs, rank)
    seen = tl.where(valid, ld_acquire(p), expected)
    errv = tl.load(ctrl + ERR_LOCAL, volatile=True)
    t0 = now_ns()
    elapsed = now_ns() - t0
    while (tl.min(seen, axis=0) < expected) & (errv == 0) & (elapsed <= timeout_ns):
        seen = tl.where(valid, ld_acquire(p), expected)
        errv = tl.load(ctrl + ERR_LOCAL, volatile=True)
        elapsed = now_ns() - t0
    ok = tl.min(seen, axis=0) >= expected
    if (tl.min(seen, axis=0) < expected) & (errv == 0):
        peer = tl.min(tl.where(seen < expected, offs, WP2), axis=0)
        got = tl.sum(tl.where(offs == peer, seen, 0), axis=0)
        record_timeout(tab, W, rank, op, expected, peer, expected, got, purpose)
    if ok == 0:
        fail_stop(tab, W, rank)
    tl.debug_barrier()
    return ok


@triton.jit
def fail_stop(tab, W, rank):
    """A wait of this rank failed: trap once the error record is complete (its device mirror is raised last, by the
    program that claimed the record; bounded by 1 s should that program be gone). A program that lost the claim
    must not abort the kernel while the winner still writes, or the host would never learn the message."""
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    t0 = now_ns()
    while (tl.load(ctrl + ERR_LOCAL, volatile=True) == 0) & (now_ns() - t0 < 1_000_000_000):
        pass
    trap()


@triton.jit
def record_timeout(tab, W, rank, op, call, peer, expected, seen, purpose):
    """Claim this rank's error record (compare-and-swap: the first timeout wins), write it, then raise the
    host-visible flag and its device mirror, which every later wait polls."""
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    zero = tl.full([], 0, tl.int64)
    claimed = tl.atomic_cas(ctrl + ERR_LOCAL_CLAIM, zero, zero + 1, sem="acq_rel", scope="gpu")
    if claimed == 0:
        err = region_ptr(tab, REG_ERR, W, rank, tl.int64)  # host-visible record
        tl.store(err + ERR_OP, op)
        tl.store(err + ERR_CALL, call)
        tl.store(err + ERR_RANK, rank)
        tl.store(err + ERR_PEER, peer)
        tl.store(err + ERR_EXPECTED, expected)
        tl.store(err + ERR_SEEN, seen)
        tl.store(err + ERR_PURPOSE, purpose)
        tl.atomic_xchg(err + ERR_FLAG, zero + 1, sem="release", scope="sys")
        tl.atomic_xchg(ctrl + ERR_LOCAL, zero + 1, sem="release", scope="gpu")


@triton.jit
def publish(tab, W, rank, purpose, value, WP2: tl.constexpr):
    """Store ``value`` into flags[purpose, rank] of every rank's heap (release, system scope). Lane p publishes to
    peer p, so the CTA barrier first: what other threads of this program wrote or acquired (the token count a single
    thread stored into ``meta``, the arrival counter another thread acquired) happens before every lane's release
    (PTX release is cumulative only over what its own thread has observed)."""
    tl.debug_barrier()
    offs = tl.arange(0, WP2)
    m = offs < W
    addr = tl.load(tab + REG_FLAGS * W + offs, mask=m, other=0)
    ptrs = addr.to(tl.pointer_type(tl.int64)) + purpose * W + rank
    tl.atomic_xchg(ptrs, tl.full([WP2], 0, tl.int64) + value, mask=m, sem="release", scope="sys")


@triton.jit
def arrive_last(tab, W, rank, slot, nprog):
    """Count this program's arrival on ctrl[slot]; True for the last of ``nprog`` (which resets it)."""
    tl.debug_barrier()
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    old = tl.atomic_add(ctrl + slot, 1, sem="acq_rel", scope="sys")
    last = old == nprog - 1
    if last:
        tl.atomic_xchg(ctrl + slot, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def arrive_publish(tab, W, rank, slot, nprog, purpose, value, WP2: tl.constexpr):
    """arrive_last; the last program publishes ``value`` on flag ``purpose`` unless this rank's error record is set.
    Returns whether this program was the last."""
    last = arrive_last(tab, W, rank, slot, nprog)
    if last:
        if error_set(tab, W, rank) == 0:
            publish(tab, W, rank, purpose, value, WP2)
    return last


@triton.jit
def current_call(tab, W, rank):
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    return tl.load(ctrl + SEQ, volatile=True)


@triton.jit(do_not_specialize=["rank"])
def _finish_kernel(tab, W, rank, src_reg, dst_ptr, n, timeout_ns, BLOCK: tl.constexpr, WP2: tl.constexpr,
                   PURPOSE: tl.constexpr):
    """grid (P,): wait flag PURPOSE (DONE or DW_DONE) >= seq from every peer, then copy region ``src_reg`` [n]
    (fp32) into dst [n]: where peers *write* into this rank's heap (send_gate_grad)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    s = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, PURPOSE, 0, W, s, OP_FINISH, timeout_ns, WP2)
    if ok:
        _copy(dst_ptr, region_ptr(tab, src_reg, W, rank, tl.float32), n, pid, P, BLOCK, True)


def finish(heap, src_reg: int, dst, n: int, programs: int, purpose: int) -> None:
    """dst[:n] = this rank's region ``src_reg`` once every peer has raised flag ``purpose`` for the current call."""
    _finish_kernel[(max(1, min(programs, triton.cdiv(max(n, 1), 1024))),)](
        heap.tab, heap.world, heap.rank, src_reg, dst, n, heap.timeout_ns, BLOCK=1024, WP2=heap.wp2, PURPOSE=purpose)
    heap.after_launch()


@triton.jit
def _copy(dst, src, n, pid, P, BLOCK: tl.constexpr, VOLATILE: tl.constexpr):
    """dst[:n] = src[:n], the programs of the launch striding over blocks of BLOCK (VOLATILE: src written by peers)."""
    i0 = pid * BLOCK
    while i0 < n:
        o = i0 + tl.arange(0, BLOCK)
        m = o < n
        tl.store(dst + o, tl.load(src + o, mask=m, volatile=VOLATILE), mask=m)
        i0 += P * BLOCK


@triton.jit(do_not_specialize=["rank"])
def _stage_kernel(
    tab, W, rank,  # tab: int64 [NUM_REGIONS, W] heap pointer table
    act_ptr, n_act,  # [n_act, H] activation rows to copy into region act_reg (dtype of the heap)
    nrows_ptr,  # int32 [1] device-side row count (HAS_NROWS): copy min(n_act, *nrows_ptr) rows
    act_reg,
    H,  # the region's row stride (elements)
    HA,  # act's row width and stride (elements, <= H): a narrower payload fills the first HA of each region row
    small_ptr, n_small, small_reg,  # int32 [n_small] 4-byte table (top-k ids, or fp32 gates as int32) -> small_reg
    small2_ptr, n_small2, small2_reg,  # int32 [n_small2] a second 4-byte table -> region small2_reg (HAS_SMALL2)
    ntok,  # tokens this call (written to meta[0]; < 0: leave meta alone)
    timeout_ns,
    HAS_ACT: tl.constexpr, HAS_SMALL: tl.constexpr, HAS_SMALL2: tl.constexpr, HAS_NROWS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    ALIGNED: tl.constexpr,  # H * itemsize % 16 == 0
    WP2: tl.constexpr,
):
    """grid (P,): open call s = seq+1 and publish this rank's sources for it.
        wait flags[DONE, p] >= s-1 for all p        # nobody still reads my buffers from earlier calls
        n = min(n_act, *nrows_ptr) if HAS_NROWS else n_act     # rows that hold data (count on the device)
        region[act_reg][:n, :HA] = act ; region[small_reg][:n_small] = small ; region[small2_reg] = small2
        last program: meta[0] = ntok; publish READY = s to every peer; seq = s"""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ctrl = region_ptr(tab, REG_CTRL, W, rank, tl.int64)
    prev = tl.load(ctrl + SEQ, volatile=True)
    ok = wait_flags(tab, W, rank, DONE, 0, W, prev, OP_STAGE, timeout_ns, WP2)
    if ok:
        if HAS_ACT:
            dst = region_ptr(tab, act_reg, W, rank, act_ptr.dtype.element_ty)
            if HAS_NROWS:
                n_act = tl.minimum(n_act, tl.load(nrows_ptr))
            r0 = pid * ROWS
            while r0 < n_act:
                r = r0 + tl.arange(0, ROWS)
                mr = r < n_act
                ro = r.to(tl.int64) * H
                h0 = tl.program_id(0) * 0
                while h0 < HA:
                    oh = h0 + tl.arange(0, BLOCK_H)
                    m = mr[:, None] & (oh < HA)[None, :]
                    o = (r.to(tl.int64) * HA)[:, None] + oh[None, :]
                    drow = dst + ro
                    if ALIGNED:
                        drow = tl.multiple_of(drow, 16)
                    tl.store(drow[:, None] + oh[None, :], tl.load(act_ptr + o, mask=m), mask=m)
                    h0 += BLOCK_H
                r0 += P * ROWS
        if HAS_SMALL:
            _copy(region_ptr(tab, small_reg, W, rank, tl.int32), small_ptr, n_small, pid, P, 1024, False)
        if HAS_SMALL2:
            _copy(region_ptr(tab, small2_reg, W, rank, tl.int32), small2_ptr, n_small2, pid, P, 1024, False)
    last = arrive_last(tab, W, rank, ARRIVE_STAGE, P)
    if last:
        if ntok >= 0:
            meta = region_ptr(tab, REG_META, W, rank, tl.int64)
            tl.store(meta, tl.cast(ntok, tl.int64))  # tl.cast: ntok == 1 arrives as a constexpr int
        if error_set(tab, W, rank) == 0:
            publish(tab, W, rank, READY, prev + 1, WP2)
        tl.store(ctrl + SEQ, prev + 1)


#: tile per program step of the row-moving kernels: op -> (elements per step, num_warps, max BLOCK_H, max ROWS). From
#: sweeps on 4x H200 (docs/performance.md); the pipelined pull keeps two units in flight, so half the unpipelined
#: loop's best step keeps as many bytes in flight (twice that spills).
TILES = {"stage": (8192, 8, 2048, 8), "pull": (16384, 16, 8192, 8), "gather": (8192, 16, 2048, 8)}


def tile_args(heap, op: str, topk: bool = True) -> dict:
    """The launch arguments every row-moving kernel of ``heap`` takes: ROWS x BLOCK_H ~ TILES[op] elements per step,
    num_warps, ALIGNED (rows start on 16-byte boundaries), WP2 and (``topk``) K, KP2."""
    sh = heap.shape
    elems, warps, cap, rows_cap = TILES[op]
    if INTERPRET:  # registers are free there and every step costs Python overhead: take big steps
        rows_cap = 64
    block_h = min(triton.next_power_of_2(max(sh.hidden, 1)), cap)
    args = dict(ROWS=max(1, min(rows_cap, elems // block_h)), BLOCK_H=block_h, num_warps=warps, WP2=heap.wp2,
                ALIGNED=(sh.hidden * sh.dtype.itemsize) % 16 == 0)
    return args | (dict(K=sh.topk, KP2=triton.next_power_of_2(sh.topk)) if topk else {})


def stage(heap, act=None, act_reg: int = 0, small=None, small_reg: int = 0, ntok: int = -1, programs=None,
          nrows=None, small2=None, small2_reg: int = 0):
    """Open a new call on ``heap`` and publish ``act`` / ``small`` / ``small2`` (4-byte tables, e.g. ids and gates)
    into its symmetric regions. ``act`` [n, HA], HA <= H, fills the first HA elements of each region row (packed
    FP8 rows are narrower). ``nrows``: int32 device tensor of one element bounding the rows copied (offs[E_l] lives
    on the device; the buffers are sized for the worst case)."""
    heap.check()
    H = heap.shape.hidden
    has_act, has_small, has_small2 = (t is not None and t.numel() > 0 for t in (act, small, small2))
    HA = act.shape[1] if act is not None and act.dim() == 2 else H
    if has_act and (HA > H or act.stride() != (HA, 1)):
        raise ValueError(f"stage: act must be contiguous [n, <= {H}], got {tuple(act.shape)} strides {act.stride()}")
    _stage_kernel[(max(1, int(programs or heap.num_sms)),)](
        heap.tab, heap.world, heap.rank,
        act if has_act else heap.tab, act.shape[0] if has_act else 0, nrows if nrows is not None else heap.tab,
        act_reg, H, HA,
        small if has_small else heap.tab, small.numel() if has_small else 0, small_reg,
        small2 if has_small2 else heap.tab, small2.numel() if has_small2 else 0, small2_reg,
        ntok, heap.timeout_ns,
        HAS_ACT=has_act, HAS_SMALL=has_small, HAS_SMALL2=has_small2, HAS_NROWS=nrows is not None,
        **tile_args(heap, "stage", topk=False))
    heap.rows_busy = False  # the kernel waited for DONE of every earlier call from every peer, reads included
    heap.after_launch()
