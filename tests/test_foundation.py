"""Config validation, presets, routers, the reference against an explicit loop, and input checks."""

from __future__ import annotations

import pytest
import torch

from megamoe import MoE, MoEConfig, preset
from megamoe.backends import BackendUnavailable, available_backends
from megamoe.config import PRESETS
from megamoe.reference import moe_forward, route_ref
from megamoe.router import route


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def moe_forward_loop(x, router_weight, w13, w2, config, router_bias=None):
    """The layer as an explicit per-token, per-slot loop of SwiGLU experts in float64 (slow): what
    megamoe.reference.moe_forward is checked against."""
    r = route_ref(x, router_weight, config, router_bias)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(config.top_k):
            e = int(r.topk_idx[t, j])
            h = w13[e] @ x[t]
            a = torch.nn.functional.silu(h[: config.intermediate]) * h[config.intermediate:]
            acc = acc + r.topk_w[t, j] * (w2[e] @ a)
        rows.append(acc)
    return torch.stack(rows)


def test_presets_have_published_shapes():
    shapes = {n: (c.hidden, c.intermediate, c.num_experts, c.top_k, c.router) for n, c in PRESETS.items()}
    assert shapes["qwen3-30b-a3b"] == (2048, 768, 128, 8, "softmax")
    assert shapes["deepseek-v3"] == (7168, 2048, 256, 8, "sigmoid")
    assert shapes["mixtral-8x7b"] == (4096, 14336, 8, 2, "softmax")
    assert shapes["gpt-oss-120b"] == (2880, 2880, 128, 4, "softmax")
    assert "tiny" in PRESETS
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-5")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=9, num_experts=8), "top_k"),  # k > E
        (dict(hidden=0), "hidden"),  # non-positive size
        (dict(router="relu"), "router"),  # unknown router kind
        (dict(dtype="int8"), "dtype"),  # unsupported dtype
        (dict(route_scale=0.0), "route_scale"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    base = dict(hidden=64, intermediate=32, num_experts=8, top_k=2)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**base)


def test_world_size_must_divide_experts():
    cfg = preset("tiny")  # E = 8
    with pytest.raises(ValueError, match="divisible by the world size"):
        cfg.local_experts(3)
    assert cfg.local_experts(4) == 2


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_reference_matches_explicit_loop_float64(router):
    cfg = preset("tiny", dtype=torch.float64, router=router, route_scale=2.5 if router == "sigmoid" else 1.0)
    g = torch.Generator().manual_seed(3)
    E, H, I = cfg.num_experts, cfg.hidden, cfg.intermediate
    x = torch.randn(29, H, generator=g, dtype=torch.float64, requires_grad=True)
    rw = (torch.randn(E, H, generator=g, dtype=torch.float64) * H**-0.5).requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * H**-0.5).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g, dtype=torch.float64) * I**-0.5).requires_grad_()
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.3 if router == "sigmoid" else None
    gy = torch.randn(29, H, generator=g, dtype=torch.float64)
    y, _ = moe_forward(x, rw, w13, w2, cfg, bias)
    grads = torch.autograd.grad((y * gy).sum(), (x, rw, w13, w2))
    y_loop = moe_forward_loop(x, rw, w13, w2, cfg, bias)
    grads_loop = torch.autograd.grad((y_loop * gy).sum(), (x, rw, w13, w2))
    assert rel(y, y_loop) < 1e-12
    for a, b in zip(grads, grads_loop, strict=True):
        assert rel(a, b) < 1e-12


@pytest.mark.parametrize("router,norm,scale", [("softmax", True, 1.0),   # Qwen3 / Mixtral
                                               ("softmax", False, 1.0),  # no renormalisation (gate = p)
                                               ("sigmoid", True, 2.5),   # DeepSeek-V3 (with a selection bias)
                                               ("sigmoid", False, 1.5)])
def test_router_matches_the_independent_reference(router, norm, scale):
    # megamoe.reference.route_ref shares no code with megamoe.router: the same experts, gates, counts and aux loss
    # (its own formula), and the same gradients of x and the router weight through the gates and the aux loss
    from megamoe.reference import route_ref

    cfg = preset("tiny", dtype=torch.float32, router=router, norm_topk=norm, route_scale=scale)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, cfg.hidden, generator=g, dtype=torch.float64)
    w = torch.randn(cfg.num_experts, cfg.hidden, generator=g, dtype=torch.float64) * 0.2
    bias = torch.randn(cfg.num_experts, generator=g, dtype=torch.float64) * 0.3 if router == "sigmoid" else None
    dg = torch.randn(50, cfg.top_k, generator=g, dtype=torch.float64)
    got = []
    for fn in (route, route_ref):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = fn(xi, wi, cfg.replace(dtype=torch.float64), bias)
        ((r.topk_w * dg).sum() + 10.0 * r.aux_loss).backward()
        got.append((r, xi.grad, wi.grad))
    (r, dx, dw), (ref, dx_ref, dw_ref) = got
    assert torch.equal(r.topk_idx, ref.topk_idx) and torch.equal(r.tokens_per_expert, ref.counts)
    assert rel(r.topk_w, ref.topk_w) < 1e-14 and rel(r.aux_loss, ref.aux_loss) < 1e-14
    assert rel(dx, dx_ref) < 1e-13 and rel(dw, dw_ref) < 1e-13
    if norm:
        torch.testing.assert_close(r.topk_w.sum(-1), torch.full((50,), scale, dtype=torch.float64))
    if bias is not None:  # the bias moves the choice, never a gate value
        big = bias.clone()
        big[4] = 100.0
        rb = route(x, w, cfg.replace(dtype=torch.float64), big)
        assert (rb.topk_idx == 4).any(-1).all()
        s = torch.sigmoid(x @ w.t()).gather(1, rb.topk_idx)
        torch.testing.assert_close(rb.topk_w, scale * (s / s.sum(-1, keepdim=True) if norm else s))
    r0 = route(x[:0], w, cfg.replace(dtype=torch.float64))  # empty batch: zero loss, no NaN
    assert r0.aux_loss.item() == 0.0 and r0.topk_idx.shape == (0, cfg.top_k)


