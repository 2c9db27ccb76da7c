"""The Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8.py) on an H100/H200, every epilogue (plain with and without
the row scale, SwiGLU with and without h, SwiGLU backward with and without the gate scale and its row sums): against
the float64 twins of megamoe.experts on the dequantised operands (per expert too) and against the Triton FP8 kernel
(the same fp32 sums: only bf16 rounding flips differ); padding rows of the inputs hold NaN and outputs are poisoned,
so a read of padding or a missed/extra write fails. Also: the public FP8 ops of megamoe.experts run the Gluon kernel
on Hopper by default and the forced Triton kernel gives the same numbers; shapes Gluon cannot take fall back."""

from __future__ import annotations

import pytest
import torch
from gemm_cases import fp8_problem
from gemm_cases import per_expert as _per_expert
from gemm_cases import problem as _problem
from gemm_cases import rel as _rel

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


# ------------------------------------------------------------------------------------- SwiGLU and its backward
SENTINEL = 4352.0  # poison for outputs: finite, so unwritten-but-required and written-but-forbidden both show
TRITON_TOL = 3e-4  # bf16 outputs vs the Triton FP8 kernel: the fp32 sums agree to ~1e-7, so only rounding flips

# edges: an empty group, 1-row, 127- and 129-row groups (around the 128-row block); one group holding every row;
# K = 1040: 9 k-steps (odd: the last one alone) with a partial last block; K = 256: 2 k-steps, fewer than the stages.
# K / 128 is never a multiple of 16 and R never one of 16, so every case shares one specialisation per config.
EPI_CASES = [([0, 1, 127, 129, 2000, 0, 513, 64], 1040, 256),
             ([3000], 1920, 384),
             ([300, 77], 256, 128)]


def _gluon_cfg(block_m, block_n, stages, warps, num_sms):
    from megamoe.kernels.gemm_config import GemmConfig

    return GemmConfig(block_m=block_m, block_n=block_n, block_k=128, num_stages=stages, num_warps=warps,
                      num_sms=num_sms, kernel="gluon")


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
@pytest.mark.parametrize("sizes,K,I", EPI_CASES)
@pytest.mark.parametrize("cfg", [(128, 64, 4, 8, None),   # the default: 128 x (64 gate + 64 up), 4 stages
                                 (128, 64, 4, 8, 3),      # 3 programs: many tiles each, the ring carries over
                                 (64, 64, 3, 4, None)],   # 64-row tiles on one warpgroup
                         ids=["bm128", "bm128-3progs", "bm64w4"])
@pytest.mark.parametrize("store_h", [True, False])
def test_gluon_swiglu(sizes, K, I, cfg, store_h):
    import megamoe.experts as X

    E_l, used, R, offs, _, xq, x_s, w13q, w13_s = fp8_problem(sizes, K, 2 * I, seed=1)  # padding rows NaN
    act = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    h = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16) if store_h else None
    got_act, got_h = X.gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, store_h=store_h, out=act, h_out=h,
                                        config=_gluon_cfg(*cfg))
    assert got_act is act and got_h is h
    tri_act, tri_h = X.gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, store_h=store_h,
                                        config=X.default_config("gemm1_swiglu_fp8", R, I, K, kernel="triton"))
    ref_act, ref_h = X.gemm1_swiglu_fp8_ref(xq, x_s, w13q, w13_s, offs)
    torch.cuda.synchronize()
    assert bool((act[used:] == SENTINEL).all()), "padding rows of act were written"
    err = _rel(act[:used], ref_act[:used])
    assert err < 1e-2, f"act vs float64 of the dequantised operands: {err:.2e}"  # bf16 output, fp8 wgmma sums
    _per_expert(act, ref_act, offs, 1e-2, "act")
    err = _rel(act[:used], tri_act[:used])
    assert err < TRITON_TOL, f"act vs the Triton FP8 kernel: {err:.2e}"
    if store_h:
        assert bool((h[used:] == SENTINEL).all()), "padding rows of h were written"
        assert _rel(h[:used], ref_h[:used]) < 1e-2
        _per_expert(h, ref_h, offs, 1e-2, "h")
        err = _rel(h[:used], tri_h[:used])
        assert err < TRITON_TOL, f"h vs the Triton FP8 kernel: {err:.2e}"
    else:
        assert got_h is None and tri_h is None


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
@pytest.mark.parametrize("sizes,K,I", EPI_CASES)
@pytest.mark.parametrize("cfg", [(128, 128, 4, 8, None),  # the default: four 32-column slices in the epilogue
                                 (128, 128, 4, 8, 3),     # 3 programs: the ring and the staging buffer reused
                                 (64, 128, 4, 8, None),   # two warps along N: the tile in one slice
                                 (64, 64, 3, 4, None)],   # one warpgroup, 64 columns: two slices
                         ids=["bm128", "bm128-3progs", "bm64", "bm64w4"])
