"""The warp-specialised Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8_ws.py: a TMA loader warp and two 64-row
consumer warpgroups), plain and SwiGLU, on an H100/H200: against the float64 twin on the dequantised operands
(globally and per expert) and against the Triton FP8 kernel (plain) or the single-stream Gluon kernel (SwiGLU):
the same fp32 sums, only bf16 rounding flips may differ; padding rows of the inputs hold NaN and outputs are
poisoned, so a read of padding or a missed / extra write fails. Edge groups (empty, 1, 127, 129 rows, one group
with every row), K not a multiple of 128, N not a multiple of 128 or smaller than the tile, fewer k-steps than
stages, 3 programs (many tiles each: the ring's stages and phases carry across tiles), an output TMA cannot store
(the epilogue's masked path everywhere; elsewhere TMA stores, masked only for half tiles crossing an expert's end)."""

from __future__ import annotations

import pytest
import torch
from gemm_cases import fp8_problem, per_expert, rel

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SENTINEL = 4352.0

CASES = [([0, 1, 127, 129, 2000, 0, 513, 64], 1040, 256),  # empty, 1-row, ragged groups; K not a multiple of 128
         ([3000], 2048, 384),                              # one group holding every row
         ([300, 0, 77], 512, 320),                         # N not a multiple of 128 (gpt-oss: 2880): clipped tiles
         ([300, 77], 256, 128),                            # fewer k-steps than stages
         ([300, 77], 640, 256),                            # k-steps = stages
         ([300, 0, 77], 512, 260)]                         # out rows not 16-byte aligned: masked stores only


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
@pytest.mark.parametrize("sizes,K,N", CASES)
@pytest.mark.parametrize("block_n,stages", [(128, 4), (128, 2), (64, 6), (256, 4), (256, 2)])
@pytest.mark.parametrize("num_sms", [None, 3])
@pytest.mark.parametrize("with_scale", [False, True])
def test_ws_matches_reference(sizes, K, N, block_n, stages, num_sms, with_scale):
    import megamoe.experts as X
    from megamoe.kernels.gluon_fp8_ws import grouped_gemm_fp8_ws

    E_l, used, R, offs, gen, aq, a_s, wq, w_s = fp8_problem(sizes, K, N, seed=0)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = torch.full((R, N), SENTINEL, device="cuda", dtype=torch.bfloat16)
    grouped_gemm_fp8_ws(aq, a_s, wq, w_s, offs, scale=s, out=out, block_n=block_n, stages=stages, num_sms=num_sms)
    ref = X.grouped_gemm_fp8_ref(aq[:used], a_s[:used], wq, w_s, offs,
                                 scale=s[:used].double() if s is not None else None)
    # the Triton FP8 kernel: the same fp32 sums (the single-stream Gluon kernel cannot take N % 128 != 0)
    tri = X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, scale=s,
                             config=X.default_config("grouped_gemm_fp8", R, N, K, kernel="triton"))
    torch.cuda.synchronize()
    assert bool((out[used:] == SENTINEL).all()), "padding rows were written"
    got = out[:used]
    assert rel(got, ref) < 1e-2
    per_expert(got, ref, offs, 1e-2, "vs float64")
    assert rel(got, tri[:used]) < 3e-4, "vs the Triton FP8 kernel"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
def test_ws_validates():
    import megamoe.experts as X
    from megamoe.kernels.gluon_fp8_ws import grouped_gemm_fp8_ws

    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    aq, a_s = X.quantize_act(x)
    wq, w_s = X.quantize_weight(torch.randn(2, 200, 256, device="cuda").to(torch.bfloat16))
    offs = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="block_n must be one of"):
        grouped_gemm_fp8_ws(aq, a_s, wq, w_s, offs, block_n=96)
    wq2, w_s2 = X.quantize_weight(torch.randn(2, 256, 256, device="cuda").to(torch.bfloat16))
    with pytest.raises(ValueError, match="num_stages"):
        grouped_gemm_fp8_ws(aq, a_s, wq2, w_s2, offs, stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        grouped_gemm_fp8_ws(aq, a_s, wq2, w_s2, offs, stages=8)


EPI_CASES = [([0, 1, 127, 129, 2000, 0, 513, 64], 1040, 256),
             ([3000], 1920, 384),
             ([300, 77], 256, 128)]


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
@pytest.mark.parametrize("sizes,K,I", EPI_CASES)
@pytest.mark.parametrize("block_n,stages,num_sms", [(64, 4, None), (64, 6, None), (64, 2, 3), (128, 4, None),
                                                    (128, 2, 3)])
@pytest.mark.parametrize("store_h", [True, False])
def test_ws_swiglu(sizes, K, I, block_n, stages, num_sms, store_h):
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import GemmConfig

    E_l, used, R, offs, _, xq, x_s, w13q, w13_s = fp8_problem(sizes, K, 2 * I, seed=1)
    act = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    h = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16) if store_h else None
    cfg = GemmConfig(block_m=128, block_n=block_n, block_k=128, num_stages=stages, num_warps=4, num_sms=num_sms,
                     kernel="gluon_ws")
    got_act, got_h = X.gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, store_h=store_h, out=act, h_out=h, config=cfg)
    assert got_act is act and got_h is h
    one_act, one_h = X.gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, store_h=store_h,
                                        config=X.default_config("gemm1_swiglu_fp8", R, I, K, kernel="gluon"))
    ref_act, ref_h = X.gemm1_swiglu_fp8_ref(xq, x_s, w13q, w13_s, offs)
    torch.cuda.synchronize()
    assert bool((act[used:] == SENTINEL).all()), "padding rows of act were written"
    assert rel(act[:used], ref_act[:used]) < 1e-2
    per_expert(act, ref_act, offs, 1e-2, "act")
    assert rel(act[:used], one_act[:used]) < 3e-4, "act vs the single-stream Gluon kernel"
    if store_h:
        assert bool((h[used:] == SENTINEL).all()), "padding rows of h were written"
        assert rel(h[:used], ref_h[:used]) < 1e-2
        per_expert(h, ref_h, offs, 1e-2, "h")
        assert rel(h[:used], one_h[:used]) < 3e-4, "h vs the single-stream Gluon kernel"
    else:
        assert got_h is None and one_h is None
