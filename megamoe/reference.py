"""The unsharded MoE layer in plain PyTorch, the reference every backend is checked against.

    route:   (topk_idx [T, k], topk_w [T, k], aux_loss, counts [E]) = route_ref(x, router weight)
    expert:  h = x_t @ w13[e]^T  ([2I]);  a = silu(h[:I]) * h[I:];  o = a @ w2[e]^T  ([H])
             gpt_oss: h = x_t @ w13[e]^T + b13[e];  a = gpt_oss_act(h);  o = a @ w2[e]^T + b2[e]
    combine: y[t] = sum_j topk_w[t, j] * o_{t, j}      (accumulated in >= float32)
    shared:  y[t] += [sigmoid(x_t . w_gate)] * shared_mlp(x_t)   (shared expert, optional gate)

Any dtype, float64 included, differentiable. The routing shares no code with :mod:`megamoe.router`, so a router
bug cannot hide in its own reference. ``experts_ref`` evaluates a subset of the experts, so a rank can check its
share of the global batch. ``store_dtype`` rounds where the kernels store (gated activation, expert output row,
combined row), so a float64 check sees only accumulation-order differences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from megamoe.config import MoEConfig, compute_dtype


class RouteRef(NamedTuple):
    """topk_idx int64 [T, k]; topk_w [T, k]; aux_loss scalar (coefficient included); counts int64 [E]."""

    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    aux_loss: torch.Tensor
    counts: torch.Tensor


def route_ref(x: torch.Tensor, weight: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None = None,
              logit_offset: torch.Tensor | None = None) -> RouteRef:
    """Top-k routing of x [T, H] by weight [E, H] from the definitions in :mod:`megamoe.router` (ties: lower
    expert id first), in float64 for float64 input, else float32."""
    E, k = config.num_experts, config.top_k
    cdt = compute_dtype(x.dtype)
    logits = x.to(cdt) @ weight.to(cdt).t()
    if logit_offset is not None:
        logits = logits + logit_offset.to(cdt)
    T = logits.shape[0]
    if config.router == "softmax":
        z = torch.exp(logits - logits.max(-1, keepdim=True).values)
        probs = z / z.sum(-1, keepdim=True)
        rank_by = density = probs
    else:
        probs = 1.0 / (1.0 + torch.exp(-logits))
        rank_by = probs + (0 if bias is None else bias.to(cdt).detach())
        density = probs / probs.sum(-1, keepdim=True)
    rank_by = rank_by.detach()
    if config.n_group > 1:  # only the experts of the topk_group groups whose two best scores sum highest
        G, per = config.n_group, E // config.n_group
        best2 = torch.sort(rank_by.reshape(T, G, per), dim=-1, descending=True).values[..., :2].sum(-1)
        groups = torch.sort(best2, dim=-1, descending=True, stable=True).indices[:, :config.topk_group]
        allowed = torch.zeros(T, G, dtype=torch.bool, device=x.device)
        allowed[torch.arange(T, device=x.device)[:, None], groups] = True
        allowed = allowed[:, torch.arange(E, device=x.device) // per]
        rank_by = torch.where(allowed, rank_by, torch.full_like(rank_by, -torch.inf))
    order = torch.sort(rank_by, dim=-1, descending=True, stable=True).indices[:, :k]
    gates = torch.gather(probs, 1, order)
    if config.norm_topk:
        gates = gates / gates.sum(-1, keepdim=True)
    gates = gates * config.route_scale
    counts = torch.bincount(order.reshape(-1), minlength=E)
    if T == 0 or config.aux_loss_coef == 0:
        aux = logits.sum() * 0.0
    else:
        aux = config.aux_loss_coef * E * torch.dot(counts.to(cdt) / (T * k), density.mean(0))
    return RouteRef(order, gates, aux, counts)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2I] -> silu(h[..., :I]) * h[..., I:]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gpt_oss_act(h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: h [..., 2I] (gate, then up) -> g * sigmoid(alpha * g) * (u + 1), with
    g = min(h[..., :I], limit) and u = clamp(h[..., I:], -limit, limit)."""
    gate, up = h.chunk(2, dim=-1)
    g = gate.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.clamp(min=-limit, max=limit) + 1)


def expert_act(config: MoEConfig):
    """The routed experts' activation of ``config``: h [..., 2I] -> [..., I]."""
    if config.expert_kind == "gpt_oss":
        return lambda h: gpt_oss_act(h, config.swiglu_alpha, config.swiglu_limit)
    return swiglu


