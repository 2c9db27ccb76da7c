"""The Gluon bf16 grouped GEMM (megamoe/kernels/gluon_bf16.py), forced through GemmConfig(kernel="gluon") on the public
bf16 ops of megamoe.experts, on an H100/H200: every epilogue in the weight layouts the ops use (GEMM1 + SwiGLU nk with
and without h, GEMM2 nk with and without the gate scale, grouped_gemm nk and kn, dgrad2 + SwiGLU backward kn with and
without the gate scale and its row sums, dgrad1 kn), against the float64 twins (per expert too) and against the Triton
bf16 kernel (pinned: the forward ops default to gluon_bf16_ws.py on Hopper) on the same inputs (same K order and
BLOCK_K: only wgmma-internal order and bf16 rounding flips differ). Padding rows of the inputs hold NaN and outputs are
poisoned, so a read of padding or a missed/extra write fails. Edge cases: empty, 1-row, 127/129-row groups, one group
holding every row, K shorter than the ring (1 and 2 k-steps), K not a multiple of BLOCK_K (nk), N not a multiple of
BLOCK_N (kn), 3 persistent programs (the ring and h buffer carried over many tiles).

CPU tests (no marker): kernel="gluon" raises a clear ValueError on CPU tensors and under the interpreter, and
gluon_bf16_limits rejects configs and shapes outside the kernel's limits.

    pytest -q -m gpu tests/test_gpu_gluon_bf16.py          (on the H200)
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import bf16_problem, dswiglu_problem, swiglu_references, triton_config
from gemm_cases import per_expert as _per_expert
from gemm_cases import problem as _problem
from gemm_cases import rel as _rel

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a wgmma)")

SENTINEL = 4352.0  # poison for outputs: finite, so unwritten-but-required and written-but-forbidden both show
REF_TOL = 1e-2     # bf16 outputs vs float64 twins
TRITON_TOL = 1e-3  # vs the Triton bf16 kernel: the same fp32 sums up to the wgmma's internal order

GROUPS = [[0, 1, 127, 129, 2000, 0, 513, 64],  # empty, 1-row, ragged groups around the 128-row block
          [3000],                              # one group holding every row
          [300, 77]]


def _cfg(block_m=128, block_n=128, block_k=64, stages=4, warps=8, num_sms=None):
    from megamoe.kernels.gemm_config import GemmConfig

    return GemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps,
                      num_sms=num_sms, kernel="gluon")


CFGS = {"bm128": dict(), "bm128-3progs": dict(num_sms=3), "bm64w4": dict(block_m=64, block_n=64, warps=4),
        "bn64": dict(block_n=64), "s2": dict(stages=2)}


def _check(got, ref, tri, offs, used, what):
    """got vs the float64 twin (whole and per expert) and vs the Triton kernel; padding rows untouched."""
    assert bool((got[used:] == SENTINEL).all()), f"{what}: padding rows were written"
    err = _rel(got[:used], ref[:used])
    assert err < REF_TOL, f"{what} vs float64: {err:.2e}"
    _per_expert(got, ref, offs, REF_TOL, what)
    err = _rel(got[:used], tri[:used])
    assert err < TRITON_TOL, f"{what} vs the Triton bf16 kernel: {err:.2e}"


def _ran_gluon():
    from megamoe.kernels.gemm_config import LAST_COMPILED

    return "_gluon_bf16_grouped_kernel" in LAST_COMPILED


def _forget():
    from megamoe.kernels.gemm_config import LAST_COMPILED

    LAST_COMPILED.pop("_gluon_bf16_grouped_kernel", None)


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------ GPU tests
@gpu
@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", list(CFGS), ids=list(CFGS))
@pytest.mark.parametrize("H,I", [(1024, 256), (1000, 128), (64, 128)])  # K = H: 16 k-steps; partial; one k-step
@pytest.mark.parametrize("store_h", [True, False])
def test_gemm1_swiglu(sizes, cfg, H, I, store_h):
    import megamoe.experts as X

    E_l, used, R, offs, gen, x, w13 = bf16_problem(sizes, H, 2 * I, seed=1)  # x's padding rows NaN
    act = torch.full((R, I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    h = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16) if store_h else None
    _forget()
    got_act, got_h = X.gemm1_swiglu(x, w13, offs, store_h=store_h, out=act, h_out=h, config=_cfg(**CFGS[cfg]))
    assert _ran_gluon() and got_act is act and got_h is h
    (tri_act, tri_h), (ref_act, ref_h) = swiglu_references(x, w13, offs)
    torch.cuda.synchronize()
    _check(act, ref_act, tri_act, offs, used, "act")
    if store_h:
        _check(h, ref_h, tri_h, offs, used, "h")


@gpu
@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", list(CFGS) + ["bn256s3"], ids=list(CFGS) + ["bn256s3"])
@pytest.mark.parametrize("K,N", [(1000, 256), (128, 512), (64, 256)])  # partial last k-step; 2 k-steps; one
@pytest.mark.parametrize("with_scale", [True, False])
def test_gemm2(sizes, cfg, K, N, with_scale):
    import megamoe.experts as X

    kw = dict(block_n=256, stages=3) if cfg == "bn256s3" else CFGS[cfg]
    E_l, used, R, offs, gen, act, w2 = bf16_problem(sizes, K, N, seed=2)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = torch.full((R, N), SENTINEL, device="cuda", dtype=torch.bfloat16)
    _forget()
    X.gemm2(act, w2, offs, scale=s, out=out, config=_cfg(**kw))
    assert _ran_gluon()
    tri = X.gemm2(act, w2, offs, scale=s, config=triton_config("gemm2", R, N, K))
    ref = X.gemm2_ref(act.double(), w2.double(), offs, scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, "gemm2")


@gpu
@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", list(CFGS) + ["bn256s3"], ids=list(CFGS) + ["bn256s3"])
@pytest.mark.parametrize("K,N", [(1024, 256), (512, 200), (64, 136)])  # kn: K a multiple of 64, any N % 8 == 0
def test_gemm1_dgrad_kn(sizes, cfg, K, N):
    import megamoe.experts as X

    kw = dict(block_n=256, stages=3) if cfg == "bn256s3" else CFGS[cfg]
    gen = torch.Generator(device="cuda").manual_seed(3)
    E_l, used, R, offs = _problem(sizes)
    dh = _randn(R, K, gen=gen)  # dgrad1: dx [R, H] = dh [R, 2I] @ w13[e] [2I, H]; K = 2I, N = H
    dh[used:] = float("nan")
    w13 = _randn(E_l, K, N, gen=gen, scale=K**-0.5)
    out = torch.full((R, N), SENTINEL, device="cuda", dtype=torch.bfloat16)
    _forget()
    X.gemm1_dgrad(dh, w13, offs, out=out, config=_cfg(**kw))
    assert _ran_gluon()
    tri = X.gemm1_dgrad(dh, w13, offs)
    ref = X.gemm1_dgrad_ref(dh.double(), w13.double(), offs)
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, "dgrad1")


@gpu
@needs_hopper
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("with_scale", [True, False])
def test_grouped_gemm_layouts(w_layout, with_scale):
    import megamoe.experts as X

    gen = torch.Generator(device="cuda").manual_seed(4)
    E_l, used, R, offs = _problem(GROUPS[0])
    K, N = 512, 384
    a = _randn(R, K, gen=gen)
    a[used:] = float("nan")
    w = _randn(E_l, *((K, N) if w_layout == "kn" else (N, K)), gen=gen, scale=K**-0.5)
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    out = torch.full((R, N), SENTINEL, device="cuda", dtype=torch.bfloat16)
    _forget()
    X.grouped_gemm(a, w, offs, w_layout=w_layout, scale=s, out=out, config=_cfg(num_sms=5))
    assert _ran_gluon()
    tri = X.grouped_gemm(a, w, offs, w_layout=w_layout, scale=s, config=triton_config("grouped_gemm", R, N, K))
    ref = X.grouped_gemm_ref(a.double(), w.double(), offs, w_layout=w_layout,
                             scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(out, ref, tri, offs, used, f"grouped_gemm {w_layout}")


@gpu
@needs_hopper
@pytest.mark.parametrize("sizes", GROUPS)
@pytest.mark.parametrize("cfg", list(CFGS), ids=list(CFGS))
@pytest.mark.parametrize("H,I", [(1024, 256), (512, 200), (64, 128)])  # I = 200: a partial last n-tile
@pytest.mark.parametrize("with_scale", [True, False])
def test_gemm2_dgrad_swiglu(sizes, cfg, H, I, with_scale):
    import megamoe.experts as X

    E_l, used, R, offs, dy, w2, h, s = dswiglu_problem(sizes, H, I, with_scale, seed=5)  # padding rows NaN
    dh = torch.full((R, 2 * I), SENTINEL, device="cuda", dtype=torch.bfloat16)
    _forget()
    got, ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, out=dh, config=_cfg(**CFGS[cfg]))
    assert _ran_gluon() and got is dh
    tri, tri_ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s)
    ref, ref_ds = X.gemm2_dgrad_swiglu_ref(dy.double(), w2.double(), h.double(), offs,
                                           scale=s.double() if s is not None else None)
    torch.cuda.synchronize()
    _check(dh, ref, tri, offs, used, "dh")
    if with_scale:
        assert ds.dtype == torch.float32 and ds.shape == (R,)
        assert bool((ds[used:] == 0).all()), "gate-gradient rows of padding are not 0"
        err = _rel(ds[:used], ref_ds[:used])
        assert err < REF_TOL, f"ds vs float64: {err:.2e}"
        # fp32 row sums of the same products, partials over 64-column slices here (tile-wide there)
        tile_n_same = CFGS[cfg].get("block_n", 128) == 128
        err = _rel(ds[:used], tri_ds[:used])
        assert err < (1e-4 if tile_n_same else TRITON_TOL), f"ds vs the Triton bf16 kernel: {err:.2e}"
    else:
        assert ds is None and tri_ds is None


@gpu
@needs_hopper
def test_gluon_is_opt_in_and_repeatable():
    # kernel None: the default runs (since 2026-12-01 the warp-specialised Gluon kernel, gluon_bf16_ws.py), not this
    # one; kernel "gluon": twice bitwise equal
    import megamoe.experts as X
    from megamoe.kernels.gemm_config import LAST_COMPILED

    gen = torch.Generator(device="cuda").manual_seed(6)
    E_l, used, R, offs = _problem([5, 300, 0, 129])
    H, I = 512, 256
    x = _randn(R, H, gen=gen)
    w13 = _randn(E_l, 2 * I, H, gen=gen, scale=H**-0.5)
    _forget()
    LAST_COMPILED.pop("_gluon_bf16_ws_kernel", None)
    X.gemm1_swiglu(x, w13, offs)
    assert "_gluon_bf16_ws_kernel" in LAST_COMPILED and not _ran_gluon()
    a1, h1 = X.gemm1_swiglu(x, w13, offs, config=_cfg())
    a2, h2 = X.gemm1_swiglu(x, w13, offs, config=_cfg())
    torch.cuda.synchronize()
    assert _ran_gluon()
    assert torch.equal(a1[:used], a2[:used]) and torch.equal(h1[:used], h2[:used])


@gpu
@needs_hopper
def test_gluon_out_of_limits_raises_on_gpu():
    import megamoe.experts as X

    gen = torch.Generator(device="cuda").manual_seed(7)
    E_l, used, R, offs = _problem([5, 300])
    H, I = 256, 200  # nk SwiGLU: I must be a multiple of block_n
    x = _randn(R, H, gen=gen)
    w13 = _randn(E_l, 2 * I, H, gen=gen, scale=H**-0.5)
    with pytest.raises(ValueError, match="kernel='gluon'.*multiple of 128"):
        X.gemm1_swiglu(x, w13, offs, config=_cfg())
    with pytest.raises(ValueError, match="block_m, num_warps"):
        X.gemm1_swiglu(x, w13, offs, config=_cfg(block_m=128, block_n=64, warps=4))
    dh = _randn(R, 1000, gen=gen)  # kn: K = 1000 is not a multiple of block_k
    w = _randn(E_l, 1000, 256, gen=gen)
    with pytest.raises(ValueError, match="multiple of 64"):
        X.gemm1_dgrad(dh, w, offs, config=_cfg())


# ------------------------------------------------------------------------------------------------ CPU tests
def test_gluon_raises_on_cpu_tensors():
    import megamoe.experts as X

    offs = torch.tensor([0, 3, 8], dtype=torch.int32)
    act = torch.randn(8, 128).to(torch.bfloat16)
    w2 = torch.randn(2, 256, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kernel='gluon'.*(not a CUDA device|interpreter)"):
        X.gemm2(act, w2, offs, config=_cfg())


def test_gluon_raises_under_the_interpreter(monkeypatch):
    import megamoe.experts as X

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    offs = torch.tensor([0, 3, 8], dtype=torch.int32)
    dy = torch.randn(8, 128).to(torch.bfloat16)
    w2 = torch.randn(2, 128, 64).to(torch.bfloat16)
    h = torch.randn(8, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kernel='gluon'.*interpreter"):
        X.gemm2_dgrad_swiglu(dy, w2, h, offs, config=_cfg(block_n=64))


def test_gluon_bf16_limits():
    from megamoe.kernels.gluon_bf16 import gluon_bf16_limits as lim
    from megamoe.kernels.grouped_gemm import EPI_DSWIGLU, EPI_NONE, EPI_SWIGLU

    ok = _cfg()
    # the ops' shapes at deepseek-v3 / qwen3: within the limits
    assert lim(ok, n=7168, k=2048, n_w=7168, epilogue=EPI_NONE) is None                       # GEMM2
    assert lim(ok.with_(block_n=256, num_stages=3), n=7168, k=4096, n_w=7168, epilogue=EPI_NONE, w_kn=True) is None
    assert lim(ok, n=768, k=2048, n_w=1536, epilogue=EPI_SWIGLU, n_up=768) is None             # GEMM1 + SwiGLU
    assert lim(ok, n=768, k=2048, n_w=768, epilogue=EPI_DSWIGLU, w_kn=True) is None            # dgrad2 + SwiGLU
    assert lim(ok, n=200, k=512, n_w=200, epilogue=EPI_NONE, w_kn=True) is None                # kn: N any % 8
    assert lim(ok, n=256, k=1000, n_w=256, epilogue=EPI_NONE) is None                          # nk: K any % 8
    bad = {
        "block_m, num_warps": (ok.with_(num_warps=4), dict(n=256, k=256, n_w=256, epilogue=EPI_NONE)),
        "block_n must be": (ok.with_(block_n=96), dict(n=192, k=256, n_w=192, epilogue=EPI_NONE)),
        "block_k must be": (ok.with_(block_k=32), dict(n=256, k=256, n_w=256, epilogue=EPI_NONE)),
        "registers per thread": (ok.with_(block_n=256, num_stages=2),
                                 dict(n=512, k=256, n_w=1024, epilogue=EPI_SWIGLU, n_up=512)),
        "more than 64": (ok.with_(block_n=256, num_stages=2),
                         dict(n=512, k=256, n_w=512, epilogue=EPI_DSWIGLU, w_kn=True)),
        "num_stages": (ok.with_(num_stages=1), dict(n=256, k=256, n_w=256, epilogue=EPI_NONE)),
        "shared memory": (ok.with_(num_stages=6), dict(n=256, k=2048, n_w=512, epilogue=EPI_SWIGLU, n_up=256)),
        "K must be a positive": (ok, dict(n=256, k=100, n_w=256, epilogue=EPI_NONE)),
        "N must be a multiple of 8": (ok, dict(n=100, k=256, n_w=100, epilogue=EPI_NONE, w_kn=True)),
        "multiple of 64 .block_k": (ok, dict(n=256, k=1000, n_w=256, epilogue=EPI_NONE, w_kn=True)),
        "multiple of 128 .block_n": (ok, dict(n=200, k=256, n_w=200, epilogue=EPI_NONE)),
        "up offset": (ok, dict(n=256, k=256, n_w=448, epilogue=EPI_SWIGLU, n_up=192)),
        "unknown epilogue": (ok, dict(n=256, k=256, n_w=256, epilogue=5)),
    }
    import re

    for what, (cfg, kw) in bad.items():
        why = lim(cfg, **kw)
        assert why is not None and re.search(what, why), f"{what}: {why}"


def test_default_bf16_configs_stay_triton():
    from megamoe.kernels.gemm_config import default_config

    for op in ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dgrad1", "grouped_gemm"):
        assert default_config(op, 4096, 768, 2048).kernel is None
