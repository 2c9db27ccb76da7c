"""Backend ``split``: megamoe's own kernels launched back to back, no host-device synchronisation.

Shape legend: T tokens on this rank, H hidden, I intermediate, E_l local experts, k top-k,
R_cap = W * T_max * min(k, E_l) receive rows (worst case), offs int32 [E_l + 1] on the device.

forward (one torch.autograd.Function):
    recv_RH, handle = dispatch(x, topk_idx, heap)          pull rows from the owners (comm/dispatch.py)
    act, h          = gemm1_swiglu(recv, w13, offs)          Triton grouped GEMM, SwiGLU epilogue
    out_RH          = gemm2(act, w2, offs)                    Triton grouped GEMM
    y_TH            = combine(out, topk_w, handle)            owner pulls its k rows, sums with gates in fp32
backward:
    g_out, d_topk_w = combine_backward(dy, out, topk_w, handle)   g_out[r] = w * dy (pulled to expert ranks)
    dh              = gemm2_dgrad_swiglu(g_out, w2, h, offs)
    d_recv          = gemm1_dgrad(dh, w13, offs)
    dx              = dispatch_backward(d_recv, handle)       owner pulls and sums its k gradient rows
    dW2 = g_out^T act;  dW13 = dh^T recv                      (overlap_backward: these two on the SMs the
                                                               communication programs leave free, while dx
                                                               travels on a side stream)

Every size the host needs (T, R_cap) is known before the call; group sizes live on the device, so the step
never waits for the GPU (``torch.cuda.set_sync_debug_mode("error")`` passes) and can be graph-captured.

Capacity policy: the receive buffer holds R_cap rows, the worst case (every token of every rank routed
here, min(k, E_l) copies each), so no routing can drop a token; the bytes are logged once when the heap is
built (``megamoe.comm.heap``) and reported by :meth:`SplitBackend.workspace_bytes`. Layers of the same shape
in one process group share one heap: calls are numbered and every rank makes them in the same order.

Supported: bf16 layers (the Triton GEMMs are bf16; FP8 GEMMs exist in megamoe.experts but are not wired
here yet). Other dtypes raise ``ValueError`` at construction.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megamoe.comm.combine import combine, combine_backward
from megamoe.comm.dispatch import dispatch, dispatch_backward
from megamoe.comm.heap import CommShape, SymmetricHeap, heap_bytes, workspace_bytes
from megamoe.experts import gemm1_dgrad, gemm1_swiglu, gemm2, gemm2_dgrad_swiglu, grouped_wgrad
from megamoe.kernels.gemm_config import default_config
from megamoe.kernels.gemm_config import num_sms as device_sms

#: one heap per (process group, shape), shared by the layers of a model
_HEAPS: dict[tuple, SymmetricHeap] = {}


def get_heap(shape: CommShape, group, device, timeout_s: float, num_sms: int) -> SymmetricHeap:
    group = group or dist.group.WORLD
    key = (group.group_name, shape, str(device), timeout_s, num_sms)  # names are unique, ids can be reused
    heap = _HEAPS.get(key)
    if heap is None or heap._closed:
        heap = SymmetricHeap(shape, group=group, device=device, timeout_s=timeout_s, num_sms=num_sms)
        _HEAPS[key] = heap
    return heap


def close_heaps() -> None:
    """Tear down every heap the split backend built (call before destroying their process groups)."""
    for heap in _HEAPS.values():
        heap.close()
    _HEAPS.clear()


def _wgrads(g_out, act, dh, recv, offs, w13, w2, sms: int | None):
    """dW2 = g_out^T act and dW13 = dh^T recv per expert; ``sms`` caps the persistent programs (None: all)."""
    def cfg(x, y):
        c = default_config("wgrad", x.shape[0], y.shape[1], x.shape[1])
        return c if sms is None else c.with_(num_sms=sms)

    dw2 = grouped_wgrad(g_out, act, offs, out_dtype=w2.dtype, config=cfg(g_out, act))
    dw13 = grouped_wgrad(dh, recv, offs, out_dtype=w13.dtype, config=cfg(dh, recv))
    return dw13, dw2


class _SplitMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, topk_idx, heap, num_sms, overlap, presum):
        recv, handle = dispatch(x, topk_idx, heap, num_sms=num_sms, topk_w=topk_w if presum else None)
        offs = handle.offs
        act, h = gemm1_swiglu(recv, w13, offs, store_h=True)
        out = gemm2(act, w2, offs)
        if presum:  # expert ranks pre-sum each token's rows with the gates dispatch brought
            y = combine(out, None, handle, num_sms=num_sms, out_dtype=x.dtype, presum=True)
        else:
            y = combine(out, topk_w, handle, num_sms=num_sms, out_dtype=x.dtype)
        ctx.save_for_backward(recv, h, act, out, topk_w, w13, w2)
        ctx.handle = handle
        ctx.num_sms = num_sms
        ctx.overlap = overlap
        ctx.presum = presum
        return y

    @staticmethod
    def backward(ctx, dy):
        recv, h, act, out, topk_w, w13, w2 = ctx.saved_tensors
        handle, num_sms = ctx.handle, ctx.num_sms
        offs = handle.offs
        g_out, d_topk_w = combine_backward(dy.contiguous(), out, topk_w, handle, num_sms=num_sms)
        dh, _ = gemm2_dgrad_swiglu(g_out, w2, h, offs)
        d_recv = gemm1_dgrad(dh, w13, offs, out=torch.zeros_like(recv))
        if ctx.overlap and d_recv.is_cuda:
            # dx goes home on a side stream (num_sms programs) while the weight gradients take the other SMs
            main = torch.cuda.current_stream(d_recv.device)
            side = _side_stream(d_recv.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dx = dispatch_backward(d_recv, handle, num_sms=num_sms, out_dtype=dy.dtype, presum=ctx.presum)
            d_recv.record_stream(side)
            dw13, dw2 = _wgrads(g_out, act, dh, recv, offs, w13, w2, max(1, device_sms(d_recv.device) - num_sms))
            main.wait_stream(side)
            dx.record_stream(main)
        else:
            dx = dispatch_backward(d_recv, handle, num_sms=num_sms, out_dtype=dy.dtype, presum=ctx.presum)
            dw13, dw2 = _wgrads(g_out, act, dh, recv, offs, w13, w2, None)
        return dx, d_topk_w.to(topk_w.dtype), dw13, dw2, None, None, None, None, None


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One communication stream per device, reused (creating streams per call would leak them)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class SplitBackend:
    """See the module docstring. Options: ``comm_sms`` (programs of the communication kernels; default 32
    on GPUs, 2 under the interpreter), ``overlap_backward`` (send dx home on a side stream with ``comm_sms``
    programs while the weight-gradient GEMMs run on the other SMs; off by default until measured),
    ``presum_combine`` (expert ranks pre-sum each token's rows so the owner pulls one row per rank, in
    combine and in dispatch's backward: comm/presum.py; off by default until measured),
    ``timeout_s`` (bound of every device-side wait, default 60)."""

    name = "split"
    graph_capturable = True  # no host sync: a whole step can be captured in a CUDA graph

    @staticmethod
    def why_unavailable(device) -> str | None:
        if not dist.is_available():
            return "torch.distributed is not available"
        return None

    def __init__(self, moe, comm_sms: int | None = None, timeout_s: float = 60.0, overlap_backward: bool = False,
                 presum_combine: bool = False):
        cfg = moe.config
        if comm_sms is None:  # the interpreter runs programs one by one: fewer is faster there
            comm_sms = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 32
        if cfg.dtype != torch.bfloat16:
            raise ValueError(f"backend 'split' needs a bfloat16 layer (its GEMMs are bf16), got {cfg.dtype}")
        if not dist.is_initialized():
            raise ValueError("backend 'split' needs an initialised torch.distributed process group "
                             "(a one-rank group is fine)")
        if comm_sms < 1:
            raise ValueError(f"comm_sms must be >= 1, got {comm_sms}")
        self.moe = moe
        self.comm_sms = comm_sms
        self.overlap_backward = overlap_backward
        self.presum_combine = presum_combine
        self.shape = CommShape(world=moe.world, max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden,
                               topk=cfg.top_k, num_experts=cfg.num_experts, dtype=cfg.dtype)
        self.heap = get_heap(self.shape, moe.group, moe.device, timeout_s, comm_sms)

    def workspace_bytes(self) -> dict:
        """Symmetric heap bytes (shared by layers of this shape) and per-call device workspace bytes."""
        return {"symmetric": heap_bytes(self.shape), "per_call": workspace_bytes(self.shape)}

    def __call__(self, x, topk_idx, topk_w, w13, w2):
        if x.shape[0] > self.shape.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed the layer's max_tokens_per_rank "
                             f"({self.shape.max_tokens}); build the MoEConfig with a larger one")
        return _SplitMoE.apply(x, topk_w, w13, w2, topk_idx, self.heap, self.comm_sms, self.overlap_backward,
                               self.presum_combine)
