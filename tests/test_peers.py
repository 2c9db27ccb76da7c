"""`megamoe bench --peers`: transformers' MoE modules on a megamoe layer's weights compute the layer's function (so
the timing compares like with like), and the bench times them beside the backends on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megamoe import MoE
from megamoe.config import preset
from megamoe.reference import expert_act, experts_ref

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name, shape, family", [
    ("tiny", {}, "qwen3_moe"),  # softmax, renormalised top-k
    ("mixtral-8x7b", dict(hidden=64, intermediate=96), "mixtral"),  # E 8, k 2
    ("deepseek-v3", dict(hidden=64, intermediate=32, num_experts=16), "deepseek_v3"),  # sigmoid, route_scale 2.5
    ("gpt-oss-20b", dict(hidden=40, intermediate=24, num_experts=8), "gpt_oss"),  # biases, interleaved, clamped
])
def test_peer_computes_the_layers_function(name, shape, family):
    from megamoe.apps.peers import HFPeer

    cfg = preset(name, dtype=torch.float32, **shape)  # grouped_mm takes no float64
    moe = MoE(cfg, backend="torch", device="cpu", seed=3)
    if family == "gpt_oss":  # large enough weights that the SwiGLU's clamps act
        with torch.no_grad():
            moe.w13.mul_(12)
    peer = HFPeer(moe)
    assert peer.family == family and peer.name == f"hf-{family}:grouped_mm"
    x = torch.randn(53, cfg.hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        r = moe.router(x.double())
        bias = {} if moe.b13 is None else dict(b13=moe.b13, b2=moe.b2, act=expert_act(cfg))
        ref = experts_ref(x.double(), r.topk_idx, r.topk_w.double(), moe.w13, moe.w2, 0, **bias)
    xg = x.clone().requires_grad_()
    y = peer(xg).out
    assert float((y.detach().double() - ref).norm() / ref.norm()) < 1e-5  # float32 against float64
    y.backward(torch.randn_like(y))
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    assert peer.experts.gate_up_proj.grad is not None and peer.experts.down_proj.grad is not None


def test_no_peer_for_other_clamps_or_several_ranks():
    from megamoe.apps.peers import HFPeer

    moe = MoE(preset("gpt-oss-120b", hidden=64, intermediate=64, num_experts=8, dtype=torch.float32,
                     swiglu_limit=5.0), device="cpu")
    with pytest.raises(ValueError, match="no peer for gpt-oss experts other than"):
        HFPeer(moe)
    from megamoe.apps.peers import SonicPeer

    with pytest.raises(ValueError, match="SonicMoE runs on one GPU process"):
        SonicPeer(MoE(preset("tiny"), device="cpu"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megamoe", "bench", "--cpu", "--world", "2", "--peers"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and "--peers runs on one process" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; GPUs run it in benchmarks/gpu.sh")
def test_bench_peers_beside_the_backends(tmp_path):
    out_json = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megamoe", "bench", "--cpu", "--world", "1", "--backends", "torch",
                           "--peers", "--iters", "1", "--warmup", "0", "--tokens", "32", "--json", str(out_json)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    assert report["config"]["peers"] is True
    by_name = {e["backend"]: e for e in report["results"]}
    assert set(by_name) == {"torch", "hf-qwen3_moe:grouped_mm"}
    for e in by_name.values():
        assert 0 < e["forward"]["median_s"] and 0 < e["forward+backward"]["median_s"]
        assert e["forward"]["peak_bytes"] is None  # no CUDA here
        assert 0 < e["rel_err"] < 2e-2, e  # bf16 against the float64 reference
    assert "hf-qwen3_moe:grouped_mm" in proc.stdout
    assert "no SonicMoE peer (SonicMoE runs on one GPU process)" in proc.stdout
