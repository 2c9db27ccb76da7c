"""Top-k routers: softmax-then-top-k (Mixtral, Qwen3, gpt-oss) and sigmoid + per-expert bias (DeepSeek-V3).

Shape legend: T tokens, H hidden, E experts, k top-k.

Both compute in float32 (float64 when the input is float64), whatever the layer dtype, so that every
backend of the layer sees the same routing for the same input.

* softmax: p = softmax(x @ W^T); (g, idx) = top-k(p); g /= sum(g) if norm_topk; g *= route_scale.
* sigmoid: s = sigmoid(x @ W^T); idx = top-k(s + bias); g = s[idx]; g /= sum(g) if norm_topk;
  g *= route_scale. ``bias`` is a buffer (DeepSeek-V3's auxiliary-loss-free balancing term), not trained by
  autograd: it only moves the choice of experts, never the gate values.

Load-balancing loss (Switch Transformer form, per rank's batch): aux = coef * E * sum_e f_e * P_e, with
f_e = (tokens routed to e) / (T k) and P_e = mean over tokens of the router probability of e (softmax: p;
sigmoid: s normalised over experts). It is 0 for an empty batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import MoEConfig


class RouterOutput(NamedTuple):
    """What the router hands to the expert layer.

    topk_idx: int64 [T, k] expert ids (global, 0..E-1), k distinct per token.
    topk_w: float32 (float64 for float64 input) [T, k] gate weights, differentiable w.r.t. the router weight.
    aux_loss: scalar load-balancing loss, already multiplied by ``aux_loss_coef``.
    tokens_per_expert: int64 [E] number of (token, slot) pairs routed to each expert on this rank, on the
        input's device (read it whenever you like; the layer never reads it on the host).
    """

    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: MoEConfig,
    bias: torch.Tensor | None = None,
    logit_offset: torch.Tensor | None = None,
) -> RouterOutput:
    """Functional router: ``x`` [T, H], ``weight`` [E, H] -> :class:`RouterOutput`.

    ``logit_offset`` [E] is added to the logits (benchmarks use it to skew the routing).
    """
    cdt = compute_dtype(x.dtype)
    T = x.shape[0]
    E, k = config.num_experts, config.top_k
    logits = F.linear(x.to(cdt), weight.to(cdt))
    if logit_offset is not None:
        logits = logits + logit_offset.to(cdt)
    if config.router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        gates, idx = torch.topk(probs, k, dim=-1)
        density_probs = probs
    else:
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias.to(cdt).detach()
        idx = torch.topk(choice, k, dim=-1).indices
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
    return RouterOutput(idx, gates, aux, counts)


class Router(nn.Module):
    """The replicated router of an MoE layer: ``weight`` [E, H] (trained), ``bias`` [E] (sigmoid only).

    ``logit_offset`` [E] is a non-persistent buffer of zeros; benchmarks set it to skew the routing.
    """

    def __init__(self, config: MoEConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        dtype = dtype or config.dtype
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden, device=device, dtype=dtype))
        if config.router == "sigmoid":
            self.register_buffer("bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32))
        else:
            self.bias = None
        self.register_buffer(
            "logit_offset", torch.zeros(config.num_experts, device=device, dtype=torch.float32), persistent=False
        )
        self._offset_set = False
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # Same values on every rank for the same generator state: drawn on the CPU, then copied.
        std = self.config.hidden ** -0.5
        w = torch.randn(self.weight.shape, generator=generator, dtype=torch.float32) * std
        with torch.no_grad():
            self.weight.copy_(w)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        offset = self.logit_offset if self._offset_set else None
        return route(x, self.weight, self.config, self.bias, offset)

    def set_logit_offset(self, offset: torch.Tensor | None) -> None:
        """Add ``offset`` [E] to every logit from now on (None: remove it)."""
        if offset is None:
            self.logit_offset.zero_()
            self._offset_set = False
            return
        if offset.shape != (self.config.num_experts,):
            raise ValueError(f"logit offset must have shape [{self.config.num_experts}], got {tuple(offset.shape)}")
        self.logit_offset.copy_(offset)
        self._offset_set = True
