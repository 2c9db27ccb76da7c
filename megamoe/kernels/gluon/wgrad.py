"""Warp-specialised bf16 grouped weight gradient for Hopper, in Gluon: kernels/wgrad.py's op (``c[e] =
x[rows_e]^T @ y[rows_e]``, deterministic: one program owns each tile, fixed reduction order, no atomics). The default
of op "wgrad" on Hopper where ``ws_wgrad_limits`` hold.

Why: the wgrad was the largest kernel of the layer's backward (deepseek-v3: half its kernel time), and its reduction
is short (a few hundred rows per expert: 8-12 k-steps), so the Triton kernel's per-tile costs show: its pipeline
fills and drains at every tile (Triton does not fuse the variable-length row loop with the tile loop), the partial
chunk is a masked load outside the pipeline, and the store waits for the k-loop. Here bf16.py's roles: a loader warp
(x's two [BK, 64] boxes, y's [BK, BLOCK_N] box per stage) and two 4-warp consumers (output rows 0..63 / 64..127), A =
x's box transposed (MN-major in shared memory), B = y's box; TMA stores drain under the next tile's k-loop.

The partial last chunk (rem = rows % BK) is the window [end - BK, end), which lies before the expert's end (earlier
experts' rows, or TMA zero fill before row 0), never in the padding; its first BK - rem rows are zeroed in shared
memory by the consumer that owns the x box before its wgmma (an A operand in registers makes ptxas serialise every
wgmma: too few registers). The window's y rows are finite (received rows), so the masked products are exact zeros.
An expert with no rows gets a zero tile.

Output: c [E_l, M, N] (bf16 or fp32) stored through the 2-D view [E_l * M, N] (columns >= N clipped); M a multiple
of 64, so a 64-row half never straddles two experts (halves at or past M are skipped).
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

from megamoe.kernels.gemm_config import GemmConfig, grid_size, record, tma_ok
from megamoe.kernels.gluon.common import REG_POOL, nvmma_desc, put, ring, ring_done, slices, stages_reason


@gluon.jit
def _wgrad_locate(tile, offs_ptr, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """tile -> (e, off_m, off_n, start, end): expert-major, GROUP_M swizzle inside the expert (kernels/wgrad.py's
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
def _wgrad_consumer(x_smem, y_smem, ready, empty, epi_smem, c_desc, offs_ptr, M, N, total, num_progs,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, NB: gl.constexpr, WG: gl.constexpr):
    """Rows WG * 64 .. WG * 64 + 63 of every output tile of this program."""
    HM: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
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
            sl = slices(acc, HM, BLOCK_N, mma_s)
            for c in gl.static_range(BLOCK_N // 64):
                v, buf = sl[c].to(cdt), WG * NB + (nst + c) % NB  # (TMA stores only: no pointer, no bounds)
                put(v, c_desc, c_desc, 0, crow, off_n + 64 * c, 0, 0, epi_smem, buf, True, HM, True, zl, NB)
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
    """Grid: (P,) persistent programs of 4 + 4 + 1 warps over the E_l * cdiv(M, 128) * cdiv(N, BLOCK_N) tiles."""
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BK, 64], x_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, [STAGES, BK, BLOCK_N], y_desc.layout)
    epi_smem = gl.allocate_shared_memory(c_desc.dtype, [2 * NB, 64, 64], c_desc.layout)
    ready, empty = ring(STAGES, 2)
    gl.warp_specialize([
        (_wgrad_consumer, (x_smem, y_smem, ready, empty, epi_smem, c_desc, offs_ptr, M, N, total, num_progs,
                           BLOCK_M, BLOCK_N, BK, GROUP_M, STAGES, NB, 0)),
        (_wgrad_consumer, (x_smem, y_smem, ready, empty, epi_smem, c_desc, offs_ptr, M, N, total, num_progs,
                           BLOCK_M, BLOCK_N, BK, GROUP_M, STAGES, NB, 1)),
        (_wgrad_loader, (x_desc, y_desc, x_smem, y_smem, ready, empty, offs_ptr, M, N, total, num_progs,
                         BLOCK_M, BLOCK_N, BK, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    ring_done(ready, empty, STAGES)


def staging_buffers(cfg: GemmConfig, out_bytes: int) -> int:
    """[64, 64] staging buffers per consumer: one per 64-column slice with a bf16 output (a tile's stores then wait
    only for the previous tile's, drained under this k-loop; with two the epilogue waited on its own stores), two
    with float32 (twice the bytes)."""
    return cfg.block_n // 64 if out_bytes == 2 else 2


def ws_wgrad_limits(cfg: GemmConfig, *, m: int, n: int, out_dtype: torch.dtype) -> str | None:
    """Why the warp-specialised wgrad kernel cannot run this launch (config and shapes; device checks are the
    caller's), or None."""
    if cfg.block_m != 128 or cfg.num_warps != 4 or cfg.block_n not in (128, 256) or cfg.block_k not in (32, 64):
        return (f"needs block_m 128, block_n 128 or 256, block_k 32 or 64 and num_warps 4 (two consumer warpgroups "
                f"of 64 rows), got {cfg.block_m} x {cfg.block_n} x {cfg.block_k}, num_warps {cfg.num_warps}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"the output must be bfloat16 or float32, got {out_dtype}"
    out_bytes = torch.finfo(out_dtype).bits // 8
    # shared memory: the ring, both consumers' [64, 64] staging buffers, barriers (rounded up)
    smem = (cfg.num_stages * 2 * cfg.block_k * (128 + cfg.block_n) + 2 * staging_buffers(cfg, out_bytes) * 64 * 64
            * out_bytes + 1024)
    if (why := stages_reason(cfg, smem)) is not None:
        return why
    if m % 64 or n % 8:
        return (f"M must be a multiple of 64 (output halves stored by TMA without straddling experts) and N of 8, "
                f"got M = {m}, N = {n}")
    return None


def launch_gluon_wgrad_ws(x: torch.Tensor, y: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                          cfg: GemmConfig) -> None:
    """Launch _gluon_wgrad_ws_kernel for wgrad.launch_grouped_wgrad's operands (validated by the caller: contiguous
    bf16 x [R, M], y [R, N], out [E_l, M, N]); ValueError naming the failing limit. Each consumer warpgroup gets
    224 registers per thread, the loader the rest of REG_POOL."""
    R, M = x.shape
    N = y.shape[1]
    E_l = out.shape[0]
    why = ws_wgrad_limits(cfg, m=M, n=N, out_dtype=out.dtype)
    if why is None and not tma_ok([x, y, out]):
        why = "x, y and out must be TMA-able (16-byte aligned bases and rows)"
    if why is not None:
        raise ValueError(f"grouped_wgrad (warp-specialised Gluon kernel): {why}")
    if E_l == 0 or M == 0 or N == 0:
        return
    if R == 0:  # no rows: zero tiles (no descriptor over an empty tensor)
        out.zero_()
        return
    bk, bn = cfg.block_k, cfg.block_n
    x_desc, y_desc = nvmma_desc(x, [bk, 64]), nvmma_desc(y, [bk, bn])
    c_desc = nvmma_desc(out.view(E_l * M, N), [64, 64], gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float32)
    total = E_l * triton.cdiv(M, 128) * triton.cdiv(N, bn)
    grid = grid_size(cfg, total, x.device)
    record("_gluon_wgrad_ws_kernel", _gluon_wgrad_ws_kernel[(grid,)](
        x_desc, y_desc, c_desc, offs, M, N, total, grid, NB=staging_buffers(cfg, out.element_size()),
        BLOCK_M=128, BLOCK_N=bn, BK=bk, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
        CONSUMER_REGS=224, LOADER_REGS=REG_POOL - 2 * 224, num_warps=4, maxnreg=REG_POOL // 3,
    ))
