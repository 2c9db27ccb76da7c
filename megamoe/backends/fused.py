"""Backend ``fused``: the forward as one persistent megakernel (megamoe/kernels/fused_moe.py).

Shape legend: T tokens on this rank, H hidden, I intermediate, E_l local experts, k top-k, R_cap worst-case
rows received, BM rows of a block.

forward (one torch.autograd.Function):
    stage x + top-k ids, publish             (comm/signals.stage)
    schedule                                  (comm/schedule.py, 4 small kernels, device-side)
    megakernel: pull rows -> GEMM1+SwiGLU -> GEMM2, whose epilogue stores each row into its owner's slot
                buffer (``combine="push"``, the default) -> (after every rank's DONE)
                y[t] = sum_j topk_w[t, j] * slot[t, j] in j order
backward, default (split's bf16 backward, backends/split.bf16_dgrad, reusing what the forward kept):
    dy rows + gates pulled to the expert rows (comm.combine.pull_grad)
    dh = dgrad2+SwiGLU, whose epilogue also gives d(topk_w)[t, j] = <dy[t], act_j @ w2^T> per row (sent to the
    owners' dw slots) and the gated activation for dW2; d_recv = dgrad1, dx = dispatch backward (owner
    gathers), dW2, dW13 (deterministic). Until 2026-12-01 the forward saved its tokens' slot rows [T, k, H]
    for d(topk_w) (a copy in the kernel's tail and a separate kernel in the backward); now only the backward
    megakernel does.
    The forward's receive rows and h are reused when the ring held every block (``ring_blocks=None``,
    dense buffers); with a smaller ring they were overwritten, so the backward first recomputes them
    (dispatch of x + GEMM1, split's kernels; that cost is what ``megamoe bench`` measures for a ring).

``combine="pull"``: GEMM2 keeps its rows in this rank's symmetric ``rows`` region and each owner pulls its k rows
after DONE (split's gather, inside the kernel); no [T_max, k, H] slot buffer. On 2x H200 (commit daafc3c, after
the row accesses were made 16 bytes wide) it measured 5-9% slower than the push (forward qwen3 2.07 vs 1.89 ms
eager, 1.34 vs 1.27 ms graph; deepseek 8.60 vs 8.14 ms), so it is the option for memory, not the default.
(Before that fix, at 1f57efe, pull measured faster: both paths stored or loaded rows 2 bytes at a time.)

backward with ``fused_backward=True`` (dense buffers only; off: on 2x H200 its fwd+bwd measured 0.03-1.2 ms slower
than the default backward for deepseek and even for qwen3, commits 1f57efe and daafc3c):
    the same megakernel in its BWD mode (kernels/fused_moe.fused_backward): pull w * dy rows, dgrad2 +
    SwiGLU', dgrad1 (pushed into the owners' slots, or kept local with ``combine="pull"``), owners sum dx;
    then split's deterministic wgrad kernels.

FP8 (option ``fp8``, off by default; issue 6 item 4): the same megakernel on e4m3 operands, the recipe of split's
``fp8=1, fp8_dispatch=1`` (DeepSeek-V3 block scales: 1x128 activations, 128x128 weights, fp32 accumulation
promoted every 128 of K):
    x quantised once per token on its home rank into packed rows [e4m3 H bytes | fp32 scales] (dispatch_fp8's
    layout, comm.dispatch.fp8_row_layout), staged; the pull moves those (~half of a bf16 row's bytes)
    GEMM1 on the e4m3 rows and q(w13), a 128-column tile as two 64-column halves; its epilogue stores h in bf16
    and quantises act = silu(g) * u (rounded to bf16 first, as split stores it) into e4m3 with its 1x128 scales
    GEMM2 on e4m3 act and q(w2) (128-column tiles), rows pushed in bf16 as in the bf16 forward
    backward: split's FP8 kernels (bf16_dgrad with the FP8 weights; dW13 on the dequantised received rows; a ring
    recomputes them with dispatch_fp8 + gemm1_swiglu_fp8: on GPUs that is split's Gluon kernel, so the recomputed
    h is close to, not bitwise, the forward's; on CPU ranks both are the Triton arithmetic); the backward
    megakernel is bf16 only
The FP8 weights come from the layer's kept copies (megamoe.backends.fp8_weights, shared with split: requantised
when a weight changes, or kept current by the optimizer with ``MasterAdamW.maintain_fp8``). On CPU ranks every output
and gradient is bitwise split's ``fp8=1, fp8_dispatch=1`` (tests/test_fused_backend.py); on a GPU split runs the
Gluon FP8 GEMMs, so the two are close, not equal. Measured (one H200, EP 1, 4096 tokens, 81c2a9b; eager, weights
cached): mixtral forward 5.83 ms against the bf16 megakernel's 5.67 and split FP8's 4.56; fwd+bwd 14.33 / 15.80 /
12.85. The megakernel's FP8 GEMMs are Triton's: each k-step's wgmma result is scaled and added before the next
wgmma is issued (Triton 3.6 waits for every wgmma: ``wait_group 0``), so they run at about the bf16 rate, where
split's warp-specialised Gluon kernels overlap the promotion with the next wgmma. docs/perf-notes.md (fifteenth
session) has the numbers.

Options: ``ring_blocks`` (None: dense buffers of R_cap rows, no recompute; an int >= 4: the macrobatch ring of that
many BM-row blocks, memory independent of routing; ``MoEConfig.ring_rows`` sets the same ring in rows, rounded up
to whole blocks), ``programs`` (persistent programs of the megakernel; default the SM count), ``lookahead`` (pull
-> GEMM1 distance in steps; default max(8, programs / items per step + 1), capped by a ring), ``lag`` (GEMM1 ->
GEMM2 distance in steps; default 3, 1 with a ring), ``pull_split`` (pull items per block), ``group_blocks`` (blocks
per step whose GEMM tiles run side by side, sharing weight tiles in L2), ``combine`` ("pull" or "push"),
``fused_backward``, ``presum_backward`` (the default backward's dx gather with split's presum: each expert rank
sums a token's rows before the owner pulls one row per rank, comm/presum.py; fewer NVLink bytes at EP >= 2, where
it is not yet measured, so off; not with ``fused_backward``), ``stages`` (pipeline depth of the GEMM k-loops, 1-4,
default 4), ``counter_scope`` ("sys" or "gpu": the scope of the megakernel's tile-counter acquire loads, default
"sys"), ``prologue`` (the first lookahead steps pull their blocks in finer parts; off, not timed yet),
``pull_prefetch`` (pull items load every row's source address before the copy loop; off, not timed yet),
``comm_sms`` (programs of the
staging / backward communication kernels, default every SM), ``timeout_s`` (bound of every device wait), ``fp8``
and ``fp8_weight_cache`` (as split's: keep the FP8 weight copies across calls; see megamoe.backends.fp8_weights),
``kernel`` ("triton", the default, or "gluon": the forward's work items in kernels/gluon_fused.py, warp-specialised
like split's Gluon GEMMs, with the same items, order, waits and results, then the tail as its own Triton kernel;
Hopper only, H and I multiples of 8; the backward is unchanged. bf16: bitwise the Triton kernel's on one H200. With
``fp8=1`` (I a multiple of 128, combine "push"): the FP8 items, each promotion overlapping the other consumer's
wgmma; bitwise the Triton FP8 megakernel's on one H200).

Capacity: no token is ever dropped: dense buffers hold the worst case (every token of every rank routed
here); a ring cycles as many times as the routing needs. With ``combine="push"`` the symmetric heap adds a
[T_max, k, H] slot buffer per rank (``CommShape(slots=True)``); sizes are reported by
:meth:`FusedBackend.workspace_bytes`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megamoe.backends.fp8_weights import Fp8WeightCache
from megamoe.backends.split import _side_stream, _wgrads, bf16_dgrad, get_heap  # noqa: F401 - shared heap cache
from megamoe.comm.dispatch import dispatch, dispatch_backward, dispatch_fp8, fp8_row_layout, fp8_rows_fit
from megamoe.comm.heap import CommShape, heap_bytes
from megamoe.experts import dequantize_act, gemm1_swiglu, gemm1_swiglu_fp8
from megamoe.kernels.fused_moe import (
    FusedConfig,
    FusedState,
    default_fused_config,
    dgate,
    fused_backward,
    fused_forward,
    plan_lag,
)
from megamoe.kernels.gemm_config import num_sms as device_sms
from megamoe.kernels.gluon_fused import gluon_fused_reason


def _state(ctx, recv, act, h) -> FusedState:
    return FusedState(handle=ctx.handle, xbuf=recv, act=act, h=h, saved=None)


class _FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, topk_idx, backend, train, wq):
        ring = backend.ring_blocks or 0
        mega = backend.fused_backward and not ring  # the backward megakernel needs the slots' rows and act
        y, st = fused_forward(backend.heap, x, topk_idx, topk_w, w13, w2, backend.config, ring_blocks=ring,
                              store_h=train and not ring, save=train and mega, comm_programs=backend.comm_sms,
                              wq=wq)
        if train:
            # FP8 (dense): the packed rows' e4m3 values and scales, dequantised in the backward for dW13
            rows = (st.xq if st.xq is not None else (st.xbuf, None))
            ctx.save_for_backward(x, topk_idx, topk_w, w13, w2, st.saved,
                                  *(() if ring else (*rows, st.act if mega else None, st.h)))
            ctx.handle = st.handle
            ctx.backend = backend
            ctx.wq = wq  # the FP8 weights of this call (a tuple, not saved tensors: no grads flow to them)
        return y

    @staticmethod
    def backward(ctx, dy):
        b = ctx.backend
        saved = ctx.saved_tensors
        x, topk_idx, topk_w, w13, w2, slots = saved[:6]
        dy = dy.contiguous()
        wq = ctx.wq
        if b.ring_blocks:  # the ring overwrote the forward's rows: recompute them (dispatch + GEMM1)
            if wq is not None:  # as the FP8 forward: packed FP8 rows pulled, GEMM1 on them
                aq, a_s, handle = dispatch_fp8(x, topk_idx, b.heap, num_sms=b.comm_sms)
                _, h = gemm1_swiglu_fp8(aq, a_s, wq[0], wq[1], handle.offs, store_h=True)
                recv = dequantize_act(aq, a_s, nrows=handle.offs[-1:])
            else:
                recv, handle = dispatch(x, topk_idx, b.heap, num_sms=b.comm_sms)
                _, h = gemm1_swiglu(recv, w13, handle.offs, store_h=True)
        else:
            recv, a_s, act, h = saved[6:]
            handle = ctx.handle
            if a_s is not None:  # FP8: dW13 = dh^T recv on the dequantised rows (only the received ones)
                recv = dequantize_act(recv, a_s, nrows=handle.offs[-1:])
        offs = handle.offs
        if b.fused_backward and not b.ring_blocks:  # the backward megakernel, then split's wgrad kernels
            d_topk_w = dgate(dy, slots)
            dx, g_out, dh = fused_backward(b.heap, dy, topk_w, _state(ctx, recv, act, h), w13, w2, b.config,
                                           comm_programs=b.comm_sms)
            dw13, dw2 = _wgrads(g_out, act, dh, recv, offs, w13, w2)
            return dx, d_topk_w.to(topk_w.dtype), dw13, dw2, None, None, None, None
        # split's bf16 backward: dy pulled unscaled with its gates, d(topk_w) and the gated activation from the
        # dgrad GEMM's epilogue (no saved expert outputs, no d(topk_w) kernel)
        # (presum_backward: each expert rank sums a token's d_recv rows first, so the owner pulls one row per rank;
        # d_recv then stays out of the heap's rows region, which presum's stage writes)
        dy_rows, acts, dh, d_recv, d_topk_w = bf16_dgrad(dy, topk_w, handle, h, recv, w13, w2, b.comm_sms, wq=wq,
                                                         presum=b.presum_backward)
        dx = dispatch_backward(d_recv, handle, num_sms=b.comm_sms, out_dtype=dy.dtype, presum=b.presum_backward)
        dw13, dw2 = _wgrads(dy_rows, acts, dh, recv, offs, w13, w2)
        return dx, d_topk_w.to(topk_w.dtype), dw13, dw2, None, None, None, None


class FusedBackend(Fp8WeightCache):
    """See the module docstring."""

    name = "fused"
    graph_capturable = True  # no host sync in forward or backward

    @staticmethod
    def why_unavailable(device) -> str | None:
        if not dist.is_available():
            return "torch.distributed is not available"
        return None

    def __init__(self, moe, ring_blocks: int | None = None, programs: int | None = None,
                 lookahead: int | None = None, pull_split: int | None = None, group_blocks: int | None = None,
                 comm_sms: int | None = None, timeout_s: float = 60.0, fused_backward: bool = False,
                 combine: str = "push", stages: int | None = None, counter_scope: str | None = None,
                 lag: int | None = None, prologue: bool = False, pull_prefetch: bool = False, fp8: bool = False,
                 fp8_weight_cache: bool = True, kernel: str = "triton", presum_backward: bool = False):
        cfg = moe.config
        if cfg.dtype != torch.bfloat16:
            raise ValueError(f"backend 'fused' needs a bfloat16 layer (its GEMMs are bf16), got {cfg.dtype}")
        if not dist.is_initialized():
            raise ValueError("backend 'fused' needs an initialised torch.distributed process group "
                             "(a one-rank group is fine)")
        if comm_sms is None:  # staging and the backward's communication kernels run alone: every SM
            comm_sms = 2 if os.environ.get("TRITON_INTERPRET") == "1" else device_sms(moe.device)
        if comm_sms < 1:
            raise ValueError(f"comm_sms must be >= 1, got {comm_sms}")
        self._init_fp8_cache(fp8, fp8_weight_cache, moe.device)
        if fp8 and fused_backward:
            raise ValueError("backend 'fused': fp8=1 runs the backward on split's FP8 kernels; the backward "
                             "megakernel (fused_backward=1) is bf16 only")
        if fp8 and not fp8_rows_fit(cfg.hidden):
            raise ValueError(f"backend 'fused' with fp8=1 needs a packed FP8 row ({fp8_row_layout(cfg.hidden)[1]} "
                             f"bytes: e4m3 values and fp32 scales) to fit in a bf16 row of the symmetric heap "
                             f"(hidden = {cfg.hidden} elements; 32 and above always fit)")
        self.config: FusedConfig = default_fused_config(moe.device, fp8=bool(fp8))
        if programs is not None:
            if programs < 1:
                raise ValueError(f"programs must be >= 1, got {programs}")
            self.config = self.config.with_(programs=int(programs))
        if lookahead is not None:
            if lookahead < 1:
                raise ValueError(f"lookahead must be >= 1, got {lookahead}")
            self.config = self.config.with_(lookahead=int(lookahead))
        for name, flag in (("prologue", prologue), ("pull_prefetch", pull_prefetch)):
            if flag not in (True, False, 0, 1):
                raise ValueError(f"{name} must be a flag (True/False or 1/0), got {flag!r}")
        self.config = self.config.with_(prologue=bool(prologue), pull_prefetch=bool(pull_prefetch))
        if lag is not None:
            if lag < 1:
                raise ValueError(f"lag must be >= 1, got {lag}")
            self.config = self.config.with_(lag=int(lag))
        if stages is not None:  # pipeline depth of the megakernel's GEMM k-loops
            if not 1 <= int(stages) <= 4:
                raise ValueError(f"stages must be 1..4 (4 fills the shared memory at the default tiles), got {stages}")
            self.config = self.config.with_(num_stages=int(stages))
        if counter_scope is not None:  # scope of the tile-counter acquires ("sys" or "gpu")
            if counter_scope not in ("sys", "gpu"):
                raise ValueError(f"counter_scope must be 'sys' or 'gpu', got {counter_scope!r}")
            self.config = self.config.with_(counter_scope=counter_scope)
        if group_blocks is not None:
            if group_blocks < 1:
                raise ValueError(f"group_blocks must be >= 1, got {group_blocks}")
            self.config = self.config.with_(group=int(group_blocks))
        if pull_split is not None:
            if pull_split < 1 or self.config.block_m % pull_split:
                raise ValueError(f"pull_split must be >= 1 and divide the block's "
                                 f"{self.config.block_m} rows, "
                                 f"got {pull_split}")
            self.config = self.config.with_(pull_split=int(pull_split))
        if cfg.ring_rows is not None:  # MoEConfig.ring_rows: the same ring, in rows (rounded up to blocks)
            from_cfg = -(-cfg.ring_rows // self.config.block_m)
            if ring_blocks is not None and int(ring_blocks) != from_cfg:
                raise ValueError(f"ring_blocks={ring_blocks} contradicts MoEConfig.ring_rows={cfg.ring_rows} "
                                 f"({from_cfg} blocks of {self.config.block_m} rows); give one of them")
            ring_blocks = from_cfg
        if ring_blocks is not None:
            ring_blocks = int(ring_blocks)
            need = plan_lag(self.config, ring_blocks) + 3
            if ring_blocks < need:
                raise ValueError(f"ring_blocks must be >= {need} (lag + 3), got {ring_blocks}")
        if combine not in ("push", "pull"):
            raise ValueError(f"combine must be 'push' or 'pull', got {combine!r}")
        self.config = self.config.with_(combine=combine)
        if fused_backward not in (True, False, 0, 1):
            raise ValueError(f"fused_backward must be a flag (True/False or 1/0), got {fused_backward!r}")
        if fused_backward and ring_blocks:
            raise ValueError("fused_backward needs the dense buffers (ring_blocks=None): a cycling ring overwrote "
                             "the forward's rows, which the backward recomputes with split's kernels")
        if presum_backward not in (True, False, 0, 1):
            raise ValueError(f"presum_backward must be a flag (True/False or 1/0), got {presum_backward!r}")
        if presum_backward and fused_backward:
            raise ValueError("presum_backward applies to the default backward (split's kernels); the backward "
                             "megakernel (fused_backward=1) sums dx in its own kernel")
        if kernel not in ("triton", "gluon"):
            raise ValueError(f"kernel must be 'triton' or 'gluon', got {kernel!r}")
        if kernel == "gluon":
            why = gluon_fused_reason(self.config, H=cfg.hidden, I=cfg.intermediate, device=moe.device, fp8=bool(fp8))
            if why is not None:
                raise ValueError(f"backend 'fused' with kernel='gluon': {why}")
            self.config = self.config.with_(kernel="gluon")
        self.moe = moe
        self.fused_backward = bool(fused_backward)
        self.presum_backward = bool(presum_backward)
        self.ring_blocks = ring_blocks
        self.comm_sms = comm_sms
        self.shape = CommShape(world=moe.world, max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden,
                               topk=cfg.top_k, num_experts=cfg.num_experts, dtype=cfg.dtype,
                               slots=combine == "push")
        self.heap = get_heap(self.shape, moe.group, moe.device, timeout_s, comm_sms)

    def workspace_bytes(self) -> dict:
        """Symmetric heap bytes (shared by layers of this shape) and the megakernel's per-call buffers."""
        sh, c = self.shape, self.config
        rows = self.ring_blocks * c.block_m if self.ring_blocks else sh.rows_cap
        inter = self.moe.config.intermediate
        h_bytes = 0 if self.ring_blocks else 2 * inter * 2
        if self.fp8:  # packed e4m3 rows with their scales, e4m3 act with its scales, h in bf16; the packed tokens
            packed_row = fp8_row_layout(sh.hidden)[1]
            per_call = rows * (packed_row + inter + 4 * -(-inter // 128) + h_bytes) + sh.max_tokens * packed_row
        else:
            per_call = rows * ((sh.hidden + inter) * 2 + h_bytes)
        out = {"symmetric": heap_bytes(self.shape), "per_call": per_call,
               "saved_slots": sh.max_tokens * sh.topk * sh.hidden * 2 if self.fused_backward else 0}
        if self.fp8:
            # the backward's bf16 copy of the received rows (dequantised for dW13; R_cap rows, ring or not)
            out["backward_fp8_rows"] = sh.rows_cap * sh.hidden * 2
            if self.fp8_weight_cache:
                out["fp8_weights"] = self.fp8_weight_bytes()
        return out

    def __call__(self, x, topk_idx, topk_w, w13, w2):
        if x.shape[0] > self.shape.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed the layer's max_tokens_per_rank "
                             f"({self.shape.max_tokens}); build the MoEConfig with a larger one")
        train = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_w, w13, w2))
        wq = self.fp8_weights(w13, w2) if self.fp8 else None
        return _FusedMoE.apply(x, topk_w, w13, w2, topk_idx, self, train, wq)
