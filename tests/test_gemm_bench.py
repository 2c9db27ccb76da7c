"""`megamoe bench-gemm` runs end to end (CPU: a tiny shape under the interpreter) and writes its JSON."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megamoe import bench_gemm  # noqa: E402


def test_bench_gemm_cpu_smoke(tmp_path):
    if torch.cuda.is_available():
        args = ["--presets", "qwen3-30b-a3b", "--tokens", "512", "--rep", "5"]
    else:
        args = ["--device", "cpu", "--presets", "tiny", "--tokens", "16", "--no-bwd"]
    out = tmp_path / "gemm.json"
    assert bench_gemm.main(args + ["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"commit", "gpu", "torch", "triton", "date", "config"} <= set(data["meta"])
    ops = {(r["op"], r["dtype"]) for r in data["rows"]}
    assert ("gemm1_swiglu", "bf16") in ops and ("gemm2", "fp8") in ops
    for r in data["rows"]:
        assert r["ours_ms"] is not None and r["ours_ms"] > 0
        if "rel_err_h_vs_torch" in r:
            assert r["rel_err_h_vs_torch"] < 1e-2
