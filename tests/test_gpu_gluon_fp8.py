"""The EXPERIMENTAL Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8.py) on an H100/H200: against the float64
reference of the dequantised operands and against the Triton FP8 kernel; padding rows never written."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


CASES = [([0, 1, 127, 129, 2000, 0, 513, 64], 1040, 256),  # empty, 1-row, ragged groups; K not a multiple of 128
         ([3000], 2048, 384),                              # one group holding every row
         ([300, 77], 128, 128), ([300, 77], 256, 128),     # fewer k-steps than stages (the prologue's guard)
         ([300, 77], 512, 128), ([300, 77], 640, 256)]     # k-steps = stages; odd k-steps (the last one alone)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
@pytest.mark.parametrize("sizes,K,N", CASES)
@pytest.mark.parametrize("block_m,stages,warps", [(128, 4, 8), (128, 3, 8), (64, 4, 8), (64, 2, 4)])
@pytest.mark.parametrize("num_sms", [None, 3])  # 3 programs: many tiles each, the ring's stages and phases carry over
@pytest.mark.parametrize("with_scale", [False, True])
def test_gluon_fp8_matches_reference(sizes, K, N, block_m, stages, warps, num_sms, with_scale):
    import megamoe.experts as X
    from megamoe.kernels.gluon_fp8 import grouped_gemm_fp8_gluon

    gen = torch.Generator(device="cuda").manual_seed(0)
    E_l, used = len(sizes), sum(sizes)
    R = used + 9  # padding rows after the last group
    offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = torch.randn(R, K, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(E_l, N, K, device="cuda", generator=gen) / K**0.5).to(torch.bfloat16)
    aq, a_s = X.quantize_act(x)
    wq, w_s = X.quantize_weight(w)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = torch.full((R, N), 7.0, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_fp8_gluon(aq, a_s, wq, w_s, offs, scale=s, out=out, block_m=block_m, stages=stages,
                           num_warps=warps, num_sms=num_sms)
    ref = X.grouped_gemm_fp8_ref(aq, a_s, wq, w_s, offs, scale=s.double() if s is not None else None)
    tri = X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, scale=s)
    torch.cuda.synchronize()
    got = out[:used].double()
    rel = float((got - ref[:used]).norm() / ref[:used].norm())
    assert rel < 1e-2, f"vs float64 of the dequantised operands: {rel:.2e}"  # bf16 output, fp8 wgmma sums
    rel_tri = float((got - tri[:used].double()).norm() / tri[:used].double().norm())
    assert rel_tri < 5e-3, f"vs the Triton FP8 kernel: {rel_tri:.2e}"
    assert bool((out[used:] == 7.0).all()), "padding rows were written"
    bounds = offs.tolist()
    for e in range(E_l):  # per expert too: one wrong small group would vanish in the global norm
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            err = float((got[lo:hi] - ref[lo:hi]).norm() / ref[lo:hi].norm().clamp_min(1e-30))
            assert err < 1e-2, f"expert {e} (rows {lo}:{hi}): {err:.2e}"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
def test_gluon_fp8_validates_shapes():
    import megamoe.experts as X
    from megamoe.kernels.gluon_fp8 import grouped_gemm_fp8_gluon

    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(2, 200, 256, device="cuda").to(torch.bfloat16)  # N = 200: not a multiple of 128
    aq, a_s = X.quantize_act(x)
    wq, w_s = X.quantize_weight(w)
    offs = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="multiple of 128"):
        grouped_gemm_fp8_gluon(aq, a_s, wq, w_s, offs)
    wq2, w_s2 = X.quantize_weight(torch.randn(2, 256, 256, device="cuda").to(torch.bfloat16))
    with pytest.raises(ValueError, match="block_m, num_warps"):
        grouped_gemm_fp8_gluon(aq, a_s, wq2, w_s2, offs, block_m=128, num_warps=4)
    with pytest.raises(ValueError, match="scale"):
        grouped_gemm_fp8_gluon(aq, a_s, wq2, w_s2, offs, scale=torch.ones(3, device="cuda"))
