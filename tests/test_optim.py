"""megamoe.optim.MasterAdamW against torch.optim.AdamW: float32 parameters, bf16 parameters with float32 masters,
gradient multipliers, the Triton kernel (interpreter on CPU, CUDA with ``-m gpu``) vs the torch-ops path, state
save/restore, bf16 moments with stochastic rounding, and input checks."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megamoe.optim import MasterAdamW  # noqa: E402
from megamoe.testing import fp8_bits  # noqa: E402

CUDA = torch.cuda.is_available()
# the Triton kernel on CPU tensors runs under the interpreter, set above only on machines without CUDA
cpu_triton = pytest.mark.skipif(CUDA, reason="the interpreter case; the gpu case covers the kernel on CUDA")
IMPLS = [("cpu", "torch"), pytest.param("cpu", "triton", marks=cpu_triton),
         pytest.param("cuda", None, marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
HP = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [[(64, 33), (33,)], [(3, 16, 8), (5,)]]  # two sets; odd sizes leave partial kernel blocks


def _params(device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in grp] for grp in SHAPES]


def _grads(sets, step, dtype):
    gen = torch.Generator().manual_seed(1000 + step)
    return [[torch.randn(p.shape, generator=gen).to(p.device, dtype) for p in grp] for grp in sets]


def _torch_adamw(sets):
    """torch's AdamW with our grouping: weight decay on parameters of 2 or more dims."""
    flat = [p for grp in sets for p in grp]
    groups = [{"params": [p for p in flat if p.dim() >= 2], "weight_decay": HP["weight_decay"]},
              {"params": [p for p in flat if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])


@pytest.mark.parametrize("device,impl", IMPLS)
def test_float32_params_follow_torch_adamw_with_multipliers(device, impl):
    ours, ref = _params(device, torch.float32), _params(device, torch.float32)
    opt = MasterAdamW(ours, impl=impl, **HP)
    topt = _torch_adamw(ref)
    for step in range(4):
        mults = [torch.tensor(0.5 + 0.1 * step, device=device), torch.tensor(0.25, device=device)]
        for grp_o, grp_r, grads, mult in zip(ours, ref, _grads(ours, step, torch.float32), mults, strict=True):
            for po, pr, g in zip(grp_o, grp_r, grads, strict=True):
                po.grad = g.clone()
                pr.grad = g * mult  # what the multiplier stands for: clip and 1/W applied to the grads first
        opt.lr = HP["lr"] * (1 + step)  # a schedule: lr is read at every step
        for grp in topt.param_groups:
            grp["lr"] = opt.lr
        opt.step(mults)
        topt.step()
        for grp_o, grads in zip(ours, _grads(ours, step, torch.float32), strict=True):
            for po, g in zip(grp_o, grads, strict=True):
                assert torch.equal(po.grad, g), "step must leave the grads as they were"
    for po, pr in zip(sum(ours, []), sum(ref, []), strict=True):
        torch.testing.assert_close(po, pr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,impl", IMPLS)
def test_bf16_params_step_float32_masters(device, impl):
    ours = _params(device, torch.bfloat16)
    ref = [[p.detach().float().requires_grad_() for p in grp] for grp in ours]  # torch AdamW on float32 copies
    opt = MasterAdamW(ours, impl=impl, **HP)
    topt = _torch_adamw(ref)
    for step in range(3):
        for grp_o, grp_r, grads in zip(ours, ref, _grads(ours, step, torch.bfloat16), strict=True):
            for po, pr, g in zip(grp_o, grp_r, grads, strict=True):
                po.grad, pr.grad = g, g.float()
        opt.step()
        topt.step()
    for po, pr, m in zip(sum(ours, []), sum(ref, []), opt.masters(), strict=True):
        assert po._version >= 3, "every step must bump the parameter's version (it is written in place)"
        assert po.dtype == torch.bfloat16 and m.dtype == torch.float32
        torch.testing.assert_close(m, pr, rtol=1e-5, atol=1e-6)
        assert torch.equal(po, m.to(torch.bfloat16)), "the bf16 parameter is its master rounded to nearest"


@cpu_triton
def test_triton_kernel_equals_torch_ops_path():
    # the CPU path (torch ops) and the kernel (interpreter here, CUDA in the gpu test above) compute one update
    runs = {}
    for impl in ("torch", "triton"):
        sets = _params("cpu", torch.bfloat16, seed=3)
        opt = MasterAdamW(sets, impl=impl, **HP)
        for step in range(3):
            for grp, grads in zip(sets, _grads(sets, step, torch.bfloat16), strict=True):
                for p, g in zip(grp, grads, strict=True):
                    p.grad = g
            opt.step([torch.tensor(0.7), None])
        runs[impl] = opt.masters()
    for a, b in zip(runs["torch"], runs["triton"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=cpu_triton)])
def test_state_dict_resumes_the_same_trajectory_and_skips_params_without_grad(impl, moments):
    def run(sets, opt, steps):
        for step in steps:
            for grp, grads in zip(sets, _grads(sets, step, torch.bfloat16), strict=True):
                for i, (p, g) in enumerate(zip(grp, grads, strict=True)):
                    p.grad = None if (i == 1 and step % 2) else g  # the 1-D params miss every other step
            opt.step()
            opt.zero_grad()

    full = _params("cpu", torch.bfloat16, seed=5)
    opt = MasterAdamW(full, impl=impl, moments_dtype=moments, **HP)
    run(full, opt, range(5))
    part = _params("cpu", torch.bfloat16, seed=5)
    opt1 = MasterAdamW(part, impl=impl, moments_dtype=moments, **HP)
    run(part, opt1, range(3))
    state = opt1.state_dict()
    fresh = _params("cpu", torch.bfloat16, seed=99)  # other values: load_state_dict must set them from the masters
    opt2 = MasterAdamW(fresh, impl=impl, moments_dtype=moments, **HP)
    opt2.load_state_dict(state)
    assert [s.step for s in opt2.sets[0]] == [3, 2]  # steps 0 and 2 of the 1-D parameter
    run(fresh, opt2, range(3, 5))
    for a, b in zip(sum(full, []), sum(fresh, []), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.masters(), opt2.masters(), strict=True):
        assert torch.equal(a, b)


def test_checks_inputs_and_refuses_other_state():
    p = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="impl"):
        MasterAdamW([[p]], lr=1e-3, impl="cuda")
    with pytest.raises(ValueError, match="twice"):
        MasterAdamW([[p], [p]], lr=1e-3)
    with pytest.raises(ValueError, match="contiguous"):
        MasterAdamW([[torch.zeros(4, 4).t().requires_grad_()]], lr=1e-3)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        MasterAdamW([[torch.zeros(4, dtype=torch.float64, requires_grad=True)]], lr=1e-3)
    with pytest.raises(ValueError, match="betas"):
        MasterAdamW([[p]], lr=1e-3, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="moments_dtype"):
        MasterAdamW([[p]], lr=1e-3, moments_dtype=torch.float16)
    opt = MasterAdamW([[p]], lr=1e-3)
    with pytest.raises(ValueError, match="multipliers"):
        opt.step([None, None])
    with pytest.raises(ValueError, match="older megamoe train"):
        opt.load_state_dict([{"state": {}, "param_groups": []}])  # the previous train checkpoints' format
    other = MasterAdamW([[torch.zeros(4, 5, requires_grad=True)]], lr=1e-3)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(other.state_dict())


