"""Persistent grouped GEMM over expert-grouped rows (bf16, FP8), with SwiGLU / row-scale / SwiGLU-backward epilogues.

Shape legend: R received rows (buffer capacity), H hidden, I expert intermediate, E_l local experts, K reduction,
N output columns. Expert e's rows are ``offs[e]:offs[e+1]`` of ``a_RK`` (``offs`` int32 [E_l+1] on the device,
offs[0] = 0); rows at or past offs[E_l] are padding: never read as data, never written.

One kernel serves every bf16 GEMM of the expert MLP:

=====================  ==========  ======================  ====================================
op                     a           w (layout)              epilogue
=====================  ==========  ======================  ====================================
GEMM1 + SwiGLU         x [R, H]    w13 [E_l, 2I, H] (NK)   act = silu(g) * u, optionally keep h
GEMM2 (+ gate scale)   act [R, I]  w2 [E_l, H, I] (NK)     out = s[r] * acc
dgrad GEMM2 + SwiGLU   dy [R, H]   w2 [E_l, H, I] (KN)     dh = d(silu(g) * u), ds partials
dgrad GEMM1            dh [R, 2I]  w13 [E_l, 2I, H] (KN)   plain
=====================  ==========  ======================  ====================================

Persistent, no host sync: the grid is min(#SMs, a bound on the tiles from R and E_l); every program reads offs and walks
tiles pid, pid + P, ... of the schedule in tiles.py. Loads use TMA (a as 2-D [R, K], w as 3-D [E_l, rows, cols] so the
bounds clip at the expert's edge) or masked pointers (``USE_TMA=False``: any alignment). A TMA tile of ``a`` may cover
rows of the next expert or the padding; they only feed output rows the masked store drops (a GEMM never mixes rows), so
NaN in padding cannot leak.

FP8 (``_grouped_gemm_fp8_kernel``, e4m3 operands with block scales, given a_s and w_s):
    aq [R, K] float8_e4m3fn, a_s [R, cdiv(K, 128)] fp32        (quantize_act)
    wq [E_l, N_w, K] float8_e4m3fn, w_s [E_l, cdiv(N_w, 128), cdiv(K, 128)] fp32   (quantize_weight)
out[rows_e] = epilogue( sum_kb (aq[:, kb] @ wq[e][:, kb]^T) * a_s[:, kb] * w_s[e][n // 128, kb] ), fp32 accum.
Same schedule and epilogues; BLOCK_K is 128, one scale pair per k-step: each k-step's product is scaled and added
into the fp32 accumulator ("promotion" every 128 of K, as DeepSeek-V3 does). wgmma on fp8 needs both operands
K-major, so weights are always [E_l, N, K]; dgrad uses quantize_weight(transpose=True). On Hopper the Gluon kernels
(gluon/fp8.py, gluon/fp8_dswiglu.py) replace it: they keep a wgmma in flight during the promotion, which Triton's
pipeliner does not. Outputs differ by the rounding of the scale products (rel. ~2e-5 after bf16 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.kernels.gemm_config import EPI_DSWIGLU, GemmConfig, grid_size, interpreting, record, resolve_tma
from megamoe.kernels.tiles import epilogue, expert_tiles, locate_tile, mma


@triton.jit
def _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles,
               a_desc, a_ptr, w_desc, w_ptr, out_ptr, h_ptr, scale_ptr, dsp_ptr, acts_ptr,
               R, N, K, stride_am, stride_we, stride_wr, stride_om, stride_hm, N_UP, bias_ptr, stride_be, alpha, limit,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               W_KN: tl.constexpr, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr,
               USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, EPI_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
               ACT: tl.constexpr, FP8: tl.constexpr = False, as_ptr=None, ws_ptr=None, stride_asm=0, stride_wse=0,
               stride_wsn=0):
    """One output tile: locate it, run the k-loop (tiles.mma), write the epilogue (inlined by the compiler)."""
    e, row0, n_rows, mi, ni = locate_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, N, BLOCK_N, GROUP_M)
    off_m = row0 + mi * BLOCK_M
    off_n = ni * BLOCK_N
    row_end = row0 + n_rows
    acc, acc2 = mma(a_desc, a_ptr, w_desc, w_ptr, e, off_m, off_n, row_end, N, K, N_UP, k_tiles, stride_am,
                    stride_we, stride_wr, BLOCK_M, BLOCK_N, BLOCK_K, W_KN, USE_TMA, DOT_F32, EPILOGUE == 1, False, FP8,
                    as_ptr, ws_ptr, stride_asm, stride_wse, stride_wsn)
    epilogue(acc, acc2, off_m, off_n, row_end, ni, R, N, out_ptr, stride_om, h_ptr, stride_hm,
              scale_ptr, dsp_ptr, acts_ptr, BLOCK_M, BLOCK_N, EPILOGUE, HAS_SCALE, STORE_H, EPI_SPLIT,
              bias_ptr, e, stride_be, alpha, limit, HAS_BIAS, ACT)


@triton.jit
def _grouped_gemm_kernel(
    a_desc, a_ptr,      # a_RK [R, K] bf16, row stride stride_am (descriptor when USE_TMA, else pointer)
    w_desc, w_ptr,      # w [E_l, N_w, K] (W_KN=False) or [E_l, K, N] (W_KN=True) bf16, contiguous
    out_ptr,            # out [R, N] (EPI_DSWIGLU: [R, 2N]) bf16, row stride stride_om
    h_ptr,              # h [R, 2N] bf16: written (EPI_SWIGLU, STORE_H) or read (EPI_DSWIGLU)
    scale_ptr,          # scale_R [R] fp32 (HAS_SCALE)
    dsp_ptr,            # dsp [cdiv(N, BLOCK_N), R] fp32: gate-gradient partials (EPI_DSWIGLU, HAS_SCALE)
    acts_ptr,           # acts [R, N] bf16 (EPI_DSWIGLU with STORE_H): s[r] * silu(g) * u
    offs_ptr,           # offs [E_l + 1] int32
    R, N, K, E_l, num_progs,
    stride_am, stride_we, stride_wr, stride_om, stride_hm,
    N_UP,               # row of w where the up projection starts (EPI_SWIGLU: I)
    bias_ptr,           # HAS_BIAS, bf16, row stride stride_be: EPI_NONE b [E_l, N], EPI_SWIGLU b13 [E_l, 2N] (gate, up)
    stride_be,
    alpha, limit,       # ACT=1: gpt-oss's clamped SwiGLU constants (fp32)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr, W_KN: tl.constexpr, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr,
    STORE_H: tl.constexpr, USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, EPI_SPLIT: tl.constexpr,
    FLATTEN: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """Grid: (P,) persistent programs. For each tile (e, mi, ni):
        acc = a[offs[e] + mi*BM : +BM, :] @ w[e][ni*BN : +BN, :]^T      (fp32; EPI_SWIGLU: acc2 with w rows N_UP + ..)
        epilogue(acc, acc2) writes rows < offs[e+1] only.
    FLATTEN: tl.range(..., flatten=True) fuses the tile loop with the k-loop, so the next tile's loads overlap this
    tile's epilogue (faster on some shapes only: gemm_config picks it). HAS_BIAS / ACT (gpt-oss's experts): see
    tiles.epi_part; HAS_BIAS=False, ACT=0 generate the plain SwiGLU code."""
    pid = tl.program_id(0)
    e_idx, starts, cnts, m_tiles, cum_end, total = expert_tiles(offs_ptr, E_l, N, BLOCK_M, BLOCK_N, BLOCK_E)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if FLATTEN:
        for tile in tl.range(pid, total, num_progs, flatten=True):
            _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles, a_desc, a_ptr, w_desc, w_ptr,
                       out_ptr, h_ptr, scale_ptr, dsp_ptr, acts_ptr, R, N, K, stride_am, stride_we, stride_wr,
                       stride_om, stride_hm, N_UP, bias_ptr, stride_be, alpha, limit, BLOCK_M, BLOCK_N, BLOCK_K,
                       GROUP_M, W_KN, EPILOGUE, HAS_SCALE, STORE_H, USE_TMA, DOT_F32, EPI_SPLIT, HAS_BIAS, ACT)
    else:
        tile = pid
        while tile < total:
            _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles, a_desc, a_ptr, w_desc, w_ptr,
                       out_ptr, h_ptr, scale_ptr, dsp_ptr, acts_ptr, R, N, K, stride_am, stride_we, stride_wr,
                       stride_om, stride_hm, N_UP, bias_ptr, stride_be, alpha, limit, BLOCK_M, BLOCK_N, BLOCK_K,
                       GROUP_M, W_KN, EPILOGUE, HAS_SCALE, STORE_H, USE_TMA, DOT_F32, EPI_SPLIT, HAS_BIAS, ACT)
            tile += num_progs


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
        _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles, a_desc, a_ptr, w_desc, w_ptr, out_ptr, h_ptr,
                   scale_ptr, dsp_ptr, acts_ptr, R, N, K, stride_am, stride_we, stride_wr, stride_om, stride_hm, N_UP,
                   out_ptr, 0, 1.0, 0.0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, False, EPILOGUE, HAS_SCALE, STORE_H,
                   USE_TMA, DOT_F32, EPI_SPLIT, False, 0, True, as_ptr, ws_ptr, stride_asm, stride_wse, stride_wsn)
        tile += num_progs


def check_grouped(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, k_dim: int, name: str) -> None:
    """Validate the grouped-row contract; raises ValueError naming the constraint."""
    if a.dim() != 2 or not a.is_contiguous():
        raise ValueError(f"{name}: a must be a contiguous 2-D [R, K] tensor, got shape {tuple(a.shape)}")
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"{name}: weights must be a contiguous 3-D [E_l, rows, cols] tensor, got {tuple(w.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != w.shape[0] + 1:
        raise ValueError(f"{name}: offs must be int32 [E_l + 1] = [{w.shape[0] + 1}], got {offs.dtype} "
                         f"{tuple(offs.shape)}")
    if a.shape[1] != k_dim:
        raise ValueError(f"{name}: a has K = {a.shape[1]}, weights expect K = {k_dim}")
    if a.device != w.device or a.device != offs.device:
        raise ValueError(f"{name}: a, w and offs must be on one device")


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


def launch_grouped_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                        *, n: int, epilogue: int, w_kn: bool = False, h: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None, dsp: torch.Tensor | None = None,
                        store_h: bool = False, n_up: int = 0, acts: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, clamp: tuple[float, float] | None = None,
                        a_s: torch.Tensor | None = None, w_s: torch.Tensor | None = None) -> None:
    """Launch _grouped_gemm_kernel, or _grouped_gemm_fp8_kernel given the FP8 operands' scales a_s, w_s (check_fp8's
    formats; nk weights, no bias or clamp); inputs validated by megamoe.experts. acts (EPI_DSWIGLU only): [R, n]
    output of the gated activation s[r] * silu(g) * u, for the backward's dW2. dsp (EPI_DSWIGLU with scale):
    cdiv(n, cfg.block_n) rows. bias (EPI_NONE [E_l, n], EPI_SWIGLU [E_l, 2n], unit column stride) and clamp =
    (alpha, limit), gpt-oss's clamped SwiGLU (EPI_SWIGLU, EPI_DSWIGLU)."""
    fp8 = a_s is not None
    name = "grouped_gemm_fp8" if fp8 else "grouped_gemm"
    (R, K), E_l = a.shape, w.shape[0]
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    if fp8 and BK != 128:
        raise ValueError(f"grouped_gemm_fp8: block_k must be 128 (one 1x128/128x128 scale per k-step), got {BK}")
    if fp8 and (w_kn or bias is not None or clamp is not None):  # the FP8 kernel has none of these
        raise ValueError("grouped_gemm_fp8: nk weights only, no bias or clamp")
    if store_h and epilogue == EPI_DSWIGLU:  # the shared epilogue reads STORE_H there as "write acts" (into out)
        raise ValueError(f"{name}: store_h is for the SwiGLU forward epilogue")
    if acts is not None and epilogue != EPI_DSWIGLU:
        raise ValueError(f"{name}: acts is an output of the SwiGLU-backward epilogue only")
    use_tma = resolve_tma(cfg, [a, w], name)
    if R == 0 or n == 0 or E_l == 0:
        return
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK]) if use_tma else None
    w_desc = TensorDescriptor.from_tensor(w, [1, BK, BN] if w_kn else [1, BN, BK]) if use_tma else None
    grid = grid_size(cfg, (triton.cdiv(R, BM) + E_l) * triton.cdiv(n, BN), a.device)
    if grid == 0:
        return
    opt = [t if t is not None else out for t in (h, scale, dsp, acts)]  # (absent pointer arguments: out, never read)
    h_stride = h.stride(0) if h is not None else 0
    common = dict(BLOCK_M=BM, BLOCK_N=BN, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(max(E_l, 2)),
                  EPILOGUE=epilogue, HAS_SCALE=scale is not None, STORE_H=store_h or acts is not None,
                  USE_TMA=use_tma, DOT_F32=interpreting(), EPI_SPLIT=cfg.epi_split, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if fp8:
        k = _grouped_gemm_fp8_kernel[(grid,)](
            a_desc, a, a_s, w_desc, w, w_s, out, *opt, offs, R, n, K, E_l, grid, a.stride(0), a_s.stride(0),
            w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1), out.stride(0), h_stride, n_up, **common)
    else:
        k = _grouped_gemm_kernel[(grid,)](
            a_desc, a, w_desc, w, out, *opt, offs, R, n, K, E_l, grid, a.stride(0), w.stride(0), w.stride(1),
            out.stride(0), h_stride, n_up, bias if bias is not None else out, bias.stride(0) if bias is not None else 0,
            float(clamp[0]) if clamp is not None else 1.0, float(clamp[1]) if clamp is not None else 0.0,
            BLOCK_K=BK, W_KN=w_kn, FLATTEN=cfg.flatten, HAS_BIAS=bias is not None, ACT=int(clamp is not None),
            **common)
    record("_grouped_gemm_fp8_kernel" if fp8 else "_grouped_gemm_kernel", k)


__all__ = ["launch_grouped_gemm", "check_grouped", "check_fp8"]
