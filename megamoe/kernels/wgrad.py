"""Deterministic grouped weight gradient: for every local expert e, ``c[e] = x[rows_e]^T @ y[rows_e]`` ([M, N],
reduced over the expert's rows; ``offs`` as in grouped_gemm.py). dW2 = (s * dy)^T @ act, dW13 = dh^T @ x. (The
dgrad GEMMs are grouped_gemm.py's kernel with w read K-major, ``W_KN``.)

Persistent: min(#SMs or cfg.num_sms, tiles) programs walk the output tiles. With TMA a tile is stored by a bulk copy
from shared memory, pipelined under the next tile's loads when the tile loop is flattened, where its staging buffer
fits beside the operand ring (``_store_fits``; else masked pointer stores).

Determinism: one program owns each tile and reduces over the rows in a fixed order, no atomics: bitwise equal runs
whatever the grid. An expert with no rows gets a zero tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.kernels.gemm_config import SMEM_LIMIT, GemmConfig, grid_size, interpreting, record, resolve_tma, tma_ok


@triton.jit
def _wgrad_tile(tile, x_desc, x_ptr, y_desc, y_ptr, c_desc, c_ptr, offs_ptr, M, N,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, STORE_TMA: tl.constexpr):
    """One output tile (e, mi, ni) (GROUP_M swizzle inside e): acc = sum over BLOCK_K-row chunks of the expert's
    rows, in order, of x^T @ y. Full chunks ride TMA; the last partial chunk is masked in both operands (padding
    may hold NaN: 0 * NaN would leak). STORE_TMA: the 3-D descriptor [E_l, M, N] clips at the expert's edges."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_e = tiles_m * tiles_n
    e = tile // per_e
    local = tile % per_e
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    gsz = tl.minimum(tiles_m - first_m, GROUP_M)
    mi = first_m + (local % width) % gsz
    ni = (local % width) // gsz
    off_m = mi * BLOCK_M
    off_n = ni * BLOCK_N
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    n_rows = tl.maximum(end - start, 0)
    n_full = n_rows // BLOCK_K
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(n_full):
        r0 = start + ki * BLOCK_K
        if USE_TMA:
            x = x_desc.load([r0, off_m])
            y = y_desc.load([r0, off_n])
        else:
            rk = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            x = tl.load(x_ptr + rk[:, None] * M + rm[None, :], mask=(rm < M)[None, :], other=0.0)
            y = tl.load(y_ptr + rk[:, None] * N + rn[None, :], mask=(rn < N)[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x.T, y, acc)
    r0 = start + n_full * BLOCK_K
    if r0 < end:
        rk = r0 + tl.arange(0, BLOCK_K)
        valid = rk < end
        rk64 = rk.to(tl.int64)
        x = tl.load(x_ptr + rk64[:, None] * M + rm[None, :], mask=valid[:, None] & (rm < M)[None, :], other=0.0)
        y = tl.load(y_ptr + rk64[:, None] * N + rn[None, :], mask=valid[:, None] & (rn < N)[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x.T, y, acc)
    if STORE_TMA:
        c_desc.store([e, off_m, off_n], acc.to(c_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
    else:
        c_ptrs = c_ptr + e.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    x_desc, x_ptr,      # x_RM [R, M] bf16 contiguous
    y_desc, y_ptr,      # y_RN [R, N] bf16 contiguous
    c_desc, c_ptr,      # c [E_l, M, N] (fp32 or bf16) contiguous
    offs_ptr,           # offs [E_l + 1] int32
    M, N, total, num_progs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, FLATTEN: tl.constexpr, STORE_TMA: tl.constexpr,
):
    """Grid: (P,) persistent programs over the E_l * cdiv(M, BM) * cdiv(N, BN) tiles. FLATTEN: Triton 3.6 does not
    fuse tl.range(flatten=True) with the row loop (variable trip count), but gives the TMA store its own buffer and
    waits only before the next store, so the store drains under the next tile's loads."""
    pid = tl.program_id(0)
    if FLATTEN:
        for tile in tl.range(pid, total, num_progs, flatten=True):
            _wgrad_tile(tile, x_desc, x_ptr, y_desc, y_ptr, c_desc, c_ptr, offs_ptr, M, N, BLOCK_M, BLOCK_N, BLOCK_K,
                        GROUP_M, USE_TMA, DOT_F32, STORE_TMA)
    else:
        tile = pid
        while tile < total:
            _wgrad_tile(tile, x_desc, x_ptr, y_desc, y_ptr, c_desc, c_ptr, offs_ptr, M, N, BLOCK_M, BLOCK_N, BLOCK_K,
                        GROUP_M, USE_TMA, DOT_F32, STORE_TMA)
            tile += num_progs


def _store_fits(cfg: GemmConfig, out_bytes: int) -> bool:
    """Whether the TMA store's staging tile fits beside the operand ring (flattened loop: its own buffer; else it
    reuses the ring). The default 128x256x32, 5 stages: 188 KB with a bf16 output, 254 KB (too many) with fp32."""
    ring = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * 2
    staging = cfg.block_m * cfg.block_n * out_bytes if cfg.flatten else 0
    return ring + staging <= SMEM_LIMIT - 4096  # a margin for the barriers and the compiler's scratch


def launch_grouped_wgrad(x: torch.Tensor, y: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
                         cfg: GemmConfig) -> None:
    (R, M), N, E_l = x.shape, y.shape[1], out.shape[0]
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    use_tma = resolve_tma(cfg, [x, y], "grouped_wgrad")
    store_tma = use_tma and tma_ok([out]) and _store_fits(cfg, out.element_size())
    if R == 0:
        out.zero_()
        return
    x_desc = TensorDescriptor.from_tensor(x, [BK, BM]) if use_tma else None
    y_desc = TensorDescriptor.from_tensor(y, [BK, BN]) if use_tma else None
    c_desc = TensorDescriptor.from_tensor(out, [1, BM, BN]) if store_tma else None
    total = E_l * triton.cdiv(M, BM) * triton.cdiv(N, BN)
    grid = grid_size(cfg, total, x.device)
    if grid == 0:
        return
    k = _grouped_wgrad_kernel[(grid,)](
        x_desc, x, y_desc, y, c_desc, out, offs, M, N, total, grid,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.group_m, USE_TMA=use_tma, DOT_F32=interpreting(),
        FLATTEN=cfg.flatten, STORE_TMA=store_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    record("_grouped_wgrad_kernel", k)
