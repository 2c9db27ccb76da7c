"""`megamoe train` on 2 gloo CPU ranks: the loss falls, a resumed run continues the same loss curve, and
backends agree."""

from __future__ import annotations

import json

import pytest

from megamoe.apps.train import main as train_main

SMALL = ["--steps", "30", "--layers", "2", "--seq", "32", "--batch", "2", "--world", "2", "--cpu", "--quiet",
         "--eval-every", "10"]


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_train_loss_falls_and_resume_reproduces(tmp_path, capfd):
    full = tmp_path / "full"
    assert train_main(SMALL + ["--out", str(full)]) == 0
    assert "Warning" not in capfd.readouterr().err  # the ranks' output stays clean (e.g. no deprecated DDP argument)
    report = _summary(full)
    (res,) = report["results"]
    losses = res["history"]["loss"]
    assert len(losses) == 30 and all(l == l for l in losses)  # 30 steps, no NaN
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"loss did not fall: {losses[0]:.3f} -> {losses[-5:]}"
    assert res["tokens_per_s_per_gpu"] > 0 and res["expert_load"] and sum(res["expert_load"]) > 0
    assert (full / "loss.png").stat().st_size > 1000
    assert len(res["history"]["eval"]) == 3

    # stop at step 15 with a checkpoint, then resume to 30: the same losses as the uninterrupted run
    part = tmp_path / "part"
    assert train_main(SMALL + ["--out", str(part), "--ckpt-every", "15", "--stop-at", "15"]) == 0
    assert _summary(part)["results"][0]["tokens_per_s_per_gpu"] is not None  # every step after warm-up timed
    assert (part / "ckpt-torch" / "rank0.pt").exists() and (part / "ckpt-torch" / "rank1.pt").exists()
    assert train_main(SMALL + ["--out", str(part), "--resume"]) == 0
    resumed = _summary(part)["results"][0]["history"]
    assert resumed["step"] == list(range(30))
    assert resumed["loss"] == pytest.approx(losses, rel=1e-6, abs=0)


def test_train_compiled_dense_parts_train_alike(tmp_path):
    # --compile wiring (Block.dense under DDP, gloo ranks) with torch.compile's "eager" backend, which traces with
    # Dynamo but needs no C++ compiler: the same losses as the uncompiled run (inductor runs on the GPU machine)
    runs = {}
    for tag, extra in (("plain", []), ("compiled", ["--compile", "eager"])):
        out = tmp_path / tag
        assert train_main(SMALL[:1] + ["4"] + SMALL[2:] + ["--out", str(out)] + extra) == 0
        runs[tag] = _summary(out)["results"][0]
    assert runs["compiled"]["compiled_dense"] == "eager" and runs["plain"]["compiled_dense"] is None
    assert runs["compiled"]["history"]["loss"] == pytest.approx(runs["plain"]["history"]["loss"], rel=1e-5)


def test_train_bf16_adam_moments(tmp_path):
    # --adam-moments bf16 reaches the optimizer (bf16 moments in the checkpoint), is recorded, and trains like the
    # float32 moments: the first step is identical (zero moments), the next ones within bf16 rounding. The float32
    # run also takes --deterministic (deterministic torch algorithms; on CPU ranks the same numbers)
    runs = {}
    for m in ("fp32", "bf16"):
        out = tmp_path / m
        det = ["--deterministic"] if m == "fp32" else []
        assert train_main(SMALL[:1] + ["4"] + SMALL[2:] + ["--out", str(out), "--adam-moments", m,
                                                           "--ckpt-every", "4"] + det) == 0
        runs[m] = _summary(out)
        assert runs[m]["config"]["adam_moments"] == m and runs[m]["config"]["deterministic"] == bool(det)
    import torch

    state = torch.load(tmp_path / "bf16" / "ckpt-torch" / "rank0.pt", weights_only=False)["opt"]
    moments = [slot[key] for slots in state["sets"] for slot in slots for key in ("exp_avg", "exp_avg_sq")]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)
    fp32, bf16 = (runs[m]["results"][0]["history"]["loss"] for m in ("fp32", "bf16"))
    assert bf16[0] == fp32[0] and bf16 == pytest.approx(fp32, rel=1e-2)


def test_train_backends_agree(tmp_path):
    # bf16 MoE layers (split needs them; fp32 master weights), same seed and data: the first losses agree to
    # bf16 tolerance (later steps drift apart as bf16 rounding differences compound, as on the GPU)
    out = tmp_path / "both"
    # (two steps: the second loss is after one optimizer update)
    args = SMALL[:1] + ["2"] + SMALL[2:] + ["--dtype", "bf16", "--backends", "torch,split,fused", "--out", str(out)]
    assert train_main(args) == 0
    torch_res, split_res, fused_res = _summary(out)["results"]
    for res in (split_res, fused_res):
        assert len(res["history"]["loss"]) == 2
        assert res["history"]["loss"] == pytest.approx(torch_res["history"]["loss"], rel=1e-2), res["backend"]


