"""Backend ``split``: megamoe's own kernels launched back to back, no host-device synchronisation.

Shape legend: T tokens on this rank, H hidden, I intermediate, E_l local experts, k top-k,
R_cap = W * T_max * min(k, E_l) receive rows (worst case), offs int32 [E_l + 1] on the device.

forward (one torch.autograd.Function):
    recv_RH, handle = dispatch(x, topk_idx, heap)          pull rows from the owners (comm/dispatch.py)
    act, h          = gemm1_swiglu(recv, w13, offs)          Triton grouped GEMM, SwiGLU epilogue
    out_RH          = gemm2(act, w2, offs)                    Triton grouped GEMM
    y_TH            = combine(out, topk_w, handle)            owner pulls its k rows, sums with gates in fp32
backward (bf16, :func:`bf16_dgrad`; saved from the forward: recv, h, topk_w only):
    dy_R, gate_R    = pull_grad(dy, topk_w, handle)           dy rows pulled unscaled with each row's gate
    dh, ds, acts    = gemm2_dgrad_swiglu(dy_R, w2, h, offs, scale=gate)   epilogue: dact = gate * dy @ w2[e],
                                                               ds[r] = <dy, act @ w2^T>, acts = gate * act
    d_topk_w        = send_gate_grad(ds, handle)              each row's ds into its owner's dw slot
    d_recv          = gemm1_dgrad(dh, w13, offs)
    dx              = dispatch_backward(d_recv, handle)       owner pulls and sums its k gradient rows
    dW2 = dy_R^T acts;  dW13 = dh^T recv                      (overlap_backward: these two while dx travels
                                                               on a side stream, the kernels sharing the SMs)
backward (FP8): the same, the two dgrad GEMMs on e4m3 operands (dy_R and dh quantised, see FP8 below).
backward (gate_grad="pull", bf16 or FP8): g_out, d_topk_w = combine_backward(dy, out, topk_w, handle) (g_out[r] =
    w * dy, d(topk_w) from the forward's saved expert outputs), then the dgrads of g_out, dW2 = g_out^T act.

Every size the host needs (T, R_cap) is known before the call; group sizes live on the device, so the step
never waits for the GPU (``torch.cuda.set_sync_debug_mode("error")`` passes) and can be graph-captured.

Capacity policy: the receive buffer holds R_cap rows, the worst case (every token of every rank routed
here, min(k, E_l) copies each), so no routing can drop a token; the bytes are logged once when the heap is
built (``megamoe.comm.heap``) and reported by :meth:`SplitBackend.workspace_bytes`. Layers of the same shape
in one process group share one heap: calls are numbered and every rank makes them in the same order.

Supported: bf16 layers; other dtypes raise ``ValueError`` at construction.

FP8 (option ``fp8``, off by default): both forward GEMMs and both dgrad GEMMs run on float8_e4m3fn operands
with the DeepSeek-V3 block scales of megamoe.experts (1x128 per row for activations, 128x128 for weights, fp32
accumulation promoted every 128 of K); the layer stays bf16 at its interface, the weights bf16 masters:
    q(w13), q(w13^T), q(w2), q(w2^T) = quantize_weight_both(w13), quantize_weight_both(w2)   (fp8_weights)
    quantize_act(recv),  q(w13)    -> act, h = gemm1_swiglu_fp8(...)
    quantize_act(act),   q(w2)     -> out    = gemm2_fp8(...)
    quantize_act(dy_R), q(w2^T)    -> dh, ds, acts = gemm2_dgrad_swiglu_fp8(..., h, scale=gate, acts_out=...)
    quantize_act(dh),    q(w13^T)  -> d_recv = gemm1_dgrad_fp8(...)
The activation quantisations cover only the rows received (offs[E_l], read on the device), not the worst-case
buffers' R_cap rows. The weight gradients stay bf16 (grouped_wgrad on the bf16 recv, act, g_out and dh). The
quantised weights are kept in buffers allocated once per layer and requantised in place when a parameter's version
counter changes (option ``fp8_weight_cache``, default on: 2 bytes per weight element kept on the device), so an
optimizer step costs one quantisation pass per weight and calls between updates none; inside a CUDA graph capture
they are quantised in the graph (one pass per weight per call), since the host-side check cannot run at replay,
unless the optimizer keeps them current (``MasterAdamW.maintain_fp8`` with :meth:`SplitBackend.fp8_copies`: its
step requantises each weight right after updating it, so the layer never quantises its weights, in a graph or out
of one; ``megamoe train`` does this for FP8 layers). Measured before the cache
(2x H200, 2026-11-30, docs/perf-notes.md): the per-call weight quantisation made the FP8 layer slower than bf16
(deepseek-v3 13.5 vs 6.9 ms forward). h and act come out of the FP8 GEMM1 in bf16 and are what backward uses.
The FP8 kernels take any H and I (a partial 128-block gets its own scale; the layer is tested at H / I = 96 / 64,
100 / 40 and 160 / 144), so the only added constraint is the device: on CUDA, FP8 tensor cores (compute
capability >= 8.9), checked at construction. Accuracy (CPU, 2026-11-30; docs/perf-notes.md, split): relative
error vs the float64 reference out 0.062-0.073, dx 0.061-0.076, dW13 0.052-0.061, dW2 0.051-0.057, router
0.037-0.109 (bf16 path: < 1e-2); cosine vs the bf16 layer 0.9965-0.9988. That is the e4m3 rounding (~0.037 per
GEMM, act compounds two) through three GEMM stages, not more: the issue's "< 5e-2, cosine >= 0.999" holds for h,
GEMM2 and dgrad1 alone (act: 0.054), not for the whole layer.

FP8 dispatch (option ``fp8_dispatch``, with ``fp8``; off by default, issue 5's "FP8 dispatch if it pays"):
    aq, a_s, handle = dispatch_fp8(x, topk_idx, heap)     x quantised once per token on its home rank, the packed
                                                          rows [e4m3 H bytes | fp32 block scales] pulled
    act, h          = gemm1_swiglu_fp8(aq, a_s, ...)      row-strided views of the receive buffer, no quantisation
instead of quantising each of a token's up to k received bf16 copies. The forward, dx, the router's and w2's
gradients are bitwise those of ``fp8`` alone (the 1x128 quantisation is per row); dW13 = dh^T recv uses the
dequantised rows (dequantize_act in the backward; CPU: 0.025 relative to ``fp8``'s dW13, cosine 0.9997). A row moves
H + 4 cdiv(H, 128) bytes padded to 16 (qwen3 2112, deepseek 7392) instead of 2H. Not measured across GPUs yet (it
needs 2+ GPUs to pay: at EP 1 the pull is a local copy).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megamoe.backends.fp8_weights import Fp8WeightCache
from megamoe.comm.combine import combine, combine_backward, pull_grad, send_gate_grad
from megamoe.comm.dispatch import dispatch, dispatch_backward, dispatch_fp8
from megamoe.comm.heap import CommShape, SymmetricHeap, heap_bytes, workspace_bytes
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
    quantize_weight,
)
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


def _wgrads(g_out, act, dh, recv, offs, w13, w2):
    """dW2 = g_out^T act and dW13 = dh^T recv per expert (default configs: every SM)."""
    dw2 = grouped_wgrad(g_out, act, offs, out_dtype=w2.dtype)
    dw13 = grouped_wgrad(dh, recv, offs, out_dtype=w13.dtype)
    return dw13, dw2


def _expert_forward(recv, w13, w2, offs, wq, recv_q=None, out=None):
    """(act [R, I], h [R, 2I], out [R, H]), bf16; with ``wq`` (the FP8 weights, see SplitBackend.fp8_weights)
    both GEMMs on e4m3 block-scaled operands, GEMM1's from ``recv_q`` (aq, a_s: dispatch_fp8) if given, else
    quantised from recv. ``out``: GEMM2's output buffer (forward_rows_buffer), else a new one."""
    if wq is None:
        act, h = gemm1_swiglu(recv, w13, offs, store_h=True)
        return act, h, gemm2(act, w2, offs, out=out)
    q13, s13, _, _, q2, s2, _, _ = wq
    n = offs[-1:]  # rows received: only those are quantised (the buffers hold the worst case)
    act, h = gemm1_swiglu_fp8(*(recv_q or quantize_act(recv, nrows=n)), q13, s13, offs, store_h=True)
    return act, h, gemm2_fp8(*quantize_act(act, nrows=n), q2, s2, offs, out=out)


