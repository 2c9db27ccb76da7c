"""Backend ``torch`` on 1-4 GPUs (NCCL) against the float64 reference: the CPU edge cases plus full-width shapes."""

from __future__ import annotations

import pytest
import torch
from test_torch_backend import check_results

from megamoe.dist import gpu_ranks_possible, spawn
from megamoe.testing import gpu_cases, layer_case, rank_device, standard_cases

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rank_cases(rank: int, world: int, backend: str) -> list[dict]:
    device = rank_device()
    return [layer_case(c, backend, device) for c in standard_cases(world) + gpu_cases(world)]


@pytest.mark.skipif(NGPU == 0, reason="needs CUDA GPUs")
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_torch_backend_on_gpus(world):
    if not gpu_ranks_possible(world):
        pytest.skip(f"needs {world} GPUs (or MEGAMOE_SHARE_GPUS=1), {NGPU} visible")
    check_results(spawn(_rank_cases, world, "torch", device="cuda", timeout_s=900), world)


@pytest.mark.skipif(NGPU == 0, reason="needs CUDA GPUs")
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_router_tensor_core_logits_are_float32(router):
    # bf16 input and weight on CUDA: the logits come from a bf16 GEMM with float32 output; routing and gates must
    # match the float32 GEMM of the upcast operands, also inside a bf16 autocast region (the router switches it
    # off), and the gradients must match float64 within the bf16 tolerance
    import dataclasses

    from megamoe.config import preset
    from megamoe.router import route

    dev = torch.device("cuda", 0)
    cfg = dataclasses.replace(preset("qwen3-30b-a3b"), router=router)
    gen = torch.Generator(device=dev).manual_seed(0)
    T, H, E = 4096, cfg.hidden, cfg.num_experts
    x = torch.randn(T, H, device=dev, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(E, H, device=dev, generator=gen) * H ** -0.5).bfloat16().requires_grad_()
    bias = torch.randn(E, device=dev, generator=gen) * 0.1 if router == "sigmoid" else None
    r = route(x, w, cfg, bias)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ra = route(x, w, cfg, bias)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    r64 = route(x64, w64, cfg, None if bias is None else bias.double())
    assert r.topk_w.dtype == ra.topk_w.dtype == torch.float32
    assert torch.equal(r.topk_idx, ra.topk_idx) and torch.equal(r.topk_w, ra.topk_w)
    # near-ties may pick another expert: nearly every (token, slot) agrees with float64, and the gates agree
    assert (r.topk_idx == r64.topk_idx).float().mean() > 0.999
    same = (r.topk_idx == r64.topk_idx).all(-1)
    rel = ((r.topk_w - r64.topk_w)[same].norm() / r64.topk_w[same].norm()).item()
    assert rel < 1e-5, rel
    g = torch.randn(T, cfg.top_k, device=dev, generator=gen, dtype=torch.float64)
    dx, dw = torch.autograd.grad((r.topk_w.double() * g)[same].sum(), (x, w))
    dx64, dw64 = torch.autograd.grad((r64.topk_w * g)[same].sum(), (x64, w64))
    for mine, ref in ((dx, dx64), (dw, dw64)):
        assert mine.dtype == torch.bfloat16
        err = ((mine.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
