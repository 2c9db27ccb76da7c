"""EXPERIMENTAL (not wired into any layer): FP8 block-scaled grouped GEMM in Gluon with the per-128-K promotion
overlapped with the next k-step's wgmma. Compiled for sm_90a on the CPU (megamoe.sm90) only; not yet run on a GPU.

Why: our Triton FP8 kernel (grouped_gemm_fp8.py) runs at our bf16 rate, because the promotion
``acc += (a_k @ b_k) * s_a * s_b`` consumes each k-step's wgmma result at once, and Triton 3.6's pipeliner then
waits for every wgmma (``wgmma.wait_group 0`` in its PTX: the tensor cores idle during the scaling FMAs). Gluon
exposes the waits: here k-steps go in pairs; both products P_a and P_b are issued asynchronously into fresh
register tiles, ``warpgroup_mma_wait(num_outstanding=1)`` waits for P_a only, which is scaled and added to
``acc`` while P_b runs on the tensor cores; then P_b is waited for and added (that half of the promotions does
not overlap). Three fp32 [128, 128] tiles live per program (acc, P_a, P_b): 192 registers per thread with 8
warps. Loads: a STAGES-deep ring of TMA tiles with one mbarrier per stage; a stage is refilled once the wgmmas of
every warpgroup that read it have completed (the wait, then a CTA barrier). Next step, if this pays: two
consumer warpgroups on different tiles (ping-pong) and per-stage "empty" barriers instead of CTA barriers.

Operands and schedule as in grouped_gemm_fp8.py (EPI_NONE only, with the optional per-row scale):
    aq [R, K] e4m3, a_s [R, cdiv(K, 128)] fp32; wq [E_l, N, K] e4m3, w_s [E_l, cdiv(N, 128), cdiv(K, 128)] fp32;
    out[rows of e] = (sum_kb (aq[:, kb] @ wq[e][:, kb]^T) * a_s[:, kb] * w_s[e][n // 128, kb]) (* scale[r]).
Limits of this version (ValueError at the entry): N a multiple of BLOCK_N = 128 (the weight descriptor is a 2-D
view [E_l * N, K], so a tile must not cross into the next expert), K a multiple of 16 (TMA strides).
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

from megamoe.kernels.gemm_config import num_sms as device_sms
from megamoe.kernels.grouped_gemm_fp8 import check_fp8


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _gluon_fp8_grouped_kernel(
    a_desc, w_desc,     # TMA descriptors: aq [R, K] block [BLOCK_M, 128]; wq as [E_l * N, K] block [BLOCK_N, 128]
    as_ptr, ws_ptr,     # a_s [R, KB] fp32 (row stride stride_asm), w_s [E_l, NB, KB] fp32 contiguous
    out_ptr,            # out [R, N] bf16, row stride stride_om
    scale_ptr,          # [R] fp32 (HAS_SCALE)
    offs_ptr,           # [E_l + 1] int32
    R, N, K, E_l, num_progs,
    stride_asm, stride_wse, stride_wsn, stride_om,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, HAS_SCALE: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_K: gl.constexpr = 128
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M],
                                                  instr_shape=[16, INSTR_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    # the schedule of grouped_gemm.py (_expert_tiles / _locate_tile, restated here with Gluon layouts: a Triton
    # @jit helper cannot be called from a Gluon kernel; keep the two in step): per-expert tile counts and their
    # running sum, read on the device
    e_idx = gl.arange(0, BLOCK_E, layout=sched)
    emask = e_idx < E_l
    starts = gl.load(offs_ptr + e_idx, mask=emask, other=0)
    ends = gl.load(offs_ptr + e_idx + 1, mask=emask, other=0)
    cnts = gl.maximum(ends - starts, 0)
    m_tiles = (cnts + BLOCK_M - 1) // BLOCK_M
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = m_tiles * tiles_n
    cum_end = gl.associative_scan(tiles, 0, _add)
    total = gl.sum(tiles, axis=0)
    k_tiles = gl.cdiv(K, BLOCK_K)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes

    it = 0  # k-steps issued by this program so far: stage = it % STAGES, barrier phase = (it // STAGES) & 1
    for tile in range(gl.program_id(0), total, num_progs):
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
        off_m = row0 + mi * BLOCK_M
        off_n = ni * BLOCK_N
        wrow = e * N + off_n

        for s in gl.static_range(STAGES):  # prologue: the first STAGES k-steps in flight
            if s < k_tiles:
                st = (it + s) % STAGES
                mbarrier.expect(bars.index(st), nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, s * BLOCK_K], bars.index(st), a_smem.index(st))
                tma.async_copy_global_to_shared(w_desc, [wrow, s * BLOCK_K], bars.index(st), b_smem.index(st))

        rm = off_m + gl.arange(0, BLOCK_M, layout=rows_l)
        mmask = rm < row_end
        as_row = as_ptr + rm.to(gl.int64) * stride_asm
        ws_tile = ws_ptr + e.to(gl.int64) * stride_wse + (off_n // 128) * stride_wsn
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        # k-steps in pairs: both products issued, the first promoted while the second runs. (A product carried
        # in flight across the loop's back edge makes ptxas serialise every wgmma, warning C7514: the one-step
        # lag of the first version of this kernel compiled to wait-after-every-wgmma.)
        for kk in range(k_tiles // 2):
            ka = 2 * kk
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
            # P_a's stage is free once every warpgroup got here (each waits for its own wgmmas only)
            gl.thread_barrier()
            if ka + STAGES < k_tiles:
                mbarrier.expect(bars.index(sta), nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, (ka + STAGES) * BLOCK_K], bars.index(sta),
                                                a_smem.index(sta))
                tma.async_copy_global_to_shared(w_desc, [wrow, (ka + STAGES) * BLOCK_K], bars.index(sta),
                                                b_smem.index(sta))
            done = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
            acc = acc + done * sc_b[:, None]
            gl.thread_barrier()
            if ka + 1 + STAGES < k_tiles:
                mbarrier.expect(bars.index(stb), nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, (ka + 1 + STAGES) * BLOCK_K], bars.index(stb),
                                                a_smem.index(stb))
                tma.async_copy_global_to_shared(w_desc, [wrow, (ka + 1 + STAGES) * BLOCK_K], bars.index(stb),
                                                b_smem.index(stb))
        if k_tiles % 2 == 1:  # an odd last k-step, synchronously
            kl = k_tiles - 1
            stl = (it + kl) % STAGES
            mbarrier.wait(bars.index(stl), ((it + kl) // STAGES) & 1)
            last = warpgroup_mma(a_smem.index(stl), b_smem.index(stl).permute((1, 0)), zero, use_acc=False)
            acc = acc + last * (gl.load(as_row + kl, mask=mmask, other=0.0) * gl.load(ws_tile + kl))[:, None]
            gl.thread_barrier()
        it += k_tiles

        if HAS_SCALE:
            acc = acc * gl.load(scale_ptr + rm, mask=mmask, other=0.0)[:, None]
        # through shared memory into a layout with 8 consecutive columns per thread: 16-byte stores
        res = gl.convert_layout(acc.to(gl.bfloat16), store_l)
        srm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
        srn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_l))
        optrs = out_ptr + srm.to(gl.int64)[:, None] * stride_om + srn[None, :]
        gl.store(optrs, res, mask=(srm < row_end)[:, None] & (srn < N)[None, :])

    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def grouped_gemm_fp8_gluon(aq: torch.Tensor, a_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor,
                           offs: torch.Tensor, *, scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           block_m: int = 128, stages: int = 4, num_warps: int = 8,
                           num_sms: int | None = None) -> torch.Tensor:
    """out [R, N] bf16 = the FP8 grouped GEMM above (EXPERIMENTAL, see the module docstring)."""
    check_fp8(aq, a_s, wq, w_s, offs, "grouped_gemm_fp8_gluon")
    R, K = aq.shape
    E_l, N, _ = wq.shape
    BN = 128
    if N % BN or K % 16:
        raise ValueError(f"grouped_gemm_fp8_gluon: N must be a multiple of {BN} and K of 16, got N={N}, K={K}")
    if (block_m, num_warps) not in ((128, 8), (64, 8), (64, 4)) or stages < 2:
        raise ValueError("grouped_gemm_fp8_gluon: (block_m, num_warps) one of (128, 8), (64, 8), (64, 4) (128 rows on "
                         f"4 warps spill) and stages >= 2; got {block_m}, {num_warps}, {stages}")
    from megamoe.experts import _check_scale, _out  # lazy: megamoe.experts imports the kernels

    _check_scale(scale, R, "grouped_gemm_fp8_gluon")
    out = _out(out, (R, N), aq)
    if R == 0 or E_l == 0 or N == 0:
        return out
    warps_m = min(num_warps, block_m // 16)
    instr_n = BN // (num_warps // warps_m)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([BN, 128], gl.float8e4nv)
    a_desc = TensorDescriptor(aq, list(aq.shape), list(aq.stride()), [block_m, 128], a_layout)
    w2d = wq.view(E_l * N, K)
    w_desc = TensorDescriptor(w2d, list(w2d.shape), list(w2d.stride()), [BN, 128], w_layout)

    grid = min(num_sms if num_sms is not None else device_sms(aq.device), (triton.cdiv(R, block_m) + E_l) * (N // BN))
    _gluon_fp8_grouped_kernel[(grid,)](
        a_desc, w_desc, a_s, w_s, out, scale if scale is not None else out, offs,
        R, N, K, E_l, grid, a_s.stride(0), w_s.stride(0), w_s.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=BN, GROUP_M=8, BLOCK_E=triton.next_power_of_2(max(E_l, 2)), STAGES=stages,
        HAS_SCALE=scale is not None, WARPS_M=warps_m, INSTR_N=instr_n, num_warps=num_warps,
    )
    return out
