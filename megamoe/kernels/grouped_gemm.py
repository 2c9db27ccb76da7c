"""Persistent grouped GEMM over expert-grouped rows (bf16), with SwiGLU / row-scale / SwiGLU-backward epilogues.

Shape legend: R received rows (buffer capacity), H hidden, I expert intermediate, E_l local experts,
K reduction dim, N output columns of one GEMM. Rows are grouped by local expert: group e holds rows
``offs[e]:offs[e+1]`` of ``a_RK``; ``offs`` is an int32 device tensor [E_l+1] with offs[0] = 0, written on
device. Rows at or past offs[E_l] are padding: never read as data, never written.

One kernel, ``_grouped_gemm_kernel``, serves every bf16 GEMM of the expert MLP:

=====================  ==========  ======================  ====================================
op                     a           w (layout)              epilogue
=====================  ==========  ======================  ====================================
GEMM1 + SwiGLU         x [R, H]    w13 [E_l, 2I, H] (NK)   act = silu(g) * u, optionally keep h
GEMM2 (+ gate scale)   act [R, I]  w2 [E_l, H, I] (NK)     out = s[r] * acc
dgrad GEMM2 + SwiGLU   dy [R, H]   w2 [E_l, H, I] (KN)     dh = d(silu(g) * u), ds partials
dgrad GEMM1            dh [R, 2I]  w13 [E_l, 2I, H] (KN)   plain
=====================  ==========  ======================  ====================================

Persistent schedule (no host sync): the grid is min(#SMs, upper bound of tiles), the upper bound computed
from R and E_l only. Every program reads offs, builds the per-expert tile counts
``tiles_e = cdiv(n_e, BLOCK_M) * cdiv(N, BLOCK_N)`` and their running sum, and walks the virtual tile
index space ``tile = pid, pid + P, ...`` while ``tile < sum(tiles_e)``. A tile index maps to (expert,
m-block, n-block) by counting how many running sums are <= tile; inside an expert, tiles are ordered in
GROUP_M-high column strips (the usual L2 swizzle), so programs running at once share weight tiles.

Example: BLOCK_M = 128, N = 256, BLOCK_N = 128, offs = [0, 300, 300, 429]: n = [300, 0, 129], m-tiles
[3, 0, 2], tiles [6, 0, 4], running sums [6, 6, 10]; tile 7 -> expert 2 (two sums <= 7), local tile 1,
-> m-block 1 (rows 428..555, only row 428 is valid), n-block 0.

Loads use TMA (host tensor descriptors: a as 2-D [R, K], w as 3-D [E_l, rows, cols], so the descriptor's
bounds clip at the expert's weight edge) or masked pointers (``USE_TMA=False``: any alignment, and the
path the tests pin). A TMA tile of ``a`` may cover rows of the next expert or of the padding; those rows
only feed output rows that the masked store drops (a GEMM never mixes rows), so NaN in padding cannot leak.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.kernels.gemm_config import GemmConfig, gluon_device_reason, grid_size, interpreting, record, tma_ok

EPI_NONE = 0
EPI_SWIGLU = 1
EPI_DSWIGLU = 2


@triton.jit
def _expert_tiles(offs_ptr, E_l, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per-expert vectors of the schedule: first row, row count, m-tiles, running sum of tiles, total."""
    e_idx = tl.arange(0, BLOCK_E)
    emask = e_idx < E_l
    starts = tl.load(offs_ptr + e_idx, mask=emask, other=0)
    ends = tl.load(offs_ptr + e_idx + 1, mask=emask, other=0)
    cnts = tl.maximum(ends - starts, 0)
    m_tiles = (cnts + BLOCK_M - 1) // BLOCK_M
    tiles = m_tiles * tl.cdiv(N, BLOCK_N)
    cum_end = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, axis=0)
    return e_idx, starts, cnts, m_tiles, cum_end, total


