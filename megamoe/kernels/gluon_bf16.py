"""bf16 grouped GEMM in Gluon for Hopper (sm_90a): the Gluon sibling of grouped_gemm._grouped_gemm_kernel for the
four expert-MLP GEMMs (GEMM1 + SwiGLU, GEMM2 with the gate scale, dgrad of GEMM2 + SwiGLU backward, dgrad of GEMM1).
It runs where a config asks for it (GemmConfig.kernel = "gluon", grouped_gemm.launch_grouped_gemm); the Triton
kernel stays the default.

Shape legend: R received rows, K reduction, N output columns, E_l local experts, offs int32 [E_l + 1] on the device,
rows >= offs[E_l] padding (never read as data, never written).
    a [R, K] bf16; w [E_l, N_w, K] (W_KN False, "nk": out = a @ w[e]^T) or [E_l, K, N_w] (W_KN True, "kn":
    out = a @ w[e], the two dgrads: w2 [E_l, H, I] with K = H, w13 [E_l, 2I, H] with K = 2I).
Grid: (P,) persistent programs over the tiles (e, mi, ni) of grouped_gemm.py's schedule (_expert_tiles /
_locate_tile, GROUP_M swizzle inside an expert); per tile acc = sum over k-steps of a[m, k] @ w[e][k, n] (fp32, in
K order: the Triton kernel's order, so with the same BLOCK_K the fp32 sums are the same up to the wgmma's internal
order) and the epilogues of grouped_gemm._epi_part with the same outputs, dtypes and rounding points:
    EPI_NONE     out [R, N] = acc (* scale[r]), bf16                                  (GEMM2, dgrad1)
    EPI_SWIGLU   acc2 = the same with the up columns N_UP + n; out [R, N] = silu(acc) * acc2 (GEMM1 + SwiGLU);
                 STORE_H also h[:, n] = acc, h[:, N + n] = acc2 (bf16)
    EPI_DSWIGLU  acc = dact = dy @ w2; g, u = h[:, n], h[:, N + n]; da = acc (* scale[r]);
                 out [R, 2N]: out[:, n] = da * u * silu'(g), out[:, N + n] = da * silu(g); with a scale also
                 dsp[ni, r] = sum over the tile's columns of acc * silu(g) * u (dsp [cdiv(N, BLOCK_N), R] fp32)
Example (dgrad2, I = 768, BLOCK_N = 128): tile ni = 2 of expert e reads w2 as the 2-D view [E_l * H, I] at rows
e * H + k0 .. k0 + 63, columns 256..383, and h[:, 256:384] (gate) and h[:, 1024:1152] (up) into shared memory.

Limits (``gluon_bf16_limits``; kernel="gluon" where one fails raises ValueError naming it): (BLOCK_M, warps) one of
(128, 8), (64, 4) (one warp along N: the epilogue's column slices are a register split); BLOCK_N 64, 128 or 256;
BLOCK_K 64 or 128; fp32 accumulator values per thread <= 128 (EPI_DSWIGLU: 64, its epilogue holds g, u and the
results besides); STAGES >= 2 (the launcher lowers it to cdiv(K, BLOCK_K) + 1 where K is short, so the ring's
look-ahead never reaches past the next tile) and ring + h tiles + staging in 227 KB; K > 0 a multiple of 8 and N a
multiple of 8 (TMA strides, 16-byte stores); weights are read through the 2-D views [E_l * N_w, K] (nk) and
[E_l * K, N_w] (kn), so a tile must not cross into the next expert: nk: N (SwiGLU: and N_UP) a multiple of BLOCK_N;
kn: K a multiple of BLOCK_K. CUDA tensors on compute capability 9.x, no interpreter (checked by the caller).

Design:
(a) persistent, the TMA ring carried across tiles: k-steps are numbered over the program's whole tile sequence
    (stage = step % STAGES, phase = (step // STAGES) & 1, one mbarrier per stage); at k-step k of a tile the stage
    freed by step k - 1 is refilled with step k + STAGES - 1, of this tile or (past its last k-step) of the
    program's next tile, located at the start of the tile. So the next tile's first STAGES - 1 k-steps are in
    flight while this tile's epilogue runs, and the next k-loop starts on loaded stages.
(b) async wgmma with the accumulator chained (acc = wgmma(a, b, acc)): warpgroup_mma_wait(1) (SwiGLU: 2, the gate
    and up groups of one k-step) leaves the k-step just issued in flight and proves the previous one done; a CTA
    barrier (both warpgroups past their wait) then frees its stage for the refill. B is taken from shared memory in
    either major order (nk: the [BLOCK_N, BLOCK_K] tile permuted; kn: the [BLOCK_K, BLOCK_N] tile as it is).
(c) EPI_DSWIGLU: the tile's h (gate and up, in 64-column chunks) is loaded by TMA into shared memory at the start of
    the tile, on its own mbarrier, so the epilogue reads g and u from shared memory (no global loads after the
    k-loop); the buffer is reloaded only after the epilogue's CTA barrier.
(d) epilogue in 64-column slices of the accumulator (a register split, no data movement); each slice's bf16 results
    go through shared memory (convert_layout) into a layout with 8 consecutive columns per thread: 16-byte masked
    stores (rows >= offs[e + 1] and columns >= N dropped; no TMA store, which cannot stop at a group's last row).
(e) SwiGLU: gate and up accumulators side by side (2 x BLOCK_M x BLOCK_N, two wgmmas per k-step on one a tile).

Compiler report (2026-11-30, ``python -m megamoe.sm90``, BF16_VARIANTS: sm_90a, Triton 3.6's ptxas, deepseek-v3
shapes on 8 experts, R = 1024; "1row": R = 1, E_l = 1): every variant 0 spill bytes, no wgmma serialisation
warning (C751x), wgmma.wait_group 1 (SwiGLU: 2) in the k-loop and 0 once after it, only 16-byte global stores
(plus the dsp row sums), and the SwiGLU backward loads nothing but the schedule and the scale from global memory.
    variant (block_m x block_n, block_k 64 unless noted)      registers   shared bytes
    none nk 128x128 s4 (+scale) / 64x128 4 warps s4           118 / 116   147584 / 106624
    none nk 128x256 s3 (+scale) / s4                          188 / 186   163960 / 213120
    none nk 128x128 block_k 128 s3 (+scale)                   118         213112
    none kn 128x128 s4 / 128x256 s3 (also 1row)               114 / 187   147584 / 163960
    swiglu 128x(2x128) s4 +h / s3 / 1row                      246 / 238 / 248   213120 / 163960
    swiglu 128x(2x64) s4 +h / 64x(2x64) 4 warps s4 +h         128 / 128   147584 / 106624
    dswiglu kn 128x128 s4 +scale (also s3, 1row) / no scale   255 / 176   213128 / 180360 (s3)
    dswiglu kn 128x64 s4 +scale / 64x64 4 warps s4 +scale     228 / 226   147592 / 90248
(The SwiGLU backward with the scale sits at ptxas's 255-register cap: its first variant spilled 4 bytes at 1row with
a row-and-column mask on g and u; the column mask alone, as now, compiles clean.) The KN weight tile [64, 128] and
[64, 256] is loaded as 64-column TMA boxes (the compiler splits the descriptor's block: tensordesc_meta block_size
[64, 64]).
Measured (one H200, 2026-11-30, commit 8c75adb, benchmarks/results/gluon-bf16-h200-2026-11-30-8c75adb.json,
4096 tokens/GPU): tests/test_gpu_gluon_bf16.py, 348 tests, passed at the first run; outputs bitwise equal to the
Triton kernel except the SwiGLU backward (1.4e-7). Against the Triton defaults (best Gluon config per op): dgrad2 +
SwiGLU 1.25x on qwen3-30b-a3b and 1.13x on deepseek-v3 at EP 4 (the h prefetch), 0.97x / 0.94x at EP 2; GEMM1 +
SwiGLU 0.97-1.03x; dgrad1 0.94-1.03x; GEMM2 0.94-0.98x. Hence opt-in only (docs/perf-notes.md, Grouped GEMM).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.kernels.gemm_config import GemmConfig, grid_size, record
from megamoe.kernels.gluon_fp8 import _add, _halves, _locate  # schedule and register-split helpers
from megamoe.kernels.grouped_gemm import EPI_DSWIGLU, EPI_NONE, EPI_SWIGLU

SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
WARP_SHAPES = ((128, 8), (64, 4))  # (BLOCK_M, warps): one warp along N (register-only epilogue slices)
EPI_COLS = 64  # columns per epilogue slice (and per h chunk: one 128-byte TMA box)


@gluon.jit
def _coords(tile, e_idx, starts_smem, cnts_smem, cum_smem, tiles_n, N, K, N_W,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, W_KN: gl.constexpr,
            sched: gl.constexpr):
    """The tile's first row and the origin of its weight tiles in the 2-D weight view: nk [E_l * N_W, K]: (row
    e * N_W + n0, column 0); kn [E_l * K, N_W]: (row e * K, column n0). Also (e, row_end, ni) for the epilogue."""
    cnts = cnts_smem.load(sched)
    e, row0, row_end, mi, ni = _locate(tile, e_idx, starts_smem.load(sched), cnts, (cnts + BLOCK_M - 1) // BLOCK_M,
                                       cum_smem.load(sched), tiles_n, GROUP_M)
    off_n = ni * BLOCK_N
    if W_KN:
        wr = e * K
        wc = off_n
    else:
        wr = e * N_W + off_n
        wc = off_n * 0
    return row0 + mi * BLOCK_M, wr, wc, row_end, ni


@gluon.jit
def _load_stage(a_desc, w_desc, bar, a_buf, b_buf, b2_buf, off_m, wr, wc, off_k, N_UP, nbytes: gl.constexpr,
                TWO_B: gl.constexpr, W_KN: gl.constexpr):
    """One ring stage: the a tile and the w tile (TWO_B: also the up tile, N_UP further along N) on bar."""
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_buf)
    if W_KN:
        tma.async_copy_global_to_shared(w_desc, [wr + off_k, wc], bar, b_buf)
        if TWO_B:
            tma.async_copy_global_to_shared(w_desc, [wr + off_k, wc + N_UP], bar, b2_buf)
    else:
        tma.async_copy_global_to_shared(w_desc, [wr, off_k], bar, b_buf)
        if TWO_B:
            tma.async_copy_global_to_shared(w_desc, [wr + N_UP, off_k], bar, b2_buf)


@gluon.jit
def _slices(x, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, mma_s: gl.constexpr):
    """x [BLOCK_M, BLOCK_N] in the wgmma layout -> BLOCK_N // 64 (1, 2 or 4) slices [BLOCK_M, 64] in mma_s (the
    wgmma layout of a 64-column tile: the same registers), padded to four with the first slice."""
    if BLOCK_N == 64:
        s0 = x
        s1 = x
        s2 = x
        s3 = x
    elif BLOCK_N == 128:
        s0, s1 = _halves(x, BLOCK_M, BLOCK_N)
        s2 = s0
        s3 = s0
    else:
        h0, h1 = _halves(x, BLOCK_M, BLOCK_N)
        s0, s1 = _halves(h0, BLOCK_M, BLOCK_N // 2)
        s2, s3 = _halves(h1, BLOCK_M, BLOCK_N // 2)
    return (gl.convert_layout(s0, mma_s, assert_trivial=True), gl.convert_layout(s1, mma_s, assert_trivial=True),
            gl.convert_layout(s2, mma_s, assert_trivial=True), gl.convert_layout(s3, mma_s, assert_trivial=True))


@gluon.jit
def _store(ptr, stride, off_m, off_n, row_end, N, val, BLOCK_M: gl.constexpr, NP: gl.constexpr,
           store_l: gl.constexpr):
    """val [BLOCK_M, NP] (bf16) -> ptr[off_m + i, off_n + j] for rows < row_end, columns < N; through shared memory
    into store_l (8 consecutive columns per thread: 16-byte stores)."""
    v = gl.convert_layout(val, store_l)
    srm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
    srn = off_n + gl.arange(0, NP, layout=gl.SliceLayout(0, store_l))
    ptrs = ptr + off_m.to(gl.int64) * stride + (gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
                                                * stride)[:, None] + srn[None, :]
    gl.store(ptrs, v, mask=(srm < row_end)[:, None] & (srn < N)[None, :])


@gluon.jit
def _epi_none(x, off_m, off_n, row_end, N, out_ptr, stride_om, scale_ptr, BLOCK_M: gl.constexpr,
              HAS_SCALE: gl.constexpr, mma_s: gl.constexpr, store_l: gl.constexpr):
    if HAS_SCALE:
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
        x = x * gl.load(scale_ptr + rm, mask=rm < row_end, other=0.0)[:, None]
    _store(out_ptr, stride_om, off_m, off_n, row_end, N, x.to(gl.bfloat16), BLOCK_M, 64, store_l)


@gluon.jit
def _epi_swiglu(g, u, off_m, off_n, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, BLOCK_M: gl.constexpr,
                STORE_H: gl.constexpr, store_l: gl.constexpr):
    if STORE_H:
        _store(h_ptr, stride_hm, off_m, off_n, row_end, N, g.to(gl.bfloat16), BLOCK_M, 64, store_l)
        _store(h_ptr + N, stride_hm, off_m, off_n, row_end, N, u.to(gl.bfloat16), BLOCK_M, 64, store_l)
    act = g / (1.0 + gl.exp(-g)) * u
    _store(out_ptr, stride_om, off_m, off_n, row_end, N, act.to(gl.bfloat16), BLOCK_M, 64, store_l)


@gluon.jit
def _epi_dswiglu(dact, g_buf, u_buf, off_m, off_n, row_end, N, out_ptr, stride_om, scale_ptr,
                 BLOCK_M: gl.constexpr, HAS_SCALE: gl.constexpr, mma_s: gl.constexpr, store_l: gl.constexpr):
    """One 64-column slice of the SwiGLU backward (grouped_gemm._epi_part, EPILOGUE 2): g, u from the tile's h
    chunks in shared memory, read in the accumulator's layout; returns the row sums of dact * silu(g) * u
    (HAS_SCALE, else 0), columns >= N and rows >= row_end counted as g = u = 0 as in the Triton kernel."""
    rn = off_n + gl.arange(0, 64, layout=gl.SliceLayout(0, mma_s))
    cmask = (rn < N)[None, :]  # rows >= row_end hold other rows' h (or padding): their results are dropped
    g = gl.where(cmask, g_buf.load(mma_s).to(gl.float32), 0.0)
    u = gl.where(cmask, u_buf.load(mma_s).to(gl.float32), 0.0)
    sig = 1.0 / (1.0 + gl.exp(-g))
    silu = g * sig
    da = dact
    part = gl.zeros([BLOCK_M], dtype=gl.float32, layout=gl.SliceLayout(1, mma_s))
    if HAS_SCALE:
        part = gl.sum(dact * silu * u, axis=1)
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
        da = dact * gl.load(scale_ptr + rm, mask=rm < row_end, other=0.0)[:, None]
    du = da * silu
    _store(out_ptr + N, stride_om, off_m, off_n, row_end, N, du.to(gl.bfloat16), BLOCK_M, 64, store_l)
    dg = da * u * (sig * (1.0 + g * (1.0 - sig)))
    _store(out_ptr, stride_om, off_m, off_n, row_end, N, dg.to(gl.bfloat16), BLOCK_M, 64, store_l)
    return part


@gluon.jit
def _gluon_bf16_grouped_kernel(
    a_desc,             # a [R, K] bf16, block [BLOCK_M, BLOCK_K]
    w_desc,             # nk: w as [E_l * N_W, K], block [BLOCK_N, BLOCK_K]; kn: [E_l * K, N_W], [BLOCK_K, BLOCK_N]
    h_desc,             # EPI_DSWIGLU: h [R, 2N] block [BLOCK_M, 64] (else a_desc, unused)
    out_ptr,            # out [R, N] bf16 (EPI_DSWIGLU: [R, 2N]), row stride stride_om
    h_ptr,              # EPI_SWIGLU with STORE_H: h [R, 2N] bf16 written, row stride stride_hm
    scale_ptr,          # [R] fp32 (HAS_SCALE)
    dsp_ptr,            # dsp [cdiv(N, BLOCK_N), R] fp32 (EPI_DSWIGLU, HAS_SCALE)
    offs_ptr,           # [E_l + 1] int32
    R, N, K, E_l, num_progs, stride_om, stride_hm,
    N_W,                # nk: weight rows per expert; kn: weight columns
    N_UP,               # EPI_SWIGLU: offset of the up projection along N
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    BLOCK_E: gl.constexpr, STAGES: gl.constexpr, EPILOGUE: gl.constexpr, W_KN: gl.constexpr,
    HAS_SCALE: gl.constexpr, STORE_H: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid: (P,) persistent programs; per tile the chained async-wgmma k-loop of the module docstring with the ring
    carried across tiles, then the epilogue in 64-column slices."""
    SWIGLU: gl.constexpr = EPILOGUE == 1
    DSWIGLU: gl.constexpr = EPILOGUE == 2
    NSL: gl.constexpr = BLOCK_N // 64  # epilogue slices
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 64, 16])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    # the schedule of grouped_gemm.py (_expert_tiles), parked in shared memory and reloaded per tile (registers)
    e_idx = gl.arange(0, BLOCK_E, layout=sched)
    emask = e_idx < E_l
    starts = gl.load(offs_ptr + e_idx, mask=emask, other=0)
    ends = gl.load(offs_ptr + e_idx + 1, mask=emask, other=0)
    cnts = gl.maximum(ends - starts, 0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = ((cnts + BLOCK_M - 1) // BLOCK_M) * tiles_n
    cum_end = gl.associative_scan(tiles, 0, _add)
    total = gl.sum(tiles, axis=0)
    k_tiles = gl.cdiv(K, BLOCK_K)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    starts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, starts)
    cnts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, cnts)
    cum_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, cum_end)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if W_KN:
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    else:
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    if SWIGLU:
        if W_KN:
            b2_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
        else:
            b2_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    else:
        b2_smem = b_smem  # unused
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    if DSWIGLU:  # the tile's h: NSL gate chunks then NSL up chunks of [BLOCK_M, 64]
        h_smem = gl.allocate_shared_memory(h_desc.dtype, [2 * NSL, BLOCK_M, 64], h_desc.layout)
        h_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(h_bar.index(0), count=1)
    fence_async_shared()
    gl.thread_barrier()

    pid = gl.program_id(0)
    # prologue: the first tile's first STAGES - 1 k-steps (the launcher keeps STAGES - 1 <= k_tiles)
    if pid < total:
        p_off_m, p_wr, p_wc, p_row_end, p_ni = _coords(pid, e_idx, starts_smem, cnts_smem, cum_smem, tiles_n, N, K,
                                                       N_W, BLOCK_M, BLOCK_N, GROUP_M, W_KN, sched)
        for s in gl.static_range(STAGES - 1):
            _load_stage(a_desc, w_desc, bars.index(s), a_smem.index(s), b_smem.index(s), b2_smem.index(s),
                        p_off_m, p_wr, p_wc, s * BLOCK_K, N_UP, nbytes, SWIGLU, W_KN)

    it = 0  # k-steps consumed by this program before the current tile
    tcount = 0  # tiles done by this program (phase of h_bar)
    for tile in range(pid, total, num_progs):
        off_m, wr, wc, row_end, ni = _coords(tile, e_idx, starts_smem, cnts_smem, cum_smem, tiles_n, N, K, N_W,
                                             BLOCK_M, BLOCK_N, GROUP_M, W_KN, sched)
        nxt = tile + num_progs
        has_next = nxt < total
        # (clamped to a real tile: the schedule's divisions are only defined there; unused without a next tile)
        n_off_m, n_wr, n_wc, n_row_end, n_ni = _coords(gl.minimum(nxt, total - 1), e_idx, starts_smem, cnts_smem,
                                                       cum_smem, tiles_n, N, K, N_W, BLOCK_M, BLOCK_N, GROUP_M, W_KN,
                                                       sched)
        off_n = ni * BLOCK_N
        if DSWIGLU:  # h of this tile into shared memory, under the k-loop (the previous epilogue is done with it)
            mbarrier.expect(h_bar.index(0), 2 * NSL * h_desc.block_type.nbytes)
            for c in gl.static_range(NSL):
                tma.async_copy_global_to_shared(h_desc, [off_m, off_n + c * 64], h_bar.index(0), h_smem.index(c))
                tma.async_copy_global_to_shared(h_desc, [off_m, N + off_n + c * 64], h_bar.index(0),
                                                h_smem.index(NSL + c))

        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        acc2 = acc
        for k in range(k_tiles):
            st = (it + k) % STAGES
            mbarrier.wait(bars.index(st), ((it + k) // STAGES) & 1)
            if W_KN:
                bv = b_smem.index(st)
                b2v = b2_smem.index(st)
            else:
                bv = b_smem.index(st).permute((1, 0))
                b2v = b2_smem.index(st).permute((1, 0))
            acc = warpgroup_mma(a_smem.index(st), bv, acc, is_async=True)
            if SWIGLU:
                acc2 = warpgroup_mma(a_smem.index(st), b2v, acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # k-step k - 1 is done on this warpgroup; past the barrier on both: its stage takes k-step k + STAGES - 1
            gl.thread_barrier()
            j = k + STAGES - 1
            sj = (it + j) % STAGES
            if j < k_tiles:
                _load_stage(a_desc, w_desc, bars.index(sj), a_smem.index(sj), b_smem.index(sj), b2_smem.index(sj),
                            off_m, wr, wc, j * BLOCK_K, N_UP, nbytes, SWIGLU, W_KN)
            elif has_next:
                _load_stage(a_desc, w_desc, bars.index(sj), a_smem.index(sj), b_smem.index(sj), b2_smem.index(sj),
                            n_off_m, n_wr, n_wc, (j - k_tiles) * BLOCK_K, N_UP, nbytes, SWIGLU, W_KN)
        if SWIGLU:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        it += k_tiles

        a0, a1, a2, a3 = _slices(acc, BLOCK_M, BLOCK_N, mma_s)
        if EPILOGUE == 0:
            _epi_none(a0, off_m, off_n, row_end, N, out_ptr, stride_om, scale_ptr, BLOCK_M, HAS_SCALE, mma_s,
                      store_l)
            if NSL > 1:
                _epi_none(a1, off_m, off_n + 64, row_end, N, out_ptr, stride_om, scale_ptr, BLOCK_M, HAS_SCALE,
                          mma_s, store_l)
            if NSL > 2:
                _epi_none(a2, off_m, off_n + 128, row_end, N, out_ptr, stride_om, scale_ptr, BLOCK_M, HAS_SCALE,
                          mma_s, store_l)
                _epi_none(a3, off_m, off_n + 192, row_end, N, out_ptr, stride_om, scale_ptr, BLOCK_M, HAS_SCALE,
                          mma_s, store_l)
        elif EPILOGUE == 1:
            u0, u1, u2, u3 = _slices(acc2, BLOCK_M, BLOCK_N, mma_s)
            _epi_swiglu(a0, u0, off_m, off_n, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, BLOCK_M, STORE_H,
                        store_l)
            if NSL > 1:
                _epi_swiglu(a1, u1, off_m, off_n + 64, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, BLOCK_M,
                            STORE_H, store_l)
            if NSL > 2:
                _epi_swiglu(a2, u2, off_m, off_n + 128, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, BLOCK_M,
                            STORE_H, store_l)
                _epi_swiglu(a3, u3, off_m, off_n + 192, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, BLOCK_M,
                            STORE_H, store_l)
        else:
            mbarrier.wait(h_bar.index(0), tcount & 1)
            part = _epi_dswiglu(a0, h_smem.index(0), h_smem.index(NSL), off_m, off_n, row_end, N, out_ptr,
                                stride_om, scale_ptr, BLOCK_M, HAS_SCALE, mma_s, store_l)
            if NSL > 1:
                part += _epi_dswiglu(a1, h_smem.index(1), h_smem.index(NSL + 1), off_m, off_n + 64, row_end, N,
                                     out_ptr, stride_om, scale_ptr, BLOCK_M, HAS_SCALE, mma_s, store_l)
            if HAS_SCALE:
                rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
                gl.store(dsp_ptr + ni.to(gl.int64) * R + rm, part, mask=rm < row_end)
            # every warp is done reading h before the next tile's TMA rewrites it (async proxy after generic reads)
            gl.thread_barrier()
            fence_async_shared()
        tcount += 1

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    if DSWIGLU:
        mbarrier.invalidate(h_bar.index(0))


def _acc_limit(epilogue: int) -> int:
    """fp32 accumulator values per thread a config may hold (see the module docstring)."""
    return 64 if epilogue == EPI_DSWIGLU else 128


def smem_bytes(cfg: GemmConfig, epilogue: int, stages: int | None = None) -> int:
    """Shared memory of a launch, estimated: ring, h chunks (EPI_DSWIGLU), one 64-column bf16 staging slice of the
    epilogue's layout conversion, schedule and barriers."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages = cfg.num_stages if stages is None else stages
    ring = stages * 2 * bk * (bm + (2 if epilogue == EPI_SWIGLU else 1) * bn)
    h = 2 * 2 * bm * bn if epilogue == EPI_DSWIGLU else 0
    return ring + h + 2 * bm * 64 + 2048


def gluon_bf16_limits(cfg: GemmConfig, *, n: int, k: int, n_w: int, epilogue: int, w_kn: bool = False,
                      n_up: int = 0) -> str | None:
    """Why the Gluon bf16 kernel cannot run this launch (config and shapes only; device checks are the caller's:
    grouped_gemm.gluon_bf16_unavailable), or None. n output columns (EPI_DSWIGLU: the width of h's halves), k
    reduction, n_w the weights' extent along N per expert (nk: w.shape[1], kn: w.shape[2])."""
    bm, bn, bk, warps, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages
    if epilogue not in (EPI_NONE, EPI_SWIGLU, EPI_DSWIGLU):
        return f"unknown epilogue {epilogue}"
    two = epilogue == EPI_SWIGLU
    if (bm, warps) not in WARP_SHAPES:
        return f"(block_m, num_warps) must be one of {WARP_SHAPES}, got ({bm}, {warps})"
    if bn not in (64, 128, 256):
        return f"block_n must be 64, 128 or 256 (whole 64-column epilogue slices), got {bn}"
    if bk not in (64, 128):
        return f"block_k must be 64 or 128, got {bk}"
    per_thread = (2 if two else 1) * bm * bn // (32 * warps)
    if per_thread > _acc_limit(epilogue):
        return (f"block_m * block_n{' * 2 (gate and up)' if two else ''} = {(2 if two else 1) * bm * bn} fp32 "
                f"accumulator values are {per_thread} registers per thread on {warps} warps, more than "
                f"{_acc_limit(epilogue)} for this epilogue (spills)")
    if stages < 2:
        return f"num_stages must be >= 2, got {stages}"
    smem = smem_bytes(cfg, epilogue)
    if smem > SMEM_LIMIT:
        return f"{stages} stages need ~{smem} bytes of shared memory, more than {SMEM_LIMIT}"
    if k <= 0 or k % 8:
        return f"K must be a positive multiple of 8 (16-byte TMA strides), got K = {k}"
    if n % 8:
        return f"N must be a multiple of 8 (16-byte TMA strides and stores), got N = {n}"
    if w_kn:
        if k % bk:
            return (f"K must be a multiple of {bk} (block_k) with kn weights ([E_l * K, N] view: a k-tile must "
                    f"stay inside its expert), got K = {k}")
        if two and n_up + n > n_w:
            return f"the up columns {n_up} + {n} exceed the weights' {n_w} columns"
    elif n % bn or (two and (n_up % bn or n_up + n > n_w)) or (not two and n != n_w):
        return (f"N must be a multiple of {bn} (block_n; SwiGLU: the up offset too, and the up rows inside the "
                f"expert's weights) so that a weight tile stays inside its expert; got N = {n}, up offset {n_up}, "
                f"{n_w} weight rows per expert")
    return None


def launch_stages(cfg: GemmConfig, k: int) -> int:
    """The ring depth a launch uses: cfg.num_stages, lowered to cdiv(K, BLOCK_K) + 1 for short K (the look-ahead of
    STAGES - 1 k-steps then never reaches past the next tile)."""
    return max(2, min(cfg.num_stages, triton.cdiv(k, cfg.block_k) + 1))


def launch_gluon_bf16(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                      *, n: int, w_kn: bool, epilogue: int, h: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None, dsp: torch.Tensor | None = None, store_h: bool = False,
                      n_up: int = 0) -> None:
    """Launch _gluon_bf16_grouped_kernel with the arguments of grouped_gemm.launch_grouped_gemm (operands validated
    by the caller, device checks too); ValueError naming the limit (``gluon_bf16_limits``) that fails."""
    R, K = a.shape
    E_l = w.shape[0]
    n_w = w.shape[2] if w_kn else w.shape[1]
    why = gluon_bf16_limits(cfg, n=n, k=K, n_w=n_w, epilogue=epilogue, w_kn=w_kn, n_up=n_up)
    if why is not None:
        raise ValueError(f"grouped_gemm (Gluon bf16 kernel): {why}")
    if R == 0 or E_l == 0 or n == 0:
        return
    bm, bn, bk, warps = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps
    bf = gl.bfloat16
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [bm, bk],
                              gl.NVMMASharedLayout.get_default_for([bm, bk], bf))
    if w_kn:
        w2d = w.view(E_l * K, n_w)
        wblock = [bk, bn]
    else:
        w2d = w.view(E_l * n_w, K)
        wblock = [bn, bk]
    w_desc = TensorDescriptor(w2d, list(w2d.shape), list(w2d.stride()), wblock,
                              gl.NVMMASharedLayout.get_default_for(wblock, bf))
    if epilogue == EPI_DSWIGLU:
        h_desc = TensorDescriptor(h, list(h.shape), list(h.stride()), [bm, EPI_COLS],
                                  gl.NVMMASharedLayout.get_default_for([bm, EPI_COLS], bf))
    else:
        h_desc = a_desc  # unused
    grid = grid_size(cfg, (triton.cdiv(R, bm) + E_l) * triton.cdiv(n, bn), a.device)
    if grid == 0:
        return
    dummy = out
    k = _gluon_bf16_grouped_kernel[(grid,)](
        a_desc, w_desc, h_desc, out, h if h is not None else dummy, scale if scale is not None else dummy,
        dsp if dsp is not None else dummy, offs,
        R, n, K, E_l, grid, out.stride(0), h.stride(0) if h is not None else 0, n_w, n_up,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(max(E_l, 2)),
        STAGES=launch_stages(cfg, K), EPILOGUE=epilogue, W_KN=w_kn, HAS_SCALE=scale is not None,
        STORE_H=store_h, num_warps=warps,
    )
    record("_gluon_bf16_grouped_kernel", k)


__all__ = ["gluon_bf16_limits", "launch_gluon_bf16", "launch_stages", "smem_bytes"]
