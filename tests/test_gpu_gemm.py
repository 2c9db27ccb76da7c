"""The Gluon grouped GEMMs of Hopper (megamoe/kernels/gluon/), each forced through GemmConfig(kernel="gluon") on the
public ops of megamoe.experts, on an H100/H200:

    bf16.py         warp-specialised bf16 (a TMA loader warp, two consumer warpgroups on the halves of 128-row tiles):
                    GEMM1 + SwiGLU with and without h, GEMM2 and grouped_gemm (nk weights) with and without the gate
                    scale, the SwiGLU backward (w2 as kn weights) with and without the gate scale and acts
    fp8.py          warp-specialised FP8 (1x128 / 128x128 block scales): the plain op with and without the row
                    scale, GEMM1 + SwiGLU with and without h
    fp8_dswiglu.py  the FP8 SwiGLU backward, with and without the gate scale and acts
    wgrad.py        warp-specialised weight gradient, bf16 and float32 outputs

Each against the float64 twin (whole and per expert: one wrong small group would vanish in the global norm) and
against its Triton twin pinned with kernel="triton" on the same inputs (same BLOCK_K and k order: only the wgmma's
internal order and bf16 rounding flips may differ); each asserts which kernel ran (gemm_config.LAST_COMPILED).
Padding rows of the inputs hold NaN and outputs are poisoned, so a read of padding or a missed / extra write fails.
Edge cases: empty, 1-row, 127 / 129-row groups, one group holding every row, K not a multiple of the k-step, N not a
multiple of the tile (clipped last tile), outputs TMA cannot store (rows not 16-byte aligned: the masked-store
epilogue everywhere), fewer k-steps than stages, 3 persistent programs (many tiles each: the ring's stages and phases
carry across tiles). Also the kernel choice on the GPU: with no config the ops run these kernels where their limits
hold, the Triton kernel (the same numbers) where one fails; GEMM1's dgrad runs the Triton kernel; kernel="gluon"
outside a limit raises naming it. Every Gluon default against its Triton twin at the presets' shapes:
tests/test_gpu_twins.py.

    pytest -q -m gpu tests/test_gpu_gemm.py          (on the H200)
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import (
    bf16_problem,
    dswiglu_problem,
    fp8_problem,
    per_expert,
    problem,
    rel,
    swiglu_references,
    triton_config,
)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma, TMA, warp specialisation)")]

SENTINEL = 4352.0  # poison for outputs: finite, so unwritten-but-required and written-but-forbidden both show
REF_TOL = 1e-2     # bf16 outputs vs float64 twins (fp8: of the dequantised operands)
BF16_TWIN_TOL = 1e-3  # bf16 Gluon vs the Triton bf16 kernel: the same fp32 sums up to the wgmma's internal order
FP8_TWIN_TOL = 3e-4   # FP8 Gluon vs the Triton FP8 kernel: the fp32 sums agree to ~1e-7, so only rounding flips
GROUPS = [[0, 1, 127, 129, 2000, 0, 513, 64],  # empty, 1-row, ragged groups around the 128-row block
          [3000],                              # one group holding every row
          [300, 77]]
#: every grouped-GEMM kernel by the name it records in gemm_config.LAST_COMPILED
KERNELS = ("_gluon_bf16_ws_kernel", "_gluon_fp8_ws_kernel", "_gluon_fp8_dswiglu_kernel", "_gluon_wgrad_ws_kernel",
           "_grouped_gemm_kernel", "_grouped_gemm_fp8_kernel", "_grouped_wgrad_kernel")


def _launched(fn):
    """Run fn(); returns (its result, the grouped-GEMM kernels it launched)."""
    from megamoe.kernels.gemm_config import LAST_COMPILED

    for name in KERNELS:
        LAST_COMPILED.pop(name, None)
    out = fn()
    torch.cuda.synchronize()
    return out, [name for name in KERNELS if name in LAST_COMPILED]


def _poisoned(*shape):
    return torch.full(shape, SENTINEL, device="cuda", dtype=torch.bfloat16)


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def _check(got, ref, tri, offs, used, what, twin_tol=BF16_TWIN_TOL):
    """got vs the float64 twin (whole and per expert) and vs the Triton kernel's output; padding rows untouched."""
    assert bool((got[used:] == SENTINEL).all()), f"{what}: padding rows were written"
    err = rel(got[:used], ref[:used])
    assert err < REF_TOL, f"{what} vs float64: {err:.2e}"
    per_expert(got, ref, offs, REF_TOL, what)
    err = rel(got[:used], tri[:used])
    assert err < twin_tol, f"{what} vs the Triton kernel: {err:.2e}"


