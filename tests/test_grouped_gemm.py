"""Grouped GEMM kernels vs float64 twins: forward (SwiGLU, gate scale), dgrad, wgrad, autograd, FP8; the kernel choice
of megamoe.experts (choose_config, gluon_reason) and the Gluon kernels' limits.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 at small sizes; tests marked gpu run on
CUDA at larger sizes (``pytest -m gpu``), with the default kernels (on Hopper the Gluon ones where they can run: their
own tests are tests/test_gpu_gemm.py) and pinned Triton configs. Padding rows of the inputs hold NaN and outputs are
poisoned before each call, so a read of padding or a missed/extra write fails.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import experts as X
from megamoe.kernels.gemm_config import EPI_DSWIGLU, EPI_NONE, EPI_SWIGLU, GLUON_OPS, GemmConfig
from megamoe.testing import fp8_bits

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu  # deselected without CUDA (tests/conftest.py)
cpu_only = pytest.mark.skipif(CUDA, reason="the CPU (interpreter) variant; the gpu tests cover CUDA")

SENTINEL = 4352.0  # poison for outputs: finite, so unwritten-but-required and written-but-forbidden both show


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


#: Bounds per checked quantity, against float64 twins rounded to the output's dtype (so a bf16 output is compared
#: with the correctly rounded value: what remains is accumulation order and the rare rounding flip it causes). The
#: interpreter's: the worst error over three seed sets (``python tools/measure_bounds.py tests/test_grouped_gemm.py``)
#: plus 30%, and at least 3e-4 for bf16 outputs (a few one-ulp flips in these small tensors; measured worst 2.8e-5)
#: and 2e-7 for fp32 ones (measured 1.2e-7). ``mlp.*`` (the autograd Function against the float64 MLP, which keeps
#: every intermediate unrounded) carries the storage roundings: worst 2.6e-3 (out) to 3.5e-3 (dw2). The CUDA
#: column (tensor cores, larger K) is measured on an H200 the same way.
GEMM_BOUNDS = {  # quantity: (interpreter, CUDA); CUDA: one H200's worst error plus 30% (benchmarks/gpu.sh tests), None
    # where only CPU tests check the quantity
    "act": (3e-4, 1.3e-4), "h": (3e-4, 9.6e-5), "out": (3e-4, 9.2e-5), "dh": (3e-4, 9.5e-5), "ds": (2e-7, 1.4e-6),
    "acts": (3e-4, 2.1e-5), "dx": (3e-4, 1.4e-4), "dw": (2e-7, 6.3e-6),
    "mlp.out": (3.5e-3, None), "mlp.dx": (4.5e-3, None), "mlp.dw13": (4.6e-3, None), "mlp.dw2": (4.6e-3, None),
    "mlp.ds": (4e-3, None),
    "fp8.act": (3e-4, 1.2e-3), "fp8.h": (3e-4, 9.1e-4), "fp8.out": (3e-4, 1.1e-3), "fp8.dh": (3e-4, 9.0e-4),
    "fp8.ds": (2e-7, 1.7e-4), "fp8.acts": (3e-4, 4.9e-5), "fp8.plain": (3e-4, None),
}


def check(key: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """got against the float64 ``ref`` rounded to got's dtype, within GEMM_BOUNDS[key] (the error is recorded for
    tools/measure_bounds.py)."""
    from megamoe.testing import note_error

    err = rel(got, ref.to(got.dtype) if got.dtype != torch.float32 else ref)
    note_error(f"gemm.{'cuda' if CUDA else 'cpu'}.{key}", err)
    bound = GEMM_BOUNDS[key][int(CUDA)]
    assert bound is not None, f"{key}: no CUDA bound measured (set it from benchmarks/gpu.sh tests)"
    assert err < bound, f"{key}: rel err {err:.3g} >= {bound:.3g}"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten().cpu(), b.double().flatten().cpu()
    return (a @ b / (a.norm() * b.norm())).item()


def make_problem(sizes: list[int], pad: int, H: int, I: int, seed: int = 0):
    from megamoe.testing import seed_offset

    g = torch.Generator().manual_seed(seed + 1000 * seed_offset())
    E = len(sizes)
    n = sum(sizes)
    R = n + pad
    offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(R, H, generator=g)
    x[n:] = float("nan")  # padding rows: never read as data
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    s = torch.rand(R, generator=g) + 0.5
    dy = torch.randn(R, H, generator=g)
    dy[n:] = float("nan")
    bf = lambda t: t.to(DEV, torch.bfloat16).contiguous()
    return dict(n=n, R=R, offs=offs.to(DEV), x=bf(x), w13=bf(w13), w2=bf(w2), s=s.to(DEV), dy=bf(dy))


def poisoned(shape, dtype=torch.bfloat16):
    return torch.full(shape, SENTINEL, device=DEV, dtype=dtype)


def check_padding_untouched(t: torch.Tensor, n: int) -> None:
    assert (t[n:].float() == SENTINEL).all(), "a padding row was written"


# Interpreter cases (small). Edges: groups of size 0, 1, 127, 129 (straddle the 32-row block), one group
# holding every row, every group empty; H = 40 and I = 24 are not multiples of the 32-wide blocks.
CPU_CASES = [
    pytest.param([0, 1, 127, 129], 5, id="sizes-0-1-127-129"),
    pytest.param([70], 3, id="one-group-all-rows"),
    pytest.param([0, 0, 0], 4, id="all-empty"),
]
CPU_CFG = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4)


def _forward_backward(p, cfg: GemmConfig, I: int):
    n, offs = p["n"], p["offs"]
    x64, w13_64, w2_64, s64 = p["x"].double(), p["w13"].double(), p["w2"].double(), p["s"].double()
    # GEMM1 + SwiGLU
    act, h = X.gemm1_swiglu(p["x"], p["w13"], offs, out=poisoned((p["R"], I)), h_out=poisoned((p["R"], 2 * I)),
                            config=cfg)
    ract, rh = X.gemm1_swiglu_ref(x64, w13_64, offs)
    check_padding_untouched(act, n)
    check_padding_untouched(h, n)
    if n:
        check("act", act[:n], ract[:n])
        check("h", h[:n], rh[:n])
    # GEMM2 with and without the gate scale
    for scale in (None, p["s"]):
        out = X.gemm2(act, p["w2"], offs, scale=scale, out=poisoned((p["R"], p["x"].shape[1])), config=cfg)
        rout = X.gemm2_ref(act.double(), w2_64, offs, scale=None if scale is None else s64)
        check_padding_untouched(out, n)
        if n:
            check("out", out[:n], rout[:n])
    # dgrad through SwiGLU (+ gate gradient), dgrad of GEMM1, both wgrads
    dh, ds = X.gemm2_dgrad_swiglu(p["dy"], p["w2"], h, offs, scale=p["s"], out=poisoned((p["R"], 2 * I)),
                                  config=cfg)
    rdh, rds = X.gemm2_dgrad_swiglu_ref(p["dy"].double(), w2_64, h.double(), offs, scale=s64)
    check_padding_untouched(dh, n)
    assert (ds[n:] == 0).all()
    if n:
        check("dh", dh[:n], rdh[:n])
        check("ds", ds[:n], rds[:n])
    # the same with the gated activation written too (the bf16 backward's dW2 operand): dh and ds unchanged
    acts = poisoned((p["R"], I))
    dh2, ds2 = X.gemm2_dgrad_swiglu(p["dy"], p["w2"], h, offs, scale=p["s"], config=cfg, acts_out=acts)
    check_padding_untouched(acts, n)
    assert (ds2[n:] == 0).all()
    if n:  # ds is summed in another order with acts (register use), so compared with the reference, not bitwise
        check("dh", dh2[:n], rdh[:n])
        check("ds", ds2[:n], rds[:n])
        g64, u64 = h[:n, :I].double(), h[:n, I:].double()
        check("acts", acts[:n], s64[:n, None] * g64 * torch.sigmoid(g64) * u64)
    dx = X.gemm1_dgrad(dh, p["w13"], offs, out=poisoned(tuple(p["x"].shape)), config=cfg)
    check_padding_untouched(dx, n)
    if n:
        check("dx", dx[:n], X.gemm1_dgrad_ref(dh.double(), w13_64, offs)[:n])
    dh_clean = torch.where(torch.arange(p["R"], device=DEV)[:, None] < n, dh, 0).double()
    x_clean = torch.nan_to_num(x64, nan=0.0)
    for xa, ya, xr, yr in ((dh, p["x"], dh_clean, x_clean), (act, dh[:, :I].contiguous(), act.double(),
                                                            dh_clean[:, :I])):
        dw = X.grouped_wgrad(xa, ya, offs, config=cfg)
        rdw = X.grouped_wgrad_ref(torch.nan_to_num(xr), torch.nan_to_num(yr), offs)
        empty = (offs[1:] - offs[:-1]).cpu() == 0
        assert (dw[empty.to(DEV)] == 0).all(), "an empty expert's weight gradient must be zero"
        if n:
            check("dw", dw, rdw)
        again = X.grouped_wgrad(xa, ya, offs, config=cfg)
        assert torch.equal(dw, again), "wgrad is not bitwise deterministic"


# every group-size case on the pointer path and on TMA with the flattened tile loop; the epilogue split in 2 (with
# 8 persistent programs instead of the interpreter's 4 SMs) and in 4 on the mixed-size case only
BF16_VARIANTS = [pytest.param(*case.values, False, 1, False, id=f"{case.id}-pointers") for case in CPU_CASES] + \
    [pytest.param(*case.values, True, 1, True, id=f"{case.id}-tma-flatten") for case in CPU_CASES] + \
    [pytest.param(*CPU_CASES[0].values, True, 2, False, id=f"{CPU_CASES[0].id}-tma-split2"),
     pytest.param(*CPU_CASES[0].values, False, 4, True, id=f"{CPU_CASES[0].id}-pointers-split4-flatten")]


@cpu_only
@pytest.mark.parametrize("sizes,pad,use_tma,epi_split,flatten", BF16_VARIANTS)
def test_bf16_ops_interpreter(sizes, pad, use_tma, epi_split, flatten):
    p = make_problem(sizes, pad, H=40, I=24)
    _forward_backward(p, CPU_CFG.with_(use_tma=use_tma, epi_split=epi_split, flatten=flatten,
                                       num_sms=8 if epi_split == 2 else None), I=24)


@cpu_only
def test_bf16_unaligned_k_pointer_path():
    # H = 36: rows of 72 bytes are not 16-byte aligned, so TMA is impossible; the default picks pointers.
    p = make_problem([5, 0, 9], 2, H=36, I=20)
    _forward_backward(p, CPU_CFG, I=20)
    with pytest.raises(ValueError, match="16-byte"):
        X.gemm1_swiglu(p["x"], p["w13"], p["offs"], config=CPU_CFG.with_(use_tma=True))


def test_validation_errors():
    p = make_problem([3, 4], 1, H=32, I=16)
    with pytest.raises(ValueError, match="offs must be int32"):
        X.gemm1_swiglu(p["x"], p["w13"], p["offs"].long())
    with pytest.raises(ValueError, match="K ="):
        X.gemm2(p["x"], p["w2"], p["offs"])
    with pytest.raises(ValueError, match="scale"):
        X.gemm2(torch.zeros(p["R"], 16, device=DEV, dtype=torch.bfloat16), p["w2"], p["offs"],
                scale=p["s"].double())
    h = torch.zeros(p["R"], 32, device=DEV, dtype=torch.bfloat16)
    dy = torch.zeros(p["R"], 32, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="acts_out"):  # [R, I] bf16 contiguous
        X.gemm2_dgrad_swiglu(dy, p["w2"], h, p["offs"], acts_out=torch.zeros(p["R"], 8, device=DEV,
                                                                             dtype=torch.bfloat16))
    q, s = X.quantize_act(p["x"])
    wq, ws = X.quantize_weight(p["w2"].transpose(1, 2))
    with pytest.raises(ValueError, match="1x128"):
        X.grouped_gemm_fp8(q, s[:, :0], wq, ws, p["offs"])
    with pytest.raises(ValueError, match="128x128"):
        X.grouped_gemm_fp8(q, s, wq, ws[:, :, :0], p["offs"])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        X.grouped_gemm_fp8(p["x"], s, wq, ws, p["offs"])
    with pytest.raises(ValueError, match="block_k must be 128"):
        X.grouped_gemm_fp8(q, s, wq, ws, p["offs"], config=GemmConfig(block_k=64))
    # the shared launcher refuses what its kernels cannot do: FP8 with a bias (or clamp, kn weights), and store_h
    # under the SwiGLU-backward epilogue (which reads STORE_H as "write acts", into out without them)
    from megamoe.kernels.gemm_config import EPI_DSWIGLU, EPI_NONE
    from megamoe.kernels.grouped_gemm import launch_grouped_gemm

    out = torch.zeros(p["R"], 32, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no bias or clamp"):
        launch_grouped_gemm(q, wq, p["offs"], out, GemmConfig(block_k=128), n=32, epilogue=EPI_NONE, a_s=s, w_s=ws,
                            bias=torch.zeros(1, 32, device=DEV))
    with pytest.raises(ValueError, match="grouped_gemm: store_h"):
        launch_grouped_gemm(dy, p["w2"], p["offs"], out, GemmConfig(), n=16, epilogue=EPI_DSWIGLU, h=h, store_h=True)


def test_experts_fn_autograd_and_determinism():
    sizes = [0, 33, 1, 40] if not CUDA else [0, 300, 1, 129, 1000]
    H, I = (40, 24) if not CUDA else (256, 192)
    p = make_problem(sizes, 6, H=H, I=I, seed=3)
    n, offs = p["n"], p["offs"]
    x = torch.nan_to_num(p["x"]).requires_grad_()
    w13 = p["w13"].clone().requires_grad_()
    w2 = p["w2"].clone().requires_grad_()
    s = p["s"].clone().requires_grad_()
    dy = torch.nan_to_num(p["dy"])
    grads = []
    for _ in range(2):
        for t in (x, w13, w2, s):
            t.grad = None
        out = X.experts_mlp(x, offs, w13, w2, s)
        out.backward(dy)
        grads.append([out.detach()[:n].clone()] +  # padding rows of out are unspecified
                      [t.grad.clone() for t in (x, w13, w2, s)])
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b), "forward/backward not bitwise deterministic"
    leaves = [t.detach().double().requires_grad_() for t in (x, w13, w2, s)]
    rout = X.experts_mlp_ref(leaves[0], offs, leaves[1], leaves[2], leaves[3])
    rout.backward(dy.double())
    out, dx, dw13, dw2, ds = grads[0]
    check("mlp.out", out, rout[:n])
    check("mlp.dx", dx[:n], leaves[0].grad[:n])
    assert (dx[n:] == 0).all()
    check("mlp.dw13", dw13, leaves[1].grad)
    check("mlp.dw2", dw2, leaves[2].grad)
    check("mlp.ds", ds[:n], leaves[3].grad[:n])


def _fp8_checks(p, cfg: GemmConfig | None, I: int):
    n, offs = p["n"], p["offs"]
    x, w13, w2 = p["x"], p["w13"], p["w2"]
    for pow2 in (False, True):
        q, s = X.quantize_act(x, pow2_scale=pow2)
        rq, rs = X.quantize_act_ref(x[:n], pow2_scale=pow2)
        assert torch.equal(s[:n], rs) and torch.equal(q[:n].float(), rq.float())
        wq, ws = X.quantize_weight(w13, pow2_scale=pow2)
        rwq, rws = X.quantize_weight_ref(w13, pow2_scale=pow2)
        assert torch.equal(ws, rws) and torch.equal(wq.float(), rwq.float())
        if pow2:
            assert torch.equal(torch.exp2(torch.log2(ws).round()), ws)
    q, s = X.quantize_act(x)
    # a device-side row count: rows below it as without it, rows from it on left unwritten
    qn, sn = X.quantize_act(x, nrows=torch.tensor([n], dtype=torch.int32, device=x.device))
    assert torch.equal(qn[:n].float(), q[:n].float()) and torch.equal(sn[:n], s[:n])
    with pytest.raises(ValueError, match="nrows"):
        X.quantize_act(x, nrows=torch.tensor([n], dtype=torch.int64, device=x.device))
    wq, ws = X.quantize_weight(w13)
    act8, h8 = poisoned((p["R"], I)), poisoned((p["R"], 2 * I))
    got = X.gemm1_swiglu_fp8(q, s, wq, ws, offs, out=act8, h_out=h8, config=cfg)
    assert got[0] is act8 and got[1] is h8
    check_padding_untouched(act8, n)
    check_padding_untouched(h8, n)
    xd = X.dequantize_act_ref(q[:n], s[:n])
    ract_q, rh_q = X.gemm1_swiglu_ref(torch.cat([xd, xd.new_zeros(p["R"] - n, xd.shape[1])]),
                                      X.dequantize_weight_ref(wq, ws), offs)
    act16, h16 = X.gemm1_swiglu(x, w13, offs)
    if n:
        # against the float64 product of the same quantised operands: only accumulation/rounding error
        check("fp8.act", act8[:n], ract_q[:n])
        check("fp8.h", h8[:n], rh_q[:n])
        # against the bf16 kernel: the e4m3 quantisation error itself
        assert rel(h8[:n], h16[:n]) < 5e-2 and cosine(h8[:n], h16[:n]) >= 0.999
        assert rel(act8[:n], act16[:n]) < 6e-2 and cosine(act8[:n], act16[:n]) >= 0.998
    aq, a_s = X.quantize_act(act16)
    w2q, w2s = X.quantize_weight(w2)
    out8 = X.gemm2_fp8(aq, a_s, w2q, w2s, offs, scale=p["s"], config=cfg)
    out16 = X.gemm2(act16, w2, offs, scale=p["s"])
    if n:
        rout8 = X.grouped_gemm_fp8_ref(aq[:n], a_s[:n], w2q, w2s, offs, scale=p["s"][:n].double())
        check("fp8.out", out8[:n], rout8)
        ract8, _ = X.gemm1_swiglu_fp8_ref(q[:n], s[:n], wq, ws, offs)
        check("fp8.act", act8[:n], ract8)
    dyq, dys = X.quantize_act(p["dy"])
    w2tq, w2ts = X.quantize_weight(w2.transpose(1, 2))
    dh8 = poisoned((p["R"], 2 * I))
    dh8_, ds8 = X.gemm2_dgrad_swiglu_fp8(dyq, dys, w2tq, w2ts, h16, offs, scale=p["s"], out=dh8, config=cfg)
    assert dh8_ is dh8
    check_padding_untouched(dh8, n)
    dh16, ds16 = X.gemm2_dgrad_swiglu(p["dy"], w2, h16, offs, scale=p["s"])
    if n:  # against the float64 twin on the same quantised operands
        rdh8, rds8 = X.gemm2_dgrad_swiglu_fp8_ref(dyq, dys, w2tq, w2ts, h16, offs, scale=p["s"])
        check("fp8.dh", dh8[:n], rdh8[:n])
        check("fp8.ds", ds8[:n], rds8[:n])
    # with the gated activation written too (the FP8 split backward's dW2 operand): dh and ds as without it
    acts8 = poisoned((p["R"], I))
    dh8a, ds8a = X.gemm2_dgrad_swiglu_fp8(dyq, dys, w2tq, w2ts, h16, offs, scale=p["s"], config=cfg, acts_out=acts8)
    check_padding_untouched(acts8, n)
    assert (ds8a[n:] == 0).all()
    if n:
        check("fp8.dh", dh8a[:n], rdh8[:n])
        check("fp8.ds", ds8a[:n], rds8[:n])
        g64, u64 = h16[:n, :I].double(), h16[:n, I:].double()
        check("fp8.acts", acts8[:n], p["s"][:n, None].double() * g64 * torch.sigmoid(g64) * u64)
    with pytest.raises(ValueError, match="acts_out"):  # [R, I] bf16 contiguous
        X.gemm2_dgrad_swiglu_fp8(dyq, dys, w2tq, w2ts, h16, offs, scale=p["s"], config=cfg,
                                 acts_out=torch.zeros(p["R"], I, device=h16.device, dtype=torch.float32))
    dhq, dhs = X.quantize_act(dh16)
    w13tq, w13ts = X.quantize_weight(w13.transpose(1, 2))
    dx8 = X.gemm1_dgrad_fp8(dhq, dhs, w13tq, w13ts, offs, config=cfg)
    dx16 = X.gemm1_dgrad(dh16, w13, offs)
    if n:
        for a8, a16 in ((out8, out16), (dx8, dx16)):
            assert rel(a8[:n], a16[:n]) < 5e-2 and cosine(a8[:n], a16[:n]) >= 0.999
        assert rel(dh8[:n], dh16[:n]) < 6e-2 and cosine(dh8[:n], dh16[:n]) >= 0.998
        assert rel(ds8[:n], ds16[:n]) < 5e-2


# the problem's padding rows are NaN on purpose (they must never reach a data row); quantising them takes the max
# of an all-NaN row, on which the interpreter's numpy warns
@cpu_only
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("use_tma,epi_split", [(False, 1), (True, 2)], ids=["pointers", "tma-split2"])
def test_fp8_interpreter(use_tma, epi_split):
    # groups 0, 1, 129 and one large; H = 160 and I = 144 are not multiples of 128 (partial scale blocks)
    p = make_problem([0, 1, 129, 70], 3, H=160, I=144, seed=1)
    _fp8_checks(p, GemmConfig(block_m=32, block_n=32, block_k=128, group_m=2, num_stages=1, num_warps=4,
                              use_tma=use_tma, epi_split=epi_split), I=144)


# ------------------------------------------------------------------------------------------------ GPU
GPU_CASES = [
    pytest.param([0, 1, 127, 129, 2000, 0, 513, 64], 37, id="mixed-0-1-127-129"),
    pytest.param([4099], 5, id="one-group-all-rows"),
]


@gpu
@pytest.mark.parametrize("variant", ["default", "pointers", "tma-flatten", "two-per-sm"])
@pytest.mark.parametrize("sizes,pad", GPU_CASES)
def test_bf16_ops_gpu(sizes, pad, variant):
    H, I = 1040, 776  # not multiples of the 64/128/256 blocks, but 16-byte aligned (TMA allowed)
    p = make_problem(sizes, pad, H=H, I=I, seed=7)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    cfg = {"default": None,  # on Hopper: the Gluon kernels where they can run (megamoe.experts.choose_config)
           "pointers": GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=3, num_warps=4, use_tma=False,
                                  epi_split=2),
           "tma-flatten": GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=8,
                                     epi_split=2, flatten=True),
           # two persistent programs per SM: one's epilogue under the other's k-loop
           "two-per-sm": GemmConfig(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4, epi_split=2,
                                    num_sms=2 * sms)}[variant]
    _forward_backward(p, cfg, I=I)


@gpu
@pytest.mark.parametrize("sizes,pad", GPU_CASES)
def test_fp8_gpu(sizes, pad):
    p = make_problem(sizes, pad, H=1040, I=776, seed=9)
    _fp8_checks(p, None, I=776)


def test_pin_config_forces_the_config():
    # H = 36: unaligned for TMA; pinning use_tma=True must reach the launcher and raise there
    p = make_problem([4, 3], 1, H=36, I=16)
    with pytest.raises(ValueError, match="16-byte"), X.pin_config("gemm1_swiglu", GemmConfig(use_tma=True)):
        X.gemm1_swiglu(p["x"], p["w13"], p["offs"])
    with pytest.raises(ValueError, match="epi_split"):
        GemmConfig(block_n=32, epi_split=8)


@cpu_only
def test_kernel_choice_on_cpu(monkeypatch):
    # the Gluon kernels need an sm_90 CUDA device and no interpreter: with no config every op runs its Triton kernel
    # here; a config naming kernel="gluon" (given or pinned) raises with the reason, for every op family
    p = make_problem([3, 4], 1, H=256, I=128)
    R, offs, x, w13, w2 = p["R"], p["offs"], p["x"], p["w13"], p["w2"]
    act = torch.nan_to_num(x[:, :128]).contiguous()
    h = torch.zeros(R, 256, device=DEV, dtype=torch.bfloat16)
    q, s = X.quantize_act(torch.nan_to_num(x))
    wq, ws = X.quantize_weight(w2.transpose(1, 2).contiguous())  # [E_l, I, H]: a plain GEMM, N = 128, K = 256
    for op, a, w, kw in (("gemm2", act, w2, dict(n=256)), ("dgrad1", h, w13, dict(n=256, w_kn=True)),
                         ("dgrad_swiglu", x, w2, dict(n=128, epilogue=EPI_DSWIGLU, w_kn=True, h=h)),
                         ("grouped_gemm_fp8", q, wq, dict(n=128)),
                         ("dgrad_swiglu_fp8", q, wq, dict(n=128, epilogue=EPI_DSWIGLU, h=h))):
        want = X.default_config(op, R, kw["n"], a.shape[1], kernel="triton" if op.endswith("fp8") else None)
        assert X.choose_config(op, None, a, w, **kw) == want, op
        assert want.kernel in (None, "triton")
    gluon = CPU_CFG.with_(kernel="gluon")
    gluon8 = gluon.with_(block_k=128)
    calls = {
        "gemm1_swiglu": lambda: X.gemm1_swiglu(x, w13, offs, config=gluon),
        "gemm2": lambda: X.gemm2(act, w2, offs, config=gluon),
        "grouped_gemm": lambda: X.grouped_gemm(x, w13, offs, config=gluon),
        "dgrad_swiglu": lambda: X.gemm2_dgrad_swiglu(torch.nan_to_num(p["dy"]), w2, h, offs, config=gluon),
        "dgrad1": lambda: X.gemm1_dgrad(h, w13, offs, config=gluon),
        "wgrad": lambda: X.grouped_wgrad(act, act, offs, config=gluon),
        "grouped_gemm_fp8": lambda: X.grouped_gemm_fp8(q, s, wq, ws, offs, config=gluon8),
        "dgrad_swiglu_fp8": lambda: X.gemm2_dgrad_swiglu_fp8(q, s, wq, ws, h, offs, config=gluon8),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"{op}: the config pins kernel='gluon', but the interpreter"):
            call()
    with pytest.raises(ValueError, match="kernel='gluon'.*interpreter"), X.pin_config("gemm2_fp8", gluon8):
        X.gemm2_fp8(q, s, wq, ws, offs)
    # outside the interpreter the CPU operands are the reason
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="kernel='gluon'.*not a CUDA device"):
        X.gemm2(act, w2, offs, config=gluon)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # an explicit Triton config runs the Triton kernel, as kernel None does
    out = X.grouped_gemm_fp8(q, s, wq, ws, offs, config=CPU_CFG.with_(block_k=128, kernel="triton"))
    check("fp8.plain", out[:p["n"]], X.grouped_gemm_fp8_ref(q[:p["n"]], s[:p["n"]], wq, ws, offs))
    assert torch.equal(out[:p["n"]], X.grouped_gemm_fp8(q, s, wq, ws, offs, config=CPU_CFG.with_(block_k=128))[:p["n"]])


def test_kernel_choice_as_on_hopper(monkeypatch):
    """megamoe.experts.choose_config as it decides on an sm_90 device (the device check stubbed out, the GPU's default
    configs): with no config each op of GLUON_OPS gets its Gluon kernel's default where that kernel's limits hold and
    the Triton kernel's where they fail; a config naming kernel="gluon" raises with the failing limit; a config with
    kernel None or "triton", or a pinned one, is taken as it is; GEMM1's dgrad has no Gluon kernel. Nothing runs:
    the operands are empty CPU tensors of the shapes (the choice reads shapes, strides and alignment only)."""
    from megamoe.kernels import gemm_config

    monkeypatch.setattr(X, "gluon_device_reason", lambda t, cfg: None)
    monkeypatch.setattr(gemm_config, "interpreting", lambda: False)
    E, R, H, I = 2, 40, 256, 128
    bf = lambda *shape: torch.empty(shape, dtype=torch.bfloat16)  # noqa: E731
    f8 = lambda *shape: torch.empty(shape, dtype=torch.float8_e4m3fn)  # noqa: E731
    swiglu, dswiglu = EPI_SWIGLU, EPI_DSWIGLU
    h = bf(R, 2 * I)
    runs_gluon = [  # op, a [R, K] (wgrad: x [R, M]), w (wgrad: y [R, N]), choose_config's keywords
        ("gemm1_swiglu", bf(R, H), bf(E, 2 * I, H), dict(n=I, epilogue=swiglu, n_up=I)),
        ("gemm2", bf(R, I), bf(E, H, I), dict(n=H)),
        ("grouped_gemm", bf(R, H), bf(E, 2 * I, H), dict(n=2 * I)),
        ("dgrad_swiglu", bf(R, H), bf(E, H, I), dict(n=I, epilogue=dswiglu, w_kn=True, h=h)),
        ("wgrad", bf(R, 2 * I), bf(R, H), dict(n=H, out_dtype=torch.float32)),
        ("wgrad", bf(R, 2 * I), bf(R, H), dict(n=H, out_dtype=torch.bfloat16)),
        ("gemm1_swiglu_fp8", f8(R, H), f8(E, 2 * I, H), dict(n=I, epilogue=swiglu, n_up=I)),
        ("gemm2_fp8", f8(R, I), f8(E, H, I), dict(n=H)),
        ("grouped_gemm_fp8", f8(R, I), f8(E, H, I), dict(n=H)),
        ("dgrad1_fp8", f8(R, 2 * I), f8(E, H, 2 * I), dict(n=H)),
        ("dgrad_swiglu_fp8", f8(R, H), f8(E, I, H), dict(n=I, epilogue=dswiglu, h=h)),
    ]
    assert {c[0] for c in runs_gluon} == set(GLUON_OPS)
    for op, a, w, kw in runs_gluon:
        n = w.shape[1] if op == "wgrad" else kw["n"]
        want = X.default_config(op, R, n, a.shape[1], kernel="gluon")
        assert want.kernel == "gluon" and want.block_m == 128, (op, want)  # the GPU's default, not the interpreter's
        assert X.choose_config(op, None, a, w, **kw) == want, op
        assert X.gluon_reason(op, want, a, w, **kw) is None, op
        for given in (GemmConfig(block_m=64, block_n=64), GemmConfig(block_m=64, block_n=64, kernel="triton")):
            assert X.choose_config(op, given, a, w, **kw) is given, op  # taken as it is: the Triton kernel
        with X.pin_config(op, CPU_CFG):
            assert X.choose_config(op, None, a, w, **kw) is CPU_CFG, op
    # a Gluon limit fails: the default is the Triton kernel's, kernel="gluon" raises naming the limit
    runs_triton = [  # op, a, w, keywords, what the reason says
        ("dgrad1", bf(R, 2 * I), bf(E, 2 * I, H), dict(n=H, w_kn=True), "GEMM1's dgrad .kn weights. runs the Triton"),
        ("grouped_gemm", bf(R, 2 * I), bf(E, 2 * I, H), dict(n=H, w_kn=True), "GEMM1's dgrad"),
        ("gemm2", bf(R, 100), bf(E, H, 100), dict(n=H), "TMA needs 16-byte aligned"),  # 200-byte rows
        ("dgrad_swiglu", bf(R, 200), bf(E, 200, I), dict(n=I, epilogue=dswiglu, w_kn=True, h=h),
         "K must be a multiple of 64"),
        ("wgrad", bf(R, 96), bf(R, H), dict(n=H, out_dtype=torch.float32), "M must be a multiple of 64"),
        ("wgrad", bf(R, 2 * I), bf(R, H), dict(n=H, out_dtype=torch.float16), "bfloat16 or float32"),
        ("gemm1_swiglu_fp8", f8(R, H), f8(E, 400, H), dict(n=200, epilogue=swiglu, n_up=200),
         "multiples of block_n"),  # I = 200: the default's 64-column tiles do not divide it, nor 128
        ("dgrad_swiglu_fp8", f8(R, H), f8(E, 192, H), dict(n=192, epilogue=dswiglu, h=bf(R, 384)),
         "N must be a multiple of 128"),
        ("gemm2_fp8", f8(R, 136), f8(E, H, 136), dict(n=H), "TMA needs 16-byte aligned"),  # 136-byte rows
    ]
    for op, a, w, kw, why in runs_triton:
        n = w.shape[1] if op == "wgrad" else kw["n"]
        cfg = X.choose_config(op, None, a, w, **kw)
        assert cfg == X.default_config(op, R, n, a.shape[1], kernel="triton" if "fp8" in op else None), op
        assert cfg.kernel != "gluon", op
        gluon = X.default_config(op, R, n, a.shape[1], kernel="gluon") if op in GLUON_OPS else \
            GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=4, kernel="gluon")
        with pytest.raises(ValueError, match=f"{op}: the config pins kernel='gluon', but .*{why}"):
            X.choose_config(op, gluon, a, w, **kw)
    with pytest.raises(ValueError, match="no Gluon kernel"):
        X.default_config("dgrad1", R, H, 2 * I, kernel="gluon")
    # a config outside the kernel's own limits, where the shapes are fine
    a, w = bf(R, I), bf(E, H, I)
    with pytest.raises(ValueError, match=r"gemm2: .*block_n must be one of \(128, 256\)"):
        X.choose_config("gemm2", GemmConfig(block_m=128, block_n=64, num_warps=4, kernel="gluon"), a, w, n=H)
    with pytest.raises(ValueError, match="kernel='gluon'.*block_n must be one of"), \
            X.pin_config("gemm2", GemmConfig(block_m=128, block_n=64, num_warps=4, kernel="gluon")):
        X.choose_config("gemm2", None, a, w, n=H)


def test_gluon_limits():
    # the limits of each Gluon kernel (configs and shapes; the device is checked elsewhere), on the messages that
    # megamoe.experts.choose_config reports
    from megamoe.kernels.gluon.bf16 import ws_bf16_limits
    from megamoe.kernels.gluon.fp8 import ws_limits
    from megamoe.kernels.gluon.fp8_dswiglu import dswiglu_limits
    from megamoe.kernels.gluon.wgrad import ws_wgrad_limits

    none, swiglu, dswiglu = EPI_NONE, EPI_SWIGLU, EPI_DSWIGLU
    # the warp-specialised FP8 kernel: plain (any N) and SwiGLU (gate / up tiles of block_n) epilogues
    ws_cfg = GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=4, num_warps=4, kernel="gluon")
    assert ws_limits(ws_cfg, n=128, k=256, n_w=128, epilogue=none) is None
    assert "plain and the SwiGLU" in ws_limits(ws_cfg, n=128, k=256, n_w=128, epilogue=dswiglu)
    assert ws_limits(ws_cfg, n=128, k=256, n_w=256, epilogue=swiglu, n_up=128) is None
    wide = ws_cfg.with_(block_n=256)
    assert "block_n must be one of (64, 128)" in ws_limits(wide, n=256, k=256, n_w=512, epilogue=swiglu, n_up=256)
    assert ws_limits(wide, n=384, k=256, n_w=384, epilogue=none) is None  # any N: the last tile is clipped
    assert "equal the weight rows" in ws_limits(wide, n=384, k=256, n_w=512, epilogue=none)
    assert "multiples of block_n 128" in ws_limits(ws_cfg, n=192, k=256, n_w=384, epilogue=swiglu, n_up=192)
    assert "num_warps 4" in ws_limits(ws_cfg.with_(num_warps=8), n=128, k=256, n_w=128, epilogue=none)
    assert "block_k must be 128" in ws_limits(ws_cfg.with_(block_k=64), n=128, k=256, n_w=128, epilogue=none)
    assert "shared memory" in ws_limits(ws_cfg.with_(num_stages=8), n=128, k=256, n_w=128, epilogue=none)
    assert "num_stages" in ws_limits(ws_cfg.with_(num_stages=1), n=128, k=256, n_w=128, epilogue=none)
    assert "multiple of 16" in ws_limits(ws_cfg, n=128, k=200, n_w=128, epilogue=none)
    # the warp-specialised bf16 kernel (cooperative): plain and SwiGLU on nk weights, the SwiGLU backward on kn
    coop = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=4, num_warps=4, kernel="gluon")
    assert ws_bf16_limits(coop, n=320, k=1000, n_w=320, epilogue=none) is None  # any N, K % 8 == 0
    assert ws_bf16_limits(coop.with_(block_n=128), n=192, k=64, n_w=384, epilogue=swiglu, n_up=192) is None
    assert ws_bf16_limits(coop.with_(block_n=128), n=200, k=128, n_w=200, epilogue=dswiglu, w_kn=True) is None
    assert "as kn weights" in ws_bf16_limits(coop, n=128, k=64, n_w=128, epilogue=dswiglu)
    assert "multiple of 8" in ws_bf16_limits(coop.with_(block_n=128), n=100, k=64, n_w=100, epilogue=dswiglu,
                                             w_kn=True)
    assert "block_n must be one of (64, 128)" in ws_bf16_limits(coop, n=256, k=64, n_w=256, epilogue=dswiglu,
                                                                 w_kn=True)
    assert "block_n must be one of (128, 256)" in ws_bf16_limits(coop.with_(block_n=64), n=256, k=64, n_w=256,
                                                                  epilogue=none)
    assert "plain and the SwiGLU-backward epilogues only" in ws_bf16_limits(coop.with_(block_n=128), n=128, k=64,
                                                                            n_w=256, epilogue=swiglu, w_kn=True,
                                                                            n_up=128)
    assert "multiple of 64" in ws_bf16_limits(coop.with_(block_n=128), n=128, k=100, n_w=128, epilogue=dswiglu,
                                              w_kn=True)
    assert "block_k must be 64" in ws_bf16_limits(coop.with_(block_k=128), n=256, k=64, n_w=256, epilogue=none)
    assert "num_warps 4" in ws_bf16_limits(coop.with_(num_warps=8), n=256, k=64, n_w=256, epilogue=none)
    assert "shared memory" in ws_bf16_limits(coop.with_(num_stages=5), n=256, k=64, n_w=256, epilogue=none)
    assert "shared memory" in ws_bf16_limits(coop.with_(block_n=128, num_stages=5), n=128, k=64, n_w=128,
                                             epilogue=dswiglu, w_kn=True)
    assert "multiple of 8" in ws_bf16_limits(coop, n=256, k=100, n_w=256, epilogue=none)
    assert "exceed" in ws_bf16_limits(coop.with_(block_n=128), n=128, k=64, n_w=200, epilogue=swiglu, n_up=128)
    assert "unknown epilogue" in ws_bf16_limits(coop, n=256, k=64, n_w=256, epilogue=5)
    # the FP8 SwiGLU backward
    ds_cfg = GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=4, num_warps=8, kernel="gluon")
    assert dswiglu_limits(ds_cfg, n=256, k=1040, n_w=256) is None
    assert dswiglu_limits(ds_cfg.with_(block_m=64, block_n=64, num_warps=4), n=64, k=256, n_w=64) is None
    assert "block_k must be 128" in dswiglu_limits(ds_cfg.with_(block_k=64), n=256, k=256, n_w=256)
    assert "(block_m, num_warps) must be one of" in dswiglu_limits(ds_cfg.with_(num_warps=4), n=256, k=256, n_w=256)
    assert "block_n must be 64 or 128" in dswiglu_limits(ds_cfg.with_(block_n=256), n=256, k=256, n_w=256)
    assert "num_stages" in dswiglu_limits(ds_cfg.with_(num_stages=1), n=256, k=256, n_w=256)
    assert "shared memory" in dswiglu_limits(ds_cfg.with_(num_stages=6), n=256, k=256, n_w=256)
    assert "multiple of 16" in dswiglu_limits(ds_cfg, n=256, k=200, n_w=256)
    assert "N must be a multiple of 128" in dswiglu_limits(ds_cfg, n=200, k=256, n_w=200)
    assert "equal the weight rows" in dswiglu_limits(ds_cfg, n=256, k=256, n_w=384)
    # the weight gradient
    wg_cfg = GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=6, num_warps=4, kernel="gluon")
    for dt in (torch.bfloat16, torch.float32):
        assert ws_wgrad_limits(wg_cfg, m=4096, n=7168, out_dtype=dt) is None
    assert "needs block_m 128" in ws_wgrad_limits(wg_cfg.with_(num_warps=8), m=256, n=256, out_dtype=torch.float32)
    assert "needs block_m 128" in ws_wgrad_limits(wg_cfg.with_(block_k=128), m=256, n=256, out_dtype=torch.float32)
    assert "num_stages" in ws_wgrad_limits(wg_cfg.with_(num_stages=1), m=256, n=256, out_dtype=torch.float32)
    assert "bfloat16 or float32" in ws_wgrad_limits(wg_cfg, m=256, n=256, out_dtype=torch.float16)
    big = wg_cfg.with_(block_k=64, num_stages=4)
    assert "shared memory" in ws_wgrad_limits(big, m=256, n=256, out_dtype=torch.bfloat16)
    assert "multiple of 64" in ws_wgrad_limits(wg_cfg, m=96, n=256, out_dtype=torch.float32)
    assert "N of 8" in ws_wgrad_limits(wg_cfg, m=128, n=100, out_dtype=torch.float32)


def test_default_configs_and_kernel_values():
    # default_config with a kernel: "gluon" for the ops of GLUON_OPS (only those), "triton" / None the Triton
    # kernel's; GemmConfig.kernel takes None, "gluon" or "triton" only
    from megamoe.kernels.gemm_config import OPS

    for op in OPS:
        if op in GLUON_OPS:
            assert X.default_config(op, 4096, 768, 2048, kernel="gluon").kernel == "gluon", op
        else:
            with pytest.raises(ValueError, match="no Gluon kernel"):
                X.default_config(op, 4096, 768, 2048, kernel="gluon")
        assert X.default_config(op, 4096, 768, 2048).kernel is None or op.endswith("fp8"), op
        assert X.default_config(op, 4096, 768, 2048, kernel="triton").kernel in (None, "triton"), op
    assert set(GLUON_OPS) == set(OPS) - {"dgrad1"}
    assert X.default_config("gemm2_fp8", 8, 128, 128, kernel="triton").kernel == "triton"
    for bad in ("cutlass", "gluon_ws"):
        with pytest.raises(ValueError, match="kernel must be one of"):
            GemmConfig(kernel=bad)
        with pytest.raises(ValueError, match="kernel must be one of"):
            X.default_config("gemm2", 8, 128, 128, kernel=bad)


@pytest.mark.parametrize("shape", [(2, 256, 384), (1, 200, 130)], ids=["blocks", "partial-blocks"])
def test_quantize_weight_transposed_without_a_copy(shape):
    # the dgrad GEMMs' weights: quantising w.transpose(1, 2) (flag or view) equals quantising a transposed copy
    # bitwise, and the twin; partial 128-blocks on both axes included
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(shape, generator=gen) * 3).to(DEV, torch.bfloat16)
    wt = w.transpose(1, 2).contiguous()
    ref_q, ref_s = X.quantize_weight(wt)
    for q, s in (X.quantize_weight(w, transpose=True), X.quantize_weight(w.transpose(1, 2))):
        assert q.shape == wt.shape and s.shape == ref_s.shape
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    tq, ts = X.quantize_weight_ref(wt.cpu())
    assert torch.equal(ref_q.cpu().view(torch.uint8), tq.view(torch.uint8)) and torch.equal(ref_s.cpu(), ts)
    # a transposed view asked for its transpose is the base tensor quantised as it is
    q2, s2 = X.quantize_weight(w.transpose(1, 2), transpose=True)
    q3, s3 = X.quantize_weight(w)
    assert torch.equal(q2.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(s2, s3)
    # both orientations from one pass (the split layer's FP8 weight cache): bitwise the two calls above
    bq, bs, bqt, bst = X.quantize_weight_both(w)
    assert torch.equal(bq.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(bs, s3)
    assert torch.equal(bqt.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(bst, ref_s)
    with pytest.raises(ValueError, match="contiguous"):
        X.quantize_weight_both(w.transpose(1, 2))


# small shapes with K or N under one block (where the one-pass kernel went wrong for float32 on an H200), partial
# blocks on both axes, and an expert shape of qwen3-30b-a3b's w2 at EP 4 (GPU only: too slow for the interpreter)
QUANT_SHAPES = [(2, 64, 40), (2, 64, 48), (2, 128, 40), (2, 64, 128), (3, 200, 136),
                pytest.param((32, 2048, 768), marks=gpu, id="qwen3-w2-ep4")]


@pytest.mark.parametrize("path", ["row-slices", "column-slices", "two-passes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", QUANT_SHAPES)
def test_quantize_weight_both_equals_the_twin(shape, dtype, path, monkeypatch):
    # both orientations against the torch twins, bitwise: one pass with the transposed orientation from row slices
    # or from its own column slices (COLS_T), or two single-orientation passes (what float32 weights take on GPUs,
    # fp8_quant.one_pass_ok; forced here, since the interpreter allows one pass for every dtype)
    from megamoe.kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "INTERPRETER_TILES", False)  # the tiling the GPU runs (CHUNK < 128)
    for mode in ("one", "both"):
        chunk, warps, _ = fp8_quant.WEIGHT_QUANT_CONFIG[mode]
        monkeypatch.setitem(fp8_quant.WEIGHT_QUANT_CONFIG, mode, (chunk, warps, path == "column-slices"))
    if path == "two-passes":
        monkeypatch.setattr(fp8_quant, "one_pass_ok", lambda w: False)
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(shape, generator=gen) * 3).to(DEV, dtype)
    got = X.quantize_weight_both(w)
    want = (*X.quantize_weight_ref(w), *X.quantize_weight_ref(w.transpose(1, 2).contiguous()))
    for name, a, b in zip(("q", "s", "qt", "st"), got, want, strict=True):
        a8, b8 = fp8_bits(a), fp8_bits(b)
        assert torch.equal(a8, b8), f"{name}: {int((a8 != b8).sum())} of {a.numel()} elements differ"


@pytest.mark.parametrize("tiles", [True, False], ids=["interpreter-tiles", "gpu-tiles"])
def test_quantize_act_tilings_equal_the_twin(tiles, monkeypatch):
    # the activations' quantisation and its inverse against the torch twins, bitwise, with the row tiles the GPU
    # runs (32 rows per program) and those the interpreter takes (fp8_quant.INTERPRETER_TILES: 128; on a GPU both
    # ids run the GPU's): 200 rows (several tiles, a partial last one), K = 300 (a partial last scale block), and a
    # device-side row count that ends inside a tile
    from megamoe.kernels import fp8_quant

    monkeypatch.setattr(fp8_quant, "INTERPRETER_TILES", tiles)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(200, 300, generator=gen) * 4).to(DEV, torch.bfloat16)
    for pow2 in (False, True):
        q, s = X.quantize_act(x, pow2_scale=pow2)
        rq, rs = X.quantize_act_ref(x, pow2_scale=pow2)
        assert torch.equal(fp8_bits(q), fp8_bits(rq)) and torch.equal(s, rs)
        qn, sn = X.quantize_act(x, pow2_scale=pow2, nrows=torch.tensor([150], dtype=torch.int32, device=DEV))
        assert torch.equal(fp8_bits(qn[:150]), fp8_bits(rq[:150])) and torch.equal(sn[:150], rs[:150])
        back = X.dequantize_act(q, s)
        assert torch.equal(back, X.dequantize_act_ref(q, s, torch.float32).to(torch.bfloat16))


@cpu_only
def test_interpreter_patches_keep_upstream_answers():
    """megamoe.kernels.interpreter's speed patches answer as the interpreter's own functions do: the numpy dtype
    table for every triton dtype; bf16 -> fp32 by a shift, bit for bit upstream's conversion except on bf16
    subnormals (where upstream drops the mantissa's leading bit: the GPU's conversion is the exact shift); fp32 ->
    bf16 rounds to nearest even, as torch does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    get, conv = interpreter._get_np_dtype, interpreter._convert_float
    assert hasattr(get, "upstream") and hasattr(conv, "upstream"), "megamoe.kernels.interpreter.apply() did not run"
    types = [v for v in vars(tl).values() if isinstance(v, tl.dtype) and not isinstance(v, tl.pointer_type)]
    types += [tl.pointer_type(tl.float32), tl.block_type(tl.bfloat16, [4]),
              tl.block_type(tl.pointer_type(tl.int8), [2])]
    known = 0
    for t in types:
        try:
            want = get.upstream(t)
        except KeyError:
            with pytest.raises(KeyError):
                get(t)
            continue
        assert get(t) == want, t
        known += 1
    assert known >= 19
    bits = np.random.default_rng(0).integers(0, 2**16, size=(300, 500), dtype=np.uint16)
    ours, theirs = conv(bits, tl.bfloat16, tl.float32, None), conv.upstream(bits, tl.bfloat16, tl.float32, None)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    exact = bits.astype(np.uint32) << np.uint32(16)
    assert np.array_equal(ours, exact)
    subnormal = ((bits >> 7) & 0xFF) == 0
    assert np.array_equal(ours[~subnormal], theirs[~subnormal])
    f32 = torch.randn(4096, dtype=torch.float32) * 3
    rne = conv(f32.numpy(), tl.float32, tl.bfloat16, None)
    assert np.array_equal(rne, f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
