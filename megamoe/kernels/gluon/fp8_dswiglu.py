"""The FP8 SwiGLU backward on Hopper, in Gluon: dh = d(silu(g) * u) for dact = dy @ w2[e] on e4m3 block-scaled
operands, with the gate-gradient partial sums and the gated activation from the epilogue (the default of
megamoe.experts.gemm2_dgrad_swiglu_fp8 on sm_90 where ``dswiglu_limits`` hold; the Triton FP8 kernel elsewhere).

Shape legend: R received rows, K = H reduction, N = I output columns (of each of h's halves), E_l local experts,
KB = cdiv(K, 128); dyq [R, K] e4m3, dy_s [R, KB] fp32, w2tq [E_l, N, K] e4m3, w2t_s [E_l, cdiv(N, 128), KB] fp32.
Persistent programs over the schedule's tiles; per tile
    dact = sum_kb (dyq[m, kb] @ w2tq[e][n, kb]^T) * (dy_s[m, kb] * w2t_s[e][n // 128, kb])      (fp32)
then tiles.epi_part's EPI_DSWIGLU (the same outputs, dtypes and rounding points).

k-loop: k-steps in pairs; both products P_a and P_b are issued asynchronously into fresh register tiles, and P_a's
promotion (acc += P_a * scale) runs while P_b is on the tensor cores. ptxas moves a wgmma wait above any independent
instruction of its basic block, so the accumulator passes through a no-op wait before the refill's conditional (a
block boundary) to keep P_a's promotion there, overlapping P_b in SASS (megamoe.testing.sm90.ffma_under_wgmma counts
it). A stage is refilled once every warpgroup's wgmmas that read it completed (the wait, then a CTA barrier).
Epilogue: the fp32 tile parked in shared memory as 32-column slices (split in registers, no data movement), one
slice live at a time, h read with 16-byte loads (the whole tile in registers spilled).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.kernels.gemm_config import GemmConfig, grid_size, record
from megamoe.kernels.gluon.common import locate, nvmma_desc, parts, schedule, stages_reason

WARP_SHAPES = ((128, 8), (64, 8), (64, 4))  # (BLOCK_M, warps); 128 rows on 4 warps spill (three fp32 tiles live)


@gluon.jit
def _load_stage(a_desc, w_desc, bars, a_smem, b_smem, st, off_m, wrow, off_k):
    """Ring stage st: the a tile and the w tile into shared memory, on bars[st]."""
    bar, a_buf, b_buf = bars.index(st), a_smem.index(st), b_smem.index(st)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_buf)
    tma.async_copy_global_to_shared(w_desc, [wrow, off_k], bar, b_buf)


@gluon.jit
def _epi_dswiglu_part(dact, off_m, off_n, row_end, N, out_ptr, stride_om, h_ptr, stride_hm, scale_ptr, acts_ptr,
                      BLOCK_M: gl.constexpr, NP: gl.constexpr, HAS_SCALE: gl.constexpr, ACTS: gl.constexpr,
                      store_l: gl.constexpr):
    """SwiGLU backward (tiles.epi_part, EPI_DSWIGLU) on a [BLOCK_M, NP] column slice, dact in store_l (8 consecutive
    columns per thread, 16-byte loads of h). Returns the gate-gradient row sums (HAS_SCALE; else 0)."""
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
    acts = silu * u  # the gated activation (times the scale where there is one)
    if HAS_SCALE:
        part = gl.sum(dact * acts, axis=1)
        s = gl.load(scale_ptr + srm, mask=rmask, other=0.0)
        da = dact * s[:, None]
        acts = acts * s[:, None]
    if ACTS:
        gl.store(acts_ptr + srm.to(gl.int64)[:, None] * N + srn[None, :], acts.to(gl.bfloat16), mask=mask)
    optrs = out_ptr + srm.to(gl.int64)[:, None] * stride_om + srn[None, :]
    dg = da * u * (sig * (1.0 + g * (1.0 - sig)))
    gl.store(optrs, dg.to(gl.bfloat16), mask=mask)
    du = da * silu
    gl.store(optrs + N, du.to(gl.bfloat16), mask=mask)
    return part


@gluon.jit
def _epi_dswiglu(acc, epi_smem, off_m, off_n, ni, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm, scale_ptr,
                 dsp_ptr, acts_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SLICES: gl.constexpr,
                 HAS_SCALE: gl.constexpr, ACTS: gl.constexpr, num_warps: gl.constexpr):
    """The SwiGLU backward epilogue of one tile: acc parked in epi_smem [SLICES, BLOCK_M, NP], then one slice per
    loop iteration; HAS_SCALE: dsp[ni, r] = the row sums over the tile's columns."""
    NP: gl.constexpr = BLOCK_N // SLICES
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (NP // 8), NP // 8], [num_warps, 1], [1, 0])
    q = parts(acc, BLOCK_M, BLOCK_N, SLICES)
    for c in gl.static_range(SLICES):
        epi_smem.index(c).store(q[c])
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
def _gluon_fp8_dswiglu_kernel(
    a_desc, w_desc,     # TMA descriptors: aq [R, K] block [BLOCK_M, 128]; wq as [E_l * N, K] block [BLOCK_N, 128]
    as_ptr, ws_ptr,     # a_s [R, KB] fp32 (row stride stride_asm), w_s [E_l, cdiv(N, 128), KB] fp32 contiguous
    out_ptr,            # out [R, 2N] bf16 (dg | du), row stride stride_om
    h_ptr,              # h [R, 2N] bf16, row stride stride_hm (read)
    scale_ptr,          # [R] fp32 (HAS_SCALE)
    dsp_ptr,            # dsp [cdiv(N, BLOCK_N), R] fp32: gate-gradient partials (HAS_SCALE)
    acts_ptr,           # acts [R, N] bf16 contiguous: the gated activation (ACTS)
    offs_ptr,           # [E_l + 1] int32
    R, N, K, E_l, num_progs,
    stride_asm, stride_wse, stride_wsn, stride_om, stride_hm,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, HAS_SCALE: gl.constexpr, ACTS: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Grid: (P,) persistent programs; per tile the paired k-loop of the module docstring, then the epilogue."""
    BLOCK_K: gl.constexpr = 128
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M],
                                                  instr_shape=[16, INSTR_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)

    e_idx, starts, cnts, m_tiles, cum_end, total = schedule(offs_ptr, E_l, N, BLOCK_M, BLOCK_N, BLOCK_E, sched)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    # 32-column slices where the split is register-only (one warp along N), else the whole tile
    EPI_SLICES: gl.constexpr = BLOCK_N // 32 if WARPS_M == num_warps else 1
    epi_smem = gl.allocate_shared_memory(gl.float32, [EPI_SLICES, BLOCK_M, BLOCK_N // EPI_SLICES],
                                         gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0]))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    # the schedule vectors parked in shared memory and reloaded per tile: four registers fewer across the tile loop
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    starts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, starts)
    cnts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, cnts)
    cum_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat, cum_end)
    gl.thread_barrier()

    it = 0  # k-steps issued by this program so far: stage = it % STAGES, barrier phase = (it // STAGES) & 1
    for tile in range(gl.program_id(0), total, num_progs):
        cnts_t = cnts_smem.load(sched)
        e, row0, row_end, mi, ni = locate(tile, e_idx, starts_smem.load(sched), cnts_t,
                                          (cnts_t + BLOCK_M - 1) // BLOCK_M, cum_smem.load(sched), tiles_n, GROUP_M)
        off_m = row0 + mi * BLOCK_M
        off_n = ni * BLOCK_N
        wrow = e * N + off_n

        for s in gl.static_range(STAGES):  # prologue: the first STAGES k-steps in flight
            if s < k_tiles:
                _load_stage(a_desc, w_desc, bars, a_smem, b_smem, (it + s) % STAGES, off_m, wrow, s * BLOCK_K)

        rm = off_m + gl.arange(0, BLOCK_M, layout=rows_l)
        mmask = rm < row_end
        as_row = as_ptr + rm.to(gl.int64) * stride_asm
        ws_tile = ws_ptr + e.to(gl.int64) * stride_wse + (off_n // 128) * stride_wsn
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        # k-steps in pairs (a product carried in flight across the loop's back edge makes ptxas serialise every
        # wgmma, warning C7514)
        for kk in range(k_tiles // 2):
            ka = 2 * kk
            sc_a = gl.load(as_row + ka, mask=mmask, other=0.0) * gl.load(ws_tile + ka)
            sc_b = gl.load(as_row + ka + 1, mask=mmask, other=0.0) * gl.load(ws_tile + ka + 1)
            sta = (it + ka) % STAGES
            mbarrier.wait(bars.index(sta), ((it + ka) // STAGES) & 1)
            pa = warpgroup_mma(a_smem.index(sta), b_smem.index(sta).permute((1, 0)), zero, use_acc=False, is_async=True)
            stb = (it + ka + 1) % STAGES
            mbarrier.wait(bars.index(stb), ((it + ka + 1) // STAGES) & 1)
            pb = warpgroup_mma(a_smem.index(stb), b_smem.index(stb).permute((1, 0)), zero, use_acc=False, is_async=True)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))  # P_a done, P_b still running
            acc = acc + done * sc_a[:, None]
            # keeps P_a's promotion ahead of the refill's block boundary: overlapped with P_b in SASS
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # P_a's stage is free once every warpgroup got here (each waits for its own wgmmas only)
            gl.thread_barrier()
            if ka + STAGES < k_tiles:
                _load_stage(a_desc, w_desc, bars, a_smem, b_smem, sta, off_m, wrow, (ka + STAGES) * BLOCK_K)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
            acc = acc + done * sc_b[:, None]
            gl.thread_barrier()
            if ka + 1 + STAGES < k_tiles:
                _load_stage(a_desc, w_desc, bars, a_smem, b_smem, stb, off_m, wrow, (ka + 1 + STAGES) * BLOCK_K)
        if k_tiles % 2 == 1:  # an odd last k-step, on its own
            kl = k_tiles - 1
            stl = (it + kl) % STAGES
            mbarrier.wait(bars.index(stl), ((it + kl) // STAGES) & 1)
            last = warpgroup_mma(a_smem.index(stl), b_smem.index(stl).permute((1, 0)), zero, use_acc=False)
            acc = acc + last * (gl.load(as_row + kl, mask=mmask, other=0.0) * gl.load(ws_tile + kl))[:, None]
            gl.thread_barrier()
        it += k_tiles

        _epi_dswiglu(acc, epi_smem, off_m, off_n, ni, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm, scale_ptr,
                     dsp_ptr, acts_ptr, BLOCK_M, BLOCK_N, EPI_SLICES, HAS_SCALE, ACTS, num_warps)

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def dswiglu_limits(cfg: GemmConfig, *, n: int, k: int, n_w: int) -> str | None:
    """Why the kernel cannot run this launch (config and shapes only; device checks are the caller's), or None. n: the
    width of h's halves (N = I), k reduction (H), n_w weight rows per expert (w2t: I)."""
    bm, bn, warps, stages = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages
    if cfg.block_k != 128:
        return f"block_k must be 128 (one scale per k-step), got {cfg.block_k}"
    if (bm, warps) not in WARP_SHAPES:
        return f"(block_m, num_warps) must be one of {WARP_SHAPES}, got ({bm}, {warps})"
    if bn not in (64, 128):
        return f"block_n must be 64 or 128 (a tile inside one 128-row weight-scale block), got {bn}"
    smem = stages * 128 * (bm + bn) + bm * bn * 4 + 4096  # the ring, the fp32 epilogue tile, schedule and barriers
    if (why := stages_reason(cfg, smem)) is not None:
        return why
    if k <= 0 or k % 16:
        return f"K must be a positive multiple of 16 (TMA strides), got K = {k}"
    if n % bn or n != n_w:
        return (f"N must be a multiple of {bn} (block_n) and equal the weight rows per expert, so that a weight tile "
                f"stays inside its expert; got N = {n}, {n_w} weight rows per expert")
    return None


def launch_gluon_fp8_dswiglu(dyq: torch.Tensor, dy_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor,
                             offs: torch.Tensor, out: torch.Tensor, cfg: GemmConfig, *, n: int, h: torch.Tensor,
                             scale: torch.Tensor | None = None, dsp: torch.Tensor | None = None,
                             acts: torch.Tensor | None = None) -> None:
    """Launch _gluon_fp8_dswiglu_kernel with the arguments of grouped_gemm.launch_grouped_gemm's FP8 launch (operands
    validated by the caller); ValueError naming the failing limit."""
    R, K = dyq.shape
    E_l, N_w, _ = wq.shape
    why = dswiglu_limits(cfg, n=n, k=K, n_w=N_w)
    if why is not None:
        raise ValueError(f"gemm2_dgrad_swiglu_fp8 (Gluon kernel): {why}")
    if R == 0 or E_l == 0 or n == 0:
        return
    bm, bn, warps = cfg.block_m, cfg.block_n, cfg.num_warps
    warps_m = min(warps, bm // 16)
    instr_n = bn // (warps // warps_m)
    a_desc = nvmma_desc(dyq, [bm, 128], gl.float8e4nv)
    w_desc = nvmma_desc(wq.view(E_l * N_w, K), [bn, 128], gl.float8e4nv)
    grid = grid_size(cfg, (triton.cdiv(R, bm) + E_l) * (n // bn), dyq.device)
    record("_gluon_fp8_dswiglu_kernel", _gluon_fp8_dswiglu_kernel[(grid,)](
        a_desc, w_desc, dy_s, w_s, out, h, scale if scale is not None else out, dsp if dsp is not None else out,
        acts if acts is not None else out, offs,
        R, n, K, E_l, grid, dy_s.stride(0), w_s.stride(0), w_s.stride(1), out.stride(0), h.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(max(E_l, 2)), STAGES=cfg.num_stages,
        HAS_SCALE=scale is not None, ACTS=acts is not None, WARPS_M=warps_m, INSTR_N=instr_n, num_warps=warps,
    ))
