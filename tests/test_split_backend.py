"""Backend ``split`` (megamoe kernels, no host sync) on 1, 2 and 4 gloo CPU ranks under the Triton
interpreter, against the float64 reference on the global batch; bitwise determinism; clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from megamoe.dist import spawn
from megamoe.testing import TOLERANCE, LayerCase, bf16_cases, determinism_case, layer_case, tiny_experts

os.environ.setdefault("TRITON_INTERPRET", "1")  # spawned CPU ranks inherit it before importing triton


# the interpreter is slow: every edge case on 2 ranks, a subset on 1 and 4 (CI runs on 2 cores)
SUBSET = {1: ("bf16:bf16-ragged", "bf16:fp64-one-expert-k1"),
          3: ("bf16:bf16-ragged", "bf16:fp32-empty-rank"),
          4: ("bf16:bf16-ragged", "bf16:fp32-empty-rank", "bf16:fp32-starved-expert")}


# the pre-summing combine (comm/presum.py) on a few edge cases
PRESUM = ("bf16:bf16-ragged", "bf16:fp32-empty-rank", "bf16:fp32-k5")


def _rank(rank: int, world: int) -> tuple[list[dict], bool]:
    dev = torch.device("cpu")
    cases = [c for c in bf16_cases(world) if world not in SUBSET or c.name in SUBSET[world]]
    results = [layer_case(c, "split", dev) for c in cases]
    if world == 2:
        results += [dict(layer_case(c, "split", dev, presum_combine=True), case="presum:" + c.name)
                    for c in bf16_cases(world) if c.name in PRESUM]
    det_case = LayerCase("det", dtype="bf16", tokens=tuple(17 + r for r in range(world)),
                         overrides={"num_experts": tiny_experts(world)})
    det = determinism_case(det_case, "split", dev)
    return results, det


def check(results, world):
    for rank_results, det in results:
        assert det, "split backend: two runs differ bitwise"
        for r in rank_results:
            for key in ("out", "dx", "drouter", "dw13", "dw2"):
                assert r[key] < TOLERANCE["bf16"], f"{r['case']} rank {r['rank']}: {key} rel err {r[key]:.3g}"
            assert r["counts_ok"]
            if r["case"].endswith("one-expert-k1") and r["tokens"] > 0:
                assert r["max_expert_share"] == 1.0
            if r["case"].endswith("starved-expert"):
                assert r["counts"][3] == 0 and r["counts"][6] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; GPUs run tests/test_gpu_split.py")
@pytest.mark.parametrize("world", [1, 2, 3, 4])  # 1: itself as the only peer; 3: not a power of two
def test_split_matches_reference_cpu(world):
    check(spawn(_rank, world, timeout_s=900), world)


def _bad_dtype(rank, world):
    from megamoe import MoE, preset

    try:
        MoE(preset("tiny", dtype=torch.float32), backend="split")
    except ValueError as exc:
        return str(exc)
    return None


def test_split_rejects_non_bf16():
    (msg,) = spawn(_bad_dtype, 1)
    assert msg is not None and "bfloat16" in msg
