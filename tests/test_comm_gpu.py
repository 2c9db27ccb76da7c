"""Communication path on GPUs (4x H200 on the device machine): `pytest -m gpu tests/test_comm_gpu.py`.

One process per GPU through megamoe.dist.spawn; cuda heap (torch symmetric memory).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from comm_cases import assert_no_failures, rank_cases, rank_graph, rank_peer_buffer  # noqa: E402

from megamoe.dist import spawn  # noqa: E402
from megamoe.testing import gpu_world  # noqa: E402

pytestmark = pytest.mark.gpu

needs_gpus = pytest.mark.skipif(gpu_world(4, 2) == 0, reason="needs at least 2 CUDA GPUs (or MEGAMOE_SHARE_GPUS=1)")


def _world():
    return gpu_world(4, 2)


@needs_gpus
def test_gpu_full_size_and_edges():
    W = _world()
    cases = [
        # deepseek-v3 routing at 4096 tokens per GPU (forward only: the CPU reference of the backward is slow)
        dict(name="gpu-deepseek", T=[4096] * W, H=7168, k=8, E=256, seed=11, backward=False, sms=24),
        # qwen3 shape with backward, uneven tokens, one rank empty
        dict(name="gpu-qwen-bwd", T=[512, 0] + [300] * (W - 2), H=2048, k=8, E=128, seed=12, sms=16),
        # edges: k = 1 with one expert receiving everything, H not a power of two (not 16-byte rows)
        dict(name="gpu-k1-hot-H100", T=[33] * W, H=100, k=1, E=4 * W, routing="hot", seed=13),
        dict(name="gpu-narrow", T=[40] * W, H=96, k=2, E=2 * W, routing="narrow", seed=14),
    ]
    assert_no_failures(spawn(rank_cases, W, cases, "cuda", device="cuda", timeout_s=600))


@needs_gpus
def test_gpu_no_sync_and_cuda_graph():
    W = _world()
    assert_no_failures(spawn(rank_graph, W, device="cuda", timeout_s=600))


@needs_gpus
def test_gpu_peer_buffer():
    # torch symmetric memory's get_buffer views of the peers' tok regions (the Gluon items' TMA pull descriptors)
    W = _world()
    assert_no_failures(spawn(rank_peer_buffer, W, device="cuda", timeout_s=300))
