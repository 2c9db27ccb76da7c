"""Backend ``torch``: expert parallelism as torchtitan does it, the baseline every backend is timed against
(S = T*k (token, slot) pairs sent, R rows received):

    counts[e]        = #(t, j) with idx[t, j] = e                                  [E]   (device)
    recv_counts      = all_to_all_single(counts)         -> [W, E_l] rows from rank s for local expert l
    in/out splits    = counts / recv_counts summed per rank, .tolist()   (HOST SYNC, as in torchtitan)
    send             = x[argsort(idx.flatten()) // k]     [S, H]  rows sorted by expert (= by dest rank)
    recv             = all_to_all_single(send)            [R, H]  ordered (source rank, local expert, token)
    xs               = recv permuted to (local expert, source rank, token), each group padded on CUDA to ALIGN
                       zero rows (torch._grouped_mm wants aligned, non-empty groups), never gathered back
    o                = grouped_mm(swiglu(grouped_mm(xs, w13^T)), w2^T)   [P, H]
                       (gpt_oss experts: + b13 / b2 of each row's expert, the clamped SwiGLU)
    back             = all_to_all_single(o[un-permute])   [S, H]  then un-sort to (t, j) order
    y[t]             = sum_j topk_w[t, j] * back[t, j]    (float32 accumulation, j in order)

NCCL on GPUs, gloo on CPU (bf16 crosses gloo as float32). The grouped GEMM is ``torch._grouped_mm`` for bf16 on
CUDA, else a per-expert loop: torch's CPU grouped_mm has no float64 and its backward fails on empty groups.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from megamoe.dist import wire_dtype
from megamoe.reference import expert_act

#: rows per expert group are padded to a multiple of this (and at least this) on CUDA, as torchtitan does
ALIGN_CUDA = 16


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with autograd; the backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.back = (in_splits, out_splits, group)
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, *ctx.back), None, None, None


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    send = x.to(wire_dtype(x.dtype, group)).contiguous()
    out = send.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
    return out.to(x.dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of g] = a[rows of g] @ b[g]; a [M, K], b [G, K, N], offs int32 [G] (group ends).
    torch._grouped_mm for bf16 CUDA tensors, else a per-group loop that reads offs on the host."""
    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    ends = offs.tolist()
    if ends[-1] != a.shape[0]:
        raise ValueError(f"grouped_mm: the last offset ({ends[-1]}) must equal the rows of a ({a.shape[0]})")
    # unbind, not b[g]: each b[g]'s backward would allocate and add a zero gradient the size of all of b
    starts, bs = [0] + ends[:-1], b.unbind(0)
    return torch.cat([a[s:e] @ bs[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True))])


class TorchBackend:
    """all_to_all + grouped GEMM baseline (see module docstring)."""

    name = "torch"
    graph_capturable = False  # the split sizes are read on the host

    @staticmethod
    def why_unavailable(device) -> str | None:
        if not dist.is_available():
            return "torch.distributed is not available in this torch build"
        return None

    def __init__(self, moe):
        self.moe = weakref.proxy(moe)  # the layer owns its backend, not the reverse: deleting it frees both
        self.act = expert_act(moe.config)

    def __call__(self, x, topk_idx, topk_w, w13, w2, b13=None, b2=None):
        moe = self.moe
        W, E_l, k = moe.world, moe.local_experts, topk_idx.shape[1]
        T, H = x.shape
        dev = x.device
        align = ALIGN_CUDA if dev.type == "cuda" else 1  # from the call: a meta-built layer moves later
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (expert, token, slot) order
        counts = torch.zeros(W * E_l, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        send = x[order // k]  # [S, H]
        if W > 1:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=moe.group)
            # the host sync of the recipe: split sizes of the row all-to-all
            splits = torch.stack([counts.view(W, E_l).sum(1), recv_counts.view(W, E_l).sum(1)]).tolist()
            in_splits, out_splits = splits
            recv = _AllToAll.apply(send, out_splits, in_splits, moe.group)
        else:
            recv_counts, recv = counts, send
        R = recv.shape[0]
        rc = recv_counts.view(W, E_l)
        # destination of each received row in the padded, expert-grouped layout
        n_l = rc.sum(0)  # [E_l]
        padded = torch.clamp_min((n_l + align - 1) // align * align, align) if align > 1 else n_l
        P = R + (E_l * align if align > 1 else 0)  # host-known upper bound of sum(padded)
        pend = torch.cumsum(padded, 0)
        # start of block (s, l) inside expert l's group: rows of lower source ranks come first
        in_group = torch.cumsum(rc, 0) - rc  # [W, E_l]
        block_dest = ((pend - padded)[None, :] + in_group).reshape(-1)  # [(s, l)]
        block_src = torch.cumsum(rc.reshape(-1), 0) - rc.reshape(-1)
        block_of_row = torch.repeat_interleave(torch.arange(W * E_l, device=dev), rc.reshape(-1), output_size=R)
        dest = block_dest[block_of_row] + (torch.arange(R, device=dev) - block_src[block_of_row])
        xs = recv.new_zeros(P, H).index_copy(0, dest, recv)
        offs = pend.to(torch.int32)
        offs[-1] = P  # the tail rows (zeros) join the last group: they produce zero rows, never read back
        h = grouped_mm(xs, w13.transpose(-2, -1), offs)
        if b13 is not None:  # each padded row's expert, found on the device; bias sums (and their gradients' row
            # sums) in float32 or better, rounded once
            eid = torch.searchsorted(pend, torch.arange(P, device=dev), right=True).clamp_max(E_l - 1)
            wide = torch.float64 if x.dtype == torch.float64 else torch.float32
            h = (h.to(wide) + b13.to(wide)[eid]).to(x.dtype)
        o = grouped_mm(self.act(h), w2.transpose(-2, -1), offs)
        if b2 is not None:
            o = (o.to(wide) + b2.to(wide)[eid]).to(x.dtype)
        o_recv = o[dest]  # [R, H] back in received order
        back = _AllToAll.apply(o_recv, in_splits, out_splits, moe.group) if W > 1 else o_recv
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=dev)
        out_tk = back[inv].view(T, k, H)
        cdt = topk_w.dtype if topk_w.dtype == torch.float64 else torch.float32
        return (out_tk.to(cdt) * topk_w.to(cdt).unsqueeze(-1)).sum(1).to(x.dtype)


__all__ = ["TorchBackend", "grouped_mm"]
