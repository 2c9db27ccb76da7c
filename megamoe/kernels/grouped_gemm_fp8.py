"""Persistent grouped GEMM with FP8 e4m3 operands and block scales (1x128 activations, 128x128 weights).

Shape legend: R received rows, K reduction, N output columns, E_l local experts; offs int32 [E_l+1] on device.
    aq [R, K] float8_e4m3fn, a_s [R, cdiv(K, 128)] fp32        (quantize_act)
    wq [E_l, N_w, K] float8_e4m3fn, w_s [E_l, cdiv(N_w, 128), cdiv(K, 128)] fp32   (quantize_weight)
out[rows_e] = epilogue( sum_kb (aq[:, kb] @ wq[e][:, kb]^T) * a_s[:, kb] * w_s[e][n // 128, kb] ), fp32 accum.

Same tile schedule and epilogues as grouped_gemm.py. BLOCK_K is 128, one scale pair per k-step: each k-step's
product is scaled and added into the fp32 accumulator ("promotion" every 128 of K, as DeepSeek-V3 does). wgmma on
fp8 needs both operands K-major, so weights are always [E_l, N, K]; dgrad uses quantize_weight(transpose=True).

On Hopper the Gluon kernels (gluon/fp8.py, gluon/fp8_dswiglu.py) replace this one: they keep a wgmma in flight
during the promotion, which Triton's pipeliner does not. Outputs differ by the rounding of the scale products
(rel. ~2e-5 after bf16 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.kernels.gemm_config import EPI_DSWIGLU, GemmConfig, grid_size, interpreting, record, resolve_tma
from megamoe.kernels.tiles import epilogue, expert_tiles, load_a, load_b, locate_tile


@triton.jit
def _grouped_gemm_fp8_kernel(
    a_desc, a_ptr,      # aq [R, K] fp8 e4m3, row stride stride_am
    as_ptr,             # a_s [R, cdiv(K, 128)] fp32, row stride stride_asm
    w_desc, w_ptr,      # wq [E_l, N_w, K] fp8 e4m3 contiguous
    ws_ptr,             # w_s [E_l, cdiv(N_w, 128), cdiv(K, 128)] fp32 contiguous
    out_ptr, h_ptr, scale_ptr, dsp_ptr,   # as in grouped_gemm._grouped_gemm_kernel
    acts_ptr,           # acts [R, N] bf16 contiguous (EPI_DSWIGLU with STORE_H): s[r] * silu(g) * u
    offs_ptr,           # offs [E_l + 1] int32
    R, N, K, E_l, num_progs,
    stride_am, stride_asm, stride_we, stride_wr, stride_wse, stride_wsn, stride_om, stride_hm,
    N_UP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_F32: tl.constexpr, EPI_SPLIT: tl.constexpr,
):
    """Grid: (P,) persistent programs; per tile and k-block kb:
        acc += (aq_tile @ wq_tile^T) * (a_s[rows, kb][:, None] * w_s[e, cols // 128, kb][None, :])
    (the scale product first, one rounding, as the Gluon kernels and the megakernel do it)"""
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    e_idx, starts, cnts, m_tiles, cum_end, total = expert_tiles(offs_ptr, E_l, N, BLOCK_M, BLOCK_N, BLOCK_E)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile = pid
    while tile < total:
        e, row0, n_rows, mi, ni = locate_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, N, BLOCK_N, GROUP_M)
        off_m = row0 + mi * BLOCK_M
        off_n = ni * BLOCK_N
        row_end = row0 + n_rows
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        as_ptrs = as_ptr + rm.to(tl.int64) * stride_asm
        mmask = rm < row_end
        ws_base = ws_ptr + e.to(tl.int64) * stride_wse
        ws_ptrs = ws_base + (rn // 128) * stride_wsn
        ws2_ptrs = ws_base + ((N_UP + rn) // 128) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = load_a(a_desc, a_ptr, off_m, off_k, row_end, K, stride_am, BLOCK_M, BLOCK_K, USE_TMA)
            b = load_b(w_desc, w_ptr, e, off_n, off_k, N, K, stride_we, stride_wr, BLOCK_N, BLOCK_K,
                        False, USE_TMA)
            sa = tl.load(as_ptrs + ki, mask=mmask, other=0.0)
            sb = tl.load(ws_ptrs + ki, mask=rn < N, other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            if EPILOGUE == 1:
                b2 = load_b(w_desc, w_ptr, e, N_UP + off_n, off_k, N_UP + N, K, stride_we, stride_wr,
                             BLOCK_N, BLOCK_K, False, USE_TMA)
                sb2 = tl.load(ws2_ptrs + ki, mask=rn < N, other=0.0)
                if DOT_F32:
                    b2 = b2.to(tl.float32)
                acc2 += tl.dot(a, b2) * (sa[:, None] * sb2[None, :])
        epilogue(acc, acc2, off_m, off_n, row_end, ni, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                  scale_ptr, dsp_ptr, acts_ptr, BLOCK_M, BLOCK_N, EPILOGUE, HAS_SCALE, STORE_H, EPI_SPLIT)
        tile += num_progs


def check_fp8(aq: torch.Tensor, a_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor, offs: torch.Tensor,
              name: str) -> None:
    """Validate operands and scale formats of an FP8 grouped GEMM; ValueError names the constraint."""
    fp8 = torch.float8_e4m3fn
    if aq.dtype != fp8 or wq.dtype != fp8:
        raise ValueError(f"{name}: operands must be float8_e4m3fn, got {aq.dtype} and {wq.dtype}")
    if aq.dim() != 2 or wq.dim() != 3 or aq.stride(-1) != 1 or not wq.is_contiguous():
        raise ValueError(f"{name}: aq must be [R, K] with unit inner stride (rows may be strided: the packed rows of "
                         f"dispatch_fp8) and wq contiguous [E_l, N, K]")
    R, K = aq.shape
    E_l, N_w, Kw = wq.shape
    if K != Kw:
        raise ValueError(f"{name}: aq has K = {K}, wq has K = {Kw}")
    kb, nb = triton.cdiv(K, 128), triton.cdiv(N_w, 128)
    if a_s.dtype != torch.float32 or tuple(a_s.shape) != (R, kb) or a_s.stride(-1) != 1:
        raise ValueError(f"{name}: activation scales must be float32 [R, cdiv(K, 128)] = {(R, kb)} (1x128 "
                         f"blocks, unit inner stride), got {a_s.dtype} {tuple(a_s.shape)}")
    if w_s.dtype != torch.float32 or tuple(w_s.shape) != (E_l, nb, kb) or not w_s.is_contiguous():
        raise ValueError(f"{name}: weight scales must be contiguous float32 [E_l, cdiv(N, 128), cdiv(K, 128)] "
                         f"= {(E_l, nb, kb)} (128x128 blocks), got {w_s.dtype} {tuple(w_s.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != E_l + 1:
        raise ValueError(f"{name}: offs must be int32 [E_l + 1] = [{E_l + 1}]")
    if len({aq.device, wq.device, a_s.device, w_s.device, offs.device}) != 1:
        raise ValueError(f"{name}: all operands must be on one device")


def launch_grouped_gemm_fp8(aq, a_s, wq, w_s, offs, out, cfg: GemmConfig, *, n: int, epilogue: int,
                            h=None, scale=None, dsp=None, store_h: bool = False, n_up: int = 0,
                            acts=None) -> None:
    """Launch the Triton FP8 grouped GEMM (inputs validated by megamoe.experts). dsp (EPI_DSWIGLU with scale):
    cdiv(n, cfg.block_n) rows; acts: as launch_grouped_gemm's ([R, n] bf16 contiguous)."""
    R, K = aq.shape
    E_l = wq.shape[0]
    BM, BN = cfg.block_m, cfg.block_n
    if cfg.block_k != 128:
        raise ValueError(f"grouped_gemm_fp8: block_k must be 128 (one 1x128/128x128 scale per k-step), "
                         f"got {cfg.block_k}")
    if store_h and epilogue == EPI_DSWIGLU:  # the shared bf16 epilogue reads STORE_H there as "write acts"
        raise ValueError("grouped_gemm_fp8: store_h is for the SwiGLU forward epilogue")
    if acts is not None and epilogue != EPI_DSWIGLU:
        raise ValueError("grouped_gemm_fp8: acts is an output of the SwiGLU-backward epilogue only")
    use_tma = resolve_tma(cfg, [aq, wq], "grouped_gemm_fp8")
    if R == 0 or n == 0 or E_l == 0:
        return
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(aq, [BM, 128])
        w_desc = TensorDescriptor.from_tensor(wq, [1, BN, 128])
    else:
        a_desc = w_desc = None
    grid = grid_size(cfg, (triton.cdiv(R, BM) + E_l) * triton.cdiv(n, BN), aq.device)
    if grid == 0:
        return
    k = _grouped_gemm_fp8_kernel[(grid,)](
        a_desc, aq, a_s, w_desc, wq, w_s, out, h if h is not None else out, scale if scale is not None else out,
        dsp if dsp is not None else out, acts if acts is not None else out, offs,
        R, n, K, E_l, grid,
        aq.stride(0), a_s.stride(0), wq.stride(0), wq.stride(1), w_s.stride(0), w_s.stride(1),
        out.stride(0), h.stride(0) if h is not None else 0, n_up,
        BLOCK_M=BM, BLOCK_N=BN, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(max(E_l, 2)),
        EPILOGUE=epilogue, HAS_SCALE=scale is not None, STORE_H=store_h or acts is not None, USE_TMA=use_tma,
        DOT_F32=interpreting(), EPI_SPLIT=cfg.epi_split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    record("_grouped_gemm_fp8_kernel", k)