BF16_IMPLS = [pytest.param("cpu", "torch", id="cpu-torch"),
              pytest.param("cpu", "triton", marks=cpu_triton, id="cpu-triton"),
              pytest.param("cuda", None, marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")],
                           id="cuda")]


def _run_bf16_params(device, impl, moments_dtype, steps, seed=3):
    sets = _params(device, torch.bfloat16, seed=seed)
    opt = MasterAdamW(sets, impl=impl, moments_dtype=moments_dtype, **HP)
    for step in range(steps):
        for grp, grads in zip(sets, _grads(sets, step, torch.bfloat16), strict=True):
            for p, g in zip(grp, grads, strict=True):
                p.grad = g
        opt.step([torch.tensor(0.7, device=device), None])
    return opt


@pytest.mark.parametrize("device,impl", BF16_IMPLS)
def test_bf16_moments_track_float32_moments_and_are_reproducible(device, impl):
    ref = _run_bf16_params(device, impl, torch.float32, 4)
    a = _run_bf16_params(device, impl, torch.bfloat16, 4)
    b = _run_bf16_params(device, impl, torch.bfloat16, 4)
    for slots_a, slots_b, slots_r in zip(a.sets, b.sets, ref.sets, strict=True):
        for sa, sb, sr in zip(slots_a, slots_b, slots_r, strict=True):
            assert sa.exp_avg.dtype == sa.exp_avg_sq.dtype == torch.bfloat16 and sa.master.dtype == torch.float32
            # bitwise reproducible: the rounding's random bits are fixed by (parameter, step)
            assert torch.equal(sa.master, sb.master) and torch.equal(sa.exp_avg_sq, sb.exp_avg_sq)
            # one bf16 ulp is 2^-8 = 3.9e-3 relative; measured after 4 steps: 1.5e-3 to 4.2e-3 (norm-relative)
            for mine, theirs in ((sa.exp_avg, sr.exp_avg), (sa.exp_avg_sq, sr.exp_avg_sq)):
                assert float((mine.float() - theirs).norm() / theirs.norm()) < 1e-2
            # the update is lr * m / sqrt(v): measured at most 1.3e-2 lr apart from the float32-moment masters
            torch.testing.assert_close(sa.master, sr.master, rtol=0, atol=4e-2 * HP["lr"])


