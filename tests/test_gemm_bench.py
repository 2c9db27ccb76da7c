"""`megamoe bench-gemm` runs end to end (CPU: a tiny shape under the interpreter) and writes its JSON; the tile
sweep's (benchmarks/gemm_sweep.py) candidate configs suit the kernels they name."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

import megamoe.experts as X
from megamoe.apps import bench_gemm
from megamoe.kernels.gemm_config import EPI_DSWIGLU, EPI_SWIGLU, GLUON_OPS


def _gemm_sweep():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_sweep.py"
    spec = importlib.util.spec_from_file_location("gemm_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
        # the kernel that ran, by the name it records (gemm_config.LAST_COMPILED): Triton under the interpreter
        assert r["ours_kernel"] in bench_gemm.KERNEL_TAGS, r["ours_kernel"]
        if not torch.cuda.is_available():
            assert bench_gemm.KERNEL_TAGS[r["ours_kernel"]] == "triton", r["ours_kernel"]
        if "rel_err_h_vs_torch" in r:
            assert r["rel_err_h_vs_torch"] < 1e-2
    # --seed draws the operands too: a second run's errors are the same numbers
    again = tmp_path / "again.json"
    assert bench_gemm.main(args + ["--json", str(again)]) == 0
    errs = lambda d: [{k: v for k, v in r.items() if "err" in k} for r in d["rows"]]
    assert errs(json.loads(again.read_text())) == errs(data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's sweep (on a GPU it compiles ~70 configs)")
def test_bench_gemm_sweep_cpu(tmp_path):
    # the sweep times every candidate: each Triton one runs, each Gluon one reports why it cannot run here, and the
    # row keeps the fastest that ran
    out = tmp_path / "sweep.json"
    args = ["--device", "cpu", "--presets", "tiny", "--tokens", "16", "--json", str(out)]
    assert _gemm_sweep().main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"gemm1_swiglu", "gemm2", "dgrad2_swiglu", "dgrad1", "wgrad1", "wgrad2"}
    for r in rows:
        assert len(r["candidates"]) > 1, r["op"]
        for c in r["candidates"]:
            if c["config"]["kernel"] == "triton":
                assert "error" not in c and c["ms"] > 0, (r["op"], c)
            else:
                assert "kernel='gluon'" in c["error"] and "interpreter" in c["error"], (r["op"], c)
        best = min((c for c in r["candidates"] if "ms" in c), key=lambda c: c["ms"])
        assert r["ours_config"] == best["config"] and r["ours_ms"] == best["ms"]
        assert bench_gemm.KERNEL_TAGS[r["ours_kernel"]] == "triton"


@pytest.mark.parametrize("preset", list(bench_gemm.PRESETS))
def test_sweep_candidates_suit_their_kernels(preset, monkeypatch):
    # every candidate names its kernel; each Gluon one passes megamoe.experts' kernel choice as on an sm_90 GPU (the
    # device check stubbed out) at the preset's EP-4 shapes, as does the op's Gluon default; the one limit a
    # candidate may fail is the FP8 SwiGLU's tile width where I is no multiple of it (gpt-oss: 2880 = 22.5 x 128)
    from megamoe.kernels import gemm_config

    monkeypatch.setattr(X, "gluon_device_reason", lambda t, cfg: None)
    monkeypatch.setattr(gemm_config, "interpreting", lambda: False)  # the GPU's default configs
    sweep = _gemm_sweep()
    H, I, E, _ = bench_gemm.PRESETS[preset]
    E_l, R = E // 4, 256
    bf = lambda *shape: torch.empty(shape, dtype=torch.bfloat16)
    f8 = lambda *shape: torch.empty(shape, dtype=torch.float8_e4m3fn)
    h = bf(R, 2 * I)
    launches = {  # bench op: (config op, a, w, choose_config's keywords), as run_shape launches them
        "gemm1": ("gemm1_swiglu", bf(R, H), bf(E_l, 2 * I, H), dict(n=I, epilogue=EPI_SWIGLU, n_up=I)),
        "gemm2": ("gemm2", bf(R, I), bf(E_l, H, I), dict(n=H)),
        "dgrad2": ("dgrad_swiglu", bf(R, H), bf(E_l, H, I), dict(n=I, epilogue=EPI_DSWIGLU, w_kn=True, h=h)),
        "dgrad1": ("dgrad1", bf(R, 2 * I), bf(E_l, 2 * I, H), dict(n=H, w_kn=True)),
        "gemm1_fp8": ("gemm1_swiglu_fp8", f8(R, H), f8(E_l, 2 * I, H), dict(n=I, epilogue=EPI_SWIGLU, n_up=I)),
        "gemm2_fp8": ("gemm2_fp8", f8(R, I), f8(E_l, H, I), dict(n=H)),
        "wgrad1": ("wgrad", bf(R, 2 * I), bf(R, H), dict(n=H, out_dtype=torch.bfloat16)),
        "wgrad2": ("wgrad", bf(R, H), bf(R, I), dict(n=I, out_dtype=torch.bfloat16)),
    }
    for name, (op, a, w, kw) in launches.items():
        cands = sweep.candidates(name)
        assert all(c.kernel in ("gluon", "triton") for c in cands), name
        assert len(set(cands)) == len(cands), f"{name}: a candidate repeats"
        gluon = [c for c in cands if c.kernel == "gluon"]
        assert bool(gluon) == (op in GLUON_OPS), name
        if not gluon:
            continue
        n = w.shape[1] if op == "wgrad" else kw["n"]
        assert X.choose_config(op, None, a, w, **kw).kernel == "gluon", (name, preset)
        for c in gluon:
            why = X.gluon_reason(op, c, a, w, **kw)
            ok = why is None or (op == "gemm1_swiglu_fp8" and n % c.block_n and "multiples of block_n" in why)
            assert ok, f"{name} on {preset}: {c} cannot run: {why}"