# ============================================================================================== bf16 (gluon/bf16.py)
def _bf16_cfg(block_n, stages, num_sms, block_m=128, warps=4):
    from megamoe.kernels.gemm_config import GemmConfig

    return GemmConfig(block_m=block_m, block_n=block_n, block_k=64, num_stages=stages, num_warps=warps,
                      num_sms=num_sms, kernel="gluon")


def _ids(cfgs):
    return [f"bn{c[0]}-s{c[1]}-p{c[2]}" for c in cfgs]


#: (block_n, stages, programs): the default's shape, 2 stages on 3 programs, the deepest ring of 64-column tiles
SWIGLU_CFGS = [(128, 4, None), (64, 2, 3), (64, 6, None), (128, 4, 3)]
PLAIN_CFGS = [(256, 4, None), (128, 2, 3), (128, 6, None), (256, 3, 3)]
DSW_CFGS = [(128, 4, None), (128, 3, 3), (64, 4, None), (64, 2, 3)]


@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", SWIGLU_CFGS, ids=_ids(SWIGLU_CFGS))
# 16 k-steps; a partial k-step and n-tile; one k-step with I % 8 != 0 (h's up half not TMA-able: masked stores only)
@pytest.mark.parametrize("H,I", [(1024, 256), (1000, 192), (64, 100)])
@pytest.mark.parametrize("store_h", [True, False])
def test_bf16_gemm1_swiglu(sizes, cfg, H, I, store_h):
    import megamoe.experts as X

    E_l, used, R, offs, gen, x, w13 = bf16_problem(sizes, H, 2 * I, seed=1)  # x's padding rows NaN
    act = _poisoned(R, I)
    h = _poisoned(R, 2 * I) if store_h else None
    (got_act, got_h), ran = _launched(lambda: X.gemm1_swiglu(x, w13, offs, store_h=store_h, out=act, h_out=h,
                                                             config=_bf16_cfg(*cfg)))
    assert ran == ["_gluon_bf16_ws_kernel"] and got_act is act and got_h is h, ran
    (tri_act, tri_h), (ref_act, ref_h) = swiglu_references(x, w13, offs)
    torch.cuda.synchronize()
    _check(act, ref_act, tri_act, offs, used, "act")
    if store_h:
        _check(h, ref_h, tri_h, offs, used, "h")


