"""Backend ``torch`` on 1, 2 and 4 gloo CPU ranks against the float64 reference on the global batch."""

from __future__ import annotations

import pytest
import torch

from megamoe.dist import spawn
from megamoe.testing import check_bounds, layer_case, standard_cases


def _rank_cases(rank: int, world: int, backend: str) -> list[dict]:
    torch.manual_seed(1234 + rank)
    return [layer_case(case, backend, torch.device("cpu")) for case in standard_cases(world)]


def check_results(results: list[list[dict]], world: int) -> None:
    for rank_results in results:
        check_bounds(rank_results)
        for r in rank_results:
            if r["case"] == "fp64-one-expert-k1" and r["tokens"] > 0:
                assert r["max_expert_share"] == 1.0, "the one-expert case did not route every token to one expert"
            if r["case"] == "fp32-starved-expert":
                assert r["counts"][3] == 0 and r["counts"][6] == 0, "starved experts received tokens"


@pytest.mark.parametrize("world", [1, 2, 3, 4])  # 1: no communication; 3: a world size that is not a power of 2
def test_torch_backend_matches_reference(world):
    results = spawn(_rank_cases, world, "torch", timeout_s=600)
    check_results(results, world)


def test_loop_grouped_mm_takes_each_weight_slice_once():
    # the CPU / non-bf16 grouped GEMM: right values and gradients, and a backward that builds b's gradient once
    # (indexing b[g] per group made each group's backward allocate and add a zero tensor the size of all of b)
    from megamoe.backends.torch_a2a import grouped_mm

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, dtype=torch.float64, generator=gen).requires_grad_()
    b = torch.randn(3, 5, 4, dtype=torch.float64, generator=gen).requires_grad_()
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # the middle group is empty
    out = grouped_mm(a, b, offs)
    ref = torch.cat([a[:2] @ b[0], a[2:7] @ b[2]])
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    da, db = torch.autograd.grad(out, (a, b), g)
    ra, rb = torch.autograd.grad(ref, (a, b), g)
    assert torch.equal(da, ra) and torch.equal(db, rb) and not db[1].any()
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo += [f for f, _ in fn.next_functions]
    assert "SelectBackward0" not in {type(f).__name__ for f in seen}
