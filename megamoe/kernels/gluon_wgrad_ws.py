"""Warp-specialised bf16 grouped weight gradient for Hopper, in Gluon: ``c[e] = x[rows_e]^T @ y[rows_e]`` ([M, N]
per local expert, reduction over the expert's rows), the op of grouped_gemm_bwd.py (dW2 = g_out^T act, dW13 = dh^T
recv), deterministic: each output tile is owned by one program, which reduces over the expert's rows in a fixed
order, no atomics.

Why (2026-12-01): the wgrad was the largest kernel of the layer's backward (deepseek-v3 at EP 1 on one H200: 13.3 of
27.7 ms of kernel time; bench-gemm at EP 4 shapes 476-700 TFLOP/s, deepseek-4096 501 / 514). Its reduction is short
(the expert's rows: 288-736 at deepseek-4096 EP 4, 8-12 k-steps of 64), so the Triton kernel's per-tile costs show:
its software pipeline fills and drains at every tile (the row loop's trip count varies per expert, so Triton does not
fuse it with the tile loop), the last partial chunk is a masked pointer load outside the pipeline, and the tile's
store waits for the k-loop. Here, as in gluon_bf16_ws.py:

    loader     (1 warp)  every k-step of every tile of the program, in order, into a STAGES-deep ring (TMA), across
                         tile boundaries: x's [BK, 64] boxes of the two consumer halves and y's [BK, BLOCK_N] box
    consumers  (2 x 4 warps, cooperative) rows WG * 64 .. WG * 64 + 63 of the 128-row output tile: one async wgmma
                         per k-step, A = x's box transposed (MN-major in shared memory), B = y's box ([K, N]); the
                         epilogue in 64-column slices, each through its own staging buffer (bf16 output; two that
                         alternate with float32) and an asynchronous TMA store that drains under the next tile's
                         k-loop

Rows of a chunk: full chunks at start + k * BK; the last, partial chunk (rem = rows % BK) is the window
[end - BK, end), which lies inside the rows before the expert's end (earlier experts' rows, or TMA zero fill before
row 0), never in the padding after offs[E_l]; its first BK - rem rows (already counted, or another expert's) are
zeroed in shared memory by the consumer that owns the box (each consumer has its own x box) before its wgmma (an
A operand in registers instead made ptxas serialise every wgmma of the kernel: too few registers). The y rows of
the window hold finite data (they are received rows), so the masked products are exact zeros. An expert with no
rows gets a zero tile.

Output: c [E_l, M, N] (bf16 or fp32) stored through the 2-D view [E_l * M, N] by TMA (columns >= N clipped); M must be
a multiple of 64 (a 64-row half never straddles two experts; halves at or past M are skipped): every preset's H and
2I are. Opt-in with GemmConfig(kernel="gluon_ws") on op "wgrad"; the default on Hopper where its limits hold
(megamoe.experts.grouped_wgrad).
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

from megamoe.kernels.gemm_config import GemmConfig, grid_size, record, tma_ok
from megamoe.kernels.gluon_bf16 import SMEM_LIMIT, _slices
from megamoe.kernels.gluon_fp8_ws import REG_POOL, _ring, _ring_done, consumer_regs_reason


@gluon.jit
def _wgrad_locate(tile, offs_ptr, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """tile -> (e, off_m, off_n, start, end): expert-major, GROUP_M swizzle inside the expert (grouped_gemm_bwd.py's
    order), and the expert's rows [start, end)."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_e = tiles_m * tiles_n
    e = tile // per_e
    local = tile % per_e
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    gsz = gl.minimum(tiles_m - first_m, GROUP_M)
    mi = first_m + (local % width) % gsz
    ni = (local % width) // gsz
    start = gl.load(offs_ptr + e)
    end = gl.maximum(gl.load(offs_ptr + e + 1), start)
    return e, mi * BLOCK_M, ni * BLOCK_N, start, end


@gluon.jit
def _wgrad_loader(x_desc, y_desc, x_smem, y_smem, ready, empty, offs_ptr, M, N, total, num_progs,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr):
    """Every k-step of this program's tiles into the ring: x's two [BK, 64] boxes (stage s at x_smem 2s, 2s + 1) and
    y's [BK, BLOCK_N] box; the partial last chunk as the window ending at the expert's end (module docstring)."""
    nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + y_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), total, num_progs):
        e, off_m, off_n, start, end = _wgrad_locate(tile, offs_ptr, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        n_full = (end - start) // BK
        for ki in range(gl.cdiv(end - start, BK)):
            s = it % STAGES
            r0 = start + ki * BK
            if ki == n_full:  # the partial chunk: the window [end - BK, end) (negative rows: TMA zero fill)
                r0 = end - BK
            # empty barriers start in phase 0: the first pass over the ring waits for the (complete) phase 1
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(x_desc, [r0, off_m], ready.index(s), x_smem.index(2 * s))
            tma.async_copy_global_to_shared(x_desc, [r0, off_m + 64], ready.index(s), x_smem.index(2 * s + 1))
            tma.async_copy_global_to_shared(y_desc, [r0, off_n], ready.index(s), y_smem.index(s))
            it += 1


@gluon.jit
def _wgrad_put(val, c_desc, epi_smem, buf, row, col, NB: gl.constexpr):
    """val ([64, 64] in c's dtype) -> c's 2-D view at (row, col) by an asynchronous TMA store through staging
    buffer buf (the consumer's NB buffers are used in turn, so the store that last read buf is NB stores back: at
    most NB - 1 pending, then a warpgroup barrier, frees buf)."""
    b = epi_smem.index(buf)
    tma.store_wait(NB - 1)
    gl.thread_barrier()
    b.store(val)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [row, col], b)


