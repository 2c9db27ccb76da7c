"""Backend ``split``: megamoe's own kernels launched back to back, no host-device synchronisation (bf16 GEMMs: a
float32 layer runs under bfloat16 autocast, the layer casting its weights per call).

R_cap = W * T_max * min(k, E_l) receive rows (worst case), offs int32 [E_l + 1] on the device:

    recv_RH, handle = dispatch(x, topk_idx, heap)          pull rows from the owners (comm/dispatch.py)
    act, h          = gemm1_swiglu(recv, w13, offs)          grouped GEMM, SwiGLU epilogue (gpt-oss: + b13, clamped)
    out_RH          = gemm2(act, w2, offs)                    grouped GEMM (gpt-oss: + b2), into the heap's rows region
    y_TH            = combine(out, topk_w, handle)            owner pulls its k rows, sums with gates in fp32
    backward: backends/common.py

The host knows every size (T, R_cap) before the call and group sizes stay on the device: no sync, graph-capturable.
R_cap is the worst case (bytes: :meth:`SplitBackend.workspace_bytes`); one rank sizes its rows by the call (T * k).
Layers of one shape share one heap (docs/design.md, "The communication protocol"): every rank makes their calls in
the same order.

Options (the README's table; measurements in docs/performance.md): ``fp8`` (e4m3 GEMMs forward and dgrad, rows
travelling FP8-packed, weight gradients bf16; SwiGLU experts only), ``presum_combine`` (2+ GPUs: one row per remote
rank crosses NVLink instead of one per slot), ``comm_sms`` (programs of the communication kernels; None: every SM),
``timeout_s`` (bound of every device-side wait: CommTimeoutError; on a GPU the kernel traps, docs/design.md).
"""

from __future__ import annotations

import torch

from megamoe.backends.common import HeapBackend, check_flag, expert_forward, heap_backward, heap_rows
from megamoe.backends.fp8_weights import Fp8WeightCache
from megamoe.comm.combine import combine
from megamoe.comm.dispatch import dispatch, dispatch_fp8
from megamoe.comm.heap import heap_bytes, workspace_bytes


class _SplitMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, b13, b2, topk_idx, backend, wq, train):
        heap, num_sms, presum = backend.heap, backend.comm_sms, backend.presum_combine
        gates = topk_w if presum else None  # presum: the gates travel with the rows, the expert ranks pre-sum
        a_s = None
        if wq is not None:  # x quantised once per token on its home rank; GEMM1 reads the packed rows
            recv, a_s, handle = dispatch_fp8(x, topk_idx, heap, num_sms=num_sms, topk_w=gates)
        else:
            recv, handle = dispatch(x, topk_idx, heap, num_sms=num_sms, topk_w=gates)
        # GEMM2 writes into the heap's rows region (no staging copy for combine) unless presum's stage writes there
        out_buf = None if presum else heap_rows(heap, (recv.shape[0], w2.shape[1]), w2.dtype)
        act, h, out = expert_forward(recv, w13, w2, handle.offs, wq, a_s, out=out_buf, b13=b13, b2=b2,
                                     clamp=backend.clamp, store_h=train)
        y = combine(out, None if presum else topk_w, handle, num_sms=num_sms, out_dtype=x.dtype, presum=presum)
        ctx.save_for_backward(recv, h, topk_w, w13, w2, a_s, b13, b2)
        ctx.handle, ctx.wq = handle, wq
        ctx.backend = backend  # the backward needs the heap, which a one-rank backend frees when collected
        return y

    @staticmethod
    def backward(ctx, dy):
        recv, h, topk_w, w13, w2, a_s, b13, b2 = ctx.saved_tensors
        b = ctx.backend
        return (*heap_backward(dy, topk_w, ctx.handle, recv, h, w13, w2, b.comm_sms, wq=ctx.wq, recv_scales=a_s,
                               presum=b.presum_combine, b13=b13, b2=b2, clamp=b.clamp), None, None, None, None)


class SplitBackend(HeapBackend, Fp8WeightCache):
    """See the module docstring for the options."""

    name = "split"

    def __init__(self, moe, fp8: bool = False, presum_combine: bool = False, comm_sms: int | None = None,
                 timeout_s: float = 60.0):
        cfg = moe.config
        self._init_common(moe, comm_sms)
        self.presum_combine = check_flag(self.name, "presum_combine", presum_combine)
        self._init_fp8_cache(check_flag(self.name, "fp8", fp8), moe.device)
        if self.fp8 and cfg.dtype != torch.bfloat16:  # the FP8 copies are keyed on the parameters the GEMMs read
            raise ValueError(f"backend 'split' with fp8=1 needs a bfloat16 layer, got {cfg.dtype}")
        if self.fp8 and cfg.expert_kind != "swiglu":  # the FP8 epilogues have no biases nor the clamped SwiGLU
            raise ValueError(f"backend 'split' with fp8=1 runs SwiGLU experts only; expert_kind "
                             f"{cfg.expert_kind!r} (gpt-oss: biases, clamped SwiGLU) runs with fp8=0")
        self._open_heap(moe, timeout_s)

    def close(self) -> None:
        """Give the symmetric heap back (freed with its last layer) and drop the FP8 weight copies."""
        super().close()
        self._fp8_copies = {}

    def workspace_bytes(self) -> dict:
        """Bytes of the symmetric heap (shared by layers of this shape), the per-call workspace and, with ``fp8``,
        the kept FP8 weights."""
        out = {"symmetric": heap_bytes(self.shape), "per_call": workspace_bytes(self.shape)}
        if self.fp8:
            out["fp8_weights"] = self.fp8_weight_bytes()
        return out

    def __call__(self, x, topk_idx, topk_w, w13, w2, b13=None, b2=None):
        train = self._check_call(x, topk_w, w13, w2, b13, b2)  # else no backward reads h
        wq = self.fp8_weights(w13, w2) if self.fp8 else None
        return _SplitMoE.apply(x, topk_w, w13, w2, b13, b2, topk_idx, self, wq, train)
