"""Bias gradients of gpt-oss's experts over expert-grouped rows: per-expert column sums and per-row dots with the
row's expert bias. Deterministic (one program owns each output, reduces in a fixed order, no atomics), no host sync.

Shape legend: R rows (buffer capacity), N columns, E_l local experts; expert e's rows are ``offs[e]:offs[e+1]``
(``offs`` int32 [E_l + 1] on the device), rows at or past offs[E_l] are padding (never read as data).

    segment_sum:  out[e, n] = sum_{r in rows_e} s[r] * x[r, n]        db2 (x = dy rows, s = gates), db13 (x = dh)
    row_bias_dot: out[r]    = sum_n y[r, n] * b[e(r), n]              the gate gradient's bias term <dy, b2[e]>
                                                                         (0 on padding rows)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.kernels.gemm_config import interpreting


@triton.jit
def _segment_sum_kernel(
    x_ptr,        # x [R, N] bf16, row stride stride_x
    scale_ptr,    # s [R] fp32 (HAS_SCALE)
    offs_ptr,     # offs [E_l + 1] int32
    out_ptr,      # out [E_l, N] (any float dtype), contiguous
    N, stride_x,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    """Grid (E_l, cdiv(N, BLOCK_N)): program (e, j) sums columns j*BLOCK_N.. of expert e's rows, BLOCK_R rows at a
    time into a [BLOCK_R, BLOCK_N] fp32 accumulator reduced once at the end (same order every run)."""
    e = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rmask = rr < end
        x = tl.load(x_ptr + rr.to(tl.int64)[:, None] * stride_x + rn[None, :], mask=rmask[:, None] & nmask[None, :],
                    other=0.0).to(tl.float32)
        if HAS_SCALE:
            x = x * tl.load(scale_ptr + rr, mask=rmask, other=0.0)[:, None]
        acc += x
    tl.store(out_ptr + e.to(tl.int64) * N + rn, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _row_bias_dot_kernel(
    y_ptr,        # y [R, N] bf16, row stride stride_y
    b_ptr,        # b [E_l, N] bf16, contiguous
    offs_ptr,     # offs [E_l + 1] int32
    out_ptr,      # out [R] fp32
    R, N, E_l, stride_y,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Grid (cdiv(R, BLOCK_R),): each row's expert is the number of ends offs[e+1] <= r; rows at or past offs[E_l]
    get 0 (and programs wholly in the padding skip the column loop)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    e_idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + 1 + e_idx, mask=e_idx < E_l, other=2147483647)
    total = tl.load(offs_ptr + E_l)
    eid = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    valid = rows < total
    n_hi = tl.where(tl.program_id(0) * BLOCK_R < total, N, 0)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for n0 in range(0, n_hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        m = valid[:, None] & (rn < N)[None, :]
        y = tl.load(y_ptr + rows.to(tl.int64)[:, None] * stride_y + rn[None, :], mask=m, other=0.0)
        b = tl.load(b_ptr + eid.to(tl.int64)[:, None] * N + rn[None, :], mask=m, other=0.0)
        acc += y.to(tl.float32) * b.to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rows < R)


def _blocks() -> tuple[int, int]:
    return (16, 32) if interpreting() else (32, 128)


def segment_sum(x: torch.Tensor, offs: torch.Tensor, *, scale: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [E_l, N] = per-expert sums of s[r] * x[r] (s: optional fp32 [R]), accumulated in fp32, rounded once."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"segment_sum: x must be [R, N] with unit column stride, got {tuple(x.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise ValueError("segment_sum: offs must be an int32 [E_l + 1] tensor")
    if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (x.shape[0],)):
        raise ValueError(f"segment_sum: scale must be float32 [R] = [{x.shape[0]}]")
    E_l, N = offs.numel() - 1, x.shape[1]
    out = torch.empty((E_l, N), device=x.device, dtype=out_dtype)
    if E_l == 0 or N == 0:
        return out
    if x.shape[0] == 0:
        return out.zero_()
    br, bn = _blocks()
    _segment_sum_kernel[(E_l, triton.cdiv(N, bn))](
        x, scale if scale is not None else x, offs, out, N, x.stride(0),
        BLOCK_R=br, BLOCK_N=bn, HAS_SCALE=scale is not None, num_warps=4)
    return out


def row_bias_dot(y: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out fp32 [R]: out[r] = <y[r], b[e(r)]> for the rows of an expert, 0 on the padding."""
    if y.dim() != 2 or y.stride(1) != 1 or b.dim() != 2 or not b.is_contiguous() or b.shape[1] != y.shape[1]:
        raise ValueError(f"row_bias_dot: y [R, N] and contiguous b [E_l, N] expected, got {tuple(y.shape)} and "
                         f"{tuple(b.shape)}")
    if offs.dtype != torch.int32 or offs.numel() != b.shape[0] + 1:
        raise ValueError(f"row_bias_dot: offs must be int32 [E_l + 1] = [{b.shape[0] + 1}]")
    R, N = y.shape
    out = torch.zeros(R, device=y.device, dtype=torch.float32)
    E_l = b.shape[0]
    if R == 0 or E_l == 0 or N == 0:
        return out
    br, bn = _blocks()
    _row_bias_dot_kernel[(triton.cdiv(R, br),)](
        y, b, offs, out, R, N, E_l, y.stride(0),
        BLOCK_R=br, BLOCK_N=bn, BLOCK_E=triton.next_power_of_2(max(E_l, 2)), num_warps=4)
    return out


def segment_sum_ref(x: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of segment_sum in x's dtype (reads offs on the host)."""
    o = offs.tolist()
    xs = x if scale is None else x * scale.to(x.dtype)[:, None]
    if len(o) == 1:
        return x.new_zeros(0, x.shape[1])
    return torch.stack([xs[o[e]:o[e + 1]].sum(0) for e in range(len(o) - 1)])


__all__ = ["segment_sum", "row_bias_dot", "segment_sum_ref"]
