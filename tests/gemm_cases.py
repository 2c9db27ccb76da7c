"""Helpers of the Gluon GEMM GPU tests (tests/test_gpu_gemm.py): problems on CUDA with NaN padding rows, the Triton
references, relative errors whole and per expert."""

from __future__ import annotations

import torch


def problem(sizes):
    """Group sizes -> (E_l, rows used, buffer rows, offs int32 on CUDA): 9 padding rows after the last group."""
    E_l, used = len(sizes), sum(sizes)
    offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return E_l, used, used + 9, offs


def fp8_problem(sizes, K: int, n_w: int, seed: int):
    """problem(sizes) with its FP8 operands: (E_l, used, R, offs, gen, xq, x_s, wq, w_s) for x [R, K] bf16 (padding
    rows NaN: never read as data) and w [E_l, n_w, K] bf16 / sqrt(K), quantised (1x128 / 128x128 scales); gen, seeded
    with ``seed``, continues after those two draws for the caller's further inputs."""
    import megamoe.experts as X

    gen = torch.Generator(device="cuda").manual_seed(seed)
    E_l, used, R, offs = problem(sizes)
    x = torch.randn(R, K, device="cuda", generator=gen).to(torch.bfloat16)
    x[used:] = float("nan")
    w = (torch.randn(E_l, n_w, K, device="cuda", generator=gen) / K**0.5).to(torch.bfloat16)
    return (E_l, used, R, offs, gen, *X.quantize_act(x), *X.quantize_weight(w))


def bf16_problem(sizes, K: int, n_w: int, seed: int):
    """problem(sizes) with bf16 operands: (E_l, used, R, offs, gen, a, w) for a [R, K] (padding rows NaN: never read
    as data) and w [E_l, n_w, K] * K**-0.5; gen, seeded with ``seed``, continues after those two draws."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E_l, used, R, offs = problem(sizes)
    a = torch.randn(R, K, device="cuda", generator=gen).to(torch.bfloat16)
    a[used:] = float("nan")
    w = (torch.randn(E_l, n_w, K, device="cuda", generator=gen) * K**-0.5).to(torch.bfloat16)
    return E_l, used, R, offs, gen, a, w


def dswiglu_problem(sizes, H: int, I: int, with_scale: bool, seed: int):
    """problem(sizes) with the SwiGLU backward's operands: (E_l, used, R, offs, dy [R, H], w2 [E_l, H, I] * I**-0.5,
    h [R, 2I], s [R] fp32 in [0.5, 1.5) or None); dy's and h's padding rows NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E_l, used, R, offs = problem(sizes)
    dy = torch.randn(R, H, device="cuda", generator=gen).to(torch.bfloat16)
    dy[used:] = float("nan")
    w2 = (torch.randn(E_l, H, I, device="cuda", generator=gen) * I**-0.5).to(torch.bfloat16)
    h = torch.randn(R, 2 * I, device="cuda", generator=gen).to(torch.bfloat16)
    h[used:] = float("nan")
    s = torch.rand(R, device="cuda", generator=gen) + 0.5 if with_scale else None
    return E_l, used, R, offs, dy, w2, h, s


def triton_config(op: str, rows: int, n: int, k: int):
    """The Triton kernel's heuristic config for op, naming kernel="triton" (with no config the ops of GLUON_OPS run
    their Gluon kernel on Hopper): the reference kernel of the Gluon tests."""
    from megamoe.kernels.gemm_config import default_config

    return default_config(op, rows, n, k, kernel="triton").with_(kernel="triton")


def swiglu_references(x: torch.Tensor, w13: torch.Tensor, offs: torch.Tensor):
    """GEMM1 + SwiGLU references of the Gluon tests: ((act, h) of the Triton kernel; (act, h) of the float64 twin)."""
    import megamoe.experts as X

    R, H = x.shape
    I = w13.shape[1] // 2
    tri = X.gemm1_swiglu(x, w13, offs, store_h=True, config=triton_config("gemm1_swiglu", R, I, H))
    return tri, X.gemm1_swiglu_ref(x.double(), w13.double(), offs)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64; asserts got is finite (NaN-poisoned padding must not leak)."""
    got, ref = got.double(), ref.double()
    assert bool(torch.isfinite(got).all()), "non-finite values in the output"
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def per_expert(got: torch.Tensor, ref: torch.Tensor, offs: torch.Tensor, tol: float, what: str) -> None:
    """rel(got, ref) < tol on every non-empty group: one wrong small group would vanish in the global norm."""
    bounds = offs.tolist()
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            err = rel(got[lo:hi], ref[lo:hi])
            assert err < tol, f"{what}, expert {e} (rows {lo}:{hi}): {err:.2e}"
