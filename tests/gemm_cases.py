"""Helpers shared by the Gluon GEMM GPU tests (test_gpu_gluon_fp8.py, test_gpu_gluon_bf16.py)."""

from __future__ import annotations

import torch


def problem(sizes):
    """Group sizes -> (E_l, rows used, buffer rows, offs int32 on CUDA): 9 padding rows after the last group."""
    E_l, used = len(sizes), sum(sizes)
    offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return E_l, used, used + 9, offs


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
