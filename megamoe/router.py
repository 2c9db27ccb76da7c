"""Top-k routers: softmax-then-top-k (Mixtral, Qwen3, gpt-oss) and sigmoid + per-expert bias (DeepSeek-V3).

Shapes: T tokens, H hidden, E experts, k top-k.

* softmax: p = softmax(x @ W^T); (g, idx) = top-k(p); g /= sum(g) if norm_topk; g *= route_scale.
* sigmoid: s = sigmoid(x @ W^T); idx = top-k(s + bias); g = s[idx]; then as softmax. ``bias`` is a buffer
  (DeepSeek-V3's auxiliary-loss-free balancing), not trained by autograd: it moves the choice, never the gates.
* group-limited (``n_group`` > 1, DeepSeek-V3): the top-k runs only over the experts of the token's ``topk_group``
  groups with the highest sum of their two best selection scores (p, or s + bias).

aux = coef * E * sum_e f_e * P_e per rank (Switch Transformer), f_e = (tokens routed to e) / (T k), P_e the mean
router probability of e (sigmoid: s normalised over experts); 0 for an empty batch.

Routing computes in float32 (float64 for float64 input) with autocast off, so every backend sees the same
routing. On CUDA with bf16/fp16 operands the logit GEMM runs on tensor cores with float32 output (bf16 products
are exact in float32, so only summation order differs) instead of a SIMT float32 GEMM costing ~0.16 ms per forward
+ backward (qwen3-30b-a3b, 4096 tokens); its backward rounds the logit gradient to the input dtype once. ``impl``:
on CUDA in float32 the steps after the GEMM are Triton kernels (megamoe/kernels/router_topk.py, ~2.4x faster than
torch ops), else torch ops; both make the same choices (ties: lowest expert id) and, up to rounding, the same gates,
loss and gradients. "torch" / "triton" forces one (tests compare them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import MoEConfig, compute_dtype


class RouterOutput(NamedTuple):
    """topk_idx int64 [T, k] global expert ids, distinct per token; topk_w float32 (float64 for float64 input)
    [T, k] gates, differentiable; aux_loss scalar, coef included; tokens_per_expert int64 [E] (token, slot) pairs
    per expert on this rank, on the device (the layer never reads it on the host); logits [T, E] in the routing dtype,
    differentiable (what HF models record for their own aux loss)."""

    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    logits: torch.Tensor


class _TensorCoreLogits(torch.autograd.Function):
    """logits = x @ w^T in float32 from bf16/fp16 ``x`` [T, H] and ``w`` [E, H] (CUDA; see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        gl = g.to(x.dtype)
        dx = gl @ w if ctx.needs_input_grad[0] else None
        dw = gl.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw


def _logits(x: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    if x.is_cuda and cdt == torch.float32 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return _TensorCoreLogits.apply(x, weight)
    return F.linear(x.to(cdt), weight.to(cdt))


IMPLS = ("auto", "torch", "triton")


def _use_triton(impl: str, x: torch.Tensor, cdt: torch.dtype) -> bool:
    if impl == "triton":
        if cdt != torch.float32:
            raise ValueError("router impl 'triton' computes in float32; float64 input needs impl 'torch' or 'auto'")
        if not x.is_cuda:
            from megamoe.kernels.gemm_config import interpreting

            if not interpreting():
                raise ValueError("router impl 'triton' on CPU needs TRITON_INTERPRET=1 (the Triton interpreter)")
        return True
    return impl == "auto" and x.is_cuda and cdt == torch.float32


def route(x: torch.Tensor, weight: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None = None,
          logit_offset: torch.Tensor | None = None, impl: str = "auto") -> RouterOutput:
    """``x`` [T, H], ``weight`` [E, H] -> :class:`RouterOutput`. ``logit_offset`` [E] is added to the logits
    (benchmarks skew the routing with it). ``impl`` "triton" needs float32 compute, and TRITON_INTERPRET=1 on CPU."""
    if impl not in IMPLS:
        raise ValueError(f"router impl must be one of {IMPLS}, got {impl!r}")
    with torch.autocast(x.device.type, enabled=False):  # float32 routing inside bf16 autocast regions too
        cdt = compute_dtype(x.dtype)
        T, E, k = x.shape[0], config.num_experts, config.top_k
        logits = _logits(x, weight, cdt)
        if logit_offset is not None:
            logits = logits + logit_offset.to(cdt)
        if T > 0 and _use_triton(impl, x, cdt):
            from megamoe.kernels.router_topk import RouteTopk

            return RouterOutput(*RouteTopk.apply(logits, bias, k, config.router == "sigmoid", config.norm_topk,
                                                 config.route_scale, config.aux_loss_coef, config.n_group,
                                                 config.topk_group), logits)  # (idx, gates, aux, counts, logits)
        if config.router == "softmax":
            probs = torch.softmax(logits, dim=-1)
            if config.n_group > 1:
                idx = torch.topk(limit_groups(probs.detach(), config), k, dim=-1).indices
                gates = probs.gather(1, idx)
            else:
                gates, idx = torch.topk(probs, k, dim=-1)
            density_probs = probs
        else:
            scores = torch.sigmoid(logits)
            choice = scores if bias is None else scores + bias.to(cdt).detach()
            idx = torch.topk(limit_groups(choice.detach(), config), k, dim=-1).indices
            gates = scores.gather(1, idx)
            density_probs = scores / scores.sum(-1, keepdim=True)
        if config.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        if config.route_scale != 1.0:
            gates = gates * config.route_scale
        counts = torch.zeros(E, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))
        if T > 0 and config.aux_loss_coef > 0:
            frac = counts.to(cdt) / (T * k)
            aux = config.aux_loss_coef * E * (frac * density_probs.mean(0)).sum()
        else:
            aux = logits.sum() * 0.0  # keeps the graph connected, exactly 0
        return RouterOutput(idx, gates, aux, counts, logits)


def limit_groups(choice: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """``choice`` [T, E] with every expert outside a token's ``topk_group`` best groups set to -inf (a group scores
    the sum of its two best entries); unchanged when ``n_group`` is 1."""
    G = config.n_group
    if G == 1:
        return choice
    T, E = choice.shape
    group_score = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros(T, G, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, torch.topk(group_score, config.topk_group, dim=-1).indices, True)
    return choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))


