"""Backend ``fused``: the forward as one persistent megakernel (megamoe/kernels/fused_moe.py).

Shapes as in :mod:`megamoe.config`, T_max its max_tokens_per_rank, R_cap the worst-case rows received.

forward (one torch.autograd.Function): stage, schedule, the megakernel and its tail, as kernels/fused_moe.py's
docstring lays out (gpt-oss experts: docs/design.md, "gpt-oss experts").
backward: split's (backends/common.py), reusing what the forward kept: the received rows and h. With a ring the
forward overwrote them, so the backward first recomputes them (dispatch of x + GEMM1, split's kernels).

On Hopper the megakernel's work items run warp-specialised in Gluon (kernels/gluon/fused.py: the same items, order,
waits and results) where they can (H and I multiples of 8, SwiGLU experts); elsewhere, and under the interpreter, the
Triton kernel. bf16 GEMMs only: an FP8 megakernel measured slower than both this one and split:fp8=1
(docs/performance.md).

Options (the README's table): ``ring_blocks`` (None: dense buffers; N >= 4: a routing-independent ring of N 128-row
blocks bounds the memory, and the backward recomputes the rows), ``comm_sms`` and ``timeout_s`` as split's (comm_sms
programs run the staging and backward kernels).

No token is dropped (docs/design.md, "Capacity"): dense buffers hold the worst case, a ring cycles. The heap adds a
[T_max, k, H] slot buffer per rank (``CommShape(slots=True)``); sizes: :meth:`FusedBackend.workspace_bytes`.
"""

from __future__ import annotations

import torch

from megamoe.backends.common import HeapBackend, heap_backward
from megamoe.comm.dispatch import dispatch
from megamoe.comm.heap import heap_bytes
from megamoe.experts import gemm1_swiglu
from megamoe.kernels.fused_moe import FusedConfig, default_fused_config, fused_forward, plan_launch
from megamoe.kernels.gluon.fused import gluon_fused_reason


class _FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, b13, b2, topk_idx, backend, train):
        ring = backend.ring_blocks or 0
        y, st = fused_forward(backend.heap, x, topk_idx, topk_w, w13, w2, backend.config, ring_blocks=ring,
                              store_h=train and not ring, comm_programs=backend.comm_sms, b13=b13, b2=b2,
                              clamp=backend.clamp)
        if train:
            ctx.save_for_backward(x, topk_idx, topk_w, w13, w2, b13, b2, *(() if ring else (st.xbuf, st.h)))
            ctx.handle = st.handle
            ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy):
        b = ctx.backend
        saved = ctx.saved_tensors
        x, topk_idx, topk_w, w13, w2, b13, b2 = saved[:7]
        if b.ring_blocks:  # the ring overwrote the forward's rows: recompute them (dispatch + GEMM1)
            recv, handle = dispatch(x, topk_idx, b.heap, num_sms=b.comm_sms)
            _, h = gemm1_swiglu(recv, w13, handle.offs, store_h=True, bias=b13, clamp=b.clamp)
        else:
            recv, h = saved[7:]
            handle = ctx.handle
        return (*heap_backward(dy, topk_w, handle, recv, h, w13, w2, b.comm_sms, b13=b13, b2=b2, clamp=b.clamp),
                None, None, None)


class FusedBackend(HeapBackend):
    """See the module docstring for the options."""

    name = "fused"

    def __init__(self, moe, ring_blocks: int | None = None, comm_sms: int | None = None, timeout_s: float = 60.0):
        cfg = moe.config
        self._init_common(moe, comm_sms)
        self.config: FusedConfig = default_fused_config(moe.device)
        if gluon_fused_reason(self.config, H=cfg.hidden, I=cfg.intermediate, device=moe.device,
                              gpt_oss=self.clamp is not None) is None:
            self.config = self.config.with_(kernel="gluon")  # the warp-specialised items, where they can run
        if ring_blocks is not None:
            if isinstance(ring_blocks, bool) or not isinstance(ring_blocks, int):
                raise ValueError(f"ring_blocks must be None or an int, got {ring_blocks!r}")
            plan_launch(self.config, moe.device, cfg.hidden, cfg.intermediate, ring_blocks)  # raises if too small
        self.ring_blocks = ring_blocks
        self._open_heap(moe, timeout_s, slots=True)

    def workspace_bytes(self) -> dict:
        """Symmetric heap bytes (shared by layers of this shape) and the megakernel's per-call buffers at most (R_cap
        rows; one rank sizes them by the call, CommShape.rows_for)."""
        inter = self.moe.config.intermediate  # per row: x and act, with dense buffers h [2I] too; bf16
        rows = self.ring_blocks * self.config.block_m if self.ring_blocks else self.shape.rows_cap
        per_row = (self.shape.hidden + inter + (0 if self.ring_blocks else 2 * inter)) * 2
        return {"symmetric": heap_bytes(self.shape), "per_call": rows * per_row}

    def __call__(self, x, topk_idx, topk_w, w13, w2, b13=None, b2=None):
        train = self._check_call(x, topk_w, w13, w2, b13, b2)
        return _FusedMoE.apply(x, topk_w, w13, w2, b13, b2, topk_idx, self, train)
