"""FP8 block-scaled grouped GEMM in Gluon with the per-128-K promotion overlapped with the next wgmma: the kernel
behind the FP8 ops of megamoe.experts on Hopper (grouped_gemm_fp8.launch_grouped_gemm_fp8 runs it where it can,
see ``gluon_limits`` and grouped_gemm_fp8.fp8_kernel; the Triton kernel of grouped_gemm_fp8.py elsewhere and under
the interpreter, which cannot run Gluon).

Shape legend: R received rows, K reduction, N output columns, N_w weight rows per expert (N, or 2I for SwiGLU),
E_l local experts, KB = cdiv(K, 128); offs int32 [E_l + 1] on the device, rows >= offs[E_l] padding.
    aq [R, K] e4m3, a_s [R, KB] fp32 (1x128 blocks); wq [E_l, N_w, K] e4m3, w_s [E_l, cdiv(N_w, 128), KB] fp32.
Grid: (P,) persistent programs over the tiles (e, mi, ni) of grouped_gemm.py's schedule; per tile
    acc = sum_kb (aq[m, kb] @ wq[e][n, kb]^T) * (a_s[m, kb] * w_s[e][n // 128, kb])        (fp32; n of one tile
                                                                       lie in one 128-row scale block)
and the epilogues of grouped_gemm._epi_part, with the same outputs, dtypes and rounding points:
    EPI_NONE     out [R, N] = acc (* scale[r])                                    (GEMM2, dgrad of GEMM1)
    EPI_SWIGLU   acc2 = the same with wq rows N_UP + n (up); out [R, N] = silu(acc) * acc2 (GEMM1 + SwiGLU);
                 STORE_H also h[:, n] = acc, h[:, N + n] = acc2 (bf16). BLOCK_N columns of gate and of up per tile.
    EPI_DSWIGLU  acc = dact = dy @ w2; g, u read from h [R, 2N]; da = acc (* scale[r]);
                 out [R, 2N]: out[:, n] = da * u * silu'(g), out[:, N + n] = da * silu(g); with a scale also
                 dsp[ni, r] = sum over the tile's columns of acc * silu(g) * u  (dsp [cdiv(N, BLOCK_N), R] fp32);
                 STORE_H here: also acts [R, N] = scale[r] * silu(g) * u (bf16; the gated activation dW2 needs)
Example (SwiGLU, I = 2048, BLOCK_N = 64): the tile ni = 5 of expert e reads w13 rows e * 4096 + 320..383 (gate,
scale block 2) and e * 4096 + 2368..2431 (up, scale block 18) and writes act[:, 320:384], h[:, 320:384] and
h[:, 2368:2432].
Limits (``gluon_limits``; forcing the kernel where one fails raises ValueError naming it): BLOCK_K 128; (BLOCK_M,
warps) one of (128, 8), (64, 8), (64, 4); BLOCK_N 64 or 128; (2 with SwiGLU, else 1) * BLOCK_M * BLOCK_N fp32
accumulator values <= 64 registers per thread; N (SwiGLU: and N_UP) a multiple of BLOCK_N: the weight descriptor
is the 2-D view [E_l * N_w, K], so a tile must not cross into the next expert; K > 0 and a multiple of 16 (TMA
strides); STAGES >= 2 and the ring plus the epilogue's staging in 227 KB of shared memory.

Why (2026-11-30): the Triton FP8 kernel runs at our bf16 rate, because the promotion ``acc += (a_k @ b_k) * s``
consumes each k-step's wgmma result at once and Triton 3.6's pipeliner then waits for every wgmma (``wgmma.wait_group
0``: the tensor cores idle during the scaling FMAs). Gluon exposes the waits: k-steps go in pairs; both products P_a
and P_b are issued asynchronously into fresh register tiles, ``warpgroup_mma_wait`` waits for P_a only, which is
meant to be scaled and added to ``acc`` while P_b runs on the tensor cores; then P_b is waited for and added. Three
fp32 [BLOCK_M, BLOCK_N] tiles live per program (acc, P_a, P_b): 192 registers per thread at 128 x 128 on 8 warps.
Loads: a STAGES-deep ring of TMA tiles with one mbarrier per stage; a stage is refilled once the wgmmas of every
warpgroup that read it have completed (the wait, then a CTA barrier).
What the SASS does (cuobjdump of the sm_90a cubin, megamoe.sm90.ffma_under_wgmma): ptxas moves a wgmma wait above
any independent instruction of its basic block, and LLVM sinks P_a's promotion FMAs past the CTA barrier into the
block of the last wait. So EPI_NONE (the loop measured below, kept unchanged) runs both promotions after
``wait_group 0``: no promotion overlaps a wgmma; its gain over Triton is two k-steps' wgmmas back to back. The new
epilogues pin their promotions: the accumulators pass through a no-op wait (which LLVM cannot sink past) before the
refill's conditional, a block boundary that ptxas does not move the next wait across. EPI_DSWIGLU, the same loop,
then runs P_a's promotion under P_b (1 of 2 per pair; 64 FFMAs at 128 x 128 on 8 warps, EPI_NONE 0).
SwiGLU (2026-11-30): gate and up tiles of BLOCK_N = 64 (acc, acc2), two wgmmas of N = 64 per k-step, four products
in flight: the same 128 columns of work, registers and ring bytes per stage as the plain 128 x 128 tile, and one
FMA per element per promotion (one 128-wide gate|up wgmma would need a per-column scale). Waits: for P_a's gate and
up, then P_b's gate; the three are promoted while P_b's up runs (the pinned block ends before its wait): 3 of 4
promotions under a wgmma (96 FFMAs per pair of k-steps at 128 x (64 + 64) on 8 warps).
Registers: the a-scale offsets are 32-bit from a 64-bit tile base (SwiGLU) and the schedule vectors live in shared
memory (SwiGLU and its backward; EPI_NONE keeps its code): 0 spills at every shape compiled (megamoe.sm90, and 7
preset/edge shapes incl. R = 1, E_l = 1), where 64-bit row pointers and register-held schedule vectors spilled 4-44
bytes (EPI_NONE spills 4-8 bytes at E_l = 1, R = 1000: the schedule, reloaded once per tile). Epilogues: NONE and
SWIGLU through shared memory (convert_layout) into a layout with 8 consecutive columns per thread, 16-byte stores;
DSWIGLU parks the fp32 tile in shared memory as column slices of 32 (split in registers, no data movement) and runs
a loop over them, one slice's values live at a time, h read with 16-byte loads (the whole 128 x 128 tile in
registers spilled 392 bytes per thread, two register halves 104, four unrolled slices up to 44).

Measured (one H200, 2026-11-30, bc1a88e, benchmarks/results/gluon-fp8-h200-2026-11-30-bc1a88e): plain epilogue,
128 x 128 tiles, 4 stages, 8 warps: 741-945 TFLOP/s on the deepseek-v3 / qwen3 / mixtral GEMM1 and GEMM2 shapes,
1.11-1.55x our bf16 Triton GEMMs and 1.25-1.51x the Triton FP8 kernel; 3 stages and 64-row tiles slower everywhere;
rel. difference from the Triton FP8 kernel 1.5-2.2e-5 (bf16 rounding of the same fp32 sums). The SwiGLU and
SwiGLU-backward epilogues compile for sm_90a without spills or serialised wgmmas; on the H200 (30f9c53, 141 GPU
tests passed) GEMM1+SwiGLU 1.13-1.20x and dgrad2+SwiGLU 1.16-1.35x our bf16 kernels (docs/perf-notes.md). Next steps:
pin EPI_NONE's promotion as EPI_DSWIGLU does (``PIN`` in the kernel) if the GPU confirms it pays; two consumer
warpgroups on different tiles (ping-pong) with per-stage "empty" barriers instead of CTA barriers.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.kernels.gemm_config import GemmConfig, grid_size, record
from megamoe.kernels.grouped_gemm import EPI_DSWIGLU, EPI_NONE, EPI_SWIGLU
from megamoe.kernels.grouped_gemm_fp8 import check_fp8

SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
WARP_SHAPES = ((128, 8), (64, 8), (64, 4))  # (BLOCK_M, warps); 128 rows on 4 warps spill


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _schedule(offs_ptr, E_l, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_E: gl.constexpr,
              layout: gl.constexpr):
    """The schedule of grouped_gemm.py (_expert_tiles restated with Gluon layouts; keep the two in step), read on
    the device: per-expert row starts, counts, m-tile counts and running tile ends, the total tile count. Also used
    by gluon_fp8_ws.py."""
    e_idx = gl.arange(0, BLOCK_E, layout=layout)
    emask = e_idx < E_l
    starts = gl.load(offs_ptr + e_idx, mask=emask, other=0)
    ends = gl.load(offs_ptr + e_idx + 1, mask=emask, other=0)
    cnts = gl.maximum(ends - starts, 0)
    m_tiles = (cnts + BLOCK_M - 1) // BLOCK_M
    tiles = m_tiles * gl.cdiv(N, BLOCK_N)
    cum_end = gl.associative_scan(tiles, 0, _add)
    return e_idx, starts, cnts, m_tiles, cum_end, gl.sum(tiles, axis=0)


@gluon.jit
def _epi_plain(acc, off_m, off_n, rm, mmask, row_end, N, out_ptr, scale_ptr, stride_om, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, HAS_SCALE: gl.constexpr, store_l: gl.constexpr):
    """out = acc (* scale[r]) as bf16 for a [BLOCK_M, BLOCK_N] tile (rm, mmask: its rows in acc's layout), through
    shared memory into a layout with 8 consecutive columns per thread (16-byte stores). Also used by
    gluon_fp8_ws.py."""
    if HAS_SCALE:
        acc = acc * gl.load(scale_ptr + rm, mask=mmask, other=0.0)[:, None]
    res = gl.convert_layout(acc.to(gl.bfloat16), store_l)
    srm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
    srn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_l))
    optrs = out_ptr + srm.to(gl.int64)[:, None] * stride_om + srn[None, :]
    gl.store(optrs, res, mask=(srm < row_end)[:, None] & (srn < N)[None, :])


@gluon.jit
def _locate(tile, e_idx, starts, cnts, m_tiles, cum_end, tiles_n, GROUP_M: gl.constexpr):
    """tile index -> (expert, its first row, its row end, m-block, n-block): grouped_gemm._locate_tile restated with
    Gluon layouts (a Triton @jit helper cannot be called from a Gluon kernel; keep the two in step). Also used by
    gluon_bf16.py."""
    e = gl.sum((cum_end <= tile).to(gl.int32), axis=0)
    sel = e_idx == e
    mt = gl.sum(gl.where(sel, m_tiles, 0), axis=0)
    t0 = gl.sum(gl.where(sel, cum_end, 0), axis=0) - mt * tiles_n
    row0 = gl.sum(gl.where(sel, starts, 0), axis=0)
    row_end = row0 + gl.sum(gl.where(sel, cnts, 0), axis=0)
    local = tile - t0
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    gsz = gl.minimum(mt - first_m, GROUP_M)
    mi = first_m + (local % width) % gsz
    ni = (local % width) // gsz
    return e, row0, row_end, mi, ni


@gluon.jit
def _load_stage(a_desc, w_desc, bar, a_buf, b_buf, b2_buf, off_m, wrow, wrow2, off_k, nbytes: gl.constexpr,
                TWO_B: gl.constexpr):
    """One ring stage: the a tile and the w tile (TWO_B: also the up tile at wrow2) into shared memory, on bar."""
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_buf)
    tma.async_copy_global_to_shared(w_desc, [wrow, off_k], bar, b_buf)
    if TWO_B:
        tma.async_copy_global_to_shared(w_desc, [wrow2, off_k], bar, b2_buf)


@gluon.jit
def _epi_swiglu(g, u, off_m, off_n, row_end, N, out_ptr, stride_om, h_ptr, stride_hm,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STORE_H: gl.constexpr, store_l: gl.constexpr):
    """act = silu(g) * u in fp32 (g, u in the MMA layout), stored as bf16; STORE_H: h[:, n] = g, h[:, N + n] = u."""
    act = g / (1.0 + gl.exp(-g)) * u
    srm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
    srn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_l))
    mask = (srm < row_end)[:, None] & (srn < N)[None, :]
    if STORE_H:
        hptrs = h_ptr + srm.to(gl.int64)[:, None] * stride_hm + srn[None, :]
        gl.store(hptrs, gl.convert_layout(g.to(gl.bfloat16), store_l), mask=mask)
        gl.store(hptrs + N, gl.convert_layout(u.to(gl.bfloat16), store_l), mask=mask)
    optrs = out_ptr + srm.to(gl.int64)[:, None] * stride_om + srn[None, :]
    gl.store(optrs, gl.convert_layout(act.to(gl.bfloat16), store_l), mask=mask)


@gluon.jit
def _epi_dswiglu_part(dact, off_m, off_n, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, scale_ptr, acts_ptr,
                      BLOCK_M: gl.constexpr, NP: gl.constexpr, HAS_SCALE: gl.constexpr, ACTS: gl.constexpr,
                      store_l: gl.constexpr):
    """SwiGLU backward on a [BLOCK_M, NP] column slice (grouped_gemm._epi_part, EPILOGUE 2), dact = acc in store_l
    (8 consecutive columns per thread): g, u read from h (16-byte loads); dg -> out[:, n], du -> out[:, N + n]
    (bf16). Returns the row sums of dact * silu(g) * u (HAS_SCALE; else 0); with HAS_SCALE da = dact * s[r].
    ACTS: also acts[:, n] = s[r] * silu(g) * u (acts [R, N] bf16 contiguous; without HAS_SCALE silu(g) * u), the
    operand of dW2 = dy^T @ acts when dy was pulled without its gate."""
    srm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
    srn = off_n + gl.arange(0, NP, layout=gl.SliceLayout(0, store_l))
    rmask = srm < row_end
    mask = rmask[:, None] & (srn < N)[None, :]
    hptrs = h_ptr + srm.to(gl.int64)[:, None] * stride_hm + srn[None, :]
    g = gl.load(hptrs, mask=mask, other=0.0).to(gl.float32)
    u = gl.load(hptrs + N, mask=mask, other=0.0).to(gl.float32)
    sig = 1.0 / (1.0 + gl.exp(-g))
    silu = g * sig
    da = dact
    part = gl.zeros([BLOCK_M], dtype=gl.float32, layout=gl.SliceLayout(1, store_l))
    if HAS_SCALE:
        su = silu * u
        part = gl.sum(dact * su, axis=1)
        s = gl.load(scale_ptr + srm, mask=rmask, other=0.0)
        da = dact * s[:, None]
        if ACTS:
            gl.store(acts_ptr + srm.to(gl.int64)[:, None] * N + srn[None, :], (su * s[:, None]).to(gl.bfloat16),
                     mask=mask)
    elif ACTS:
        gl.store(acts_ptr + srm.to(gl.int64)[:, None] * N + srn[None, :], (silu * u).to(gl.bfloat16), mask=mask)
    optrs = out_ptr + srm.to(gl.int64)[:, None] * stride_om + srn[None, :]
    dg = da * u * (sig * (1.0 + g * (1.0 - sig)))
    gl.store(optrs, dg.to(gl.bfloat16), mask=mask)
    du = da * silu
    gl.store(optrs + N, du.to(gl.bfloat16), mask=mask)
    return part


@gluon.jit
def _halves(x, BLOCK_M: gl.constexpr, NP: gl.constexpr):
    """[BLOCK_M, NP] -> (cols 0..NP/2-1, cols NP/2..NP-1); in the wgmma layout with one warp along N the split bit is
    a register bit, so this moves no data."""
    x = gl.permute(gl.reshape(x, [BLOCK_M, 2, NP // 2]), (0, 2, 1))
    return gl.split(x)


@gluon.jit
def _epi_dswiglu(acc, epi_smem, off_m, off_n, ni, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm, scale_ptr,
                 dsp_ptr, acts_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SLICES: gl.constexpr,
                 HAS_SCALE: gl.constexpr, ACTS: gl.constexpr, num_warps: gl.constexpr):
    """The SwiGLU backward epilogue of one tile: acc (fp32) split in registers into SLICES column slices, parked in
    shared memory (epi_smem [SLICES, BLOCK_M, NP]), then processed one slice per iteration of a loop (see the
    module docstring for what spilled otherwise); HAS_SCALE: dsp[ni, r] = the row sums over the tile's columns."""
    NP: gl.constexpr = BLOCK_N // SLICES
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (NP // 8), NP // 8], [num_warps, 1], [1, 0])
    if SLICES == 4:
        h0, h1 = _halves(acc, BLOCK_M, BLOCK_N)
        q0, q1 = _halves(h0, BLOCK_M, BLOCK_N // 2)
        q2, q3 = _halves(h1, BLOCK_M, BLOCK_N // 2)
        epi_smem.index(0).store(q0)
        epi_smem.index(1).store(q1)
        epi_smem.index(2).store(q2)
        epi_smem.index(3).store(q3)
    elif SLICES == 2:
        h0, h1 = _halves(acc, BLOCK_M, BLOCK_N)
        epi_smem.index(0).store(h0)
        epi_smem.index(1).store(h1)
    else:
        epi_smem.index(0).store(acc)
    gl.thread_barrier()  # written by every warp; rewritten only after the next tile's k-loop (CTA barriers)
    part = gl.zeros([BLOCK_M], dtype=gl.float32, layout=gl.SliceLayout(1, store_l))
    for c in range(SLICES):  # a loop, not unrolled: one slice's values live at a time
        dact = epi_smem.index(c).load(store_l)
        part += _epi_dswiglu_part(dact, off_m, off_n + c * NP, row_end, N, out_ptr, stride_om, h_ptr, stride_hm,
                                  scale_ptr, acts_ptr, BLOCK_M, NP, HAS_SCALE, ACTS, store_l)
    if HAS_SCALE:
        srm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
        gl.store(dsp_ptr + ni.to(gl.int64) * R + srm, part, mask=srm < row_end)


@gluon.jit
def _gluon_fp8_grouped_kernel(
    a_desc, w_desc,     # TMA descriptors: aq [R, K] block [BLOCK_M, 128]; wq as [E_l * N_W, K] block [BLOCK_N, 128]
    as_ptr, ws_ptr,     # a_s [R, KB] fp32 (row stride stride_asm), w_s [E_l, cdiv(N_W, 128), KB] fp32 contiguous
    out_ptr,            # out [R, N] bf16 (EPI_DSWIGLU: [R, 2N]), row stride stride_om
    h_ptr,              # h [R, 2N] bf16, row stride stride_hm: written (EPI_SWIGLU, STORE_H) or read (EPI_DSWIGLU)
    scale_ptr,          # [R] fp32 (HAS_SCALE)
    dsp_ptr,            # dsp [cdiv(N, BLOCK_N), R] fp32: gate-gradient partials (EPI_DSWIGLU, HAS_SCALE)
    acts_ptr,           # acts [R, N] bf16 contiguous: the gated activation (EPI_DSWIGLU with STORE_H)
    offs_ptr,           # [E_l + 1] int32
    R, N, K, E_l, num_progs,
    stride_asm, stride_wse, stride_wsn, stride_om, stride_hm,
    N_W, N_UP,          # rows of wq per expert; first row of the up projection (EPI_SWIGLU)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, EPILOGUE: gl.constexpr, HAS_SCALE: gl.constexpr, STORE_H: gl.constexpr,
    WARPS_M: gl.constexpr, INSTR_N: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid: (P,) persistent programs; tile (e, mi, ni) as in grouped_gemm.py's schedule; per tile the k-loop of the
    module docstring (pairs of k-steps, the first promoted while the second's wgmma runs), then the epilogue."""
    BLOCK_K: gl.constexpr = 128
    SWIGLU: gl.constexpr = EPILOGUE == 1
    # EPI_NONE keeps the k-loop that was measured (ptxas runs both of its promotions after the last wait, see the
    # module docstring); the SwiGLU backward, the same loop otherwise, pins P_a's promotion ahead of that wait
    PIN: gl.constexpr = EPILOGUE == 2
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M],
                                                  instr_shape=[16, INSTR_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [num_warps, 1], [1, 0])

    e_idx, starts, cnts, m_tiles, cum_end, total = _schedule(offs_ptr, E_l, N, BLOCK_M, BLOCK_N, BLOCK_E, sched)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    if SWIGLU:  # the up tiles
        b2_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    else:
        b2_smem = b_smem  # unused
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    # SwiGLU backward: the fp32 tile parked in shared memory as column slices of 32 (register-only split: with one
    # warp along N), else whole
    EPI_SLICES: gl.constexpr = BLOCK_N // 32 if WARPS_M == num_warps else 1
    if EPILOGUE == 2:
        epi_smem = gl.allocate_shared_memory(gl.float32, [EPI_SLICES, BLOCK_M, BLOCK_N // EPI_SLICES],
                                             gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0]))
    else:
        epi_smem = a_smem  # unused
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    if EPILOGUE != 0:  # the schedule vectors parked in shared memory and reloaded per tile: four registers fewer
        # across the tile loop (with them the SwiGLU variants spilled 4-44 bytes at some shapes; EPI_NONE keeps its
        # measured code, which spills 4-8 bytes at E_l = 1, R = 1000)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        starts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, starts)
        cnts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, cnts)
        cum_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, cum_end)
        gl.thread_barrier()

    it = 0  # k-steps issued by this program so far: stage = it % STAGES, barrier phase = (it // STAGES) & 1
    for tile in range(gl.program_id(0), total, num_progs):
        if EPILOGUE != 0:
            cnts_t = cnts_smem.load(sched)
            e, row0, row_end, mi, ni = _locate(tile, e_idx, starts_smem.load(sched), cnts_t,
                                               (cnts_t + BLOCK_M - 1) // BLOCK_M, cum_smem.load(sched), tiles_n,
                                               GROUP_M)
        else:
            e, row0, row_end, mi, ni = _locate(tile, e_idx, starts, cnts, m_tiles, cum_end, tiles_n, GROUP_M)
        off_m = row0 + mi * BLOCK_M
        off_n = ni * BLOCK_N
        if SWIGLU:
            wrow = e * N_W + off_n
        else:
            wrow = e * N + off_n
        wrow2 = wrow + N_UP

        for s in gl.static_range(STAGES):  # prologue: the first STAGES k-steps in flight
            if s < k_tiles:
                st = (it + s) % STAGES
                _load_stage(a_desc, w_desc, bars.index(st), a_smem.index(st), b_smem.index(st), b2_smem.index(st),
                            off_m, wrow, wrow2, s * BLOCK_K, nbytes, SWIGLU)

        rm = off_m + gl.arange(0, BLOCK_M, layout=rows_l)
        mmask = rm < row_end
        if SWIGLU:  # a 64-bit tile base and 32-bit in-tile offsets (fewer registers than 64-bit row pointers)
            as_tile = as_ptr + off_m.to(gl.int64) * stride_asm
            as_off = gl.arange(0, BLOCK_M, layout=rows_l) * stride_asm
        else:
            as_row = as_ptr + rm.to(gl.int64) * stride_asm
        ws_tile = ws_ptr + e.to(gl.int64) * stride_wse + (off_n // 128) * stride_wsn
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        if SWIGLU:
            d2 = ((N_UP + off_n) // 128 - off_n // 128) * stride_wsn  # the up tile's scales: ws_tile + d2
            acc2 = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        # k-steps in pairs: both products issued, the first promoted while the second runs. (A product carried
        # in flight across the loop's back edge makes ptxas serialise every wgmma, warning C7514: the one-step
        # lag of the first version of this kernel compiled to wait-after-every-wgmma.)
        for kk in range(k_tiles // 2):
            ka = 2 * kk
            if SWIGLU:
                sa_a = gl.load(as_tile + (as_off + ka), mask=mmask, other=0.0)
                sa_b = gl.load(as_tile + (as_off + ka + 1), mask=mmask, other=0.0)
                sc_a = sa_a * gl.load(ws_tile + ka)
                sc_b = sa_b * gl.load(ws_tile + ka + 1)
                sc2_a = sa_a * gl.load(ws_tile + (d2 + ka))
                sc2_b = sa_b * gl.load(ws_tile + (d2 + ka + 1))
                sta = (it + ka) % STAGES
                mbarrier.wait(bars.index(sta), ((it + ka) // STAGES) & 1)
                pa = warpgroup_mma(a_smem.index(sta), b_smem.index(sta).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                pa2 = warpgroup_mma(a_smem.index(sta), b2_smem.index(sta).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                stb = (it + ka + 1) % STAGES
                mbarrier.wait(bars.index(stb), ((it + ka + 1) // STAGES) & 1)
                pb = warpgroup_mma(a_smem.index(stb), b_smem.index(stb).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                pb2 = warpgroup_mma(a_smem.index(stb), b2_smem.index(stb).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                # P_a's gate and up, then P_b's gate promoted while P_b's up runs (3 of 4 promotions overlap a
                # wgmma). ptxas moves a wait above any independent instruction of its basic block, so the wait for
                # P_b's up sits behind the conditional refill (a block boundary), and the accumulators pass through
                # a no-op wait before it (else LLVM sinks the FMAs past the boundary, as in EPI_NONE's SASS).
                done, done2 = warpgroup_mma_wait(num_outstanding=2, deps=(pa, pa2))
                acc = acc + done * sc_a[:, None]
                acc2 = acc2 + done2 * sc2_a[:, None]
                done = warpgroup_mma_wait(num_outstanding=1, deps=(pb,))
                acc = acc + done * sc_b[:, None]
                acc, acc2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, acc2))
                gl.thread_barrier()  # P_a's stage is free once every warpgroup got here
                if ka + STAGES < k_tiles:
                    _load_stage(a_desc, w_desc, bars.index(sta), a_smem.index(sta), b_smem.index(sta),
                                b2_smem.index(sta), off_m, wrow, wrow2, (ka + STAGES) * BLOCK_K, nbytes, True)
                done2 = warpgroup_mma_wait(num_outstanding=0, deps=(pb2,))
                acc2 = acc2 + done2 * sc2_b[:, None]
                gl.thread_barrier()
                if ka + 1 + STAGES < k_tiles:
                    _load_stage(a_desc, w_desc, bars.index(stb), a_smem.index(stb), b_smem.index(stb),
                                b2_smem.index(stb), off_m, wrow, wrow2, (ka + 1 + STAGES) * BLOCK_K, nbytes, True)
            else:
                sc_a = gl.load(as_row + ka, mask=mmask, other=0.0) * gl.load(ws_tile + ka)
                sc_b = gl.load(as_row + ka + 1, mask=mmask, other=0.0) * gl.load(ws_tile + ka + 1)
                sta = (it + ka) % STAGES
                mbarrier.wait(bars.index(sta), ((it + ka) // STAGES) & 1)
                pa = warpgroup_mma(a_smem.index(sta), b_smem.index(sta).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                stb = (it + ka + 1) % STAGES
                mbarrier.wait(bars.index(stb), ((it + ka + 1) // STAGES) & 1)
                pb = warpgroup_mma(a_smem.index(stb), b_smem.index(stb).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))  # P_a done, P_b still running
                acc = acc + done * sc_a[:, None]
                if PIN:  # keeps P_a's promotion ahead of the refill's block boundary: overlapped with P_b in SASS
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # P_a's stage is free once every warpgroup got here (each waits for its own wgmmas only)
                gl.thread_barrier()
                if ka + STAGES < k_tiles:
                    _load_stage(a_desc, w_desc, bars.index(sta), a_smem.index(sta), b_smem.index(sta),
                                b2_smem.index(sta), off_m, wrow, wrow2, (ka + STAGES) * BLOCK_K, nbytes, False)
                done = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
                acc = acc + done * sc_b[:, None]
                gl.thread_barrier()
                if ka + 1 + STAGES < k_tiles:
                    _load_stage(a_desc, w_desc, bars.index(stb), a_smem.index(stb), b_smem.index(stb),
                                b2_smem.index(stb), off_m, wrow, wrow2, (ka + 1 + STAGES) * BLOCK_K, nbytes, False)
        if k_tiles % 2 == 1:  # an odd last k-step, on its own
            kl = k_tiles - 1
            stl = (it + kl) % STAGES
            mbarrier.wait(bars.index(stl), ((it + kl) // STAGES) & 1)
            if SWIGLU:
                sa_l = gl.load(as_tile + (as_off + kl), mask=mmask, other=0.0)
                pl = warpgroup_mma(a_smem.index(stl), b_smem.index(stl).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)
                pl2 = warpgroup_mma(a_smem.index(stl), b2_smem.index(stl).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                last, last2 = warpgroup_mma_wait(num_outstanding=0, deps=(pl, pl2))
                acc = acc + last * (sa_l * gl.load(ws_tile + kl))[:, None]
                acc2 = acc2 + last2 * (sa_l * gl.load(ws_tile + (d2 + kl)))[:, None]
            else:
                last = warpgroup_mma(a_smem.index(stl), b_smem.index(stl).permute((1, 0)), zero, use_acc=False)
                acc = acc + last * (gl.load(as_row + kl, mask=mmask, other=0.0) * gl.load(ws_tile + kl))[:, None]
            gl.thread_barrier()
        it += k_tiles

        if EPILOGUE == 0:
            _epi_plain(acc, off_m, off_n, rm, mmask, row_end, N, out_ptr, scale_ptr, stride_om, BLOCK_M, BLOCK_N,
                       HAS_SCALE, store_l)
        elif EPILOGUE == 1:
            _epi_swiglu(acc, acc2, off_m, off_n, row_end, N, out_ptr, stride_om, h_ptr, stride_hm,
                        BLOCK_M, BLOCK_N, STORE_H, store_l)
        else:
            _epi_dswiglu(acc, epi_smem, off_m, off_n, ni, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                         scale_ptr, dsp_ptr, acts_ptr, BLOCK_M, BLOCK_N, EPI_SLICES, HAS_SCALE, STORE_H, num_warps)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def gluon_limits(cfg: GemmConfig, *, n: int, k: int, n_w: int, epilogue: int, n_up: int = 0) -> str | None:
    """Why the Gluon kernel cannot run this launch (config and shapes only; device checks are the caller's), or
    None. n output columns (EPI_DSWIGLU: the width of h's halves), k reduction, n_w weight rows per expert."""
    bm, bn, warps, stages = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages
    two = epilogue == EPI_SWIGLU
    if cfg.block_k != 128:
        return f"block_k must be 128 (one scale per k-step), got {cfg.block_k}"
    if (bm, warps) not in WARP_SHAPES:
        return f"(block_m, num_warps) must be one of {WARP_SHAPES}, got ({bm}, {warps})"
    if bn not in (64, 128):
        return f"block_n must be 64 or 128 (a tile inside one 128-row weight-scale block), got {bn}"
    if (2 if two else 1) * bm * bn > 64 * 32 * warps:
        return (f"block_m * block_n{' * 2 (gate and up)' if two else ''} = {(2 if two else 1) * bm * bn} fp32 "
                f"accumulator values exceed 64 registers per thread on {warps} warps (three such sets live: spills)")
    if stages < 2:
        return f"num_stages must be >= 2, got {stages}"
    # the ring, plus the epilogue's staging (fp32 tile; else the bf16 layout conversion), schedule and barriers
    smem = stages * 128 * (bm + (2 if two else 1) * bn) + bm * bn * (4 if epilogue == EPI_DSWIGLU else 2) + 4096
    if smem > SMEM_LIMIT:
        return f"{stages} stages need ~{smem} bytes of shared memory, more than {SMEM_LIMIT}"
    if k <= 0 or k % 16:
        return f"K must be a positive multiple of 16 (TMA strides), got K = {k}"
    if n % bn or (two and (n_up % bn or n_up + n > n_w)) or (not two and n != n_w):
        return (f"N must be a multiple of {bn} (block_n; SwiGLU: the up offset too, and the up rows inside the "
                f"expert's weights) so that a weight tile stays inside its expert; got N = {n}, up offset {n_up}, "
                f"{n_w} weight rows per expert")
    return None


def launch_gluon_fp8(aq: torch.Tensor, a_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor, offs: torch.Tensor,
                     out: torch.Tensor, cfg: GemmConfig, *, n: int, epilogue: int, h: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None, dsp: torch.Tensor | None = None, store_h: bool = False,
                     n_up: int = 0, acts: torch.Tensor | None = None) -> None:
    """Launch _gluon_fp8_grouped_kernel with the arguments of grouped_gemm_fp8.launch_grouped_gemm_fp8 (operands
    validated by the caller); ValueError naming the limit (``gluon_limits``) that fails."""
    R, K = aq.shape
    E_l, N_w, _ = wq.shape
    why = gluon_limits(cfg, n=n, k=K, n_w=N_w, epilogue=epilogue, n_up=n_up)
    if why is not None:
        raise ValueError(f"grouped_gemm_fp8 (Gluon kernel): {why}")
    if R == 0 or E_l == 0 or n == 0:
        return
    bm, bn, warps = cfg.block_m, cfg.block_n, cfg.num_warps
    warps_m = min(warps, bm // 16)
    instr_n = bn // (warps // warps_m)
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    a_desc = TensorDescriptor(aq, list(aq.shape), list(aq.stride()), [bm, 128], a_layout)
    w2d = wq.view(E_l * N_w, K)
    w_desc = TensorDescriptor(w2d, list(w2d.shape), list(w2d.stride()), [bn, 128], w_layout)
    grid = grid_size(cfg, (triton.cdiv(R, bm) + E_l) * (n // bn), aq.device)
    dummy = out
    k = _gluon_fp8_grouped_kernel[(grid,)](
        a_desc, w_desc, a_s, w_s, out, h if h is not None else dummy, scale if scale is not None else dummy,
        dsp if dsp is not None else dummy, acts if acts is not None else dummy, offs,
        R, n, K, E_l, grid, a_s.stride(0), w_s.stride(0), w_s.stride(1), out.stride(0),
        h.stride(0) if h is not None else 0, N_w, n_up,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(max(E_l, 2)), STAGES=cfg.num_stages,
        EPILOGUE=epilogue, HAS_SCALE=scale is not None, STORE_H=store_h or acts is not None, WARPS_M=warps_m,
        INSTR_N=instr_n,
        num_warps=warps,
    )
    record("_gluon_fp8_grouped_kernel", k)


def grouped_gemm_fp8_gluon(aq: torch.Tensor, a_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor,
                           offs: torch.Tensor, *, scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           block_m: int = 128, block_n: int = 128, stages: int = 4, num_warps: int = 8,
                           num_sms: int | None = None) -> torch.Tensor:
    """out [R, N] bf16 = the plain FP8 grouped GEMM (EPI_NONE, optional row scale) on the Gluon kernel, whatever the
    device (benchmarks and tests; megamoe.experts.grouped_gemm_fp8 picks the kernel itself)."""
    check_fp8(aq, a_s, wq, w_s, offs, "grouped_gemm_fp8_gluon")
    from megamoe.experts import _check_scale, _out  # lazy: megamoe.experts imports the kernels

    _check_scale(scale, aq.shape[0], "grouped_gemm_fp8_gluon")
    out = _out(out, (aq.shape[0], wq.shape[1]), aq)
    cfg = GemmConfig(block_m=block_m, block_n=block_n, block_k=128, num_stages=stages, num_warps=num_warps,
                     num_sms=num_sms, kernel="gluon")
    launch_gluon_fp8(aq, a_s, wq, w_s, offs, out, cfg, n=wq.shape[1], epilogue=EPI_NONE, scale=scale)
    return out


__all__ = ["gluon_limits", "launch_gluon_fp8", "grouped_gemm_fp8_gluon"]
