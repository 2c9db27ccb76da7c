"""The router's Triton implementation (megamoe/kernels/router_topk.py) against its torch-ops path: choices, gates,
tokens per expert, the aux loss and the gradients of x and the router weight; softmax and sigmoid (+ bias),
k = 1, E not a power of two, token counts leaving partial blocks, no normalisation, route_scale, aux off.
On CPU the kernels run under the interpreter; ``-m gpu`` runs the same cases on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megamoe.config import preset  # noqa: E402
from megamoe.router import route  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="the interpreter case; -m gpu covers CUDA")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]

# (router, E, k, T, norm_topk, route_scale, aux_loss_coef, bias, n_group, topk_group)
CASES = [
    ("softmax", 128, 8, 70, True, 1.0, 1e-2, False, 1, 1),   # qwen3's routing; 70 tokens: a partial last block
    ("sigmoid", 256, 8, 37, True, 2.5, 1e-2, True, 1, 1),    # deepseek-v3's, with the selection bias
    ("sigmoid", 256, 8, 37, True, 2.5, 1e-2, True, 8, 4),    # and its group-limited routing
    ("softmax", 24, 4, 29, True, 1.0, 1e-2, False, 3, 2),    # groups: 3 (not a power of two) of 8 experts
    ("softmax", 12, 1, 33, True, 1.0, 1e-2, False, 1, 1),    # k = 1, E not a power of two
    ("softmax", 8, 2, 5, False, 1.0, 0.0, False, 1, 1),      # no normalisation, aux loss off
    ("sigmoid", 20, 3, 50, False, 1.5, 0.1, False, 1, 1),    # sigmoid without bias or normalisation
]


def _inputs(E, T, H, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(E, H, generator=g) * H ** -0.5
    b = torch.randn(E, generator=g) * 0.3
    dg = torch.randn(T, 1, generator=g)
    return x.to(device), w.to(device), b.to(device), dg.to(device)


def _run(cfg, x, w, bias, impl, dg_seed=1):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    r = route(x, w, cfg, bias, impl=impl)
    g = torch.Generator().manual_seed(dg_seed)
    dgates = torch.randn(r.topk_w.shape, generator=g).to(x.device)
    ((r.topk_w * dgates).sum() + 3.0 * r.aux_loss).backward()
    return r, x.grad, w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-E{c[1]}-k{c[2]}-T{c[3]}-G{c[8]}")
def test_triton_router_matches_torch(device, case):
    router, E, k, T, norm, scale, coef, use_bias, n_group, topk_group = case
    H = 64
    cfg = preset("tiny", dtype=torch.float32).replace(
        num_experts=E, top_k=k, router=router, norm_topk=norm, route_scale=scale, aux_loss_coef=coef, n_group=n_group,
        topk_group=topk_group)
    x, w, b, _ = _inputs(E, T, H, device)
    bias = b if use_bias else None
    rt, dxt, dwt = _run(cfg, x, w, bias, "torch")
    rk, dxk, dwk = _run(cfg, x, w, bias, "triton")
    assert rk.topk_idx.dtype == torch.int64 and rk.tokens_per_expert.dtype == torch.int64
    assert torch.equal(rk.topk_idx, rt.topk_idx)  # same choices, in the same (descending) order
    assert torch.equal(rk.tokens_per_expert, rt.tokens_per_expert)
    torch.testing.assert_close(rk.topk_w, rt.topk_w, rtol=2e-6, atol=1e-7)
    assert rk.aux_loss.shape == () and rk.aux_loss.dtype == torch.float32
    torch.testing.assert_close(rk.aux_loss, rt.aux_loss, rtol=1e-5, atol=1e-9)
    if coef == 0:
        assert rk.aux_loss.item() == 0.0
    torch.testing.assert_close(dxk, dxt, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dwk, dwt, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_router_reproducible_and_ties(device):
    cfg = preset("tiny", dtype=torch.float32).replace(num_experts=12, top_k=3)
    x, w, _, _ = _inputs(12, 40, 64, device)
    a = _run(cfg, x, w, None, "triton")
    b = _run(cfg, x, w, None, "triton")
    assert torch.equal(a[0].topk_w, b[0].topk_w) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert torch.equal(a[0].aux_loss, b[0].aux_loss)
    # all logits equal: the lowest expert ids win, gates 1/k; one token's gradient only from the aux loss
    r = route(x, torch.zeros_like(w), cfg, impl="triton")
    assert torch.equal(r.topk_idx.cpu(), torch.arange(3).expand(40, 3))
    torch.testing.assert_close(r.topk_w, torch.full_like(r.topk_w, 1 / 3))
    assert r.tokens_per_expert.tolist() == [40, 40, 40] + [0] * 9


@pytest.mark.parametrize("device", DEVICES)
def test_triton_router_pinned_tiles_agree(device):
    """The sweep's pins (benchmarks/router_bench.py): other forward / backward tiles give the same routing and
    gradients (the forward bitwise; the backward computes each token alone, so bitwise too)."""
    from megamoe.kernels import router_topk

    cfg = preset("tiny", dtype=torch.float32).replace(num_experts=20, top_k=3, router="sigmoid")
    x, w, b, _ = _inputs(20, 37, 64, device)
    base = _run(cfg, x, w, b, "triton")
    try:
        router_topk.PIN, router_topk.PIN_BWD = (2, 4, 4), (8, 8)
        pinned = _run(cfg, x, w, b, "triton")
    finally:
        router_topk.PIN = router_topk.PIN_BWD = None
    assert torch.equal(base[0].topk_idx, pinned[0].topk_idx) and torch.equal(base[0].topk_w, pinned[0].topk_w)
    assert torch.equal(base[1], pinned[1]) and torch.equal(base[2], pinned[2])


def test_router_impl_choice_and_errors():
    cfg = preset("tiny", dtype=torch.float32)
    x, w, _, _ = _inputs(cfg.num_experts, 6, cfg.hidden, "cpu")
    with pytest.raises(ValueError, match="impl"):
        route(x, w, cfg, impl="cuda")
    with pytest.raises(ValueError, match="float64"):
        route(x.double(), w.double(), cfg.replace(dtype=torch.float64), impl="triton")
    # no tokens: the torch path's exact zero loss, whatever the impl
    r0 = route(x[:0], w, cfg, impl="triton")
    assert r0.aux_loss.item() == 0.0 and r0.topk_idx.shape == (0, cfg.top_k)