@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", PLAIN_CFGS, ids=_ids(PLAIN_CFGS))
# a partial k-step; N % 8 != 0 (rows not 16-byte aligned: masked stores only) and a clipped tile; one k-step, TMA
# stores clipped at N = 200
@pytest.mark.parametrize("K,N", [(1000, 256), (128, 324), (64, 200)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_bf16_gemm2(sizes, cfg, K, N, with_scale):
    import megamoe.experts as X

    E_l, used, R, offs, gen, act, w2 = bf16_problem(sizes, K, N, seed=2)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = _poisoned(R, N)
    _, ran = _launched(lambda: X.gemm2(act, w2, offs, scale=s, out=out, config=_bf16_cfg(*cfg)))
    assert ran == ["_gluon_bf16_ws_kernel"], ran
    tri = X.gemm2(act, w2, offs, scale=s, config=triton_config("gemm2", R, N, K))
    ref = X.gemm2_ref(act.double(), w2.double(), offs, scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, "gemm2")


@pytest.mark.parametrize("with_scale", [True, False])
def test_bf16_grouped_gemm_layouts(with_scale):
    # nk weights: the Gluon kernel (5 programs); kn weights (GEMM1's dgrad): the Triton kernel, by default and as the
    # only choice (kernel="gluon" raises)
    import megamoe.experts as X

    gen = torch.Generator(device="cuda").manual_seed(4)
    E_l, used, R, offs = problem(GROUPS[0])
    K, N = 512, 384
    a = _randn(R, K, gen=gen)
    a[used:] = float("nan")
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    sd = s.double() if s is not None else None
    w = _randn(E_l, N, K, gen=gen, scale=K**-0.5)
    out = _poisoned(R, N)
    _, ran = _launched(lambda: X.grouped_gemm(a, w, offs, w_layout="nk", scale=s, out=out,
                                              config=_bf16_cfg(256, 4, 5)))
    assert ran == ["_gluon_bf16_ws_kernel"], ran
    tri = X.grouped_gemm(a, w, offs, w_layout="nk", scale=s, config=triton_config("grouped_gemm", R, N, K))
    _check(out, X.grouped_gemm_ref(a.double(), w.double(), offs, w_layout="nk", scale=sd), tri, offs, used, "nk")
    wkn = w.transpose(1, 2).contiguous()  # [E_l, K, N]
    out = _poisoned(R, N)
    _, ran = _launched(lambda: X.grouped_gemm(a, wkn, offs, w_layout="kn", scale=s, out=out))
    assert ran == ["_grouped_gemm_kernel"], ran
    ref = X.grouped_gemm_ref(a.double(), wkn.double(), offs, w_layout="kn", scale=sd)
    assert bool((out[used:] == SENTINEL).all()) and rel(out[:used], ref[:used]) < REF_TOL
    per_expert(out, ref, offs, REF_TOL, "kn")
    with pytest.raises(ValueError, match="kernel='gluon'.*GEMM1's dgrad"):
        X.grouped_gemm(a, wkn, offs, w_layout="kn", scale=s, config=_bf16_cfg(256, 4, None))


@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", DSW_CFGS, ids=_ids(DSW_CFGS))
@pytest.mark.parametrize("H,I", [(1024, 256), (512, 200), (64, 128)])  # I = 200: a partial last n-tile; one k-step
@pytest.mark.parametrize("with_scale,with_acts", [(True, True), (True, False), (False, False)])
def test_bf16_gemm2_dgrad_swiglu(sizes, cfg, H, I, with_scale, with_acts):
    # the SwiGLU backward: dh [R, 2I] from dact = dy @ w2[e] (w2 [E_l, H, I] as kn weights: K = H, N = I) and h; with
    # the gate scale also ds [R]; with acts_out also s[r] * silu(g) * u
    import megamoe.experts as X

    E_l, used, R, offs, dy, w2, h, s = dswiglu_problem(sizes, H, I, with_scale, seed=5)  # padding rows NaN
    dh = _poisoned(R, 2 * I)
    acts = _poisoned(R, I) if with_acts else None
    (got, ds), ran = _launched(lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, out=dh, acts_out=acts,
                                                            config=_bf16_cfg(*cfg)))
    assert ran == ["_gluon_bf16_ws_kernel"] and got is dh, ran
    tri_acts = _poisoned(R, I) if with_acts else None
    tri, tri_ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=tri_acts,
                                       config=triton_config("dgrad_swiglu", R, I, H))
    ref, ref_ds = X.gemm2_dgrad_swiglu_ref(dy.double(), w2.double(), h.double(), offs,
                                           scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(dh, ref, tri, offs, used, "dh")
    if with_scale:
        assert ds.dtype == torch.float32 and ds.shape == (R,)
        assert bool((ds[used:] == 0).all()), "gate-gradient rows of padding are not 0"
        assert rel(ds[:used], ref_ds[:used]) < REF_TOL, "ds vs float64"
        assert rel(ds[:used], tri_ds[:used]) < BF16_TWIN_TOL, "ds vs the Triton bf16 kernel"
    else:
        assert ds is None and tri_ds is None
    if with_acts:
        g, u = h[:used, :I].double(), h[:used, I:].double()
        ref_acts = torch.zeros(R, I, dtype=torch.float64, device="cuda")
        ref_acts[:used] = g * torch.sigmoid(g) * u * (s[:used, None].double() if s is not None else 1.0)
        _check(acts, ref_acts, tri_acts, offs, used, "acts")


def test_bf16_validates():
    # kernel="gluon" outside the kernel's limits: ValueError naming the limit, nothing launched
    import megamoe.experts as X

    E_l, used, R, offs, gen, a, w = bf16_problem([64, 64], 256, 256, seed=3)
    cases = [
        ("block_n must be one of .128, 256.", lambda: X.gemm2(a, w, offs, config=_bf16_cfg(64, 4, None))),
        ("shared memory", lambda: X.gemm2(a, w, offs, config=_bf16_cfg(256, 6, None))),
        ("block_m must be 128 and num_warps 4",
         lambda: X.gemm2(a, w, offs, config=_bf16_cfg(128, 4, None, block_m=64))),
        # the SwiGLU backward reads w2 as kn weights: a k-tile must stay inside its expert (K = H = 200)
        ("multiple of 64", lambda: X.gemm2_dgrad_swiglu(a[:, :200].contiguous(), _randn(E_l, 200, 128, gen=gen),
                                                        _randn(R, 256, gen=gen), offs, config=_bf16_cfg(128, 4, None))),
        ("GEMM1's dgrad", lambda: X.gemm1_dgrad(a, w, offs, config=_bf16_cfg(256, 4, None))),
    ]
    for what, call in cases:
        with pytest.raises(ValueError, match=f"kernel='gluon'.*{what}"):
            _launched(call)


def test_bf16_defaults():
    # with no config the forward ops and the SwiGLU backward run the Gluon kernel, GEMM1's dgrad (kn weights) the
    # Triton kernel; the defaults twice bitwise equal, the SwiGLU backward within the twin bound of the Triton kernel
    import megamoe.experts as X

    E_l, used, R, offs, dy, w2, h, s = dswiglu_problem([5, 300, 0, 129], 512, 256, True, seed=8)
    act = h[:, :256].contiguous()
    w13 = torch.cat([w2, w2], 2).transpose(1, 2).contiguous()  # [E_l, 2I, H]
    outs = {}
    for name, fn, kernel in (("gemm2", lambda: X.gemm2(act, w2, offs, scale=s), "_gluon_bf16_ws_kernel"),
                             ("gemm1_swiglu", lambda: X.gemm1_swiglu(dy, w13, offs), "_gluon_bf16_ws_kernel"),
                             ("dgrad1", lambda: X.gemm1_dgrad(h, w13, offs), "_grouped_gemm_kernel")):
        for _ in range(2):
            got, ran = _launched(fn)
            assert ran == [kernel], (name, ran)
            outs.setdefault(name, []).append(got)
        a, b = (o if isinstance(o, tuple) else (o,) for o in outs[name])
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x[:used], y[:used]), f"{name}: two runs differ"
    runs = []
    for _ in range(2):
        acts = _poisoned(R, 256)
        (dh, ds), ran = _launched(lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=acts))  # noqa: B023
        assert ran == ["_gluon_bf16_ws_kernel"], ran
        runs.append((dh, ds, acts))
    tri_acts = torch.empty(R, 256, device="cuda", dtype=torch.bfloat16)
    tri, tri_ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=tri_acts,
                                       config=triton_config("dgrad_swiglu", R, 256, 512))
    torch.cuda.synchronize()
    (dh, ds, acts), (dh2, ds2, acts2) = runs
    assert torch.equal(dh[:used], dh2[:used]) and torch.equal(ds, ds2) and torch.equal(acts, acts2)
    assert rel(dh[:used], tri[:used]) < BF16_TWIN_TOL and rel(ds[:used], tri_ds[:used]) < BF16_TWIN_TOL
    assert rel(acts[:used], tri_acts[:used]) < BF16_TWIN_TOL and bool((acts[used:] == SENTINEL).all())