def _stored(t: torch.Tensor, store_dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` rounded to ``store_dtype`` and back (autograd passes through: the rounding is a value, not a function)."""
    if store_dtype is None or store_dtype == t.dtype:
        return t
    return t + (t.detach().to(store_dtype).to(t.dtype) - t.detach())


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               store_dtype: torch.dtype | None = None, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, act=swiglu) -> torch.Tensor:
    """One expert: x [n, H], w13 [2I, H], w2 [H, I], optional biases b13 [2I], b2 [H] -> [n, H]; ``act`` maps
    h [n, 2I] to [n, I] (``store_dtype``: see the module docstring)."""
    h = x @ w13.t()
    a = _stored(act(h if b13 is None else h + b13), store_dtype)
    o = a @ w2.t()
    return _stored(o if b2 is None else o + b2, store_dtype)


def experts_ref(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                expert_offset: int = 0, store_dtype: torch.dtype | None = None, b13: torch.Tensor | None = None,
                b2: torch.Tensor | None = None, act=swiglu) -> torch.Tensor:
    """y [T, H] = sum_j topk_w[t, j] * expert_{idx[t, j]}(x_t) over the experts ``expert_offset ..
    expert_offset + E_sub - 1`` held in w13 [E_sub, 2I, H], w2 [E_sub, H, I] (with biases b13 [E_sub, 2I], b2
    [E_sub, H] and activation ``act`` as :func:`expert_mlp`); other slots contribute nothing.
    x [T, H]; topk_idx [T, k] global ids. y is in x's dtype, accumulated in float64 for float64 x, else float32,
    in expert order. Weights are cast one expert at a time: no float64 copy of a deepseek-v3-sized layer."""
    T, H = x.shape
    cdt = compute_dtype(x.dtype)
    y = torch.zeros(T, H, dtype=cdt, device=x.device)
    for e_local in range(w13.shape[0]):
        e = expert_offset + e_local
        hit = topk_idx == e  # [T, k]; a token picks an expert at most once
        tok = hit.any(dim=1).nonzero().squeeze(1)
        if tok.numel() == 0:
            continue
        gate = (topk_w.to(cdt) * hit.to(cdt)).sum(dim=1)[tok]  # [n]
        bias = {} if b13 is None else {"b13": b13[e_local].to(x.dtype), "b2": b2[e_local].to(x.dtype)}
        out = expert_mlp(x[tok], w13[e_local].to(x.dtype), w2[e_local].to(x.dtype), store_dtype, act=act, **bias)
        y = y.index_add(0, tok, out.to(cdt) * gate[:, None])
    return _stored(y, store_dtype).to(x.dtype)


def shared_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert: x [T, H], w13 [2S, H], w2 [H, S], gate [1, H] or None -> [T, H] in float64 for float64 x,
    else float32 (from operands in x's dtype)."""
    cdt = compute_dtype(x.dtype)
    out = expert_mlp(x, w13.to(x.dtype), w2.to(x.dtype)).to(cdt)
    if gate is not None:
        out = out * torch.sigmoid(x.to(cdt) @ gate.to(cdt).t())
    return out


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, config: MoEConfig,
                router_bias: torch.Tensor | None = None, logit_offset: torch.Tensor | None = None,
                store_dtype: torch.dtype | None = None, shared: tuple | None = None,
                expert_bias: tuple | None = None) -> tuple[torch.Tensor, RouteRef]:
    """The whole layer on one process: x [T, H], router_weight [E, H], w13 [E, 2I, H], w2 [E, H, I] ->
    (y [T, H], RouteRef), differentiable. ``shared``: (w13 [2S, H], w2 [H, S], gate [1, H] or None) of the shared
    expert, whose output is added (:func:`shared_ref`). gpt_oss experts: ``expert_bias`` = (b13 [E, 2I], b2 [E, H]);
    the router's trained logit bias goes in as ``logit_offset`` (differentiable)."""
    if (expert_bias is not None) != (config.expert_kind == "gpt_oss"):
        raise ValueError("reference: give expert_bias=(b13, b2) exactly when config.expert_kind is 'gpt_oss'")
    if w13.shape[0] != config.num_experts:
        raise ValueError(f"reference needs all {config.num_experts} experts, got w13 with {w13.shape[0]}")
    if (shared is not None) != bool(config.shared_intermediate):
        raise ValueError("reference: give shared=(w13, w2, gate) exactly when the config has a shared expert")
    r = route_ref(x, router_weight, config, router_bias, logit_offset)
    b13, b2 = expert_bias or (None, None)
    y = experts_ref(x, r.topk_idx, r.topk_w, w13, w2, store_dtype=store_dtype, b13=b13, b2=b2, act=expert_act(config))
    if shared is not None:
        y = (y.to(compute_dtype(x.dtype)) + shared_ref(x, *shared)).to(x.dtype)
    return y, r
