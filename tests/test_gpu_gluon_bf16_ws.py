"""The warp-specialised Gluon bf16 grouped GEMM (megamoe/kernels/gluon_bf16_ws.py: a TMA loader warp and two consumer
warpgroups, cooperative or ping-pong), forced through GemmConfig(kernel="gluon_ws") on the public bf16 ops (GEMM1 +
SwiGLU with and without h, GEMM2 with and without the gate scale, GEMM1's dgrad with kn weights, the SwiGLU backward
with and without the gate scale and acts), on an H100/H200: against the float64 twins (whole and per expert) and against
the Triton bf16 kernel on the same inputs (same BLOCK_K and K order: only the wgmma's internal order and bf16 rounding
flips may differ). Padding rows of the inputs hold NaN and outputs are poisoned, so a read of padding or a missed /
extra write fails. Edge cases: empty, 1-row, 127 / 129-row groups, one group holding every row, K not a multiple of 64,
N not a multiple of the tile (clipped last tile), outputs that TMA cannot store (rows not 16-byte aligned: the
masked-store epilogue everywhere), fewer k-steps than stages, 3 persistent programs (many tiles each: the ring's stages
and phases, and ping-pong's turns, carry across tiles; with 3 programs and an odd tile count the two consumers get
different numbers of tiles).

    pytest -q -m gpu tests/test_gpu_gluon_bf16_ws.py          (on the H200)
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import bf16_problem, dswiglu_problem, per_expert, rel, swiglu_references, triton_config

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")

SENTINEL = 4352.0
GROUPS = [[0, 1, 127, 129, 2000, 0, 513, 64], [3000], [300, 77]]
#: (ping-pong, block_n, stages, programs): the defaults' shapes, 2 stages, 3 programs
SWIGLU_CFGS = [(False, 128, 4, None), (False, 64, 2, 3), (True, 64, 5, None), (True, 64, 2, 3), (False, 128, 4, 3)]
PLAIN_CFGS = [(False, 256, 4, None), (False, 128, 2, 3), (True, 128, 5, None), (True, 128, 2, 3), (True, 64, 4, None),
              (False, 256, 3, 3)]


def _cfg(pingpong, block_n, stages, num_sms):
    from megamoe.kernels.gemm_config import GemmConfig

    return GemmConfig(block_m=128, block_n=block_n, block_k=64, num_stages=stages, num_warps=4, num_sms=num_sms,
                      kernel="gluon_ws", pingpong=pingpong)


def _ran_ws(forget=False):
    from megamoe.kernels.gemm_config import LAST_COMPILED

    if forget:
        LAST_COMPILED.pop("_gluon_bf16_ws_kernel", None)
    return "_gluon_bf16_ws_kernel" in LAST_COMPILED


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def _check(got, ref, tri, offs, used, what):
    assert bool((got[used:] == SENTINEL).all()), f"{what}: padding rows were written"
    assert rel(got[:used], ref[:used]) < 1e-2, f"{what} vs float64"
    per_expert(got, ref, offs, 1e-2, what)
    assert rel(got[:used], tri[:used]) < 1e-3, f"{what} vs the Triton bf16 kernel"


@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", SWIGLU_CFGS, ids=[f"pp{int(c[0])}-bn{c[1]}-s{c[2]}-p{c[3]}" for c in SWIGLU_CFGS])
# 16 k-steps; a partial k-step and n-tile; one k-step with I % 8 != 0 (h's up half not TMA-able: masked stores only)
@pytest.mark.parametrize("H,I", [(1024, 256), (1000, 192), (64, 100)])
@pytest.mark.parametrize("store_h", [True, False])
def test_ws_gemm1_swiglu(sizes, cfg, H, I, store_h):
    import megamoe.experts as X

    E_l, used, R, offs, gen, x, w13 = bf16_problem(sizes, H, 2 * I, seed=1)
    act = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    h = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16) if store_h else None
    _ran_ws(forget=True)
    X.gemm1_swiglu(x, w13, offs, store_h=store_h, out=act, h_out=h, config=_cfg(*cfg))
    assert _ran_ws()
    (tri_act, tri_h), (ref_act, ref_h) = swiglu_references(x, w13, offs)
    torch.cuda.synchronize()
    _check(act, ref_act, tri_act, offs, used, "act")
    if store_h:
        _check(h, ref_h, tri_h, offs, used, "h")


@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", PLAIN_CFGS, ids=[f"pp{int(c[0])}-bn{c[1]}-s{c[2]}-p{c[3]}" for c in PLAIN_CFGS])
# a partial k-step; N % 8 != 0 (rows not 16-byte aligned: masked stores only) and a clipped tile; one k-step, TMA
# stores clipped at N = 200
@pytest.mark.parametrize("K,N", [(1000, 256), (128, 324), (64, 200)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_ws_gemm2(sizes, cfg, K, N, with_scale):
    import megamoe.experts as X

    E_l, used, R, offs, gen, act, w2 = bf16_problem(sizes, K, N, seed=2)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = torch.full((R, N), SENTINEL, device="cuda", dtype=torch.bfloat16)
    _ran_ws(forget=True)
    X.gemm2(act, w2, offs, scale=s, out=out, config=_cfg(*cfg))
    assert _ran_ws()
    tri = X.gemm2(act, w2, offs, scale=s, config=triton_config("gemm2", R, N, K))
    ref = X.gemm2_ref(act.double(), w2.double(), offs, scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, "gemm2")


KN_CFGS = [(False, 256, 4, None), (False, 128, 2, 3), (True, 128, 5, None), (True, 64, 4, 3)]


@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", KN_CFGS, ids=[f"pp{int(c[0])}-bn{c[1]}-s{c[2]}-p{c[3]}" for c in KN_CFGS])
@pytest.mark.parametrize("K,N", [(1024, 256), (512, 200), (64, 136)])  # kn: K a multiple of 64; clipped tiles; 1 k-step
def test_ws_gemm1_dgrad_kn(sizes, cfg, K, N):
    # GEMM1's dgrad, dx [R, H] = dh [R, 2I] @ w13[e] [2I, H] (kn weights: K = 2I, N = H), opt-in on this kernel
    import megamoe.experts as X

    E_l, used, R, offs, gen, dh, w13t = bf16_problem(sizes, K, N, seed=4)
    w13 = w13t.transpose(1, 2).contiguous()  # [E_l, K, N]
    out = torch.full((R, N), SENTINEL, device="cuda", dtype=torch.bfloat16)
    _ran_ws(forget=True)
    X.gemm1_dgrad(dh, w13, offs, out=out, config=_cfg(*cfg))
    assert _ran_ws()
    tri = X.gemm1_dgrad(dh, w13, offs, config=triton_config("dgrad1", R, N, K))
    ref = X.gemm1_dgrad_ref(dh.double(), w13.double(), offs)
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, "dgrad1")


DSW_CFGS = [(128, 4, None), (128, 3, 3), (64, 4, None), (64, 2, 3)]  # cooperative (block_n, stages, programs)


@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", DSW_CFGS, ids=[f"bn{c[0]}-s{c[1]}-p{c[2]}" for c in DSW_CFGS])
@pytest.mark.parametrize("H,I", [(1024, 256), (512, 200), (64, 128)])  # I = 200: a partial last n-tile; one k-step
@pytest.mark.parametrize("with_scale,with_acts", [(True, True), (True, False), (False, False)])
def test_ws_gemm2_dgrad_swiglu(sizes, cfg, H, I, with_scale, with_acts):
    # the SwiGLU backward (dgrad2; the default on Hopper since 2026-12-01): dh [R, 2I] from dact = dy @ w2[e] (w2
    # [E_l, H, I] as kn weights: K = H, N = I) and h; with the gate scale also ds [R]; with acts_out also
    # s[r] * silu(g) * u
    import megamoe.experts as X

    E_l, used, R, offs, dy, w2, h, s = dswiglu_problem(sizes, H, I, with_scale, seed=5)  # padding rows NaN
    dh = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    acts = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16) if with_acts else None
    bn, stages, progs = cfg
    _ran_ws(forget=True)
    got, ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, out=dh, acts_out=acts,
                                   config=_cfg(False, bn, stages, progs))
    assert _ran_ws() and got is dh
    tri_acts = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16) if with_acts else None
    tri, tri_ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=tri_acts,
                                       config=triton_config("dgrad_swiglu", R, I, H))
    ref, ref_ds = X.gemm2_dgrad_swiglu_ref(dy.double(), w2.double(), h.double(), offs,
                                           scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(dh, ref, tri, offs, used, "dh")
    if with_scale:
        assert ds.shape == (R,) and bool((ds[used:] == 0).all()), "gate-gradient rows of padding are not 0"
        assert rel(ds[:used], ref_ds[:used]) < 1e-2, "ds vs float64"
        assert rel(ds[:used], tri_ds[:used]) < 1e-3, "ds vs the Triton bf16 kernel"
    else:
        assert ds is None
    if with_acts:
        g, u = h[:used, :I].double(), h[:used, I:].double()
        ref_acts = torch.zeros(R, I, dtype=torch.float64, device="cuda")
        ref_acts[:used] = g * torch.sigmoid(g) * u * (s[:used, None].double() if s is not None else 1.0)
        _check(acts, ref_acts, tri_acts.double(), offs, used, "acts")  # (the float64 acts is no Triton stand-in:
        # bf16 rounding alone is ~2e-3 relative)


@needs_hopper
def test_ws_validates():
    import megamoe.experts as X

    E_l, used, R, offs, gen, a, w = bf16_problem([64, 64], 256, 256, seed=3)
    with pytest.raises(ValueError, match="block_n must be one of"):
        X.gemm2(a, w, offs, config=_cfg(True, 256, 4, None))  # ping-pong 128 x 256: 256 accumulator registers
    with pytest.raises(ValueError, match="shared memory"):
        X.gemm2(a, w, offs, config=_cfg(False, 256, 6, None))
    with pytest.raises(ValueError, match="kernel='gluon_ws'.*cooperative schedule only"):
        X.gemm2_dgrad_swiglu(a, w, _randn(R, 512, gen=gen), offs, config=_cfg(True, 128, 4, None))
    with pytest.raises(ValueError, match="multiple of 64"):  # kn: a k-tile must stay inside its expert
        X.gemm1_dgrad(a[:, :200].contiguous(), _randn(E_l, 200, 256, gen=gen), offs, config=_cfg(False, 256, 4, None))


@needs_hopper
def test_ws_defaults():
    # with no config the forward ops and the SwiGLU backward run this kernel (since 2026-12-01), dgrad1 (kn weights)
    # the Triton kernel; the default SwiGLU backward twice bitwise equal and within 1e-3 of the Triton kernel
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import LAST_COMPILED

    E_l, used, R, offs, dy, w2, h, s = dswiglu_problem([5, 300, 0, 129], 512, 256, True, seed=8)
    _ran_ws(forget=True)
    X.gemm2(h[:, :256].contiguous(), w2, offs)
    assert _ran_ws()
    LAST_COMPILED.pop("_grouped_gemm_kernel", None)
    _ran_ws(forget=True)
    X.gemm1_dgrad(h, torch.cat([w2, w2], 2), offs)  # dh [R, 2I] @ w13 [E_l, 2I, H]: kn weights
    assert not _ran_ws() and "_grouped_gemm_kernel" in LAST_COMPILED
    outs = []
    for _ in range(2):
        acts = torch.full((R, 256), SENTINEL, device="cuda", dtype=torch.bfloat16)
        _ran_ws(forget=True)
        dh, ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=acts)
        assert _ran_ws()
        outs.append((dh, ds, acts))
    tri_acts = torch.empty(R, 256, device="cuda", dtype=torch.bfloat16)
    tri, tri_ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=tri_acts,
                                       config=triton_config("dgrad_swiglu", R, 256, 512))
    torch.cuda.synchronize()
    (dh, ds, acts), (dh2, ds2, acts2) = outs
    assert torch.equal(dh[:used], dh2[:used]) and torch.equal(ds, ds2) and torch.equal(acts, acts2)
    assert rel(dh[:used], tri[:used]) < 1e-3 and rel(ds[:used], tri_ds[:used]) < 1e-3
    assert rel(acts[:used], tri_acts[:used]) < 1e-3 and bool((acts[used:] == SENTINEL).all())