# ============================================================================================== FP8 (gluon/fp8.py)
def _fp8_cfg(block_n, stages, num_sms, block_m=128, warps=4):
    from megamoe.kernels.gemm_config import GemmConfig

    return GemmConfig(block_m=block_m, block_n=block_n, block_k=128, num_stages=stages, num_warps=warps,
                      num_sms=num_sms, kernel="gluon")


FP8_CASES = [([0, 1, 127, 129, 2000, 0, 513, 64], 1040, 256),  # ragged groups; K not a multiple of 128 (odd k-steps)
             ([3000], 2048, 384),                              # one group holding every row
             ([300, 0, 77], 512, 320),                         # N not a multiple of 128 (gpt-oss: 2880): clipped tiles
             ([300, 77], 256, 128),                            # fewer k-steps than stages
             ([300, 77], 640, 256),                            # k-steps = stages
             ([300, 0, 77], 512, 260)]                         # out rows not 16-byte aligned: masked stores only


@pytest.mark.parametrize("sizes,K,N", FP8_CASES)
@pytest.mark.parametrize("block_n,stages", [(128, 4), (128, 2), (64, 6), (256, 4), (256, 2)])
@pytest.mark.parametrize("num_sms", [None, 3])
@pytest.mark.parametrize("with_scale", [False, True])
def test_fp8_plain(sizes, K, N, block_n, stages, num_sms, with_scale):
    import megamoe.experts as X

    E_l, used, R, offs, gen, aq, a_s, wq, w_s = fp8_problem(sizes, K, N, seed=0)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = _poisoned(R, N)
    _, ran = _launched(lambda: X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, scale=s, out=out,
                                                  config=_fp8_cfg(block_n, stages, num_sms)))
    assert ran == ["_gluon_fp8_ws_kernel"], ran
    ref = X.grouped_gemm_fp8_ref(aq, a_s, wq, w_s, offs, scale=s.double() if s is not None else None)
    tri = X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, scale=s,
                             config=X.default_config("grouped_gemm_fp8", R, N, K, kernel="triton"))
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, "out", FP8_TWIN_TOL)