@triton.jit
def _locate_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """tile index -> (expert, first row of the expert, its row count, m-block, n-block)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    e = tl.sum((cum_end <= tile).to(tl.int32), axis=0)
    sel = e_idx == e
    mt = tl.sum(tl.where(sel, m_tiles, 0), axis=0)
    t0 = tl.sum(tl.where(sel, cum_end, 0), axis=0) - mt * tiles_n
    row0 = tl.sum(tl.where(sel, starts, 0), axis=0)
    n_rows = tl.sum(tl.where(sel, cnts, 0), axis=0)
    local = tile - t0
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    gsz = tl.minimum(mt - first_m, GROUP_M)
    mi = first_m + (local % width) % gsz
    ni = (local % width) // gsz
    return e, row0, n_rows, mi, ni


@triton.jit
def _epi_part(acc, acc2, off_m, off_n, row_end, R, N,
              out_ptr, stride_om, h_ptr, stride_hm, scale_ptr, acts_ptr,
              BLOCK_M: tl.constexpr, NP: tl.constexpr,
              EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr):
    """Write a [BLOCK_M, NP] column slice of the output tile; rows >= row_end and cols >= N are dropped.

    EPI_NONE:    out = acc (* s[r])
    EPI_SWIGLU:  acc = g, acc2 = u; h[:, n] = g, h[:, N + n] = u (STORE_H); out = silu(g) * u
    EPI_DSWIGLU: acc = dact (unscaled, = dy @ w2); g, u read from h; da = s[r] * dact;
                 out[:, n] = da * u * silu'(g), out[:, N + n] = da * silu(g); STORE_H here: also
                 acts[:, n] = s[r] * silu(g) * u ([R, N], the gated activation that dW2 = dy^T @ acts needs)
    Returns the row sums of dact * silu(g) * u (EPI_DSWIGLU with HAS_SCALE: the gate's gradient), else 0.
    Pointers are a 64-bit tile base plus 32-bit in-tile offsets, to keep registers down.
    """
    lm = tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, NP)
    rm = off_m + lm
    mmask = rm < row_end
    mask = mmask[:, None] & (rn < N)[None, :]
    o_base = out_ptr + off_m.to(tl.int64) * stride_om
    o_offs = lm[:, None] * stride_om + rn[None, :]
    part = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if EPILOGUE == 0:
        if HAS_SCALE:
            s = tl.load(scale_ptr + rm, mask=mmask, other=0.0)
            acc = acc * s[:, None]
        tl.store(o_base + o_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == 1:
        g = acc
        u = acc2
        if STORE_H:
            h_base = h_ptr + off_m.to(tl.int64) * stride_hm
            h_offs = lm[:, None] * stride_hm + rn[None, :]
            tl.store(h_base + h_offs, g.to(h_ptr.dtype.element_ty), mask=mask)
            tl.store(h_base + N + h_offs, u.to(h_ptr.dtype.element_ty), mask=mask)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(o_base + o_offs, act.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        h_base = h_ptr + off_m.to(tl.int64) * stride_hm
        h_offs = lm[:, None] * stride_hm + rn[None, :]
        g = tl.load(h_base + h_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_base + N + h_offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        da = acc
        if HAS_SCALE:
            if STORE_H:  # the gated activation first, so that its values die before dg / du (registers)
                s = tl.load(scale_ptr + rm, mask=mmask, other=0.0)
                su = silu * u
                tl.store(acts_ptr + off_m.to(tl.int64) * N + (lm[:, None] * N + rn[None, :]),
                         (su * s[:, None]).to(acts_ptr.dtype.element_ty), mask=mask)
                part = tl.sum(acc * su, axis=1)
            else:  # this order: 236 registers, no spills (sm_90a, the default config)
                part = tl.sum(acc * silu * u, axis=1)
                s = tl.load(scale_ptr + rm, mask=mmask, other=0.0)
            da = acc * s[:, None]
        elif STORE_H:
            tl.store(acts_ptr + off_m.to(tl.int64) * N + (lm[:, None] * N + rn[None, :]),
                     (silu * u).to(acts_ptr.dtype.element_ty), mask=mask)
        dg = da * u * (sig * (1.0 + g * (1.0 - sig)))
        tl.store(o_base + o_offs, dg.to(out_ptr.dtype.element_ty), mask=mask)
        du = da * silu
        tl.store(o_base + N + o_offs, du.to(out_ptr.dtype.element_ty), mask=mask)
    return part


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, NP: tl.constexpr):
    """[BLOCK_M, NP] -> (cols 0..NP/2-1, cols NP/2..NP-1)."""
    x = tl.permute(tl.reshape(x, (BLOCK_M, 2, NP // 2)), (0, 2, 1))
    return tl.split(x)


@triton.jit
def _epilogue(acc, acc2, off_m, off_n, row_end, ni, R, N,
              out_ptr, stride_om, h_ptr, stride_hm, scale_ptr, dsp_ptr, acts_ptr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """Write one [BLOCK_M, BLOCK_N] output tile in EPI_SPLIT column slices (1, 2 or 4; fewer live registers),
    see _epi_part; EPI_DSWIGLU with HAS_SCALE also writes dsp[ni, r] = sum over the tile's columns."""
    if EPI_SPLIT == 1:
        part = _epi_part(acc, acc2, off_m, off_n, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                         scale_ptr, acts_ptr, BLOCK_M, BLOCK_N, EPILOGUE, HAS_SCALE, STORE_H)
    elif EPI_SPLIT == 2:
        HN: tl.constexpr = BLOCK_N // 2
        a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
        b0, b1 = _halves(acc2, BLOCK_M, BLOCK_N)
        part = _epi_part(a0, b0, off_m, off_n, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                         scale_ptr, acts_ptr, BLOCK_M, HN, EPILOGUE, HAS_SCALE, STORE_H)
        part += _epi_part(a1, b1, off_m, off_n + HN, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                          scale_ptr, acts_ptr, BLOCK_M, HN, EPILOGUE, HAS_SCALE, STORE_H)
    else:
        HN: tl.constexpr = BLOCK_N // 2
        QN: tl.constexpr = BLOCK_N // 4
        a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
        b0, b1 = _halves(acc2, BLOCK_M, BLOCK_N)
        a00, a01 = _halves(a0, BLOCK_M, HN)
        b00, b01 = _halves(b0, BLOCK_M, HN)
        part = _epi_part(a00, b00, off_m, off_n, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                         scale_ptr, acts_ptr, BLOCK_M, QN, EPILOGUE, HAS_SCALE, STORE_H)
        part += _epi_part(a01, b01, off_m, off_n + QN, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                          scale_ptr, acts_ptr, BLOCK_M, QN, EPILOGUE, HAS_SCALE, STORE_H)
        a10, a11 = _halves(a1, BLOCK_M, HN)
        b10, b11 = _halves(b1, BLOCK_M, HN)
        part += _epi_part(a10, b10, off_m, off_n + HN, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                          scale_ptr, acts_ptr, BLOCK_M, QN, EPILOGUE, HAS_SCALE, STORE_H)
        part += _epi_part(a11, b11, off_m, off_n + HN + QN, row_end, R, N, out_ptr, stride_om, h_ptr,
                          stride_hm, scale_ptr, acts_ptr, BLOCK_M, QN, EPILOGUE, HAS_SCALE, STORE_H)
    if EPILOGUE == 2:
        if HAS_SCALE:
            rm = off_m + tl.arange(0, BLOCK_M)
            tl.store(dsp_ptr + ni.to(tl.int64) * R + rm, part, mask=rm < row_end)


@triton.jit
def _load_a(a_desc, a_ptr, off_m, off_k, row_end, K, stride_am,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        a = a_desc.load([off_m, off_k])
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        rk = off_k + tl.arange(0, BLOCK_K)
        ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
        a = tl.load(ptrs, mask=(rm < row_end)[:, None] & (rk < K)[None, :], other=0.0)
    return a


@triton.jit
def _load_b(w_desc, w_ptr, e, off_n, off_k, N_lim, K, stride_we, stride_wr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_KN: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] operand of w[e] for out = a @ w[e]^T (W_KN=False, w [E, N, K]) or a @ w[e]
    (W_KN=True, w [E, K, N]). N_lim bounds the n index (pointer path)."""
    if USE_TMA:
        if W_KN:
            b = w_desc.load([e, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = w_desc.load([e, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T
    else:
        rn = off_n + tl.arange(0, BLOCK_N)
        rk = off_k + tl.arange(0, BLOCK_K)
        base = w_ptr + e.to(tl.int64) * stride_we
        mask = (rk < K)[:, None] & (rn < N_lim)[None, :]
        if W_KN:
            b = tl.load(base + rk.to(tl.int64)[:, None] * stride_wr + rn[None, :], mask=mask, other=0.0)
        else:
            b = tl.load(base + rn.to(tl.int64)[None, :] * stride_wr + rk[:, None], mask=mask, other=0.0)
    return b


@triton.jit
def _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles,
               a_desc, a_ptr, w_desc, w_ptr, out_ptr, h_ptr, scale_ptr, dsp_ptr, acts_ptr,
               R, N, K, stride_am, stride_we, stride_wr, stride_om, stride_hm, N_UP,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               W_KN: tl.constexpr, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr,
               USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """One output tile: locate it, run the k-loop, write the epilogue (inlined by the compiler)."""
    e, row0, n_rows, mi, ni = _locate_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, N, BLOCK_N, GROUP_M)
    off_m = row0 + mi * BLOCK_M
    off_n = ni * BLOCK_N
    row_end = row0 + n_rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        off_k = ki * BLOCK_K
        a = _load_a(a_desc, a_ptr, off_m, off_k, row_end, K, stride_am, BLOCK_M, BLOCK_K, USE_TMA)
        b = _load_b(w_desc, w_ptr, e, off_n, off_k, N, K, stride_we, stride_wr, BLOCK_N, BLOCK_K,
                    W_KN, USE_TMA)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if EPILOGUE == 1:
            b2 = _load_b(w_desc, w_ptr, e, N_UP + off_n, off_k, N_UP + N, K, stride_we, stride_wr,
                         BLOCK_N, BLOCK_K, W_KN, USE_TMA)
            if DOT_F32:
                b2 = b2.to(tl.float32)
            acc2 = tl.dot(a, b2, acc2)
    _epilogue(acc, acc2, off_m, off_n, row_end, ni, R, N, out_ptr, stride_om, h_ptr, stride_hm,
              scale_ptr, dsp_ptr, acts_ptr, BLOCK_M, BLOCK_N, EPILOGUE, HAS_SCALE, STORE_H, EPI_SPLIT)


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr, W_KN: tl.constexpr, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr,
    STORE_H: tl.constexpr, USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, EPI_SPLIT: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """Grid: (P,) persistent programs. For each tile (e, mi, ni) of the schedule in the module docstring:
        acc = a[offs[e] + mi*BM : +BM, :] @ w[e][ni*BN : +BN, :]^T      (fp32, k-loop over BLOCK_K)
        (EPI_SWIGLU: acc2 = same with w rows N_UP + ni*BN, the up projection)
        _epilogue(acc, acc2) writes rows < offs[e+1] only.
    The tile loop is a while loop (the measured default) or, with FLATTEN, tl.range(..., flatten=True), which
    lets the compiler fuse it with the k-loop so the next tile's loads overlap this tile's epilogue.
    """
    pid = tl.program_id(0)
    e_idx, starts, cnts, m_tiles, cum_end, total = _expert_tiles(offs_ptr, E_l, N, BLOCK_M, BLOCK_N, BLOCK_E)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if FLATTEN:
        for tile in tl.range(pid, total, num_progs, flatten=True):
            _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles, a_desc, a_ptr, w_desc, w_ptr,
                       out_ptr, h_ptr, scale_ptr, dsp_ptr, acts_ptr, R, N, K, stride_am, stride_we, stride_wr,
                       stride_om, stride_hm, N_UP, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, W_KN, EPILOGUE, HAS_SCALE,
                       STORE_H, USE_TMA, DOT_F32, EPI_SPLIT)
    else:
        tile = pid
        while tile < total:
            _gemm_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, k_tiles, a_desc, a_ptr, w_desc, w_ptr,
                       out_ptr, h_ptr, scale_ptr, dsp_ptr, acts_ptr, R, N, K, stride_am, stride_we, stride_wr,
                       stride_om, stride_hm, N_UP, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, W_KN, EPILOGUE, HAS_SCALE,
                       STORE_H, USE_TMA, DOT_F32, EPI_SPLIT)
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


def _resolve_tma(cfg: GemmConfig, tensors: list[torch.Tensor], name: str) -> bool:
    ok = tma_ok(tensors)
    if cfg.use_tma is None:
        return ok
    if cfg.use_tma and not ok:
        raise ValueError(f"{name}: config pins use_tma=True, but TMA needs 16-byte aligned base pointers and "
                         f"row strides (bf16: the inner dims must be multiples of 8); shapes "
                         f"{[tuple(t.shape) for t in tensors]}")
    return bool(cfg.use_tma)


def gluon_bf16_unavailable(cfg: GemmConfig, a: torch.Tensor, w: torch.Tensor, *, n: int, w_kn: bool, epilogue: int,
                           h: torch.Tensor | None = None, n_up: int = 0, kernel: str = "gluon") -> str | None:
    """Why a Gluon bf16 kernel (kernel "gluon": kernels/gluon_bf16.py; "gluon_ws": the warp-specialised
    kernels/gluon_bf16_ws.py) cannot run this launch, or None: CUDA tensors on a device of compute capability 9.x,
    no interpreter, TMA-able operands, and the kernel's config and shape limits. No device sync: the capability
    comes from torch's cached device properties."""
    why = gluon_device_reason(a, cfg)
    if why is not None:
        return why
    if not tma_ok([a, w] + ([h] if h is not None and epilogue == EPI_DSWIGLU else [])):
        return "TMA needs 16-byte aligned base pointers and row strides (bf16: inner dims multiples of 8)"
    n_w = w.shape[2] if w_kn else w.shape[1]
    if kernel == "gluon_ws":
        from megamoe.kernels.gluon_bf16_ws import ws_bf16_limits  # lazy: Gluon only where it can run

        return ws_bf16_limits(cfg, n=n, k=a.shape[1], n_w=n_w, epilogue=epilogue, w_kn=w_kn, n_up=n_up)
    from megamoe.kernels.gluon_bf16 import gluon_bf16_limits

    return gluon_bf16_limits(cfg, n=n, k=a.shape[1], n_w=n_w, epilogue=epilogue, w_kn=w_kn, n_up=n_up)


def launch_grouped_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                        *, n: int, w_kn: bool, epilogue: int, h: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None, dsp: torch.Tensor | None = None,
                        store_h: bool = False, n_up: int = 0, acts: torch.Tensor | None = None) -> None:
    """Launch _grouped_gemm_kernel (inputs already validated by the caller in megamoe.experts); cfg.kernel = "gluon"
    or "gluon_ws": that Gluon bf16 kernel instead (ValueError naming the reason where it cannot run). acts
    (EPI_DSWIGLU only): [R, n] output of the gated activation s[r] * silu(g) * u, for the backward's dW2."""
    R, K = a.shape
    E_l = w.shape[0]
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    if acts is not None and epilogue != EPI_DSWIGLU:
        raise ValueError("grouped_gemm: acts is an output of the SwiGLU-backward epilogue only")
    if cfg.kernel in ("gluon", "gluon_ws"):  # a Gluon bf16 kernel, only where asked for
        why = gluon_bf16_unavailable(cfg, a, w, n=n, w_kn=w_kn, epilogue=epilogue, h=h, n_up=n_up, kernel=cfg.kernel)
        if why is None and acts is not None and cfg.kernel == "gluon":
            why = "its SwiGLU-backward epilogue does not write the gated activation (acts)"
        if why is not None:
            raise ValueError(f"grouped_gemm: the config pins kernel={cfg.kernel!r}, but {why}")
        if cfg.kernel == "gluon_ws":
            from megamoe.kernels.gluon_bf16_ws import launch_gluon_bf16_ws

            launch_gluon_bf16_ws(a, w, offs, out, cfg, n=n, epilogue=epilogue, h=h, scale=scale, store_h=store_h,
                                 n_up=n_up, w_kn=w_kn, dsp=dsp, acts=acts)
            return
        from megamoe.kernels.gluon_bf16 import launch_gluon_bf16

        launch_gluon_bf16(a, w, offs, out, cfg, n=n, w_kn=w_kn, epilogue=epilogue, h=h, scale=scale, dsp=dsp,
                          store_h=store_h, n_up=n_up)
        return
    use_tma = _resolve_tma(cfg, [a, w], "grouped_gemm")
    if R == 0 or n == 0 or E_l == 0:
        return
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(a, [BM, BK])
        w_desc = TensorDescriptor.from_tensor(w, [1, BK, BN] if w_kn else [1, BN, BK])
    else:
        a_desc = w_desc = None
    tiles_n = triton.cdiv(n, BN)
    grid = grid_size(cfg, (triton.cdiv(R, BM) + E_l) * tiles_n, a.device)
    if grid == 0:
        return
    dummy = out
    k = _grouped_gemm_kernel[(grid,)](
        a_desc, a, w_desc, w, out, h if h is not None else dummy,
        scale if scale is not None else dummy, dsp if dsp is not None else dummy,
        acts if acts is not None else dummy, offs,
        R, n, K, E_l, grid,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), h.stride(0) if h is not None else 0,
        n_up,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.group_m,
        BLOCK_E=triton.next_power_of_2(max(E_l, 2)), W_KN=w_kn, EPILOGUE=epilogue,
        HAS_SCALE=scale is not None, STORE_H=store_h or acts is not None, USE_TMA=use_tma, DOT_F32=interpreting(),
        EPI_SPLIT=cfg.epi_split, FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    record("_grouped_gemm_kernel", k)


__all__ = ["EPI_NONE", "EPI_SWIGLU", "EPI_DSWIGLU", "launch_grouped_gemm", "check_grouped", "gluon_bf16_unavailable"]
