"""Backend ``torch`` on 1-4 GPUs (NCCL) against the float64 reference: the CPU edge cases plus full-width shapes."""

from __future__ import annotations

import pytest
import torch
from test_torch_backend import check_results

from megamoe.dist import spawn
from megamoe.testing import gpu_cases, layer_case, standard_cases

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rank_cases(rank: int, world: int, backend: str) -> list[dict]:
    device = torch.device("cuda", rank)
    return [layer_case(c, backend, device) for c in standard_cases(world) + gpu_cases(world)]


@pytest.mark.skipif(NGPU == 0, reason="needs CUDA GPUs")
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_torch_backend_on_gpus(world):
    if world > NGPU:
        pytest.skip(f"needs {world} GPUs, {NGPU} visible")
    check_results(spawn(_rank_cases, world, "torch", device="cuda", timeout_s=900), world)
