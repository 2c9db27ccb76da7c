"""What the ``split`` and ``fused`` backends share: their setup, the expert GEMMs of the forward, the whole backward.

R_cap worst-case rows received, offs int32 [E_l + 1] on the device. Backward (saved: received rows, h, topk_w):
    dy_R, gate_R    = pull_grad(dy, topk_w, handle)           dy rows pulled unscaled with each row's gate
    dh, ds, acts    = gemm2_dgrad_swiglu(dy_R, w2, h, offs, scale=gate)   epilogue: dact = gate * dy @ w2[e],
                                                               ds[r] = <dy, act @ w2^T>, acts = gate * act
    d_topk_w        = send_gate_grad(ds, handle)              each row's ds into its owner's dw slot
    d_recv          = gemm1_dgrad(dh, w13, offs)
    dx              = dispatch_backward(d_recv, handle)       owner pulls and sums its k gradient rows
    dW2 = dy_R^T acts;  dW13 = dh^T recv                      deterministic, no atomics

Each buffer goes once its last reader is enqueued (h after GEMM2's dgrad; dy_R and acts after dW2): the peak holds
neither h nor the backward's row buffers beside both weight gradients (unless the graph is retained). The rows are
saved tensors, so saved-tensor hooks (non-reentrant checkpointing, offloading) see them.

gpt-oss experts (``clamp`` = (alpha, limit), biases b13 / b2; bf16 GEMMs only): docs/design.md, "gpt-oss experts";
db13 = per-expert row sums of dh, db2 = of gate * dy_R (kernels/bias_grad.py).

FP8 (``wq``, :mod:`megamoe.backends.fp8_weights`; the recipe: docs/design.md, "FP8"): the forward and dgrad GEMMs
run on e4m3. Rows arrive quantised (dispatch_fp8); act, dy rows and dh are quantised where made, only the offs[E_l]
rows received. Weight gradients stay bf16 (dW13 reads the dequantised rows).
"""

from __future__ import annotations

import weakref

import torch

from megamoe.comm.combine import dispatch_backward, pull_grad, send_gate_grad
from megamoe.comm.heap import CommShape, get_heap, hold_heap
from megamoe.experts import (
    dequantize_act,
    gemm1_dgrad,
    gemm1_dgrad_fp8,
    gemm1_swiglu,
    gemm1_swiglu_fp8,
    gemm2,
    gemm2_dgrad_swiglu,
    gemm2_dgrad_swiglu_fp8,
    gemm2_fp8,
    grouped_wgrad,
    quantize_act,
    segment_sum,
)
from megamoe.kernels.gemm_config import interpreting
from megamoe.kernels.gemm_config import num_sms as device_sms
from megamoe.kernels.interpreter import row_buffer

#: tests set this (in their ranks) to fill d_recv's padding rows with NaN, so that a read of one shows in dx
POISON_PADDING = False


def heap_rows(heap, shape, dtype) -> torch.Tensor | None:
    """The first rows of ``heap.rows_buffer()`` if they fit this shape and dtype and no peer may still read them
    (``heap.rows_busy``), else None. A GEMM writing there (GEMM2, GEMM1's dgrad) saves combine's /
    dispatch_backward's staging copy; why that is safe: docs/design.md, after the flag table."""
    rb = heap.rows_buffer()
    fits = shape[0] <= rb.shape[0] and tuple(shape[1:]) == tuple(rb.shape[1:]) and rb.dtype == dtype
    return rb[:shape[0]] if fits and not heap.rows_busy else None


def dgrad_buffer(shape, device, heap=None) -> torch.Tensor:
    """Storage for d_recv [R_b, H] bf16 (the call's rows), not zero-filled on a GPU: only its first offs[E_l] rows
    are written and read.

    ``heap``: use the heap's ``rows`` region (see heap_rows). Only without presum (whose stage writes its sums there)
    and only after pull_grad, whose pull waits for READY from every peer: no peer still reads ``rows`` then."""
    buf = None if heap is None else heap_rows(heap, shape, torch.bfloat16)
    buf = row_buffer(shape, torch.bfloat16, device) if buf is None else buf
    return buf.fill_(float("nan")) if POISON_PADDING else buf


