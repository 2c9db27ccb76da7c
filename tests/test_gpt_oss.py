"""gpt-oss experts (router logit bias, projection biases, clamped SwiGLU) in megamoe.MoE against the float64
reference: forward and every gradient on the torch backend, world 1 and sharded over 2 gloo ranks; the reference's
activation against its definition; and the Triton backends refusing the form at construction."""

from __future__ import annotations

import pytest
import torch

from megamoe import MoE, preset
from megamoe.dist import spawn
from megamoe.reference import gpt_oss_act, moe_forward
from megamoe.testing import rel_err


def _cfg(**kw):
    # H not a power of two; wide enough weights that some pre-activations pass the clamp limit
    return preset("gpt-oss-20b", **{**dict(hidden=40, intermediate=24, num_experts=8, top_k=2, dtype=torch.float64),
                                    **kw})


def _full(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    E, H, I = cfg.num_experts, cfg.hidden, cfg.intermediate
    r = lambda *s, std: torch.randn(*s, generator=gen, dtype=torch.float64) * std  # noqa: E731
    return dict(router_weight=r(E, H, std=H ** -0.5), logit_bias=r(E, std=0.5), w13=r(E, 2 * I, H, std=0.6),
                w2=r(E, H, I, std=I ** -0.5), b13=r(E, 2 * I, std=1.0), b2=r(E, H, std=0.3))


def _reference(cfg, full, x, g):
    leaves = {k: v.clone().requires_grad_() for k, v in full.items()}
    xr = x.clone().requires_grad_()
    y, r = moe_forward(xr, leaves["router_weight"], leaves["w13"], leaves["w2"], cfg,
                       logit_offset=leaves["logit_bias"], expert_bias=(leaves["b13"], leaves["b2"]))
    loss = (y * g).sum() + 10 * r.aux_loss
    names = ["x", *leaves]
    grads = torch.autograd.grad(loss, [xr, *leaves.values()], allow_unused=True, materialize_grads=True)
    return y, r, dict(zip(names, grads, strict=True))


def _layer_run(moe, x, g):
    xi = x.clone().requires_grad_()
    out = moe(xi)
    loss = (out.out * g).sum() + 10 * out.aux_loss
    params = {"router_weight": moe.router.weight, "logit_bias": moe.router.logit_bias, "w13": moe.w13,
              "w2": moe.w2, "b13": moe.b13, "b2": moe.b2}
    grads = torch.autograd.grad(loss, [xi, *params.values()], allow_unused=True, materialize_grads=True)
    return out, dict(zip(["x", *params], grads, strict=True))


def _load(moe, full):
    from megamoe.layer import load_full_weights

    load_full_weights(moe, full["router_weight"], full["w13"], full["w2"], expert_bias=(full["b13"], full["b2"]),
                      logit_bias=full["logit_bias"])


def test_activation_matches_its_definition():
    h = torch.randn(50, 2 * 6, dtype=torch.float64) * 6
    g, u = h[:, :6], h[:, 6:]
    gc, uc = torch.minimum(g, torch.tensor(7.0)), torch.maximum(torch.minimum(u, torch.tensor(7.0)), torch.tensor(-7.0))
    want = gc / (1 + torch.exp(-1.702 * gc)) * (uc + 1)
    assert (g > 7).any() and (u < -7).any()  # the clamps act
    assert rel_err(gpt_oss_act(h), want) < 1e-15


@pytest.mark.parametrize("tokens", [37, 0])  # ragged; an empty batch (zero gradients of the right shape)
def test_torch_backend_matches_reference(tokens):
    cfg = _cfg()
    full = _full(cfg, 0)
    moe = MoE(cfg, backend="torch", device="cpu", init="none")
    _load(moe, full)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    g = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    y, r, ref = _reference(cfg, full, x, g)
    out, grads = _layer_run(moe, x, g)
    assert rel_err(out.out, y) < 1e-12 and rel_err(out.aux_loss, r.aux_loss) < 1e-12
    for k, v in ref.items():
        assert rel_err(grads[k], v) < 1e-12, k
    if tokens:  # the clamps act on this input
        h = torch.einsum("th,eih->tei", x, full["w13"]) + full["b13"]
        assert (h[..., :cfg.intermediate] > cfg.swiglu_limit).any() and (h.abs()[..., cfg.intermediate:] > 7).any()


def test_random_init_draws_biases():
    moe = MoE(preset("gpt-oss-20b", hidden=32, intermediate=16, num_experts=4, dtype=torch.float32), seed=3)
    assert moe.b13.abs().sum() > 0 and moe.b2.abs().sum() > 0 and moe.router.logit_bias.abs().sum() > 0
    assert "experts=gpt_oss" in repr(moe)


def _ep_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megamoe.layer import gather_experts

    cfg = _cfg()
    full = _full(cfg, 2)
    moe = MoE(cfg, group=dist.group.WORLD, backend="torch", device="cpu", init="none")
    _load(moe, full)
    tokens = [19, 0][: world] if world == 2 else [19]
    gen = torch.Generator().manual_seed(4)
    x_all = torch.randn(sum(tokens), cfg.hidden, generator=gen, dtype=torch.float64)
    g_all = torch.randn(sum(tokens), cfg.hidden, generator=gen, dtype=torch.float64)
    lo = sum(tokens[:rank])
    x, g = x_all[lo:lo + tokens[rank]], g_all[lo:lo + tokens[rank]]
    out, grads = _layer_run(moe, x, g)
    # the reference's loss without the aux term: each rank's aux loss covers its own tokens
    leaves = {k: v.clone().requires_grad_() for k, v in full.items()}
    y, _ = moe_forward(x_all, leaves["router_weight"], leaves["w13"], leaves["w2"], cfg,
                       logit_offset=leaves["logit_bias"], expert_bias=(leaves["b13"], leaves["b2"]))
    ref = dict(zip(leaves, torch.autograd.grad((y * g_all).sum(), list(leaves.values())), strict=True))
    xi = x.clone().requires_grad_()
    o = moe(xi).out
    mine = dict(zip(["w13", "w2", "b13", "b2"], torch.autograd.grad((o * g).sum(), [moe.w13, moe.w2, moe.b13, moe.b2],
                                                                    materialize_grads=True), strict=True))
    errs = {"out": rel_err(out.out, y[lo:lo + tokens[rank]])}
    for k in ("w13", "w2", "b13", "b2"):
        errs[k] = rel_err(gather_experts(moe, mine[k]), ref[k])
    return errs


def test_expert_parallel_world_2():
    # rank 1 has no tokens; every expert's gradient is complete on its owner
    for r in spawn(_ep_rank, 2, timeout_s=600):
        assert max(r.values()) < 1e-12, r


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_triton_backends_refuse_gpt_oss_experts(backend):
    with pytest.raises(ValueError, match="gpt-oss.*backend 'torch'"):
        MoE(_cfg(dtype=torch.bfloat16), backend=backend, device="cpu")