@gluon.jit
def _wgrad_consumer(x_smem, y_smem, ready, empty, epi_smem, c_desc, offs_ptr, M, N, total, num_progs,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, NB: gl.constexpr, WG: gl.constexpr):
    """Rows WG * 64 .. WG * 64 + 63 of every output tile of this program (module docstring)."""
    HM: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # x's [BK, 64] box, 16 bytes per thread
    cdt: gl.constexpr = c_desc.dtype
    it = 0
    nst = 0  # staged stores so far (the parity of the next one's staging buffer)
    for tile in range(gl.program_id(0), total, num_progs):
        e, off_m, off_n, start, end = _wgrad_locate(tile, offs_ptr, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        n_full = (end - start) // BK
        rem = (end - start) - n_full * BK
        acc = gl.zeros((HM, BLOCK_N), dtype=gl.float32, layout=mma)
        for ki in range(n_full):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(x_smem.index(2 * s + WG).permute((1, 0)), y_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if ki > 0:  # the previous k-step's product is done: its stage can be refilled
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
        if rem > 0:  # the window [end - BK, end): its first BK - rem rows are zeroed in this consumer's x box
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # (fewer live registers for the rewrite)
            xb = x_smem.index(2 * s + WG)
            v = xb.load(zl)
            kk = gl.arange(0, BK, layout=gl.SliceLayout(1, zl))
            xb.store(gl.where((kk >= BK - rem)[:, None], v, gl.zeros_like(v)))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(xb.permute((1, 0)), y_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if n_full > 0:
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if end > start:
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)

        row = off_m + WG * HM
        if row < M:  # (M % 64 == 0: a half is all inside the expert's M rows or all past them)
            crow = e * M + row
            a0, a1, a2, a3 = _slices(acc, HM, BLOCK_N, mma_s)
            b = WG * NB
            _wgrad_put(a0.to(cdt), c_desc, epi_smem, b + nst % NB, crow, off_n, NB)
            _wgrad_put(a1.to(cdt), c_desc, epi_smem, b + (nst + 1) % NB, crow, off_n + 64, NB)
            if BLOCK_N == 256:
                _wgrad_put(a2.to(cdt), c_desc, epi_smem, b + (nst + 2) % NB, crow, off_n + 128, NB)
                _wgrad_put(a3.to(cdt), c_desc, epi_smem, b + (nst + 3) % NB, crow, off_n + 192, NB)
            nst += BLOCK_N // 64
    tma.store_wait(0)  # the staging buffers stay allocated until the last store has read them


@gluon.jit
def _gluon_wgrad_ws_kernel(
    x_desc,             # x [R, M] bf16, block [BK, 64]
    y_desc,             # y [R, N] bf16, block [BK, BLOCK_N]
    c_desc,             # c as [E_l * M, N] (bf16 or fp32), block [64, 64]
    offs_ptr,           # [E_l + 1] int32
    M, N, total, num_progs,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    NB: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid: (P,) persistent programs of 4 + 4 + 1 warps over the E_l * cdiv(M, 128) * cdiv(N, BLOCK_N) tiles,
    tile = pid, pid + P, ... (module docstring)."""
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BK, 64], x_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, [STAGES, BK, BLOCK_N], y_desc.layout)
    epi_smem = gl.allocate_shared_memory(c_desc.dtype, [2 * NB, 64, 64], c_desc.layout)
    ready, empty = _ring(STAGES, 2)
    gl.warp_specialize([
        (_wgrad_consumer, (x_smem, y_smem, ready, empty, epi_smem, c_desc, offs_ptr, M, N, total, num_progs,
                           BLOCK_M, BLOCK_N, BK, GROUP_M, STAGES, NB, 0)),
        (_wgrad_consumer, (x_smem, y_smem, ready, empty, epi_smem, c_desc, offs_ptr, M, N, total, num_progs,
                           BLOCK_M, BLOCK_N, BK, GROUP_M, STAGES, NB, 1)),
        (_wgrad_loader, (x_desc, y_desc, x_smem, y_smem, ready, empty, offs_ptr, M, N, total, num_progs,
                         BLOCK_M, BLOCK_N, BK, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    _ring_done(ready, empty, STAGES)


def staging_buffers(cfg: GemmConfig, out_bytes: int) -> int:
    """[64, 64] staging buffers per consumer: one per 64-column slice of its tile half with a bf16 output (a tile's
    stores then wait only for the previous tile's, which drained under this tile's k-loop; with two buffers the
    epilogue waited on its own stores, ~3 store latencies per tile: the first GPU run, 2026-12-01), two with a
    float32 one (twice the bytes)."""
    return cfg.block_n // 64 if out_bytes == 2 else 2


def smem_bytes(cfg: GemmConfig, out_bytes: int) -> int:
    """Shared memory of a launch: the ring (x's two [BK, 64] boxes and y's [BK, BLOCK_N] per stage), the two
    consumers' [64, 64] staging buffers in the output dtype, barriers (rounded up)."""
    nb = staging_buffers(cfg, out_bytes)
    return cfg.num_stages * 2 * cfg.block_k * (128 + cfg.block_n) + 2 * nb * 64 * 64 * out_bytes + 1024


def ws_wgrad_limits(cfg: GemmConfig, *, m: int, n: int, out_dtype: torch.dtype) -> str | None:
    """Why the warp-specialised wgrad kernel cannot run this launch (config and shapes; device checks are the
    caller's), or None."""
    if cfg.block_m != 128 or cfg.num_warps != 4 or cfg.block_n not in (128, 256) or cfg.block_k not in (32, 64):
        return (f"needs block_m 128, block_n 128 or 256, block_k 32 or 64 and num_warps 4 (two consumer warpgroups "
                f"of 64 rows), got {cfg.block_m} x {cfg.block_n} x {cfg.block_k}, num_warps {cfg.num_warps}")
    if cfg.pingpong:
        return "the cooperative schedule only (pingpong=False)"
    if cfg.num_stages < 2:
        return f"num_stages must be >= 2, got {cfg.num_stages}"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"the output must be bfloat16 or float32, got {out_dtype}"
    smem = smem_bytes(cfg, torch.finfo(out_dtype).bits // 8)
    if smem > SMEM_LIMIT:
        return f"{cfg.num_stages} stages need ~{smem} bytes of shared memory, more than {SMEM_LIMIT}"
    if m % 64 or n % 8:
        return (f"M must be a multiple of 64 (output halves stored by TMA without straddling experts) and N of 8, "
                f"got M = {m}, N = {n}")
    return None


def launch_gluon_wgrad_ws(x: torch.Tensor, y: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                          *, consumer_regs: int = 224) -> None:
    """Launch _gluon_wgrad_ws_kernel for grouped_gemm_bwd.launch_grouped_wgrad's operands (validated by the caller:
    contiguous bf16 x [R, M], y [R, N], out [E_l, M, N]); ValueError naming the limit that fails."""
    R, M = x.shape
    N = y.shape[1]
    E_l = out.shape[0]
    why = ws_wgrad_limits(cfg, m=M, n=N, out_dtype=out.dtype)
    if why is None and not tma_ok([x, y, out]):
        why = "x, y and out must be TMA-able (16-byte aligned bases and rows)"
    if why is None:
        why = consumer_regs_reason(consumer_regs)
    if why is not None:
        raise ValueError(f"grouped_wgrad (warp-specialised Gluon kernel): {why}")
    if E_l == 0 or M == 0 or N == 0:
        return
    if R == 0:  # no rows: zero tiles (no descriptor over an empty tensor)
        out.zero_()
        return
    bk, bn = cfg.block_k, cfg.block_n
    bf = gl.bfloat16
    x_desc = TensorDescriptor(x, [R, M], [M, 1], [bk, 64], gl.NVMMASharedLayout.get_default_for([bk, 64], bf))
    y_desc = TensorDescriptor(y, [R, N], [N, 1], [bk, bn], gl.NVMMASharedLayout.get_default_for([bk, bn], bf))
    cdt = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float32
    c2 = out.view(E_l * M, N)
    c_desc = TensorDescriptor(c2, [E_l * M, N], [N, 1], [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], cdt))
    total = E_l * triton.cdiv(M, 128) * triton.cdiv(N, bn)
    grid = grid_size(cfg, total, x.device)
    k = _gluon_wgrad_ws_kernel[(grid,)](
        x_desc, y_desc, c_desc, offs, M, N, total, grid,
        BLOCK_M=128, BLOCK_N=bn, BK=bk, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
        NB=staging_buffers(cfg, out.element_size()),
        CONSUMER_REGS=consumer_regs, LOADER_REGS=REG_POOL - 2 * consumer_regs, num_warps=4, maxnreg=REG_POOL // 3,
    )
    record("_gluon_wgrad_ws_kernel", k)


__all__ = ["launch_gluon_wgrad_ws", "ws_wgrad_limits"]
