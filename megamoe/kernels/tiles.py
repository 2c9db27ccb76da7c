"""Device helpers the Triton grouped GEMMs and the megakernel share: the expert-tile schedule read from ``offs`` on
the device, the operand loads (TMA or masked pointers) and the epilogues. Shape legend as in grouped_gemm.py.

Schedule (no host sync): per-expert tile counts ``tiles_e = cdiv(n_e, BLOCK_M) * cdiv(N, BLOCK_N)`` and their running
sum; a tile index maps to (expert, m-block, n-block) by counting how many running sums are <= it; inside an expert,
tiles go in GROUP_M-high column strips (L2 swizzle), so programs running at once share weight tiles.

Example: BLOCK_M = 128, N = 256, BLOCK_N = 128, offs = [0, 300, 300, 429]: n = [300, 0, 129], m-tiles [3, 0, 2],
tiles [6, 0, 4], running sums [6, 6, 10]; tile 7 -> expert 2 (two sums <= 7), local tile 1 -> m-block 1 (rows
428..555, only row 428 is valid), n-block 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_tiles(offs_ptr, E_l, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
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
def locate_tile(tile, e_idx, starts, cnts, m_tiles, cum_end, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
def epi_part(acc, acc2, off_m, off_n, row_end, R, N,
              out_ptr, stride_om, h_ptr, stride_hm, scale_ptr, acts_ptr,
              BLOCK_M: tl.constexpr, NP: tl.constexpr,
              EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr,
              bias_ptr=None, e=0, stride_be=0, alpha=1.0, limit=0.0,
              HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """Write a [BLOCK_M, NP] column slice of the output tile; rows >= row_end and cols >= N are dropped.
    EPI_NONE:    out = acc (* s[r])
    EPI_SWIGLU:  acc = g, acc2 = u; h[:, n] = g, h[:, N + n] = u (STORE_H); out = silu(g) * u
    EPI_DSWIGLU: acc = dact (unscaled, = dy @ w2); g, u read from h; da = s[r] * dact;
                 out[:, n] = da * u * silu'(g), out[:, N + n] = da * silu(g); STORE_H here: also
                 acts[:, n] = s[r] * silu(g) * u ([R, N], the gated activation that dW2 = dy^T @ acts needs)
    Returns the row sums of dact * silu(g) * u (EPI_DSWIGLU with HAS_SCALE: the gate's gradient), else 0.
    HAS_BIAS (bias_ptr: [E_l, *] with row stride stride_be, e: the tile's expert): EPI_NONE adds b[e, n] before
    the scale; EPI_SWIGLU adds b[e, n] to g and b[e, N + n] to u (h keeps the biased values). ACT=1 (gpt-oss):
    the clamped SwiGLU act = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1) in
    place of silu(g) * u, forward and backward (zero gradient where a clamp holds, as torch.clamp's). The defaults
    (HAS_BIAS=False, ACT=0) generate the plain code.
    Pointers are a 64-bit tile base plus 32-bit in-tile offsets, to keep registers down."""
    lm = tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, NP)
    rm = off_m + lm
    mmask = rm < row_end
    mask = mmask[:, None] & (rn < N)[None, :]
    o_base = out_ptr + off_m.to(tl.int64) * stride_om
    o_offs = lm[:, None] * stride_om + rn[None, :]
    part = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if EPILOGUE == 0:
        if HAS_BIAS:
            b_base = bias_ptr + e.to(tl.int64) * stride_be
            acc = acc + tl.load(b_base + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if HAS_SCALE:
            s = tl.load(scale_ptr + rm, mask=mmask, other=0.0)
            acc = acc * s[:, None]
        tl.store(o_base + o_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == 1:
        g = acc
        u = acc2
        if HAS_BIAS:
            b_base = bias_ptr + e.to(tl.int64) * stride_be
            g = g + tl.load(b_base + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            u = u + tl.load(b_base + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if STORE_H:
            h_base = h_ptr + off_m.to(tl.int64) * stride_hm
            h_offs = lm[:, None] * stride_hm + rn[None, :]
            tl.store(h_base + h_offs, g.to(h_ptr.dtype.element_ty), mask=mask)
            tl.store(h_base + N + h_offs, u.to(h_ptr.dtype.element_ty), mask=mask)
        if ACT == 0:
            act = g / (1.0 + tl.exp(-g)) * u
        else:
            gc = tl.minimum(g, limit)
            act = gc / (1.0 + tl.exp(-alpha * gc)) * (tl.minimum(tl.maximum(u, -limit), limit) + 1.0)
        tl.store(o_base + o_offs, act.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        h_base = h_ptr + off_m.to(tl.int64) * stride_hm
        h_offs = lm[:, None] * stride_hm + rn[None, :]
        g = tl.load(h_base + h_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_base + N + h_offs, mask=mask, other=0.0).to(tl.float32)
        da = acc
        if ACT == 1:
            # h holds the biased, unclamped g, u: gc = min(g, limit), uc = clamp(u, -limit, limit), sig =
            # sigmoid(alpha * gc), act = gc * sig * (uc + 1); dg = da * (uc + 1) * sig * (1 + alpha * gc * (1 - sig))
            # where g <= limit, else 0; du = da * gc * sig where -limit <= u <= limit, else 0
            gc = tl.minimum(g, limit)
            up1 = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
            sig = 1.0 / (1.0 + tl.exp(-alpha * gc))
            glu = gc * sig
            act = glu * up1
            if HAS_SCALE:
                s = tl.load(scale_ptr + rm, mask=mmask, other=0.0)
                part = tl.sum(acc * act, axis=1)
                if STORE_H:
                    tl.store(acts_ptr + off_m.to(tl.int64) * N + (lm[:, None] * N + rn[None, :]),
                             (act * s[:, None]).to(acts_ptr.dtype.element_ty), mask=mask)
                da = acc * s[:, None]
            elif STORE_H:
                tl.store(acts_ptr + off_m.to(tl.int64) * N + (lm[:, None] * N + rn[None, :]),
                         act.to(acts_ptr.dtype.element_ty), mask=mask)
            dg = tl.where(g <= limit, da * up1 * (sig * (1.0 + alpha * gc * (1.0 - sig))), 0.0)
            tl.store(o_base + o_offs, dg.to(out_ptr.dtype.element_ty), mask=mask)
            du = tl.where((u >= -limit) & (u <= limit), da * glu, 0.0)
            tl.store(o_base + N + o_offs, du.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            sig = 1.0 / (1.0 + tl.exp(-g))
            silu = g * sig
            if HAS_SCALE:
                if STORE_H:  # the gated activation first, so that its values die before dg / du (registers)
                    s = tl.load(scale_ptr + rm, mask=mmask, other=0.0)
                    su = silu * u
                    tl.store(acts_ptr + off_m.to(tl.int64) * N + (lm[:, None] * N + rn[None, :]),
                             (su * s[:, None]).to(acts_ptr.dtype.element_ty), mask=mask)
                    part = tl.sum(acc * su, axis=1)
                else:  # this order: no spills on sm_90a with the default config
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
def halves(x, BLOCK_M: tl.constexpr, NP: tl.constexpr):
    """[BLOCK_M, NP] -> (cols 0..NP/2-1, cols NP/2..NP-1)."""
    x = tl.permute(tl.reshape(x, (BLOCK_M, 2, NP // 2)), (0, 2, 1))
    return tl.split(x)


@triton.jit
def col_slices(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> a tuple of its SPLIT (1, 2 or 4) column slices, left to right."""
    parts = (x,)
    if SPLIT > 1:
        x0, x1 = halves(x, BLOCK_M, BLOCK_N)
        parts = (x0, x1)
    if SPLIT == 4:
        x00, x01 = halves(x0, BLOCK_M, BLOCK_N // 2)
        x10, x11 = halves(x1, BLOCK_M, BLOCK_N // 2)
        parts = (x00, x01, x10, x11)
    return parts


@triton.jit
def epilogue(acc, acc2, off_m, off_n, row_end, ni, R, N,
              out_ptr, stride_om, h_ptr, stride_hm, scale_ptr, dsp_ptr, acts_ptr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_H: tl.constexpr, EPI_SPLIT: tl.constexpr,
              bias_ptr=None, e=0, stride_be=0, alpha=1.0, limit=0.0,
              HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """Write one [BLOCK_M, BLOCK_N] output tile in EPI_SPLIT column slices (1, 2 or 4; fewer live registers),
    see epi_part (also for the bias and activation arguments); EPI_DSWIGLU with HAS_SCALE also writes
    dsp[ni, r] = sum over the tile's columns."""
    NP: tl.constexpr = BLOCK_N // EPI_SPLIT
    aa = col_slices(acc, BLOCK_M, BLOCK_N, EPI_SPLIT)
    bb = col_slices(acc2, BLOCK_M, BLOCK_N, EPI_SPLIT)
    part = epi_part(aa[0], bb[0], off_m, off_n, row_end, R, N, out_ptr, stride_om, h_ptr, stride_hm,
                     scale_ptr, acts_ptr, BLOCK_M, NP, EPILOGUE, HAS_SCALE, STORE_H,
                     bias_ptr, e, stride_be, alpha, limit, HAS_BIAS, ACT)
    for c in tl.static_range(1, EPI_SPLIT):
        part += epi_part(aa[c], bb[c], off_m, off_n + c * NP, row_end, R, N, out_ptr, stride_om, h_ptr,
                          stride_hm, scale_ptr, acts_ptr, BLOCK_M, NP, EPILOGUE, HAS_SCALE, STORE_H,
                          bias_ptr, e, stride_be, alpha, limit, HAS_BIAS, ACT)
    if EPILOGUE == 2:
        if HAS_SCALE:
            rm = off_m + tl.arange(0, BLOCK_M)
            tl.store(dsp_ptr + ni.to(tl.int64) * R + rm, part, mask=rm < row_end)


@triton.jit
def load_a(a_desc, a_ptr, off_m, off_k, row_end, K, stride_am,
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
def load_b(w_desc, w_ptr, e, off_n, off_k, N_lim, K, stride_we, stride_wr,
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
def mma(a_desc, a_ptr, w_desc, w_ptr, e, off_m, off_n, row_end, N, K, N_UP, k_tiles, stride_am, stride_we,
        stride_wr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_KN: tl.constexpr,
        USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, GATED: tl.constexpr, UP_FIRST: tl.constexpr = False,
        FP8: tl.constexpr = False, as_ptr=None, ws_ptr=None, stride_asm=0, stride_wse=0, stride_wsn=0):
    """The k-loop of one tile (fp32): acc = a[off_m:+BLOCK_M] @ w[e][off_n:+BLOCK_N]^T (load_b's layouts), rows from
    row_end on read as 0; GATED: acc2 likewise from w's rows N_UP + off_n.. (SwiGLU's up projection), else zeros;
    UP_FIRST: both weight tiles loaded before the first dot (the megakernel's order, its code as it was tuned).
    FP8: each k-step's product scaled by a_s[rows, kb] * w_s[e, cols // 128, kb] (as_ptr [R, *] with row stride
    stride_asm, ws_ptr [E_l, *, *] with strides stride_wse, stride_wsn) before it is added."""
    if FP8:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        as_ptrs = as_ptr + rm.to(tl.int64) * stride_asm
        amask = rm < row_end
        ws_base = ws_ptr + e.to(tl.int64) * stride_wse
        ws_ptrs = ws_base + (rn // 128) * stride_wsn
        ws2_ptrs = ws_base + ((N_UP + rn) // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        off_k = ki * BLOCK_K
        a = load_a(a_desc, a_ptr, off_m, off_k, row_end, K, stride_am, BLOCK_M, BLOCK_K, USE_TMA)
        b = load_b(w_desc, w_ptr, e, off_n, off_k, N, K, stride_we, stride_wr, BLOCK_N, BLOCK_K,
                    W_KN, USE_TMA)
        if GATED and UP_FIRST:
            b2 = load_b(w_desc, w_ptr, e, N_UP + off_n, off_k, N_UP + N, K, stride_we, stride_wr,
                        BLOCK_N, BLOCK_K, W_KN, USE_TMA)
        if FP8:
            sa = tl.load(as_ptrs + ki, mask=amask, other=0.0)
            sb = tl.load(ws_ptrs + ki, mask=rn < N, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            if not UP_FIRST:
                b2 = load_b(w_desc, w_ptr, e, N_UP + off_n, off_k, N_UP + N, K, stride_we, stride_wr,
                            BLOCK_N, BLOCK_K, W_KN, USE_TMA)
            if FP8:
                sb2 = tl.load(ws2_ptrs + ki, mask=rn < N, other=0.0)
            if DOT_F32:
                b2 = b2.to(tl.float32)
            if FP8:
                acc2 += tl.dot(a, b2) * (sa[:, None] * sb2[None, :])
            else:
                acc2 = tl.dot(a, b2, acc2)
    return acc, acc2