class Router(nn.Module):
    """Replicated router: ``weight`` [E, H] (trained), ``bias`` [E] (sigmoid only), ``logit_bias`` [E] (trained,
    added to the logits; ``config.router_bias`` only, else None), ``logit_offset`` [E] (non-persistent, zeros; see
    :meth:`set_logit_offset`)."""

    def __init__(self, config: MoEConfig, device: torch.device | str | None = None, init: bool = True):
        super().__init__()
        self.config = config
        dtype = config.dtype
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden, device=device, dtype=dtype))
        if config.router == "sigmoid":
            self.register_buffer("bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32))
        else:
            self.bias = None
        self.logit_bias = (nn.Parameter(torch.empty(config.num_experts, device=device, dtype=dtype))
                           if config.router_bias else None)
        self.register_buffer("logit_offset", torch.zeros(config.num_experts, device=device, dtype=torch.float32),
                             persistent=False)
        self._offset_set = False
        if init:
            self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # Same values on every rank for the same generator state: drawn on the CPU, then copied.
        std = self.config.hidden ** -0.5
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator, dtype=torch.float32) * std)
            if self.logit_bias is not None:
                self.logit_bias.copy_(torch.randn(self.logit_bias.shape, generator=generator) * std)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        offset = self.logit_offset if self._offset_set else None
        if self.logit_bias is not None:  # differentiable: the bias is trained
            lb = self.logit_bias.to(compute_dtype(x.dtype))
            offset = lb if offset is None else lb + offset
        return route(x, self.weight, self.config, self.bias, offset)

    def set_logit_offset(self, offset: torch.Tensor | None) -> None:
        """Add ``offset`` [E] to every logit from now on (None: remove it)."""
        if offset is None:
            self.logit_offset.zero_()
        elif offset.shape != (self.config.num_experts,):
            raise ValueError(f"logit offset must have shape [{self.config.num_experts}], got {tuple(offset.shape)}")
        else:
            self.logit_offset.copy_(offset)
        self._offset_set = offset is not None