def _heap_rows(heap, shape, dtype) -> torch.Tensor | None:
    """``heap.rows_buffer()`` if it has this shape and dtype, else None. The GEMMs that write there (GEMM2 in the
    forward, forward_rows_buffer; GEMM1's dgrad, dgrad_buffer) save a staging copy: combine and dispatch_backward
    gather the region in place. Why writing it is safe: comm/signals.py, "What each wait guards"."""
    rb = heap.rows_buffer()
    return rb if tuple(rb.shape) == tuple(shape) and rb.dtype == dtype else None


def forward_rows_buffer(heap, rows: int, w2: torch.Tensor) -> torch.Tensor | None:
    """GEMM2's output buffer in the forward (_heap_rows: ~0.3 ms of qwen3-30b-a3b's forward at 16384 tokens on one
    H200 was the staging copy, 2026-12-03 profile). The caller uses it only when nothing keeps the expert outputs past
    this call (not with pull_gate_grad, which saves them for combine_backward, and a later layer's forward on the
    same heap overwrites the region) and not with presum (its stage kernel writes the sums into this region while
    reading the rows)."""
    return _heap_rows(heap, (rows, w2.shape[1]), w2.dtype)


#: tests set this (in their ranks) to fill d_recv's padding rows with NaN, so that a read of one shows in dx
POISON_PADDING = False


