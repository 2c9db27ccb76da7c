"""`megamoe train` on GPUs: the MoE layers captured in CUDA graphs (--graph-moe) train exactly like eager."""

from __future__ import annotations

import json

import pytest

from megamoe.apps.train import main as train_main
from megamoe.dist import gpu_world

pytestmark = pytest.mark.gpu
SMALL = ["--steps", "4", "--lr", "3e-4", "--warmup", "2", "--layers", "2", "--seq", "256", "--batch", "2",
         "--heads", "4", "--preset", "qwen3-30b-a3b", "--eval-every", "4", "--timing-skip", "2", "--quiet",
         "--world", "2"]


@pytest.mark.skipif(gpu_world(2, 2) == 0, reason="needs 2 CUDA GPUs (or MEGAMOE_SHARE_GPUS=1)")
def test_graphed_moe_layers_train_like_eager(tmp_path):
    runs = {}
    for tag, extra in (("eager", []), ("graph", ["--graph-moe"])):
        out = tmp_path / tag
        assert train_main(SMALL + ["--backends", "split,fused", "--out", str(out)] + extra) == 0
        runs[tag] = json.loads((out / "summary.json").read_text())["results"]
    for eager, graph in zip(runs["eager"], runs["graph"], strict=True):
        assert graph["moe_cuda_graph"] and not eager["moe_cuda_graph"]
        # same kernels, same inputs: replaying them from a graph changes nothing but the launches; the first step
        # agrees exactly, later ones up to the run-to-run spread of eager training itself (2x H200, 2026-11-30: two
        # eager runs of the same config differ by up to 1e-3 relative within 6 steps: the attention backward is
        # not deterministic; over 8 steps with a loss spike the spread reached 2%, hence 4 short steps here)
        lg, le = graph["history"]["loss"], eager["history"]["loss"]
        assert lg[0] == pytest.approx(le[0], rel=1e-6, abs=0), graph["backend"]
        # the first step's gradient norm (replicated and expert grads) checks the graphed backward directly
        assert graph["history"]["grad_norm"][0] == pytest.approx(eager["history"]["grad_norm"][0], rel=1e-3)
        assert lg == pytest.approx(le, rel=2e-3, abs=0), graph["backend"]
        assert [e for _, e in graph["history"]["eval"]] == pytest.approx([e for _, e in eager["history"]["eval"]],
                                                                         rel=2e-3)
