"""The unsharded MoE layer in plain PyTorch: what every backend is checked against.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.

    route:   (topk_idx [T, k], topk_w [T, k]) = router(x)                       (megamoe.router.route)
    expert:  h = x_t @ w13[e]^T  ([2I]);  a = silu(h[:I]) * h[I:];  o = a @ w2[e]^T  ([H])
    combine: y[t] = sum_j topk_w[t, j] * o_{t, j}      (j = 0..k-1 in order, accumulated in >= float32)

Runs in any dtype, float64 included, forward and backward through autograd. ``experts_ref`` evaluates a
subset of the experts (those numbered ``expert_offset .. expert_offset + E_sub - 1``), so a rank can compute
its experts' share of the reference output for the global batch without holding every expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.config import MoEConfig
from megamoe.router import RouterOutput, compute_dtype, route


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2I] -> silu(h[..., :I]) * h[..., I:]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: x [n, H], w13 [2I, H], w2 [H, I] -> [n, H]."""
    return swiglu(x @ w13.t()) @ w2.t()


def experts_ref(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """sum_j topk_w[t, j] * expert_{idx[t, j]}(x_t), over the experts held in ``w13``/``w2`` only.

    x [T, H]; topk_idx [T, k] global expert ids; topk_w [T, k]; w13 [E_sub, 2I, H]; w2 [E_sub, H, I] holding
    experts ``expert_offset .. expert_offset + E_sub - 1``. Slots routed elsewhere contribute nothing.
    Returns y [T, H] in x's dtype, accumulated in ``compute_dtype(x.dtype)``. Weights of another dtype are cast to
    x's one expert at a time (a float64 check of a deepseek-v3-sized layer needs no float64 copy of all weights).
    """
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
        out = expert_mlp(x[tok], w13[e_local].to(x.dtype), w2[e_local].to(x.dtype))
        y = y.index_add(0, tok, out.to(cdt) * gate[:, None])
    return y.to(x.dtype)


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
    router_bias: torch.Tensor | None = None,
    logit_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RouterOutput]:
    """The whole layer on one process: x [T, H], router_weight [E, H], w13 [E, 2I, H], w2 [E, H, I].

    Returns (y [T, H], RouterOutput). Differentiable w.r.t. x, router_weight, w13 and w2.

    Note: ``experts_ref`` sums each token's k outputs in expert order, not slot order; the result equals
    the slot-ordered sum up to rounding, which is what the reference is for (float64 makes it exact enough).
    """
    if w13.shape[0] != config.num_experts:
        raise ValueError(f"reference needs all {config.num_experts} experts, got w13 with {w13.shape[0]}")
    r = route(x, router_weight, config, router_bias, logit_offset)
    y = experts_ref(x, r.topk_idx, r.topk_w, w13, w2)
    return y, r


def moe_forward_loop(
    x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, config: MoEConfig,
    router_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """An explicit per-token, per-slot loop (slow; tests check :func:`moe_forward` against it)."""
    r = route(x, router_weight, config, router_bias)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=compute_dtype(x.dtype), device=x.device)
        for j in range(config.top_k):
            e = int(r.topk_idx[t, j])
            h = w13[e] @ x[t]
            a = F.silu(h[: config.intermediate]) * h[config.intermediate:]
            acc = acc + r.topk_w[t, j] * (w2[e] @ a)
        rows.append(acc.to(x.dtype))
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