def expert_forward(recv, w13, w2, offs, wq=None, recv_scales=None, out=None, b13=None, b2=None, clamp=None,
                   store_h=True):
    """(act [R, I], h [R, 2I] or None, out [R, H]), bf16. With ``wq`` both GEMMs run FP8: recv is e4m3 with 1x128
    ``recv_scales`` (dispatch_fp8). ``out``: GEMM2's output buffer. ``store_h``: keep GEMM1's pre-activation for a
    backward (without one, its R x 2I bf16 are neither allocated nor written). gpt-oss: b13, b2 and clamp (module
    docstring)."""
    if wq is None:
        act, h = gemm1_swiglu(recv, w13, offs, store_h=store_h, bias=b13, clamp=clamp)
        return act, h, gemm2(act, w2, offs, out=out, bias=b2)
    q13, s13, _, _, q2, s2, _, _ = wq
    act, h = gemm1_swiglu_fp8(recv, recv_scales, q13, s13, offs, store_h=store_h)
    return act, h, gemm2_fp8(*quantize_act(act, nrows=offs[-1:]), q2, s2, offs, out=out)


def retained() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``), so that its saved rows must outlive it.
    Asked as torch's AOTAutograd asks before it frees saved tensors early; a torch without the query keeps them."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else keep()


def heap_backward(dy, topk_w, handle, recv, h, w13, w2, num_sms, *, wq=None, recv_scales=None, presum=False,
                  b13=None, b2=None, clamp=None) -> tuple:
    """The whole backward (module docstring): (dx, d_topk_w in topk_w's dtype, dW13, dW2, db13, db2) from the
    forward's received rows ``recv`` and GEMM1's pre-activation ``h``, whose storage is shrunk to nothing after GEMM2's
    dgrad (the saved tensor still refers to it) unless the graph is retained. d_recv goes to the heap's ``rows``
    region unless ``presum``. FP8 (``wq``): recv is e4m3 with 1x128 ``recv_scales``, dequantised for dW13 only. gpt-oss:
    b13, b2 (their dtypes are the gradients') and clamp, bf16 GEMMs only."""
    dy = dy.contiguous()
    offs = handle.offs
    n = offs[-1:]  # rows received: only those are quantised (the buffers may hold more)
    dy_rows, gate = pull_grad(dy, topk_w, handle, num_sms=num_sms)
    acts = row_buffer((dy_rows.shape[0], w2.shape[2]), dy_rows.dtype, dy_rows.device)
    if wq is None:
        dh, ds = gemm2_dgrad_swiglu(dy_rows, w2, h, offs, scale=gate, acts_out=acts, clamp=clamp, b2=b2)
    else:
        dh, ds = gemm2_dgrad_swiglu_fp8(*quantize_act(dy_rows, nrows=n), wq[6], wq[7], h, offs, scale=gate,
                                        acts_out=acts)
    if not retained():  # (stream-ordered: the allocator reuses the block only after the dgrad, as after a del)
        h.untyped_storage().resize_(0)
    d_topk_w = send_gate_grad(ds, handle, num_sms=num_sms).to(topk_w.dtype)
    db13 = None if b13 is None else segment_sum(dh, offs, out_dtype=b13.dtype)
    db2 = None if b2 is None else segment_sum(dy_rows, offs, scale=gate, out_dtype=b2.dtype)
    d_recv = dgrad_buffer((recv.shape[0], w13.shape[2]), recv.device, None if presum else handle.heap)
    if wq is None:
        gemm1_dgrad(dh, w13, offs, out=d_recv)
    else:  # (the FP8 kernel wants both operands K-major: w13^T)
        gemm1_dgrad_fp8(*quantize_act(dh, nrows=n), wq[2], wq[3], offs, out=d_recv)
    dx = dispatch_backward(d_recv, handle, num_sms=num_sms, out_dtype=dy.dtype, presum=presum)
    del d_recv
    dw2 = grouped_wgrad(dy_rows, acts, offs, out_dtype=w2.dtype)  # deterministic, no atomics
    del dy_rows, acts
    if recv_scales is not None:
        recv = dequantize_act(recv, recv_scales, nrows=n)
    dw13 = grouped_wgrad(dh, recv, offs, out_dtype=w13.dtype)
    return dx, d_topk_w, dw13, dw2, db13, db2


