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


#: a one-rank process: dispatch + combine captured in a CUDA graph, replayed once; then its call counter is pushed past
#: its own DONE, so the next replay's stage waits for a DONE that never comes (timeout TIMEOUT_S), and the loop keeps
#: replaying, as a training loop would
_STOP_SCRIPT = r"""
import os, sys, time
import torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
from megamoe.dist import init_from_env
dev = init_from_env("cuda")
from megamoe.comm import CommShape, SymmetricHeap, combine, dispatch
heap = SymmetricHeap(CommShape(1, 64, 256, 2, 4), timeout_s=float(sys.argv[2]), num_sms=8)
x = torch.randn(64, 256, device=dev).to(torch.bfloat16)
idx = torch.stack([torch.randperm(4)[:2] for _ in range(64)]).to(dev)
w = torch.rand(64, 2, device=dev)
recv, h = dispatch(x, idx, heap)
y = combine(recv, w, h)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    recv, h = dispatch(x, idx, heap)
    y = combine(recv, w, h)
g.replay()
torch.cuda.synchronize()
heap.buffer("ctrl")[0] += 5
print("STALLED_AT", time.time(), flush=True)
while True:
    g.replay()
    time.sleep(0.01)
"""


@pytest.mark.skipif(gpu_world(1, 1) == 0, reason="needs a CUDA GPU")
def test_gpu_timeout_in_graph_replay_stops_the_process():
    import re
    import socket
    import subprocess
    import time

    with socket.socket() as sock:  # a free port for the one-rank group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    timeout_s = 5.0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", _STOP_SCRIPT, str(port), str(timeout_s)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=300)
    ended = time.time()
    m = re.search(r"STALLED_AT ([0-9.]+)", proc.stdout)
    assert m, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.returncode != 0, "the process went on after a timeout inside a replayed graph"
    assert "megamoe comm timeout in stage" in proc.stderr and "on rank 0: peer rank 0" in proc.stderr, \
        proc.stderr[-4000:]
    assert ended - float(m.group(1)) < timeout_s + 10, (ended - float(m.group(1)), proc.stderr[-2000:])
