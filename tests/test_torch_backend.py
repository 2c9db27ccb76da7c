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