FP8_EPI_CASES = [([0, 1, 127, 129, 2000, 0, 513, 64], 1040, 256),
                 ([3000], 1920, 384),
                 ([300, 77], 256, 128)]


@pytest.mark.parametrize("sizes,K,I", FP8_EPI_CASES)
@pytest.mark.parametrize("block_n,stages,num_sms", [(64, 4, None), (64, 6, None), (64, 2, 3), (128, 4, None),
                                                    (128, 2, 3)])
@pytest.mark.parametrize("store_h", [True, False])
def test_fp8_gemm1_swiglu(sizes, K, I, block_n, stages, num_sms, store_h):
    import megamoe.experts as X

    E_l, used, R, offs, _, xq, x_s, w13q, w13_s = fp8_problem(sizes, K, 2 * I, seed=1)  # padding rows NaN
    act = _poisoned(R, I)
    h = _poisoned(R, 2 * I) if store_h else None
    (got_act, got_h), ran = _launched(lambda: X.gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, store_h=store_h,
                                                                 out=act, h_out=h,
                                                                 config=_fp8_cfg(block_n, stages, num_sms)))
    assert ran == ["_gluon_fp8_ws_kernel"] and got_act is act and got_h is h, ran
    tri_act, tri_h = X.gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, store_h=store_h,
                                        config=X.default_config("gemm1_swiglu_fp8", R, I, K, kernel="triton"))
    ref_act, ref_h = X.gemm1_swiglu_fp8_ref(xq, x_s, w13q, w13_s, offs)
    torch.cuda.synchronize()
    _check(act, ref_act, tri_act, offs, used, "act", FP8_TWIN_TOL)
    if store_h:
        _check(h, ref_h, tri_h, offs, used, "h", FP8_TWIN_TOL)
    else:
        assert tri_h is None


def test_fp8_validates():
    import megamoe.experts as X

    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    aq, a_s = X.quantize_act(x)
    wq, w_s = X.quantize_weight(torch.randn(2, 256, 256, device="cuda").to(torch.bfloat16))
    offs = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    for what, cfg in (("block_n must be one of", _fp8_cfg(96, 4, None)), ("num_stages", _fp8_cfg(128, 1, None)),
                      ("shared memory", _fp8_cfg(128, 8, None)), ("num_warps 4", _fp8_cfg(128, 4, None, warps=8))):
        with pytest.raises(ValueError, match=f"kernel='gluon'.*{what}"):
            _launched(lambda: X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, config=cfg))  # noqa: B023


# ================================================================================ FP8 SwiGLU backward (fp8_dswiglu.py)
@pytest.mark.parametrize("sizes,K,I", FP8_EPI_CASES)
@pytest.mark.parametrize("cfg", [(128, 128, 4, 8, None),  # the default: four 32-column slices in the epilogue
                                 (128, 128, 4, 8, 3),     # 3 programs: the ring and the staging buffer reused
                                 (64, 128, 4, 8, None),   # two warps along N: the tile in one slice
                                 (64, 64, 3, 4, None)],   # one warpgroup, 64 columns: two slices
                         ids=["bm128", "bm128-3progs", "bm64", "bm64w4"])
