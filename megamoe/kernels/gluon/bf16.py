"""Warp-specialised bf16 grouped GEMM for Hopper, in Gluon: the plain op (EPI_NONE, optional row scale: GEMM2) and
GEMM1 + SwiGLU (EPI_SWIGLU, optionally keeping h) on "nk" weights ([E_l, N_w, K]: out = a @ w[e]^T), and the SwiGLU
backward (EPI_DSWIGLU) on "kn" w2 ([E_l, K, N_w]: out = a @ w[e]). The plain op runs on kn weights too, but
megamoe.experts keeps GEMM1's dgrad on the Triton kernel (0.82-1.15x it, no variant ahead on every shape). Selected
by GemmConfig(kernel="gluon"); the default on Hopper where ``ws_bf16_limits`` hold.

    out[r, n] = sum_k a[r, k] * w[e][n, k]      (fp32 accumulation, bf16 out; with a scale: * scale[r])
    SwiGLU: g, u = the same for the gate rows n and the up rows N_UP + n; out = silu(g) * u, h = [g | u]

Why: a kernel issuing loads and wgmmas from one instruction stream, with a CTA barrier per k-step, stops the tensor
cores in every epilogue (SwiGLU writes h and act: 1.5x the bytes of torch's); the Triton kernel reaches 0.83-0.90x
torch._grouped_mm (CUTLASS, warp-specialised) on GEMM1 + SwiGLU. Here one loader warp (common.ws_loader: a
STAGES-deep ring, loads issued as soon as stages free up, across tile boundaries) feeds two 4-warp consumers taking
rows 0..63 / 64..127 of every 128-row tile (128 x 256 plain or 128 x (128 gate + 128 up) SwiGLU tiles), each stage
released by both (empty count 2): the epilogue's math stops the tensor cores, its stores do not.

k-loop: the accumulator is chained through async wgmmas; warpgroup_mma_wait(1) (SwiGLU: 2, gate and up) leaves the
step just issued in flight and proves the previous one done, whose stage is then released. Epilogue: common.put, in
64-column slices; h as two descriptors [R, N] of row stride 2N, so a gate slice past N is clipped instead of
overwriting the up half. Rows past the expert's end (the next expert's, or TMA zero fill) and weight rows past N are
loaded and dropped by the epilogue's mask, hence any N.
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

from megamoe.kernels.gemm_config import EPI_DSWIGLU, EPI_NONE, EPI_SWIGLU, GemmConfig, grid_size, record, tma_ok
from megamoe.kernels.gluon.common import (
    REG_POOL,
    epi_tile,
    locate,
    nvmma_desc,
    put,
    ring,
    ring_done,
    schedule,
    slices,
    stages_reason,
    ws_loader,
)

BLOCK_K = 64  # one 128-byte swizzled row of bf16 per k-step


@gluon.jit
def _epi_dswiglu_slice(dact, g_buf, u_buf, off_m, col, row_end, N, dg_desc, du_desc, acts_desc, out_ptr, stride_om,
                       acts_ptr, scale_ptr, epi_smem, b0, tma_ok, HM: gl.constexpr, HAS_SCALE: gl.constexpr,
                       ACTS: gl.constexpr, EPI_TMA: gl.constexpr, mma_s: gl.constexpr, store_l: gl.constexpr):
    """One 64-column slice of the SwiGLU backward (as tiles.epi_part, EPI_DSWIGLU), g, u from the tile's h slices in
    shared memory (TMA zero fill past N: they contribute 0). ACTS: acts stored first; then du at N + col, dg at col
    of out [R, 2N]. 2 or 3 staged stores, the first on buffer b0. Returns the gate-gradient row sums (else 0)."""
    g = g_buf.load(mma_s).to(gl.float32)
    u = u_buf.load(mma_s).to(gl.float32)
    sig = 1.0 / (1.0 + gl.exp(-g))
    silu = g * sig
    part = gl.zeros([HM], dtype=gl.float32, layout=gl.SliceLayout(1, mma_s))
    if HAS_SCALE:
        rm = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, mma_s))
        sc = gl.load(scale_ptr + rm, mask=rm < row_end, other=0.0)
    acts = silu * u  # the gated activation (times the scale where there is one)
    if HAS_SCALE:
        part = gl.sum(dact * acts, axis=1)
        acts = acts * sc[:, None]
    if ACTS:
        put(acts.to(gl.bfloat16), acts_desc, acts_ptr, N, off_m, col, row_end, N, epi_smem, b0, tma_ok, HM, EPI_TMA,
             store_l)
    da = dact * sc[:, None] if HAS_SCALE else dact
    nb = b0 ^ 1 if ACTS else b0
    # du before dg: silu dies first (fewer live tiles at the peak; dg first spilled with scale and acts)
    du = da * silu
    put(du.to(gl.bfloat16), du_desc, out_ptr + N, stride_om, off_m, col, row_end, N, epi_smem, nb, tma_ok, HM,
         EPI_TMA, store_l)
    dg = da * u * (sig * (1.0 + g * (1.0 - sig)))
    put(dg.to(gl.bfloat16), dg_desc, out_ptr, stride_om, off_m, col, row_end, N, epi_smem, nb ^ 1, tma_ok, HM,
         EPI_TMA, store_l)
    return part


@gluon.jit
def _bf16_consumer(a_smem, b_smem, b2_smem, ready, empty, epi_smem, h_smem, h_bar, out_desc, hg_desc,
                   hu_desc, du_desc, acts_desc, out_ptr, h_ptr, scale_ptr, acts_ptr, dsp_ptr, offs_ptr,
                   R, N, K, E_l, num_progs, stride_om, stride_hm,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
                   STAGES: gl.constexpr, HAS_SCALE: gl.constexpr, SWIGLU: gl.constexpr, STORE_H: gl.constexpr,
                   EPI_TMA: gl.constexpr, W_KN: gl.constexpr, DSWIGLU: gl.constexpr, ACTS: gl.constexpr,
                   WG: gl.constexpr):
    """One consumer warpgroup: rows WG * 64 .. WG * 64 + 63 of every tile of this program, staged through buffers
    2 WG, 2 WG + 1 of epi_smem. DSWIGLU: the tile's h slices are TMA-loaded into this consumer's part of h_smem on
    h_bar[WG] at the start of the tile, so the epilogue reads no global memory but the scale."""
    BK: gl.constexpr = 64
    HM: gl.constexpr = BLOCK_M // 2
    NSL: gl.constexpr = BLOCK_N // 64
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    store_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    e_idx, starts, cnts, m_tiles, cum_end, total = schedule(offs_ptr, E_l, N, BLOCK_M, BLOCK_N, BLOCK_E, sched)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    nt = 0  # tiles of this consumer so far (the phase of its h barrier)
    nst = 0  # staged stores so far (TMA or masked; the parity of the next one's staging buffer)
    # staged stores per 64-column slice: SwiGLU 3 with h (gate, up, act) else 1; its backward 2 (dg, du), 3 with acts
    PER_SLICE: gl.constexpr = (3 if STORE_H else 1) if SWIGLU else (3 if ACTS else 2) if DSWIGLU else 1
    PER_TILE: gl.constexpr = NSL * PER_SLICE
    for tile in range(pid, total, num_progs):
        e, row0, row_end, mi, ni = locate(tile, e_idx, starts, cnts, m_tiles, cum_end, tiles_n, GROUP_M)
        off_m = row0 + mi * BLOCK_M + WG * HM
        off_n = ni * BLOCK_N
        it = ((tile - pid) // num_progs) * k_tiles  # ring position of the tile's first k-step
        hph = nt & 1  # DSWIGLU: the phase of this tile's h load on h_bar[WG]
        if DSWIGLU:  # the tile's h (the previous epilogue is done reading h_smem: barrier + fence at its end)
            mbarrier.expect(h_bar.index(WG), 2 * NSL * hg_desc.block_type.nbytes)
            for c in gl.static_range(NSL):
                tma.async_copy_global_to_shared(hg_desc, [off_m, off_n + c * 64], h_bar.index(WG),
                                                h_smem.index(WG * 2 * NSL + c))
                tma.async_copy_global_to_shared(hu_desc, [off_m, off_n + c * 64], h_bar.index(WG),
                                                h_smem.index(WG * 2 * NSL + NSL + c))
        acc = gl.zeros((HM, BLOCK_N), dtype=gl.float32, layout=mma)
        acc2 = acc
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a_v = a_smem.index(s).slice(WG * HM, HM)
            if W_KN:  # the [BK, BLOCK_N] tile as it is
                acc = warpgroup_mma(a_v, b_smem.index(s), acc, is_async=True)
            else:  # the [BLOCK_N, BK] tile transposed
                acc = warpgroup_mma(a_v, b_smem.index(s).permute((1, 0)), acc, is_async=True)
            if SWIGLU:
                acc2 = warpgroup_mma(a_v, b2_smem.index(s).permute((1, 0)), acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if ki > 0:  # the previous k-step's products are done: its stage can be refilled
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
        if SWIGLU:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        nt += 1

        sl = slices(acc, HM, BLOCK_N, mma_s)
        tma_ok = off_m + HM <= row_end  # TMA stores cannot stop at the expert's last row
        b0 = 2 * WG + (nst & 1)
        # (1 or 3 stores per slice: each slice starts on the buffer after the previous slice's last)
        if DSWIGLU:
            hb = WG * 2 * NSL
            mbarrier.wait(h_bar.index(WG), hph)
            part = _epi_dswiglu_slice(sl[0], h_smem.index(hb), h_smem.index(hb + NSL), off_m, off_n, row_end, N,
                                      out_desc, du_desc, acts_desc, out_ptr, stride_om, acts_ptr, scale_ptr,
                                      epi_smem, b0, tma_ok, HM, HAS_SCALE, ACTS, EPI_TMA, mma_s, store_l)
            if NSL > 1:
                part += _epi_dswiglu_slice(sl[1], h_smem.index(hb + 1), h_smem.index(hb + NSL + 1), off_m, off_n + 64,
                                           row_end, N, out_desc, du_desc, acts_desc, out_ptr, stride_om, acts_ptr,
                                           scale_ptr, epi_smem, b0 ^ (PER_SLICE & 1), tma_ok, HM, HAS_SCALE, ACTS,
                                           EPI_TMA, mma_s, store_l)
            if HAS_SCALE:  # this tile's column block's share of the gate's gradient, per row
                rm = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, mma_s))
                gl.store(dsp_ptr + ni.to(gl.int64) * R + rm, part, mask=rm < row_end)
            # every thread is done reading h_smem before the next tile's TMA rewrites it (async after generic)
            gl.thread_barrier()
            fence_async_shared()
        else:
            epi_tile(acc, acc2, off_m, off_n, row_end, N, out_desc, hg_desc, hu_desc, out_ptr, stride_om, h_ptr,
                     stride_hm, scale_ptr, epi_smem, b0, tma_ok, HM, BLOCK_N, SWIGLU, STORE_H, HAS_SCALE, EPI_TMA,
                     mma_s, store_l)
        nst += PER_TILE
    if EPI_TMA:  # the staging buffers stay allocated until the last store has read them
        tma.store_wait(0)


@gluon.jit
def _gluon_bf16_ws_kernel(
    a_desc, w_desc,     # TMA descriptors: a [R, K] block [BLOCK_M, 64]; w as [E_l * N_W, K] block [BLOCK_N, 64]
    #                     (W_KN: as [E_l * K, N_W] block [64, BLOCK_N])
    out_desc,           # EPI_TMA: out [R, N] block [HM, 64] (DSWIGLU: its dg half [R, N] of row stride 2N)
    hg_desc, hu_desc,   # h's gate and up halves, each [R, N] (row stride 2N), block [HM, 64]: stored (SWIGLU with
    #                     STORE_H and EPI_TMA) or loaded (DSWIGLU)
    du_desc,            # DSWIGLU with EPI_TMA: out's du half [R, N] (base out + N, row stride 2N)
    acts_desc,          # DSWIGLU with ACTS and EPI_TMA: acts [R, N]   (unused descriptors: a_desc)
    out_ptr,            # out [R, N] bf16 (DSWIGLU: [R, 2N]), row stride stride_om
    h_ptr,              # h [R, 2N] bf16, row stride stride_hm (SWIGLU with STORE_H)
    scale_ptr,          # [R] fp32 (HAS_SCALE: plain and DSWIGLU)
    acts_ptr,           # DSWIGLU with ACTS: acts [R, N] bf16 (contiguous)
    dsp_ptr,            # DSWIGLU with HAS_SCALE: dsp [cdiv(N, BLOCK_N), R] fp32, the gate gradient's partial sums
    offs_ptr,           # [E_l + 1] int32
    R, N, K, E_l, num_progs, stride_om, stride_hm,
    N_W, N_UP,          # weight rows per expert; SWIGLU: the up rows' offset
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr, HAS_SCALE: gl.constexpr, SWIGLU: gl.constexpr, STORE_H: gl.constexpr,
    EPI_TMA: gl.constexpr, W_KN: gl.constexpr, DSWIGLU: gl.constexpr, ACTS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid: (P,) persistent programs of 4 + 4 + 1 warps (module docstring)."""
    BK: gl.constexpr = 64
    HM: gl.constexpr = BLOCK_M // 2
    MODE: gl.constexpr = 1 if SWIGLU else 3 if W_KN else 0  # common.ws_loader's
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)  # (kn: BK x N)
    # the up tiles (SWIGLU; else unused)
    b2_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BK], w_desc.layout) if SWIGLU else b_smem
    # two staging buffers per consumer, in the swizzled layout of a's [BLOCK_M, 64] tiles (the same for [HM, 64])
    epi_smem = gl.allocate_shared_memory(gl.bfloat16, [4, HM, 64], a_desc.layout)
    NSL: gl.constexpr = BLOCK_N // 64
    if DSWIGLU:  # per consumer the tile's h slices: NSL gate then NSL up, [HM, 64] each
        h_smem = gl.allocate_shared_memory(gl.bfloat16, [4 * NSL, HM, 64], a_desc.layout)
        h_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(h_bar.index(c), count=1)
    else:
        h_smem = epi_smem  # unused
        h_bar = epi_smem
    ready, empty = ring(STAGES, 2)  # one arrive per consumer of the stage
    gl.warp_specialize([
        (_bf16_consumer, (a_smem, b_smem, b2_smem, ready, empty, epi_smem, h_smem, h_bar, out_desc, hg_desc,
                          hu_desc, du_desc, acts_desc, out_ptr, h_ptr, scale_ptr, acts_ptr, dsp_ptr, offs_ptr, R, N,
                          K, E_l, num_progs, stride_om, stride_hm, BLOCK_M, BLOCK_N, GROUP_M, BLOCK_E, STAGES,
                          HAS_SCALE, SWIGLU, STORE_H, EPI_TMA, W_KN, DSWIGLU, ACTS, 0)),
        (_bf16_consumer, (a_smem, b_smem, b2_smem, ready, empty, epi_smem, h_smem, h_bar, out_desc, hg_desc,
                          hu_desc, du_desc, acts_desc, out_ptr, h_ptr, scale_ptr, acts_ptr, dsp_ptr, offs_ptr, R, N,
                          K, E_l, num_progs, stride_om, stride_hm, BLOCK_M, BLOCK_N, GROUP_M, BLOCK_E, STAGES,
                          HAS_SCALE, SWIGLU, STORE_H, EPI_TMA, W_KN, DSWIGLU, ACTS, 1)),
        (ws_loader, (a_desc, w_desc, a_smem, b_smem, b2_smem, ready, empty, offs_ptr, N, K, E_l, num_progs, N_W,
                      N_UP, BLOCK_M, BLOCK_N, GROUP_M, BLOCK_E, STAGES, MODE, BK)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    ring_done(ready, empty, STAGES)
    if DSWIGLU:
        for c in gl.static_range(2):
            mbarrier.invalidate(h_bar.index(c))


def ws_bf16_limits(cfg: GemmConfig, *, n: int, k: int, n_w: int, epilogue: int, w_kn: bool = False,
                   n_up: int = 0) -> str | None:
    """Why the warp-specialised bf16 kernel cannot run this launch (config and shapes only; device checks are the
    caller's), or None. n output columns, k reduction, n_w weight rows (kn: columns) per expert, n_up the first up
    row (SwiGLU)."""
    if epilogue not in (EPI_NONE, EPI_SWIGLU, EPI_DSWIGLU):
        return f"unknown epilogue {epilogue}"
    if w_kn and epilogue == EPI_SWIGLU:
        return "weights [E_l, K, N] (kn) with the plain and the SwiGLU-backward epilogues only (the dgrads)"
    if epilogue == EPI_DSWIGLU and not w_kn:
        return "the SwiGLU backward takes w2 as kn weights [E_l, H, I] (K = H, N = I)"
    if epilogue == EPI_DSWIGLU and n % 8:
        return f"the SwiGLU backward loads h's halves by TMA: N must be a multiple of 8, got N = {n}"
    if w_kn and k % BLOCK_K:
        return (f"kn weights: K must be a multiple of {BLOCK_K} (the [E_l * K, N] view: a k-tile must stay inside "
                f"its expert), got K = {k}")
    two = epilogue == EPI_SWIGLU
    if cfg.block_k != BLOCK_K:
        return f"block_k must be {BLOCK_K}, got {cfg.block_k}"
    if cfg.block_m != 128 or cfg.num_warps != 4:
        return (f"block_m must be 128 and num_warps 4 (consumer warpgroups of 4 warps), got block_m={cfg.block_m}, "
                f"num_warps={cfg.num_warps}")
    widths = (128, 256) if epilogue == EPI_NONE else (64, 128)
    if cfg.block_n not in widths:
        return (f"block_n must be one of {widths}{' with SwiGLU (gate = up columns per tile)' if two else ''} (128 "
                f"accumulator registers per thread at most; the SwiGLU backward's epilogue holds g and u besides), "
                f"got {cfg.block_n}")
    # shared memory: the ring, the consumers' staging buffers (2 x 2 x [64, 64] bf16), barriers (rounded up), and the
    # SwiGLU backward's h tiles (each consumer's gate and up slices)
    smem = cfg.num_stages * 2 * BLOCK_K * (cfg.block_m + (2 if two else 1) * cfg.block_n) + 4 * 64 * 64 * 2 + 1024
    if epilogue == EPI_DSWIGLU:
        smem += 2 * 2 * 64 * cfg.block_n * 2
    if (why := stages_reason(cfg, smem)) is not None:
        return why
    if k <= 0 or k % 8:
        return f"K must be a positive multiple of 8 (16-byte TMA strides), got K = {k}"
    if not two and n != n_w:
        return f"N must equal the weights' extent along N per expert, got N = {n}, {n_w}"
    if two and n_up + n > n_w:
        return f"SwiGLU: the up rows {n_up} + {n} exceed the expert's {n_w} weight rows"
    return None


def launch_gluon_bf16_ws(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                         *, n: int, epilogue: int, h: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                         store_h: bool = False, n_up: int = 0, w_kn: bool = False, dsp: torch.Tensor | None = None,
                         acts: torch.Tensor | None = None) -> None:
    """Launch _gluon_bf16_ws_kernel with the arguments of grouped_gemm.launch_grouped_gemm (operands and device
    checked by the caller); ValueError naming the failing limit."""
    R, K = a.shape
    E_l = w.shape[0]
    n_w = w.shape[2] if w_kn else w.shape[1]
    # registers per thread of each consumer warpgroup (the loader gets the rest of REG_POOL): 224 (no spills, the
    # loader keeps 56), 240 for the SwiGLU backward with acts (its epilogue spills less)
    consumer_regs = 240 if epilogue == EPI_DSWIGLU and acts is not None else 224
    why = ws_bf16_limits(cfg, n=n, k=K, n_w=n_w, epilogue=epilogue, w_kn=w_kn, n_up=n_up)
    if why is None and epilogue == EPI_SWIGLU and scale is not None:
        why = "the SwiGLU epilogue takes no row scale"
    if why is None and epilogue == EPI_DSWIGLU and (h is None or (scale is None) != (dsp is None)):
        why = "the SwiGLU backward needs h, and dsp exactly with a scale"
    if why is not None:
        raise ValueError(f"grouped_gemm (warp-specialised Gluon bf16 kernel): {why}")
    if R == 0 or E_l == 0 or n == 0:
        return
    bm, bn = cfg.block_m, cfg.block_n
    a_desc = nvmma_desc(a, [bm, BLOCK_K])
    w2d = w.view(E_l * K, n_w) if w_kn else w.view(E_l * n_w, K)
    w_desc = nvmma_desc(w2d, [BLOCK_K, bn] if w_kn else [bn, BLOCK_K])
    two, back = epilogue == EPI_SWIGLU, epilogue == EPI_DSWIGLU

    def desc(t, col=0):  # columns col .. col + n - 1 of t as [R, n] (t's row stride), blocks [bm / 2, 64]
        return nvmma_desc(t[:, col:], [bm // 2, 64], shape=[R, n])

    # TMA stores where the outputs are TMA-able: 16-byte aligned bases and row strides (a half's base: n % 8 == 0)
    out_desc = hg_desc = hu_desc = du_desc = acts_desc = a_desc  # unused where not set below
    if back:  # h is read by TMA whatever the outputs (the caller checked it TMA-able)
        hg_desc, hu_desc = desc(h), desc(h, n)
        epi_tma = tma_ok([out]) and n % 8 == 0 and (acts is None or tma_ok([acts]))
        if epi_tma:
            out_desc, du_desc = desc(out), desc(out, n)
            acts_desc = desc(acts) if acts is not None else a_desc
    else:
        epi_tma = tma_ok([out]) and (not (two and store_h) or (tma_ok([h]) and n % 8 == 0))
        if epi_tma:
            out_desc = desc(out)
            if two and store_h:
                hg_desc, hu_desc = desc(h), desc(h, n)
    grid = grid_size(cfg, (triton.cdiv(R, bm) + E_l) * triton.cdiv(n, bn), a.device)
    record("_gluon_bf16_ws_kernel", _gluon_bf16_ws_kernel[(grid,)](
        a_desc, w_desc, out_desc, hg_desc, hu_desc, du_desc, acts_desc, out, h if h is not None else out,
        scale if scale is not None else out, acts if acts is not None else out, dsp if dsp is not None else out, offs,
        R, n, K, E_l, grid, out.stride(0), h.stride(0) if h is not None else 0, n_w, n_up,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(max(E_l, 2)),
        STAGES=cfg.num_stages, HAS_SCALE=scale is not None, SWIGLU=epilogue == EPI_SWIGLU, STORE_H=store_h,
        EPI_TMA=epi_tma, W_KN=w_kn, DSWIGLU=back, ACTS=acts is not None, CONSUMER_REGS=consumer_regs,
        LOADER_REGS=REG_POOL - 2 * consumer_regs, num_warps=4, maxnreg=REG_POOL // 3,
    ))