@pytest.mark.parametrize("device,impl", BF16_IMPLS)
def test_bf16_moments_rounding_is_unbiased(device, impl):
    # beta2 = 0.999: after a large first gradient, v decays by 0.1% per step under small gradients, less than half a
    # bf16 ulp (2^-9); rounded to nearest it would stay frozen at its first value. Stochastic rounding keeps the
    # mean on the float32 trajectory.
    n, steps = 4096, 200
    p32 = torch.zeros(n, device=device, requires_grad=True)
    p16 = torch.zeros(n, device=device, requires_grad=True)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    # the float32 trajectory from torch ops (equal to the kernel's within 2e-6, test above): the interpreter runs
    # only the bf16 one
    o32 = MasterAdamW([[p32]], impl="torch" if device == "cpu" else impl, **hp)
    o16 = MasterAdamW([[p16]], impl=impl, moments_dtype=torch.bfloat16, **hp)
    for step in range(steps):
        g = torch.full((n,), 1.0 if step == 0 else 0.01, device=device)
        p32.grad, p16.grad = g, g.clone()
        o32.step()
        o16.step()
    v32, v16 = o32.sets[0][0].exp_avg_sq, o16.sets[0][0].exp_avg_sq.float()
    first = 1e-3  # (1 - beta2) * 1^2 after step 0
    # 0.999^200 = 0.82: v32 ~ 0.84e-3, so a frozen v (1e-3) would be 19% off
    assert float(v32.mean()) < 0.85 * first, "the float32 trajectory must have moved (else the test shows nothing)"
    assert abs(float(v16.mean()) / float(v32.mean()) - 1) < 0.01


# ------------------------------------------------------------------ FP8 copies refreshed in the update (maintain_fp8)
# expert weights [E_l, N, K]: N and K not multiples of 128 (partial blocks in both dims, one of them narrower than a
# 32-row slice) and a single-block weight; a 1-D parameter beside them takes the flat kernel
FP8_SHAPES = [(3, 200, 136), (2, 64, 40), (7,)]
_gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
# (device, impl): the update, then the quantisation (the kernels, or the torch twins on the torch-ops path)
FP8_IMPLS = [pytest.param("cpu", "torch", id="cpu-torch"),
             pytest.param("cpu", "triton", marks=cpu_triton, id="cpu-triton"),
             pytest.param("cuda", None, marks=_gpu, id="cuda")]


def _fp8_run(device, impl, moments, maintain, steps=2, pow2=False, dtype=torch.bfloat16):
    from megamoe.kernels.fp8_quant import Fp8Weight

    gen = torch.Generator().manual_seed(21)
    params = [(torch.randn(s, generator=gen) * 3).to(device, dtype).requires_grad_() for s in FP8_SHAPES]
    opt = MasterAdamW([params[:2], params[2:]], impl=impl, moments_dtype=moments, **HP)
    copies = [Fp8Weight.empty_like(p, pow2_scale=pow2) for p in params[:2]] if maintain else []
    for p, c in zip(params, copies, strict=False):  # the expert weights; the 1-D parameter has none
        opt.maintain_fp8(p, c)
    for step in range(steps):
        gg = torch.Generator().manual_seed(300 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gg).to(device, dtype)
        opt.step([torch.tensor(0.8, device=device), None])
    return params, opt, copies