def check_flag(backend: str, name: str, value) -> bool:
    if value not in (True, False, 0, 1):
        raise ValueError(f"backend '{backend}': {name} must be a flag (True/False or 1/0), got {value!r}")
    return bool(value)


class HeapBackend:
    """What ``split`` and ``fused`` share: bf16 GEMMs, the symmetric heap of the layer's shape (given back by
    :meth:`close`), no host sync in forward or backward (a whole step can be captured in a CUDA graph)."""

    name: str
    graph_capturable = True

    @staticmethod
    def why_unavailable(device) -> str | None:
        """Off CUDA the Triton kernels need the interpreter (which ``triton.jit`` reads when a kernel module is
        imported, so the variable has to be set before Python starts) or a driver standing in for a GPU
        (megamoe.testing.sm90 compiles for Hopper on a CPU)."""
        if torch.device(device).type == "cuda" or interpreting():
            return None
        from triton.runtime import driver

        try:
            driver.active  # noqa: B018 - raises without a GPU ("0 active drivers")
            return None
        except RuntimeError:
            return ("the Triton kernels run on a CPU only under the Triton interpreter: start Python with "
                    "TRITON_INTERPRET=1 in the environment (e.g. `TRITON_INTERPRET=1 python train.py`), or use "
                    "backend 'torch'")

    def _init_common(self, moe, comm_sms: int | None) -> None:
        """The checks and settings before the backend's own (which come before :meth:`_open_heap`)."""
        cfg = moe.config
        if cfg.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"backend '{self.name}' needs a bfloat16 layer, or a float32 one run under bfloat16 "
                             f"autocast (its GEMMs are bf16), got {cfg.dtype}")
        self.moe = weakref.proxy(moe)  # the layer owns its backend, not the reverse: deleting it frees both
        if comm_sms is not None and comm_sms < 1:
            raise ValueError(f"comm_sms must be >= 1, got {comm_sms}")
        # default every SM (2 under the interpreter, which runs programs one by one)
        self.comm_sms = int(comm_sms) if comm_sms is not None else 2 if interpreting() else device_sms(moe.device)
        self.clamp = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.expert_kind == "gpt_oss" else None  # clamped SwiGLU

    def _open_heap(self, moe, timeout_s: float, slots: bool = False) -> None:
        cfg = moe.config
        self.shape = CommShape(world=moe.world, max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden,
                               topk=cfg.top_k, num_experts=cfg.num_experts, dtype=torch.bfloat16, slots=slots)
        self.heap = get_heap(self.shape, moe.group, moe.device, timeout_s, self.comm_sms)
        self._release = hold_heap(self, self.heap)

    def close(self) -> None:
        """Give the symmetric heap back (freed with its last layer)."""
        self._release()

    def _check_call(self, x, topk_w, w13, w2, b13, b2) -> bool:
        """Check a call on the host (not its expert ids: that would read them, a sync); whether autograd will run a
        backward through it (else nothing is kept for one)."""
        if x.shape[0] > self.shape.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed the layer's max_tokens_per_rank "
                             f"({self.shape.max_tokens}); build the MoEConfig with a larger one")
        if (b13 is None) != (self.clamp is None) or (b13 is None) != (b2 is None):
            raise ValueError(f"backend '{self.name}': b13 and b2 are given exactly for gpt_oss experts")
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, topk_w, w13, w2, b13, b2))