def test_bad_input_errors():
    moe = MoE(preset("tiny", dtype=torch.float32))
    H = moe.config.hidden
    with pytest.raises(ValueError, match=r"\[\.\.\., hidden=96\]"):
        moe(torch.randn(4, H + 1))
    with pytest.raises(TypeError, match="dtype.*autocast"):
        moe(torch.randn(4, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden"):
        moe(torch.randn(()))
    with pytest.raises(ValueError, match="topk_idx must be a tensor of shape"):
        moe.experts_forward(torch.randn(4, H), torch.zeros(4, 3, dtype=torch.int64), torch.rand(4, 3))
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        moe.experts_forward(torch.randn(4, H), torch.zeros(4, 2), torch.rand(4, 2))
    out = moe(torch.randn(5, H))
    assert out.out.shape == (5, H) and torch.isfinite(out.out).all()


def test_backend_selection_never_falls_back(monkeypatch):
    from megamoe.backends.split import SplitBackend

    cfg = preset("tiny", dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown backend"):
        MoE(cfg, backend="nccl")
    assert available_backends("cpu") == ["torch", "split", "fused"]
    # a backend that cannot run here raises with its reason, and the layer never takes another one instead
    monkeypatch.setattr(SplitBackend, "why_unavailable", staticmethod(lambda device: "no symmetric memory here"))
    assert available_backends("cpu") == ["torch", "fused"]
    with pytest.raises(BackendUnavailable, match="no symmetric memory here"):
        MoE(cfg.replace(dtype=torch.bfloat16), backend="split")
    # an option the backend does not have is named, with the ones it has
    with pytest.raises(ValueError, match="no option 'overlap_backward'.*ring_blocks"):
        MoE(cfg.replace(dtype=torch.bfloat16), backend="fused", overlap_backward=True)


def test_import_does_no_work():
    import subprocess
    import sys

    code = "import sys, megamoe; print('megamoe.layer' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_results_name_the_code_they_ran(tmp_path):
    # benchmark JSON carries a digest of the package sources: the same for a copy of the tree (a GPU machine's copy,
    # whose git HEAD can be stale), different once any source changes
    import os
    import shutil

    import megamoe
    from megamoe.apps.perf import run_metadata, source_digest

    pkg = os.path.dirname(megamoe.__file__)
    copy = tmp_path / "megamoe"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    live = source_digest()
    assert len(live) == 40 and source_digest(str(copy)) == live
    (copy / "layer.py").write_text((copy / "layer.py").read_text() + "\n# changed\n")
    assert source_digest(str(copy)) != live
    assert run_metadata(torch.device("cpu"), 1)["source_sha1"] == live


def test_ranks_share_gpus_only_when_asked(monkeypatch):
    # more GPU ranks than GPUs: a clear error unless MEGAMOE_SHARE_GPUS=1 (then gloo, rank r on GPU r mod n); one GPU
    # per rank stays on NCCL; the GPU tests' world helpers follow the same switch
    import torch.distributed as dist

    import megamoe.dist as mdist
    from megamoe.dist import NO_MULTICAST, gpu_ranks_on_gloo, gpu_ranks_possible, init_from_env
    from megamoe.testing import gpu_world

    for k, v in NO_MULTICAST.items():  # init_from_env sets them; restored after the test
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(mdist, "_GPU_RANKS_ON_GLOO", False)
    gpus, joined = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", gpus.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw)))
    monkeypatch.delenv("MEGAMOE_SHARE_GPUS", raising=False)

    def env(rank, local_world):
        for k, v in {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                     "LOCAL_WORLD_SIZE": None if local_world is None else str(local_world)}.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)

    env(0, 1)  # one rank per GPU (e.g. two hosts of one GPU each): NCCL, GPU 0
    assert init_from_env("cuda") == torch.device("cuda", 0)
    assert joined[-1][0] == "nccl" and "device_id" in joined[-1][1] and gpus[-1] == 0 and not gpu_ranks_on_gloo()
    for rank, local_world in ((0, 2), (1, 2), (1, None)):  # two ranks, one GPU: every rank refuses
        env(rank, local_world)
        with pytest.raises(RuntimeError, match="MEGAMOE_SHARE_GPUS=1"):
            init_from_env("cuda")
    assert gpu_ranks_possible(1) and not gpu_ranks_possible(2)
    assert gpu_world(4, 1) == 1 and gpu_world(4, 2) == 0

    monkeypatch.setenv("MEGAMOE_SHARE_GPUS", "1")
    env(1, 2)  # shared: gloo, rank 1 on GPU 0
    assert init_from_env("cuda") == torch.device("cuda", 0)
    assert joined[-1] == ("gloo", {"timeout": joined[-1][1]["timeout"]}) and gpus[-1] == 0 and gpu_ranks_on_gloo()
    env(1, None)  # without LOCAL_WORLD_SIZE the ranks could pick different groups
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE"):
        init_from_env("cuda")
    assert gpu_ranks_possible(4) and gpu_world(4, 2) == 2 and gpu_world(4, 1) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not gpu_ranks_possible(1) and gpu_world(4, 2) == 0