def _quantised(p, pow2):
    """Both orientations of p by the torch twins (on p's device; bitwise the kernels' values there too)."""
    from megamoe.kernels.fp8_quant import quantize_weight_ref

    return (*quantize_weight_ref(p, pow2_scale=pow2), *quantize_weight_ref(p.transpose(1, 2).contiguous(),
                                                                           pow2_scale=pow2))


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
@pytest.mark.parametrize("device,impl", FP8_IMPLS)
def test_maintain_fp8_is_the_update_then_the_quantisation(device, impl, moments):
    from megamoe.kernels.fp8_quant import weight_key

    plain, opt_plain, _ = _fp8_run(device, impl, moments, maintain=False)
    fused, opt, copies = _fp8_run(device, impl, moments, maintain=True)
    # the update itself is unchanged: parameters, masters and moments bitwise those of the plain optimizer
    for a, b in zip(plain, fused, strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(sum(opt_plain.sets, []), sum(opt.sets, []), strict=True):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    # and the copies hold the updated parameters' quantisation, bitwise, in the buffers they were given
    for p, c in zip(fused, copies, strict=False):
        assert c.managed and c.key == weight_key(p)
        for got, want in zip(c.tensors(), _quantised(p.detach(), False), strict=True):
            assert got.dtype == want.dtype and torch.equal(fp8_bits(got), fp8_bits(want))


@pytest.mark.parametrize("device,impl", FP8_IMPLS)
def test_maintain_fp8_pow2_scales_and_float32_params(device, impl):
    # power-of-two scales, and float32 parameters (their own masters): the copies quantise the parameter itself
    for dtype in (torch.bfloat16, torch.float32):
        params, _, copies = _fp8_run(device, impl, torch.float32, maintain=True, steps=1, pow2=True, dtype=dtype)
        for p, c in zip(params, copies, strict=False):
            s = c.s
            assert torch.equal(s, torch.exp2(torch.log2(s).round())), "pow2 scales must be powers of two"
            for name, got, want in zip("q s qt st".split(), c.tensors(), _quantised(p.detach(), True),
                                       strict=True):
                bad = int((fp8_bits(got) != fp8_bits(want)).sum())
                assert bad == 0, f"{dtype} {tuple(p.shape)}: {bad} of {got.numel()} elements of {name} differ"


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=cpu_triton)])
def test_maintain_fp8_refreshes_on_load_and_refresh(impl):
    from megamoe.kernels.fp8_quant import Fp8Weight, weight_key

    params, opt, copies = _fp8_run("cpu", impl, torch.float32, maintain=True, steps=2)
    state = opt.state_dict()
    others = [(torch.randn(s) * 5).to(torch.bfloat16).requires_grad_() for s in FP8_SHAPES]
    opt2 = MasterAdamW([others[:2], others[2:]], impl=impl, **HP)
    c2 = [Fp8Weight.empty_like(p) for p in others[:2]]
    for p, c in zip(others, c2, strict=False):
        opt2.maintain_fp8(p, c)
    opt2.load_state_dict(state)  # sets the parameters from the masters: the copies must follow
    for p, mine, c, want in zip(others, params, c2, copies, strict=False):
        assert torch.equal(p, mine) and c.key == weight_key(p)
        assert all(torch.equal(fp8_bits(a), fp8_bits(b)) for a, b in zip(c.tensors(), want.tensors(), strict=True))
    with torch.no_grad():  # a write that bypasses the optimizer, then an explicit refresh
        others[0].mul_(2.0)
    opt2.refresh_fp8()
    for got, want in zip(c2[0].tensors(), _quantised(others[0].detach(), False), strict=True):
        assert torch.equal(fp8_bits(got), fp8_bits(want))
    # reload_masters: masters (and the maintained copies) follow parameters rewritten outside the optimizer
    with torch.no_grad():
        others[1].add_(1.0)
    opt2.reload_masters([others[1]])
    assert torch.equal(opt2.sets[0][1].master, others[1].float())
    assert torch.equal(fp8_bits(c2[1].q), fp8_bits(_quantised(others[1].detach(), False)[0]))
    with pytest.raises(ValueError, match="not one of this optimizer's"):
        opt2.reload_masters([torch.zeros(3)])


def test_maintain_fp8_checks_its_inputs():
    from megamoe.kernels.fp8_quant import Fp8Weight

    w = torch.randn(2, 64, 40).to(torch.bfloat16).requires_grad_()
    b = torch.randn(40, requires_grad=True)
    opt = MasterAdamW([[w, b]], lr=1e-3, impl="torch")
    with pytest.raises(ValueError, match="not one of this optimizer's"):
        opt.maintain_fp8(torch.randn(2, 64, 40, requires_grad=True), Fp8Weight.empty_like(w))
    with pytest.raises(ValueError, match="3-D"):
        opt.maintain_fp8(b, Fp8Weight.empty_like(w))
    with pytest.raises(TypeError, match="Fp8Weight"):
        opt.maintain_fp8(w, (1, 2, 3, 4))
    bad = Fp8Weight.empty_like(torch.empty(2, 40, 64))  # the transpose's buffers
    with pytest.raises(ValueError, match="FP8 buffer q must be"):
        opt.maintain_fp8(w, bad)
    assert opt.sets[0][0].fp8 is None  # nothing attached by a refused call