@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("with_acts", [True, False])  # also the gated activation (the FP8 split backward's dW2 operand)
def test_gluon_dswiglu(sizes, K, I, cfg, with_scale, with_acts):
    import megamoe.experts as X

    gen = torch.Generator(device="cuda").manual_seed(2)
    E_l, used, R, offs = _problem(sizes)
    H = K  # dgrad of GEMM2: dact [R, I] = dy [R, H] @ w2[e] [H, I]
    dy = torch.randn(R, H, device="cuda", generator=gen).to(torch.bfloat16)
    dy[used:] = float("nan")
    w2 = (torch.randn(E_l, H, I, device="cuda", generator=gen) / I**0.5).to(torch.bfloat16)
    h = torch.randn(R, 2 * I, device="cuda", generator=gen).to(torch.bfloat16)
    h[used:] = float("nan")
    dyq, dy_s = X.quantize_act(dy)
    w2tq, w2t_s = X.quantize_weight(w2.transpose(1, 2))
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    dh = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    acts = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16) if with_acts else None
    tri_acts = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16) if with_acts else None
    got, ds = X.gemm2_dgrad_swiglu_fp8(dyq, dy_s, w2tq, w2t_s, h, offs, scale=s, out=dh, config=_gluon_cfg(*cfg),
                                       acts_out=acts)
    assert got is dh
    tri, tri_ds = X.gemm2_dgrad_swiglu_fp8(dyq, dy_s, w2tq, w2t_s, h, offs, scale=s,
                                           config=X.default_config("dgrad_swiglu_fp8", R, I, H, kernel="triton"),
                                           acts_out=tri_acts)
    ref, ref_ds = X.gemm2_dgrad_swiglu_fp8_ref(dyq, dy_s, w2tq, w2t_s, h, offs, scale=s)
    torch.cuda.synchronize()
    assert bool((dh[used:] == SENTINEL).all()), "padding rows of dh were written"
    err = _rel(dh[:used], ref[:used])
    assert err < 1e-2, f"dh vs float64 of the dequantised operands: {err:.2e}"
    _per_expert(dh, ref, offs, 1e-2, "dh")
    err = _rel(dh[:used], tri[:used])
    assert err < TRITON_TOL, f"dh vs the Triton FP8 kernel: {err:.2e}"
    if with_acts:
        assert bool((acts[used:] == SENTINEL).all()), "padding rows of acts were written"
        g, u = h[:used, :I].double(), h[:used, I:].double()
        ref_acts = g * torch.sigmoid(g) * u * (s[:used, None].double() if with_scale else 1.0)
        err = _rel(acts[:used], ref_acts)
        assert err < 1e-2, f"acts vs float64: {err:.2e}"
        err = _rel(acts[:used], tri_acts[:used])
        assert err < TRITON_TOL, f"acts vs the Triton FP8 kernel: {err:.2e}"  # the same fp32 math: rounding flips
    if with_scale:
        assert ds.dtype == torch.float32 and ds.shape == (R,)
        assert bool((ds[used:] == 0).all()), "gate-gradient rows of padding are not 0"
        # fp32 row sums of the same products (partials over 32-column slices here, over 64-column tiles there)
        err = _rel(ds[:used], tri_ds[:used])
        assert err < 1e-5, f"ds vs the Triton FP8 kernel: {err:.2e}"
        err = _rel(ds[:used], ref_ds[:used])
        assert err < 5e-3, f"ds vs float64: {err:.2e}"  # fp8 wgmma accumulation within each 128-K step
        # (no per-expert check of ds: a 1-row group's sum can cancel to near 0, its relative error is noise)
    else:
        assert ds is None and tri_ds is None