@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("with_acts", [True, False])  # also the gated activation (the FP8 split backward's dW2 operand)
def test_fp8_dswiglu(sizes, K, I, cfg, with_scale, with_acts):
    import megamoe.experts as X

    block_m, block_n, stages, warps, num_sms = cfg
    gen = torch.Generator(device="cuda").manual_seed(2)
    E_l, used, R, offs = problem(sizes)
    H = K  # dgrad of GEMM2: dact [R, I] = dy [R, H] @ w2[e] [H, I]
    dy = _randn(R, H, gen=gen)
    dy[used:] = float("nan")
    w2 = _randn(E_l, H, I, gen=gen, scale=I**-0.5)
    h = _randn(R, 2 * I, gen=gen)
    h[used:] = float("nan")
    dyq, dy_s = X.quantize_act(dy)
    w2tq, w2t_s = X.quantize_weight(w2.transpose(1, 2))
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    dh = _poisoned(R, 2 * I)
    acts = _poisoned(R, I) if with_acts else None
    tri_acts = _poisoned(R, I) if with_acts else None
    (got, ds), ran = _launched(lambda: X.gemm2_dgrad_swiglu_fp8(
        dyq, dy_s, w2tq, w2t_s, h, offs, scale=s, out=dh, acts_out=acts,
        config=_fp8_cfg(block_n, stages, num_sms, block_m=block_m, warps=warps)))
    assert ran == ["_gluon_fp8_dswiglu_kernel"] and got is dh, ran
    tri, tri_ds = X.gemm2_dgrad_swiglu_fp8(dyq, dy_s, w2tq, w2t_s, h, offs, scale=s,
                                           config=X.default_config("dgrad_swiglu_fp8", R, I, H, kernel="triton"),
                                           acts_out=tri_acts)
    ref, ref_ds = X.gemm2_dgrad_swiglu_fp8_ref(dyq, dy_s, w2tq, w2t_s, h, offs, scale=s)
    torch.cuda.synchronize()
    _check(dh, ref, tri, offs, used, "dh", FP8_TWIN_TOL)
    if with_acts:
        g, u = h[:used, :I].double(), h[:used, I:].double()
        ref_acts = torch.zeros(R, I, dtype=torch.float64, device="cuda")
        ref_acts[:used] = g * torch.sigmoid(g) * u * (s[:used, None].double() if with_scale else 1.0)
        _check(acts, ref_acts, tri_acts, offs, used, "acts", FP8_TWIN_TOL)  # the same fp32 math: rounding flips
    if with_scale:
        assert ds.dtype == torch.float32 and ds.shape == (R,)
        assert bool((ds[used:] == 0).all()), "gate-gradient rows of padding are not 0"
        # fp32 row sums of the same products (partials over 32-column slices here, over 64-column tiles there)
        err = rel(ds[:used], tri_ds[:used])
        assert err < 1e-5, f"ds vs the Triton FP8 kernel: {err:.2e}"
        err = rel(ds[:used], ref_ds[:used])
        assert err < 5e-3, f"ds vs float64: {err:.2e}"  # fp8 wgmma accumulation within each 128-K step
        # (no per-expert check of ds: a 1-row group's sum can cancel to near 0, its relative error is noise)
    else:
        assert ds is None and tri_ds is None