def test_train_fp8_switch(tmp_path):
    # --fp8 trains the bf16 split layer and its FP8 twin (weights kept by the optimizer) in one run, both in the
    # summary and the loss plot; one transformer block (the interpreter runs each FP8 layer's kernels)
    from megamoe.apps.train import with_fp8

    assert with_fp8("torch") == "torch,split,split:fp8=1"
    assert with_fp8("torch,split") == "torch,split,split:fp8=1"
    assert with_fp8("split:presum_combine=1,split:fp8=1") == \
        "split:presum_combine=1,split:presum_combine=1:fp8=1,split:fp8=1"
    out = tmp_path / "fp8"
    assert train_main(SMALL[:1] + ["2"] + SMALL[2:] + ["--layers", "1", "--dtype", "bf16", "--backends", "split",
                                                       "--fp8", "--out", str(out)]) == 0
    bf16, fp8 = _summary(out)["results"]
    assert (bf16["backend"], bf16["fp8"], fp8["backend"], fp8["fp8"]) == ("split", False, "split:fp8=1", True)
    assert len(fp8["history"]["loss"]) == 2
    # the first loss is before any update: the FP8 forward's error only (e4m3 operands, 2 GEMMs)
    assert fp8["history"]["loss"][0] == pytest.approx(bf16["history"]["loss"][0], rel=2e-2)


def _clip_rank(rank: int, world: int) -> list[float]:
    import torch

    from megamoe.apps.train import clip_multipliers

    gen = torch.Generator().manual_seed(100 + rank)  # expert grads differ per rank, replicated ones do not
    rep = [torch.zeros(5, 3, requires_grad=True), torch.zeros(7, requires_grad=True)]
    loc = [torch.zeros(4, 6, requires_grad=True)]
    for i, p in enumerate(rep):
        p.grad = torch.full(p.shape, 0.5 + i)
    for p in loc:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    out = []
    for max_norm in (1.0, 1e6):  # clipping and not
        norm, m_rep, m_loc = clip_multipliers(rep, loc, max_norm, world)
        out += [float(norm), float(m_rep), float(m_loc)]
    return out


def test_clip_multipliers_match_dividing_expert_grads_first():
    # the old recipe: expert grads / W, then the norm over replicated grads (once) and every rank's expert grads
    import torch

    from megamoe.dist import spawn

    W = 2
    got = spawn(_clip_rank, W, timeout_s=120)
    rep_sq = 5 * 3 * 0.5**2 + 7 * 1.5**2
    loc_sq = 0.0
    for r in range(W):
        g = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + r)) * 3
        loc_sq += float((g / W).double().square().sum())
    norm = (rep_sq + loc_sq) ** 0.5
    for res in got:
        assert res[0] == pytest.approx(norm, rel=1e-5) and res[3] == pytest.approx(norm, rel=1e-5)
        coef = min(1.0, 1.0 / (norm + 1e-6))
        assert res[1] == pytest.approx(coef, rel=1e-5) and res[2] == pytest.approx(coef / W, rel=1e-5)
        assert res[4] == pytest.approx(1.0) and res[5] == pytest.approx(1.0 / W)



def test_capture_moe_layers_validates_its_input():
    import torch

    from megamoe import MoE, capture_moe_layers, preset

    moe = MoE(preset("tiny"), backend="torch", device="cpu")
    with pytest.raises(ValueError, match="cannot run in a CUDA graph"):
        capture_moe_layers([moe], 8)
    with pytest.raises(ValueError, match="positive int"):
        capture_moe_layers([moe], 0)
    with pytest.raises(TypeError, match="megamoe.MoE"):
        capture_moe_layers([torch.nn.Linear(2, 2)], 8)
    with pytest.raises(ValueError, match="no layers"):
        capture_moe_layers([], 8)


@pytest.mark.parametrize("argv, text", [
    (["--steps", "0"], "--steps must be > 0"),  # an explicit 0 is an error, not the default
    (["--lr", "0"], "--lr must be > 0"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
])
def test_train_rejects_non_positive_settings(argv, text):
    with pytest.raises(SystemExit, match=text):
        train_main(["--cpu", "--world", "1", *argv])


def test_model_config_rejects_no_layers():
    # the model refuses what train's flags refuse, for callers that build it directly
    from megamoe import preset
    from megamoe.apps.model import ModelConfig

    with pytest.raises(ValueError, match="layers must be >= 1"):
        ModelConfig(preset("tiny"), layers=0)