# ------------------------------------------------------------------------------------- kernel choice
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
def test_public_fp8_ops_run_gluon_on_hopper():
    # every FP8 op of megamoe.experts, default config: a Gluon kernel runs (the Triton one does not), twice
    # bitwise equal, and the forced Triton kernel gives the same numbers; a pinned config forces the kernel too
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import LAST_COMPILED, GemmConfig

    gen = torch.Generator(device="cuda").manual_seed(3)
    E_l, used, R, offs = _problem([0, 1, 127, 129, 700])
    H, I = 1024, 384  # multiples of 128: every op within the Gluon kernel's limits
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    x, dy = bf(torch.randn(R, H, device="cuda", generator=gen)), bf(torch.randn(R, H, device="cuda", generator=gen))
    w13 = bf(torch.randn(E_l, 2 * I, H, device="cuda", generator=gen) / H**0.5)
    w2 = bf(torch.randn(E_l, H, I, device="cuda", generator=gen) / I**0.5)
    act = bf(torch.randn(R, I, device="cuda", generator=gen))
    h = bf(torch.randn(R, 2 * I, device="cuda", generator=gen))
    s = torch.rand(R, device="cuda", generator=gen) + 0.5
    xq, xs = X.quantize_act(x)
    aq, as_ = X.quantize_act(act)
    dyq, dys = X.quantize_act(dy)
    dhq, dhs = X.quantize_act(h)
    w13q, w13s = X.quantize_weight(w13)
    w2q, w2s = X.quantize_weight(w2)
    w2tq, w2ts = X.quantize_weight(w2.transpose(1, 2))
    w13tq, w13ts = X.quantize_weight(w13.transpose(1, 2))
    ops = {  # op (config name): (call with a config, (rows, n, k) of its default_config)
        "gemm1_swiglu_fp8": (lambda c: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=c), (R, I, H)),
        "gemm2_fp8": (lambda c: (X.gemm2_fp8(aq, as_, w2q, w2s, offs, scale=s, config=c),), (R, H, I)),
        "dgrad_swiglu_fp8": (lambda c: X.gemm2_dgrad_swiglu_fp8(dyq, dys, w2tq, w2ts, h, offs, scale=s, config=c),
                             (R, I, H)),
        "dgrad1_fp8": (lambda c: (X.gemm1_dgrad_fp8(dhq, dhs, w13tq, w13ts, offs, config=c),), (R, H, 2 * I)),
        "grouped_gemm_fp8": (lambda c: (X.grouped_gemm_fp8(aq, as_, w2q, w2s, offs, config=c),), (R, H, I)),
    }
    names = ("_gluon_fp8_ws_kernel", "_gluon_fp8_grouped_kernel", "_grouped_gemm_fp8_kernel")
    # the default kernel per op: the warp-specialised one where it has the epilogue, else the single-stream one
    default = {op: "_gluon_fp8_grouped_kernel" if op == "dgrad_swiglu_fp8" else "_gluon_fp8_ws_kernel" for op in ops}

    def ran(fn, cfg):
        for n in names:
            LAST_COMPILED.pop(n, None)
        outs = fn(cfg)
        torch.cuda.synchronize()
        return outs, [n for n in names if n in LAST_COMPILED]

    for op, (fn, (rows, n, k)) in ops.items():
        got, kernels = ran(fn, None)
        assert kernels == [default[op]], f"{op}: default config ran {kernels}"
        again, _ = ran(fn, None)
        tri, kernels = ran(fn, X.default_config(op, rows, n, k, kernel="triton"))
        assert kernels == ["_grouped_gemm_fp8_kernel"], f"{op}: kernel='triton' ran {kernels}"
        for g, a, t in zip(got, again, tri, strict=True):
            assert torch.equal(g[:used], a[:used]), f"{op}: two runs differ"
            tol = 1e-5 if g.dtype == torch.float32 else TRITON_TOL  # ds: fp32 sums
            err = _rel(g[:used], t[:used])
            assert err < tol, f"{op}: Gluon vs Triton {err:.2e}"
        with X.pin_config(op, X.default_config(op, rows, n, k, kernel="triton")):
            _, kernels = ran(fn, None)
        assert kernels == ["_grouped_gemm_fp8_kernel"], f"{op}: pinned kernel='triton' ran {kernels}"
        with X.pin_config(op, GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=3, num_warps=4)):
            _, kernels = ran(fn, None)  # a pinned config without a kernel: Gluon, with that config's tiles (64-row
        assert kernels == ["_gluon_fp8_grouped_kernel"], f"{op}: pinned kernel=None ran {kernels}"  # : not ws)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")
def test_fp8_ops_fall_back_to_triton_outside_gluon_limits():
    # I = 200: not a multiple of the 64-column gate/up tiles. Default: the Triton kernel, silently (same numbers);
    # kernel='gluon' forced: ValueError naming the limit
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import LAST_COMPILED, GemmConfig
    from megamoe.kernels.grouped_gemm import EPI_SWIGLU
    from megamoe.kernels.grouped_gemm_fp8 import fp8_kernel

    gen = torch.Generator(device="cuda").manual_seed(4)
    E_l, used, R, offs = _problem([5, 300])
    H, I = 256, 200
    x = torch.randn(R, H, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E_l, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(torch.bfloat16)
    xq, xs = X.quantize_act(x)
    w13q, w13s = X.quantize_weight(w13)
    for name in ("_gluon_fp8_grouped_kernel", "_gluon_fp8_ws_kernel"):
        LAST_COMPILED.pop(name, None)
    act, _ = X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs)
    assert "_gluon_fp8_grouped_kernel" not in LAST_COMPILED and "_gluon_fp8_ws_kernel" not in LAST_COMPILED
    ref, _ = X.gemm1_swiglu_fp8_ref(xq, xs, w13q, w13s, offs)
    assert _rel(act[:used], ref[:used]) < 1e-2
    cfg = GemmConfig(block_m=128, block_n=64, block_k=128, num_stages=4, num_warps=8, kernel="gluon")
    with pytest.raises(ValueError, match="kernel='gluon'.*multiple of 64"):
        X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=cfg)
    assert fp8_kernel(cfg.with_(kernel=None), xq, w13q, n=I, epilogue=EPI_SWIGLU, n_up=I) == "triton"