# ============================================================================================== FP8 kernel choice
def test_fp8_defaults():
    # every FP8 op of megamoe.experts with no config: its Gluon kernel runs, twice bitwise equal, and within the twin
    # bound of the Triton kernel; a pinned config runs the kernel it names (kernel None: the Triton kernel)
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import GemmConfig

    gen = torch.Generator(device="cuda").manual_seed(3)
    E_l, used, R, offs = problem([0, 1, 127, 129, 700])
    H, I = 1024, 384  # multiples of 128: every op within its Gluon kernel's limits
    x, dy = _randn(R, H, gen=gen), _randn(R, H, gen=gen)
    w13 = _randn(E_l, 2 * I, H, gen=gen, scale=H**-0.5)
    w2 = _randn(E_l, H, I, gen=gen, scale=I**-0.5)
    act, h = _randn(R, I, gen=gen), _randn(R, 2 * I, gen=gen)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5
    xq, xs = X.quantize_act(x)
    aq, as_ = X.quantize_act(act)
    dyq, dys = X.quantize_act(dy)
    dhq, dhs = X.quantize_act(h)
    w13q, w13s, w13tq, w13ts = X.quantize_weight_both(w13)
    w2q, w2s, w2tq, w2ts = X.quantize_weight_both(w2)
    ops = {  # op (config name): (call with a config, (rows, n, k) of its default_config, its Gluon kernel)
        "gemm1_swiglu_fp8": (lambda c: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=c), (R, I, H),
                             "_gluon_fp8_ws_kernel"),
        "gemm2_fp8": (lambda c: (X.gemm2_fp8(aq, as_, w2q, w2s, offs, scale=s, config=c),), (R, H, I),
                      "_gluon_fp8_ws_kernel"),
        "dgrad_swiglu_fp8": (lambda c: X.gemm2_dgrad_swiglu_fp8(dyq, dys, w2tq, w2ts, h, offs, scale=s, config=c),
                             (R, I, H), "_gluon_fp8_dswiglu_kernel"),
        "dgrad1_fp8": (lambda c: (X.gemm1_dgrad_fp8(dhq, dhs, w13tq, w13ts, offs, config=c),), (R, H, 2 * I),
                       "_gluon_fp8_ws_kernel"),
        "grouped_gemm_fp8": (lambda c: (X.grouped_gemm_fp8(aq, as_, w2q, w2s, offs, config=c),), (R, H, I),
                             "_gluon_fp8_ws_kernel"),
    }
    for op, (fn, (rows, n, k), gluon) in ops.items():
        got, ran = _launched(lambda: fn(None))  # noqa: B023
        assert ran == [gluon], f"{op}: the default ran {ran}"
        again, _ = _launched(lambda: fn(None))  # noqa: B023
        tri, ran = _launched(lambda: fn(X.default_config(op, rows, n, k, kernel="triton")))  # noqa: B023
        assert ran == ["_grouped_gemm_fp8_kernel"], f"{op}: kernel='triton' ran {ran}"
        for g, a, t in zip(got, again, tri, strict=True):
            assert torch.equal(g[:used], a[:used]), f"{op}: two runs differ"
            tol = 1e-5 if g.dtype == torch.float32 else FP8_TWIN_TOL  # ds: fp32 sums
            err = rel(g[:used], t[:used])
            assert err < tol, f"{op}: Gluon vs Triton {err:.2e}"
        for pinned, kernel in ((X.default_config(op, rows, n, k, kernel="triton"), "_grouped_gemm_fp8_kernel"),
                               (GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=3, num_warps=4),
                                "_grouped_gemm_fp8_kernel"),
                               (X.default_config(op, rows, n, k, kernel="gluon"), gluon)):
            with X.pin_config(op, pinned):
                _, ran = _launched(lambda: fn(None))  # noqa: B023
            assert ran == [kernel], f"{op}: pinned {pinned} ran {ran}"


def test_fp8_outside_gluon_limits_runs_triton():
    # I = 200: no multiple of the SwiGLU's 64-column gate / up tiles. Default: the Triton kernel (the same numbers);
    # kernel="gluon" forced: ValueError naming the limit
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import EPI_SWIGLU

    gen = torch.Generator(device="cuda").manual_seed(4)
    E_l, used, R, offs = problem([5, 300])
    H, I = 256, 200
    xq, xs = X.quantize_act(_randn(R, H, gen=gen))
    w13q, w13s = X.quantize_weight(_randn(E_l, 2 * I, H, gen=gen, scale=H**-0.5))
    (act, _), ran = _launched(lambda: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs))
    assert ran == ["_grouped_gemm_fp8_kernel"], ran
    ref, _ = X.gemm1_swiglu_fp8_ref(xq, xs, w13q, w13s, offs)
    assert rel(act[:used], ref[:used]) < REF_TOL
    cfg = _fp8_cfg(64, 4, None)
    assert "multiples of block_n 64" in X.gluon_reason("gemm1_swiglu_fp8", cfg, xq, w13q, n=I, epilogue=EPI_SWIGLU,
                                                      n_up=I)
    with pytest.raises(ValueError, match="kernel='gluon'.*multiples of block_n 64"):
        X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=cfg)


# ============================================================================================== wgrad (gluon/wgrad.py)
WGRAD_GROUPS = [[5, 0, 1, 127, 129, 64, 63, 65, 700], [3000], [300, 0, 77], [0, 0]]
#: (block_n, block_k, stages at most, programs)
WGRAD_CFGS = [(256, 64, 3, None), (256, 64, 2, 3), (128, 64, 5, None), (256, 32, 6, 3), (128, 32, 3, None)]


def _wgrad_cfg(block_n, block_k, stages, num_sms, out_dtype=torch.bfloat16):
    """The config with at most ``stages`` stages: fewer where the output dtype's staging buffers leave less room."""
    from megamoe.kernels.gemm_config import GemmConfig
    from megamoe.kernels.gluon.wgrad import ws_wgrad_limits

    cfg = GemmConfig(block_m=128, block_n=block_n, block_k=block_k, num_stages=stages, num_warps=4, num_sms=num_sms,
                     kernel="gluon")
    while ws_wgrad_limits(cfg, m=64, n=64, out_dtype=out_dtype) is not None and cfg.num_stages > 2:
        cfg = cfg.with_(num_stages=cfg.num_stages - 1)
    return cfg