def dgrad_buffer(recv: torch.Tensor, heap=None) -> torch.Tensor:
    """Storage for d_recv [R_cap, H]: only its first offs[E_l] rows are written (gemm1_dgrad) and read
    (dispatch_backward), so it is not zero-filled (R_cap = W * T * min(k, E_l) rows: a 268 MB fill, 80 us, for
    qwen3-30b-a3b at 4096 tokens on 2 ranks, measured 2026-11-30). POISON_PADDING: NaN-filled instead.

    ``heap``: the GEMM writes straight into the heap's ``rows`` region (_heap_rows, when it has recv's shape and
    dtype; qwen3-30b-a3b, 16384 tokens, one H200: the staging copy cost ~0.3 ms of a 5 ms backward, 2026-12-03). Only
    for the gather without presum (presum's stage kernel writes its sums into the same region while it reads the
    rows) and only after the backward's first call (pull_grad / combine_backward), whose pull kernel waits for that
    call's READY from *every* peer (comm/dispatch.py _pull_kernel; comm/signals.py, "What each wait guards"); no
    peer reads ``rows`` in that call."""
    buf = None if heap is None else _heap_rows(heap, recv.shape, recv.dtype)
    if POISON_PADDING:
        return torch.full_like(recv, float("nan")) if buf is None else buf.fill_(float("nan"))
    return torch.empty_like(recv) if buf is None else buf


def _dgrad_swiglu(dy_rows, h, w2, offs, wq, scale=None, acts_out=None):
    """(dh [R, 2I], ds [R] or None): GEMM2's dgrad through SwiGLU (scale / acts_out as gemm2_dgrad_swiglu); with
    ``wq`` (SplitBackend.fp8_weights) on e4m3 operands: dy_rows quantised (only the rows received) and w2^T."""
    if wq is None:
        return gemm2_dgrad_swiglu(dy_rows, w2, h, offs, scale=scale, acts_out=acts_out)
    q2t, s2t = _transposed_fp8(wq, w2, 6)
    return gemm2_dgrad_swiglu_fp8(*quantize_act(dy_rows, nrows=offs[-1:]), q2t, s2t, h, offs, scale=scale,
                                  acts_out=acts_out)


def _dgrad1(dh, recv, w13, offs, wq, heap=None):
    """d_recv [R_cap, H] = GEMM1's dgrad into dgrad_buffer(recv, heap) (padding rows unwritten); with ``wq`` on
    e4m3 operands (dh quantised, w13^T: the FP8 kernel wants both operands K-major)."""
    out = dgrad_buffer(recv, heap)
    if wq is None:
        return gemm1_dgrad(dh, w13, offs, out=out)
    q13t, s13t = _transposed_fp8(wq, w13, 2)
    return gemm1_dgrad_fp8(*quantize_act(dh, nrows=offs[-1:]), q13t, s13t, offs, out=out)


