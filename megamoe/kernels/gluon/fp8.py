"""Warp-specialised FP8 (e4m3, 1x128 / 128x128 block scales) grouped GEMM for Hopper, in Gluon: the plain op
(EPI_NONE, optional row scale: GEMM2 and GEMM1's dgrad) and GEMM1 + SwiGLU (EPI_SWIGLU, optionally keeping h); what
megamoe.experts runs for those ops on sm_90. The SwiGLU backward is fp8_dswiglu.py.

    out[r, n] = sum_kb (aq[r, kb] @ wq[e][n, kb]^T) * a_s[r, kb] * w_s[e][n // 128, kb]      (fp32, bf16 out)
    SwiGLU: g, u = the same for the gate rows n and the up rows N_UP + n; out = silu(g) * u, h = [g | u]

Why: a single-stream kernel cannot keep the tensor cores busy during the per-k-step promotion (acc += P * scale):
its warpgroups share one instruction stream with CTA barriers before every refill, so both promote while no wgmma
runs. Here (as in DeepGEMM and CUTLASS) bf16.py's roles: a loader warp and two 4-warp consumers (rows 0..63 /
64..127), each running its 64 x BLOCK_N wgmma, waiting, releasing the stage and promoting; coupled only through the
ring, one's promotion FMAs run while the other's wgmma occupies the tensor cores.

Wider tiles (MODE 2: 256 output columns; SwiGLU 128 gate + 128 up): two 128-column weight tiles per stage and two
accumulators per consumer; the second wgmma is issued after the first product's promotion, so three 64-register
tiles are live, not four. Why: 128 x 128 tiles move 32 KB from L2 per 4.2 MFLOP (~8 TB/s into the SMs at ~1000
TFLOP/s), 128 x 256 tiles 1.5x fewer bytes per flop: 1.1-1.2x faster on an H200. TMA multicast across a CTA pair
(DeepGEMM's other lever) is not exposed by Gluon's Hopper TMA in Triton 3.6.

Epilogue: common.put, as bf16.py's (storing from registers made the tensor cores wait and spilled the SwiGLU tile).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from megamoe.kernels.gemm_config import EPI_NONE, EPI_SWIGLU, GemmConfig, grid_size, record, tma_ok
from megamoe.kernels.gluon.common import (
    REG_POOL,
    epi_tile,
    locate,
    nvmma_desc,
    ring,
    ring_done,
    schedule,
    stages_reason,
    ws_loader,
)


@gluon.jit
def _ws_consumer(a_smem, b_smem, b2_smem, ready, empty, epi_smem, out_desc, hg_desc, hu_desc, as_ptr, ws_ptr, out_ptr,
                 h_ptr, scale_ptr, offs_ptr, R, N, K, E_l, num_progs, stride_asm, stride_wse, stride_wsn, stride_om,
                 stride_hm, B2_OFF, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                 BLOCK_E: gl.constexpr, STAGES: gl.constexpr, HAS_SCALE: gl.constexpr, MODE: gl.constexpr,
                 STORE_H: gl.constexpr, EPI_TMA: gl.constexpr, HALF: gl.constexpr):
    """Rows HALF * 64 .. HALF * 64 + 63 of every tile of this program (4 warps). MODE 0: one [64, BLOCK_N] product
    per k-step; 1 (SwiGLU): gate (acc) and up (acc2, weight rows + B2_OFF); 2 (wide plain): two adjacent BLOCK_N
    column blocks (acc, acc2). Staging buffers 2 HALF, 2 HALF + 1 of epi_smem."""
    BLOCK_K: gl.constexpr = 128
    HM: gl.constexpr = BLOCK_M // 2
    TN: gl.constexpr = 2 * BLOCK_N if MODE == 2 else BLOCK_N
    SERIAL: gl.constexpr = MODE != 0 and BLOCK_N == 128
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # the masked stores: [HM, 64] slices
    NSL: gl.constexpr = BLOCK_N // 64  # 64-column slices per product
    PER_TILE: gl.constexpr = (2 * NSL if MODE == 2 else NSL) * (3 if MODE == 1 and STORE_H else 1)  # staged stores
    nst = 0  # staged stores so far (the parity of the next one's staging buffer)
    e_idx, starts, cnts, m_tiles, cum_end, total = schedule(offs_ptr, E_l, N, BLOCK_M, TN, BLOCK_E, sched)
    tiles_n = gl.cdiv(N, TN)
    k_tiles = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros((HM, BLOCK_N), dtype=gl.float32, layout=mma)
    it = 0
    for tile in range(gl.program_id(0), total, num_progs):
        e, row0, row_end, mi, ni = locate(tile, e_idx, starts, cnts, m_tiles, cum_end, tiles_n, GROUP_M)
        off_m = row0 + mi * BLOCK_M + HALF * HM
        off_n = ni * TN
        rm = off_m + gl.arange(0, HM, layout=rows_l)
        mmask = rm < row_end
        as_row = as_ptr + rm.to(gl.int64) * stride_asm
        ws_tile = ws_ptr + e.to(gl.int64) * stride_wse + (off_n // 128) * stride_wsn
        acc = gl.zeros((HM, BLOCK_N), dtype=gl.float32, layout=mma)
        # the scales of k-step ki + 1 are loaded during k-step ki (a global load's latency is longer than one
        # k-step's wgmma); the last step's prefetch reads index k_tiles - 1 again (in bounds)
        sa_nx = gl.load(as_row, mask=mmask, other=0.0)
        sw_nx = gl.load(ws_tile)
        if MODE != 0:
            # the second tile's scale row; MODE 2's last tile may start past N (its columns are dropped): clamped
            blk2 = gl.minimum((off_n + BLOCK_N) // 128, (N - 1) // 128) if MODE == 2 else (B2_OFF + off_n) // 128
            ws_2 = ws_tile + (blk2 - off_n // 128) * stride_wsn
            su_nx = gl.load(ws_2)
            acc2 = gl.zeros((HM, BLOCK_N), dtype=gl.float32, layout=mma)
        for ki in range(k_tiles):
            s = it % STAGES
            sa = sa_nx
            sc = sa * sw_nx
            if MODE != 0:
                sc2 = sa * su_nx
            kn = gl.minimum(ki + 1, k_tiles - 1)
            sa_nx = gl.load(as_row + kn, mask=mmask, other=0.0)
            sw_nx = gl.load(ws_tile + kn)
            if MODE != 0:
                su_nx = gl.load(ws_2 + kn)
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a_half = a_smem.index(s).slice(HALF * HM, HM)
            p = warpgroup_mma(a_half, b_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            if MODE == 0:
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc + p * sc[:, None]
            elif SERIAL:
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                acc = acc + p * sc[:, None]
                p2 = warpgroup_mma(a_half, b2_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
                p2 = warpgroup_mma_wait(num_outstanding=0, deps=(p2,))
                mbarrier.arrive(empty.index(s), count=1)
                acc2 = acc2 + p2 * sc2[:, None]
            else:
                p2 = warpgroup_mma(a_half, b2_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
                p, p2 = warpgroup_mma_wait(num_outstanding=0, deps=(p, p2))
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc + p * sc[:, None]
                acc2 = acc2 + p2 * sc2[:, None]
            it += 1
        tma_ok = off_m + HM <= row_end  # TMA stores cannot stop at the expert's last row
        b0 = 2 * HALF + (nst & 1)  # (1 or 3 stores per slice: each slice starts on the buffer after the previous's)
        epi_tile(acc, acc2 if MODE == 1 else acc, off_m, off_n, row_end, N, out_desc, hg_desc, hu_desc, out_ptr,
                 stride_om, h_ptr, stride_hm, scale_ptr, epi_smem, b0, tma_ok, HM, BLOCK_N, MODE == 1, STORE_H,
                 HAS_SCALE, EPI_TMA, mma_s, store_l)
        if MODE == 2:  # (BLOCK_N 128: two slices per product)
            epi_tile(acc2, acc2, off_m, off_n + BLOCK_N, row_end, N, out_desc, hg_desc, hu_desc, out_ptr, stride_om,
                     h_ptr, stride_hm, scale_ptr, epi_smem, b0, tma_ok, HM, BLOCK_N, False, STORE_H, HAS_SCALE,
                     EPI_TMA, mma_s, store_l)
        nst += PER_TILE
    if EPI_TMA:  # the staging buffers stay allocated until the last store has read them
        tma.store_wait(0)


@gluon.jit
def _gluon_fp8_ws_kernel(
    a_desc, w_desc,     # TMA descriptors: aq [R, K] block [BLOCK_M, 128]; wq as [E_l * N_W, K] block [BLOCK_N, 128]
    out_desc,           # EPI_TMA: out [R, N] block [64, 64] (else unused, any descriptor)
    hg_desc, hu_desc,   # EPI_TMA and STORE_H: h's gate and up halves, each [R, N] (row stride 2N), block [64, 64]
    as_ptr, ws_ptr,     # a_s [R, KB] fp32 (row stride stride_asm), w_s [E_l, cdiv(N_W, 128), KB] fp32
    out_ptr,            # out [R, N] bf16, row stride stride_om
    h_ptr,              # h [R, 2N] bf16, row stride stride_hm (MODE 1 with STORE_H)
    scale_ptr,          # [R] fp32 (HAS_SCALE, plain only)
    offs_ptr,           # [E_l + 1] int32
    R, N, K, E_l, num_progs,
    stride_asm, stride_wse, stride_wsn, stride_om, stride_hm,
    N_W, B2_OFF,        # rows of wq per expert; the second weight tile's row offset (MODE 1: up rows, 2: BLOCK_N)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, HAS_SCALE: gl.constexpr, MODE: gl.constexpr, STORE_H: gl.constexpr, EPI_TMA: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid: (P,) persistent programs of 4 + 4 + 1 warps (module docstring)."""
    BLOCK_K: gl.constexpr = 128
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    # the second weight tiles (up, or the next BLOCK_N columns; MODE 0: unused)
    b2_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout) if MODE else b_smem
    # two bf16 staging buffers [64, 64] per consumer for the epilogue (128-byte swizzle, as the descriptors')
    epi_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    epi_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_M // 2, 64], epi_l)
    ready, empty = ring(STAGES, 2)  # one arrive per consumer warpgroup
    gl.warp_specialize([
        (_ws_consumer, (a_smem, b_smem, b2_smem, ready, empty, epi_smem, out_desc, hg_desc, hu_desc, as_ptr, ws_ptr,
                        out_ptr, h_ptr, scale_ptr, offs_ptr, R, N, K, E_l, num_progs, stride_asm, stride_wse,
                        stride_wsn, stride_om, stride_hm, B2_OFF, BLOCK_M, BLOCK_N, GROUP_M, BLOCK_E, STAGES,
                        HAS_SCALE, MODE, STORE_H, EPI_TMA, 0)),
        (_ws_consumer, (a_smem, b_smem, b2_smem, ready, empty, epi_smem, out_desc, hg_desc, hu_desc, as_ptr, ws_ptr,
                        out_ptr, h_ptr, scale_ptr, offs_ptr, R, N, K, E_l, num_progs, stride_asm, stride_wse,
                        stride_wsn, stride_om, stride_hm, B2_OFF, BLOCK_M, BLOCK_N, GROUP_M, BLOCK_E, STAGES,
                        HAS_SCALE, MODE, STORE_H, EPI_TMA, 1)),
        (ws_loader, (a_desc, w_desc, a_smem, b_smem, b2_smem, ready, empty, offs_ptr, N, K, E_l, num_progs, N_W,
                      B2_OFF, BLOCK_M, BLOCK_N, GROUP_M, BLOCK_E, STAGES, MODE, BLOCK_K)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    ring_done(ready, empty, STAGES)


def ws_limits(cfg: GemmConfig, *, n: int, k: int, n_w: int, epilogue: int, n_up: int = 0) -> str | None:
    """Why the warp-specialised kernel cannot run this launch (config and shapes only), or None. n output columns,
    k reduction, n_w weight rows per expert, n_up the first up row. block_n: the plain op's output columns per tile
    (64, 128, or 256 = two 128-column products), SwiGLU's gate (= up) columns (64 or 128). The plain op takes any N:
    tiles start on 128-column boundaries, so each product stays in one weight-scale block; columns past N dropped."""
    two = epilogue == EPI_SWIGLU
    if epilogue not in (EPI_NONE, EPI_SWIGLU):
        return "only the plain and the SwiGLU epilogues are warp-specialised"
    if cfg.block_k != 128:
        return f"block_k must be 128 (one scale per k-step), got {cfg.block_k}"
    if cfg.block_m != 128 or cfg.num_warps != 4:
        return (f"block_m must be 128 and num_warps 4 (two 64-row consumer warpgroups), got block_m={cfg.block_m}, "
                f"num_warps={cfg.num_warps}")
    widths = (64, 128) if two else (64, 128, 256)
    if cfg.block_n not in widths:
        return (f"block_n must be one of {widths} (products of at most 128 columns, each inside one 128-row "
                f"weight-scale block), got {cfg.block_n}")
    # the ring (a, and the weight tiles: 2 x block_n rows for SwiGLU), four bf16 [64, 64] staging buffers, barriers
    smem = cfg.num_stages * 128 * (cfg.block_m + (2 if two else 1) * cfg.block_n) + 4 * 64 * 64 * 2 + 1024
    if (why := stages_reason(cfg, smem)) is not None:
        return why
    if k <= 0 or k % 16:
        return f"K must be a positive multiple of 16 (TMA strides), got K = {k}"
    bn = cfg.block_n
    if not two and n != n_w:
        return f"the plain op's N must equal the weight rows per expert, got N = {n}, {n_w} rows"
    if two and (n % bn or n_up % bn or n_up + n > n_w):
        # (a 128-row weight tile starting off a 128-row boundary would straddle two weight-scale blocks)
        return (f"SwiGLU: N and the up offset must be multiples of block_n {bn}, the up rows inside the expert's "
                f"weights; got N = {n}, up offset {n_up}, {n_w} weight rows per expert")
    return None


def launch_gluon_fp8_ws(aq: torch.Tensor, a_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor, offs: torch.Tensor,
                        out: torch.Tensor, cfg: GemmConfig, *, n: int, epilogue: int, h: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None, store_h: bool = False, n_up: int = 0) -> None:
    """Launch _gluon_fp8_ws_kernel with the arguments of grouped_gemm.launch_grouped_gemm's FP8 launch (operands
    validated by the caller); ValueError naming the failing limit."""
    R, K = aq.shape
    E_l, N_w, _ = wq.shape
    why = ws_limits(cfg, n=n, k=K, n_w=N_w, epilogue=epilogue, n_up=n_up)
    if why is None and epilogue == EPI_SWIGLU and scale is not None:
        why = "the SwiGLU epilogue takes no row scale"
    mode = 1 if epilogue == EPI_SWIGLU else 2 if cfg.block_n == 256 else 0
    bn = 128 if mode == 2 else cfg.block_n  # columns of one product (one weight tile)
    block_e = triton.next_power_of_2(max(E_l, 2))
    # registers per thread of each consumer warpgroup (the loader gets the rest of REG_POOL): two 128-column products
    # spill at 232 (10% slower), but 240 leave the loader 24, whose schedule vectors spill above 8 experts (15-20%
    # slower): 240 for SwiGLU tiles and up to 8 experts, else 232
    consumer_regs = 240 if mode == 1 and bn == 128 or mode == 2 and block_e <= 8 else 232
    if why is not None:
        raise ValueError(f"grouped_gemm_fp8 (warp-specialised Gluon kernel): {why}")
    if R == 0 or E_l == 0 or n == 0:
        return
    bm = cfg.block_m
    a_desc = nvmma_desc(aq, [bm, 128], gl.float8e4nv)
    w_desc = nvmma_desc(wq.view(E_l * N_w, K), [bn, 128], gl.float8e4nv)
    # TMA-store epilogue where the outputs are TMA-able (16-byte aligned bases and row strides; h's up half starts
    # at column n: n % 8 == 0); else every store masked (same staging buffers)
    epi_tma = tma_ok([out]) and (not (mode == 1 and store_h) or (tma_ok([h]) and n % 8 == 0))
    out_desc = hg_desc = hu_desc = a_desc  # unused where not set below
    if epi_tma:
        out_desc = nvmma_desc(out, [bm // 2, 64], shape=[R, n])
        if mode == 1 and store_h:
            hg_desc, hu_desc = (nvmma_desc(h[:, col:], [bm // 2, 64], shape=[R, n]) for col in (0, n))
    grid = grid_size(cfg, (triton.cdiv(R, bm) + E_l) * triton.cdiv(n, cfg.block_n), aq.device)
    record("_gluon_fp8_ws_kernel", _gluon_fp8_ws_kernel[(grid,)](
        a_desc, w_desc, out_desc, hg_desc, hu_desc, a_s, w_s, out, h if h is not None else out,
        scale if scale is not None else out, offs,
        R, n, K, E_l, grid, a_s.stride(0), w_s.stride(0), w_s.stride(1), out.stride(0),
        h.stride(0) if h is not None else 0, N_w, n_up if mode == 1 else bn,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.group_m, BLOCK_E=block_e,
        STAGES=cfg.num_stages, HAS_SCALE=scale is not None, MODE=mode, STORE_H=store_h, EPI_TMA=epi_tma,
        CONSUMER_REGS=consumer_regs, LOADER_REGS=REG_POOL - 2 * consumer_regs, num_warps=4, maxnreg=REG_POOL // 3,
    ))