def _wgrad_operands(sizes, M, N, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E_l, used, R, offs = problem(sizes)
    x = _randn(R, M, gen=gen)
    y = _randn(R, N, gen=gen)
    x[used:] = float("nan")
    y[used:] = float("nan")
    return E_l, used, offs, x, y


@pytest.mark.parametrize("sizes", WGRAD_GROUPS)
@pytest.mark.parametrize("cfg", WGRAD_CFGS, ids=[f"bn{c[0]}-bk{c[1]}-s{c[2]}-p{c[3]}" for c in WGRAD_CFGS])
@pytest.mark.parametrize("M,N", [(256, 512), (192, 200), (64, 72)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_wgrad(sizes, cfg, M, N, out_dtype):
    # c[e] = x[rows_e]^T @ y[rows_e]. Rows of other experts inside a partial chunk's window must contribute exact
    # zeros; the 5-row first group's window starts before row 0 (TMA zero fill); M = 192: the second consumer's half
    # of the last m-tile skipped
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import GemmConfig

    E_l, used, offs, x, y = _wgrad_operands(sizes, M, N, seed=M + N)
    got, ran = _launched(lambda: X.grouped_wgrad(x, y, offs, out_dtype=out_dtype, config=_wgrad_cfg(*cfg, out_dtype)))
    assert ran == ["_gluon_wgrad_ws_kernel"], ran
    again = X.grouped_wgrad(x, y, offs, out_dtype=out_dtype, config=_wgrad_cfg(*cfg, out_dtype))
    tri, ran = _launched(lambda: X.grouped_wgrad(
        x, y, offs, out_dtype=out_dtype, config=GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=5,
                                                           num_warps=8, flatten=True, kernel="triton")))
    assert ran == ["_grouped_wgrad_kernel"], ran
    ref = X.grouped_wgrad_ref(x[:used].double(), y[:used].double(), offs)
    torch.cuda.synchronize()
    assert got.dtype == out_dtype and tuple(got.shape) == (E_l, M, N)
    assert torch.equal(got, again), "two runs differ bitwise"
    assert bool(torch.isfinite(got).all()), "NaN / inf in the gradient: padding or another expert's rows leaked"
    for e in range(E_l):  # empty experts: exact zeros; the others against float64 and the Triton kernel
        if sizes[e] == 0:
            assert bool((got[e] == 0).all()), f"expert {e} (no rows) not zero"
            continue
        assert rel(got[e].double(), ref[e]) < REF_TOL, f"expert {e} vs float64"
        assert rel(got[e].float(), tri[e].float()) < 2e-3, f"expert {e} vs the Triton wgrad kernel"


def test_wgrad_deepseek_shape():
    """dW13-like shape at deepseek width (M = 2I = 4096, N = H = 7168) with uneven groups, default-like config."""
    import megamoe.experts as X

    sizes = [288, 736, 511, 513, 0, 1, 640, 257]
    E_l, used, offs, x, y = _wgrad_operands(sizes, 4096, 7168, seed=3)
    got, ran = _launched(lambda: X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16,
                                                 config=_wgrad_cfg(256, 64, 3, None)))
    assert ran == ["_gluon_wgrad_ws_kernel"], ran
    ref = X.grouped_wgrad_ref(x[:used].double(), y[:used].double(), offs)
    torch.cuda.synchronize()
    for e in range(E_l):
        assert rel(got[e].double(), ref[e]) < REF_TOL if sizes[e] else bool((got[e] == 0).all()), f"expert {e}"


def test_wgrad_limits():
    # kernel="gluon" outside the limits raises; with no config the same shapes run the Triton kernel
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import GemmConfig

    E_l, used, offs, x, y = _wgrad_operands([10, 20], 96, 64, seed=0)  # M % 64 != 0
    with pytest.raises(ValueError, match="kernel='gluon'.*multiple of 64"):
        X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=_wgrad_cfg(256, 64, 3, None))
    _, ran = _launched(lambda: X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16))
    assert ran == ["_grouped_wgrad_kernel"], ran
    E_l, used, offs, x, y = _wgrad_operands([10, 20], 128, 64, seed=0)
    big = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=4, num_warps=4, kernel="gluon")
    with pytest.raises(ValueError, match="kernel='gluon'.*shared memory"):
        X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=big)
    _, ran = _launched(lambda: X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16))
    assert ran == ["_gluon_wgrad_ws_kernel"], ran