def _expert_dgrad(g_out, h, recv, w13, w2, offs, wq, heap=None):
    """(dh [R, 2I], d_recv [R, H]) bf16 for gate_grad="pull" (g_out already gated), bf16 or FP8 (``wq``); heap: see
    dgrad_buffer."""
    dh, _ = _dgrad_swiglu(g_out, h, w2, offs, wq)
    return dh, _dgrad1(dh, recv, w13, offs, wq, heap)


def bf16_dgrad(dy, topk_w, handle, h, recv, w13, w2, num_sms, wq=None, presum=False):
    """The backward up to dx's send (shared with the fused backend): pull dy rows unscaled with their gates
    (comm.combine.pull_grad), then one dgrad GEMM through SwiGLU whose epilogue applies the gate, gives each row's
    d(topk_w) = <dy, act @ w2^T> (fp32 accumulator) and writes the gated activation acts = gate * silu(g) * u;
    send d(topk_w) home; dgrad GEMM1. Returns (dy_rows [R_cap, H], acts [R_cap, I], dh [R_cap, 2I], d_recv
    [R_cap, H], d_topk_w [T, k] fp32); dW2 = dy_rows^T acts, dW13 = dh^T recv. With ``wq`` (the FP8 weights of
    SplitBackend.fp8_weights) both dgrad GEMMs run on e4m3 operands: dy_rows and dh quantised (only the rows
    received), the transposed weights; the same epilogue outputs. d_recv is written into the heap's ``rows`` region
    (dgrad_buffer), where dispatch_backward gathers it without a staging copy, unless ``presum`` (dx will be
    gathered with presum=True, whose stage writes that region).

    Replaces combine_backward for bf16 (2026-12-01) and FP8 (2026-12-01, thirteenth session): that pull read the
    forward's expert outputs [R_cap, H] (kept alive from the forward) to form <dy, out> and could not use the
    pipelined pull loop (one H200, EP 1: 0.23 vs 0.09 ms on qwen3, 0.80 vs 0.31 on deepseek)."""
    offs = handle.offs
    dy_rows, gate = pull_grad(dy, topk_w, handle, num_sms=num_sms)
    acts = torch.empty(dy_rows.shape[0], w2.shape[2], dtype=dy_rows.dtype, device=dy_rows.device)
    dh, ds = _dgrad_swiglu(dy_rows, h, w2, offs, wq, scale=gate, acts_out=acts)
    d_topk_w = send_gate_grad(ds, handle, num_sms=num_sms)
    d_recv = _dgrad1(dh, recv, w13, offs, wq, None if presum else handle.heap)
    return dy_rows, acts, dh, d_recv, d_topk_w


def _transposed_fp8(wq, w, i):
    """The dgrad orientation (q^T, s^T) of a weight, entries i, i + 1 of wq (SplitBackend.fp8_weights), quantised
    here if the forward made only its own orientation (fp8_weights under no_grad)."""
    if wq[i] is None:
        return quantize_weight(w, transpose=True)
    return wq[i], wq[i + 1]


class _SplitMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, topk_idx, heap, num_sms, overlap, presum, wq, pull_gate_grad=False,
                fp8_dispatch=False):
        recv_q = a_s = None
        if fp8_dispatch:  # rows arrive quantised (one quantisation per token, ~half the bytes): GEMM1 reads them
            aq, a_s, handle = dispatch_fp8(x, topk_idx, heap, num_sms=num_sms, topk_w=topk_w if presum else None)
            recv, recv_q = aq, (aq, a_s)
        else:
            recv, handle = dispatch(x, topk_idx, heap, num_sms=num_sms, topk_w=topk_w if presum else None)
        offs = handle.offs
        # GEMM2 writes into the heap's rows region (combine gathers from there without staging a copy) unless the
        # outputs must outlive this call or presum's stage writes that region
        out_buf = None if (presum or pull_gate_grad) else forward_rows_buffer(heap, recv.shape[0], w2)
        act, h, out = _expert_forward(recv, w13, w2, offs, wq, recv_q, out=out_buf)
        if presum:  # expert ranks pre-sum each token's rows with the gates dispatch brought
            y = combine(out, None, handle, num_sms=num_sms, out_dtype=x.dtype, presum=True)
        else:
            y = combine(out, topk_w, handle, num_sms=num_sms, out_dtype=x.dtype)
        ctx.epilogue_gate_grad = not pull_gate_grad
        # (with fp8_dispatch recv is the e4m3 rows and a_s their scales: dequantised in the backward for dW13)
        if ctx.epilogue_gate_grad:  # the backward through pull_grad needs neither the expert outputs nor act:
            # dW2's operand and d(topk_w) come from the dgrad GEMM's epilogue (bf16_dgrad, bf16 or FP8)
            ctx.save_for_backward(recv, h, None, None, topk_w, w13, w2, a_s)
        else:
            ctx.save_for_backward(recv, h, act, out, topk_w, w13, w2, a_s)
        ctx.handle = handle
        ctx.num_sms = num_sms
        ctx.overlap = overlap
        ctx.presum = presum
        ctx.wq = wq  # the FP8 weights of this call (a tuple, not saved tensors: no grads flow to them)
        return y

    @staticmethod
    def backward(ctx, dy):
        recv, h, act, out, topk_w, w13, w2, a_s = ctx.saved_tensors
        handle, num_sms = ctx.handle, ctx.num_sms
        offs = handle.offs
        if a_s is not None:  # fp8_dispatch: dW13 = dh^T recv on the dequantised rows (only the received ones)
            recv = dequantize_act(recv, a_s, nrows=offs[-1:])
        if ctx.epilogue_gate_grad:
            # g_out here is dy pulled without its gate and act the gated activation: dW2 = g_out^T act either way
            g_out, act, dh, d_recv, d_topk_w = bf16_dgrad(dy.contiguous(), topk_w, handle, h, recv, w13, w2,
                                                          num_sms, wq=ctx.wq, presum=ctx.presum)
        else:
            g_out, d_topk_w = combine_backward(dy.contiguous(), out, topk_w, handle, num_sms=num_sms)
            dh, d_recv = _expert_dgrad(g_out, h, recv, w13, w2, offs, ctx.wq, None if ctx.presum else handle.heap)
        if ctx.overlap and d_recv.is_cuda:
            # dx goes home on a side stream (num_sms programs) while the weight gradients run
            main = torch.cuda.current_stream(d_recv.device)
            side = _side_stream(d_recv.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dx = dispatch_backward(d_recv, handle, num_sms=num_sms, out_dtype=dy.dtype, presum=ctx.presum)
            d_recv.record_stream(side)
            # the weight gradients on every SM, sharing them with the communication kernel's CTAs (capping them to
            # the SMs it leaves, as before e562a52, gained nothing: the 1.38x slowdown measured with the option on
            # 2026-11-30 came from its 32 communication programs, docs/perf-notes.md)
            dw13, dw2 = _wgrads(g_out, act, dh, recv, offs, w13, w2)
            main.wait_stream(side)
            dx.record_stream(main)
        else:
            dx = dispatch_backward(d_recv, handle, num_sms=num_sms, out_dtype=dy.dtype, presum=ctx.presum)
            dw13, dw2 = _wgrads(g_out, act, dh, recv, offs, w13, w2)
        return dx, d_topk_w.to(topk_w.dtype), dw13, dw2, None, None, None, None, None, None, None, None


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One communication stream per device, reused (creating streams per call would leak them)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class SplitBackend(Fp8WeightCache):
    """See the module docstring. Options: ``comm_sms`` (programs of the communication kernels; default every
    SM on GPUs, 2 under the interpreter), ``overlap_backward`` (send dx home on a side stream with ``comm_sms``
    programs while the weight-gradient GEMMs run, sharing the SMs; off by default: 2x H200 2026-11-30 with
    presum_combine, qwen3 in a CUDA graph, fwd+bwd 2.885 vs 2.968 ms, one run),
    ``presum_combine`` (expert ranks pre-sum each token's rows so the owner pulls one row per rank, in
    combine and in dispatch's backward: comm/presum.py; off by default until measured),
    ``fp8`` (GEMM1+SwiGLU, GEMM2 and both dgrad GEMMs on FP8 e4m3 with 1x128 activation / 128x128 weight
    scales; wgrad stays bf16; off by default: relative error vs float64 0.05-0.11 against the bf16 path's
    < 1e-2, see the module docstring; needs compute capability >= 8.9 on CUDA), ``fp8_weight_cache`` (with
    ``fp8``, default True: keep the quantised weights across calls until the parameters change, see
    :meth:`fp8_weights`; False: quantise them in every call, both orientations in the forward, held until the
    backward: the same 2 bytes per weight element during a step, none between calls), ``fp8_dispatch`` (with
    ``fp8``, off by default: the rows travel FP8-quantised, see the module docstring),
    ``gate_grad`` ("epilogue", the default since 2026-12-01: d(topk_w) and dW2's operand from the dgrad GEMM's
    epilogue, see :func:`bf16_dgrad`, bf16 and FP8; "pull": the earlier backward, combine_backward's pull
    computing <dy, out> from the forward's saved expert outputs),
    ``timeout_s`` (bound of every device-side wait, default 60)."""

    name = "split"
    graph_capturable = True  # no host sync: a whole step can be captured in a CUDA graph

    @staticmethod
    def why_unavailable(device) -> str | None:
        if not dist.is_available():
            return "torch.distributed is not available"
        return None

    def __init__(self, moe, comm_sms: int | None = None, timeout_s: float = 60.0, overlap_backward: bool = False,
                 presum_combine: bool = False, fp8: bool = False, fp8_weight_cache: bool = True,
                 gate_grad: str = "epilogue", fp8_dispatch: bool = False):
        cfg = moe.config
        if comm_sms is None:  # the interpreter runs programs one by one: fewer is faster there
            # on GPUs: every SM (the pull at 132 programs took 0.53-0.65x its time at 32, 2x H200, 2026-11-30),
            # also with overlap_backward: at 32 its forward and backward were 1.24x / 1.38x slower than without the
            # option (qwen3, EP 2, graph), at 132 1.00x / 0.97x (the weight gradients share the SMs)
            comm_sms = 2 if os.environ.get("TRITON_INTERPRET") == "1" else device_sms(moe.device)
        if cfg.dtype != torch.bfloat16:
            raise ValueError(f"backend 'split' needs a bfloat16 layer (its GEMMs are bf16), got {cfg.dtype}")
        if not dist.is_initialized():
            raise ValueError("backend 'split' needs an initialised torch.distributed process group "
                             "(a one-rank group is fine)")
        if comm_sms < 1:
            raise ValueError(f"comm_sms must be >= 1, got {comm_sms}")
        self._init_fp8_cache(fp8, fp8_weight_cache, moe.device)
        if fp8_dispatch not in (True, False, 0, 1):
            raise ValueError(f"backend 'split': fp8_dispatch must be a flag (True/False or 1/0), got {fp8_dispatch!r}")
        if fp8_dispatch and not fp8:
            raise ValueError("backend 'split': fp8_dispatch=1 sends the rows FP8-quantised for the FP8 GEMM1; it needs "
                             "fp8=1")
        if gate_grad not in ("epilogue", "pull"):
            raise ValueError(f"backend 'split': gate_grad must be 'epilogue' or 'pull', got {gate_grad!r}")
        self.gate_grad = gate_grad
        self.moe = moe
        self.comm_sms = comm_sms
        self.overlap_backward = overlap_backward
        self.presum_combine = presum_combine
        self.fp8_dispatch = bool(fp8_dispatch)
        self.shape = CommShape(world=moe.world, max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden,
                               topk=cfg.top_k, num_experts=cfg.num_experts, dtype=cfg.dtype)
        self.heap = get_heap(self.shape, moe.group, moe.device, timeout_s, comm_sms)

    def workspace_bytes(self) -> dict:
        """Symmetric heap bytes (shared by layers of this shape), per-call device workspace bytes and, with
        ``fp8`` and ``fp8_weight_cache``, the bytes of the cached FP8 weights (both orientations and scales)."""
        out = {"symmetric": heap_bytes(self.shape), "per_call": workspace_bytes(self.shape)}
        if self.fp8 and self.fp8_weight_cache:
            out["fp8_weights"] = self.fp8_weight_bytes()
        return out

    def __call__(self, x, topk_idx, topk_w, w13, w2):
        if x.shape[0] > self.shape.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed the layer's max_tokens_per_rank "
                             f"({self.shape.max_tokens}); build the MoEConfig with a larger one")
        wq = self.fp8_weights(w13, w2) if self.fp8 else None
        return _SplitMoE.apply(x, topk_w, w13, w2, topk_idx, self.heap, self.comm_sms, self.overlap_backward,
                               self.presum_combine, wq, self.gate_grad == "pull", self.fp8_dispatch)
