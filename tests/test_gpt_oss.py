"""gpt-oss experts (router logit bias, projection biases, clamped SwiGLU) in megamoe.MoE against the float64
reference: forward and every gradient on the torch, split and fused backends, world 1 and sharded over 2 gloo ranks
(split and fused: also without host reads, bitwise reproducible; fused also with a ring); the Triton epilogues (bias,
clamped SwiGLU and its backward) and the bias-gradient kernels against their float64 twins; the reference's
activation against its definition; and the Gluon kernels (grouped GEMMs, megakernel items) never taking the form."""

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


def test_split_fp8_refuses_gpt_oss_experts():
    with pytest.raises(ValueError, match="fp8=1 runs SwiGLU experts only"):
        MoE(_cfg(dtype=torch.bfloat16), backend="split", device="cpu", fp8=True)


# --- the Triton kernels' gpt-oss epilogues and bias gradients, op by op -------------------------------------------

def _rel(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


SENTINEL = 4352.0


def _op_problem(sizes, pad, H=40, I=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, E = sum(sizes), len(sizes)
    R = n + pad
    offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(R, H, generator=gen) * 5  # |h| past the clamp limit for a good share of the entries
    x[n:] = float("nan")  # padding rows: never read as data
    dy = torch.randn(R, H, generator=gen)
    dy[n:] = float("nan")
    bf = lambda t: t.to(torch.bfloat16).contiguous()  # noqa: E731
    return dict(n=n, R=R, I=I, H=H, offs=offs, x=bf(x), dy=bf(dy), s=torch.rand(R, generator=gen) + 0.5,
                w13=bf(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5),
                w2=bf(torch.randn(E, H, I, generator=gen) / I ** 0.5),
                b13=bf(torch.randn(E, 2 * I, generator=gen)), b2=bf(torch.randn(E, H, generator=gen) * 0.3))


# edges: empty experts (first and between), a group of 1, groups straddling the 32-row block; one group with all
# rows; every group empty
OP_CASES = [pytest.param([0, 1, 45, 0, 33], 5, id="sizes-0-1-45-0-33"), pytest.param([70], 3, id="one-group"),
            pytest.param([0, 0], 4, id="all-empty")]


@pytest.mark.parametrize("use_tma,epi_split", [(False, 1), (True, 2)], ids=["pointers", "tma-split2"])
@pytest.mark.parametrize("sizes,pad", OP_CASES)
def test_gpt_oss_ops_match_float64_twins(sizes, pad, use_tma, epi_split):
    from megamoe import experts as X
    from megamoe.kernels.gemm_config import GemmConfig

    cfg = GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4, use_tma=use_tma,
                     epi_split=epi_split)
    p = _op_problem(sizes, pad)
    n, R, I, H, offs = p["n"], p["R"], p["I"], p["H"], p["offs"]
    clamp = (1.702, 7.0)
    d = {k: p[k].double() for k in ("x", "w13", "w2", "b13", "b2", "dy")}
    s64 = p["s"].double()
    full = lambda shape: torch.full(shape, SENTINEL, dtype=torch.bfloat16)  # noqa: E731
    act, h = X.gemm1_swiglu(p["x"], p["w13"], offs, out=full((R, I)), h_out=full((R, 2 * I)), config=cfg,
                            bias=p["b13"], clamp=clamp)
    ract, rh = X.gemm1_swiglu_ref(d["x"], d["w13"], offs, bias=d["b13"], clamp=clamp)
    for t in (act, h):
        assert (t[n:].float() == SENTINEL).all(), "a padding row was written"
    if n:
        assert (rh[:n, :I] > 7).float().mean() > 0.05 and (rh[:n, I:].abs() > 7).float().mean() > 0.05
        assert _rel(h[:n], rh[:n].bfloat16()) < 3e-4 and _rel(act[:n], ract[:n].bfloat16()) < 3e-4
    out = X.gemm2(act, p["w2"], offs, scale=p["s"], out=full((R, H)), config=cfg, bias=p["b2"])
    assert (out[n:].float() == SENTINEL).all()
    if n:
        rout = X.gemm2_ref(act.double(), d["w2"], offs, scale=s64, bias=d["b2"])
        assert _rel(out[:n], rout[:n].bfloat16()) < 3e-4
    acts = full((R, I))
    dh, ds = X.gemm2_dgrad_swiglu(p["dy"], p["w2"], h, offs, scale=p["s"], out=full((R, 2 * I)), config=cfg,
                                  acts_out=acts, clamp=clamp, b2=p["b2"])
    rdh, rds = X.gemm2_dgrad_swiglu_ref(d["dy"], d["w2"], h.double(), offs, scale=s64, clamp=clamp, b2=d["b2"])
    assert (dh[n:].float() == SENTINEL).all() and (acts[n:].float() == SENTINEL).all() and (ds[n:] == 0).all()
    if n:
        assert _rel(dh[:n], rdh[:n].bfloat16()) < 3e-4 and _rel(ds[:n], rds[:n]) < 1e-6
        g, u = h[:n, :I].double(), h[:n, I:].double()
        gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
        assert _rel(acts[:n], (s64[:n, None] * gc * torch.sigmoid(1.702 * gc) * (uc + 1)).bfloat16()) < 3e-4
        assert (rdh[:n] == 0).float().mean() > 0.05  # the clamps' zero gradients are exercised
    again = X.gemm2_dgrad_swiglu(p["dy"], p["w2"], h, offs, scale=p["s"], config=cfg, clamp=clamp, b2=p["b2"])
    assert torch.equal(dh[:n], again[0][:n]) and torch.equal(ds, again[1])
    # bias gradients: per-expert row sums (gate-scaled for db2), empty experts zero, bitwise reproducible
    db13 = X.segment_sum(dh, offs, out_dtype=torch.bfloat16)
    db2 = X.segment_sum(p["dy"], offs, scale=p["s"])
    dh_clean = torch.where(torch.arange(R)[:, None] < n, dh.double(), 0)
    dy_clean = torch.where(torch.arange(R)[:, None] < n, d["dy"], 0)
    empty = (offs[1:] - offs[:-1]) == 0
    assert (db13[empty] == 0).all() and (db2[empty] == 0).all()
    if n:
        assert _rel(db13, X.segment_sum_ref(dh_clean, offs).bfloat16()) < 3e-4
        assert _rel(db2, X.segment_sum_ref(dy_clean, offs, scale=s64)) < 1e-6
    assert torch.equal(db2, X.segment_sum(p["dy"], offs, scale=p["s"]))


def test_gluon_never_takes_gpt_oss_launches(monkeypatch):
    # as on Hopper (device check stubbed, the GPU's default configs): the same shapes take the Gluon kernel without
    # gpt-oss's epilogue and the Triton one with it; a config pinning kernel="gluon" raises with the reason
    import megamoe.experts as X
    from megamoe.kernels import gemm_config

    monkeypatch.setattr(X, "gluon_device_reason", lambda t, cfg: None)
    monkeypatch.setattr(gemm_config, "interpreting", lambda: False)
    E, R, H, I = 2, 40, 256, 128
    bf = lambda *shape: torch.empty(shape, dtype=torch.bfloat16)  # noqa: E731
    h = bf(R, 2 * I)
    for op, a, w, kw in (("gemm1_swiglu", bf(R, H), bf(E, 2 * I, H), dict(n=I, epilogue=1, n_up=I)),
                         ("gemm2", bf(R, I), bf(E, H, I), dict(n=H)),
                         ("dgrad_swiglu", bf(R, H), bf(E, H, I), dict(n=I, epilogue=2, w_kn=True, h=h))):
        assert X.choose_config(op, None, a, w, **kw).kernel == "gluon", op
        assert X.choose_config(op, None, a, w, gpt_oss=True, **kw).kernel != "gluon", op
        with pytest.raises(ValueError, match="Triton kernels only"):
            X.choose_config(op, X.GemmConfig(kernel="gluon"), a, w, gpt_oss=True, **kw)


# --- the split backend's layer against the float64 reference ------------------------------------------------------

#: bf16 bounds of the split layer against the float64 reference on bf16-rounded weights and inputs (the conventions'
#: 1e-2 for bf16 operands): gpt-oss's wider pre-activations (past the clamps) round more than the SwiGLU cases'
SPLIT_BOUND = 1e-2


def _bf16_full(cfg, seed):
    return {k: v.to(torch.bfloat16).double() for k, v in _full(cfg, seed).items()}


def _bf16_layer(full, group=None, backend="split", **opts):
    cfg = _cfg(dtype=torch.bfloat16, max_tokens_per_rank=64)
    moe = MoE(cfg, group=group, backend=backend, device="cpu", init="none", **opts)
    _load(moe, {k: v.to(torch.bfloat16) for k, v in full.items()})
    if backend == "fused":  # the megakernel's Triton items (the Gluon ones have no gpt-oss epilogues)
        assert moe.backend.config.kernel == "triton"
    return moe


@pytest.mark.parametrize("backend", ["split", "fused"])
@pytest.mark.parametrize("tokens", [37, 0])  # ragged; an empty batch
def test_bf16_backend_matches_reference(tokens, backend):
    cfg64 = _cfg()
    full = _bf16_full(cfg64, 0)
    moe = _bf16_layer(full, backend=backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, cfg64.hidden, generator=gen, dtype=torch.float64).bfloat16().double()
    g = torch.randn(tokens, cfg64.hidden, generator=gen, dtype=torch.float64)
    y, r, ref = _reference(cfg64, full, x, g)
    out, grads = _layer_run(moe, x.bfloat16(), g)
    if tokens:
        assert _rel(out.out, y) < SPLIT_BOUND
        for k, v in ref.items():
            assert _rel(grads[k], v) < SPLIT_BOUND, k
        h = torch.einsum("th,eih->tei", x, full["w13"]) + full["b13"]
        assert (h[..., :cfg64.intermediate] > 7).any() and (h.abs()[..., cfg64.intermediate:] > 7).any()
    else:
        assert out.out.shape == (0, cfg64.hidden)
        assert all(torch.isfinite(v).all() and v.shape == ref[k].shape for k, v in grads.items())
        assert all((grads[k] == 0).all() for k in ("w13", "w2", "b13", "b2"))


def _bf16_ep_rank(rank: int, world: int, backend: str, opts: dict) -> dict:
    import torch.distributed as dist

    from megamoe.layer import gather_experts
    from megamoe.testing.sync_guard import no_host_reads

    cfg64 = _cfg()
    full = _bf16_full(cfg64, 2)
    full["logit_bias"][3] = -40.0  # expert 3 (rank 0's at world 2) receives no token
    moe = _bf16_layer(full, group=dist.group.WORLD, backend=backend, **opts)
    tokens = [19, 0] if world == 2 else [19]
    gen = torch.Generator().manual_seed(4)
    x_all = torch.randn(sum(tokens), cfg64.hidden, generator=gen, dtype=torch.float64).bfloat16().double()
    g_all = torch.randn(sum(tokens), cfg64.hidden, generator=gen, dtype=torch.float64)
    lo = sum(tokens[:rank])
    x, g = x_all[lo:lo + tokens[rank]], g_all[lo:lo + tokens[rank]]
    leaves = {k: v.clone().requires_grad_() for k, v in full.items()}
    y, r = moe_forward(x_all, leaves["router_weight"], leaves["w13"], leaves["w2"], cfg64,
                       logit_offset=leaves["logit_bias"], expert_bias=(leaves["b13"], leaves["b2"]))
    assert r.counts[3] == 0
    ref = dict(zip(leaves, torch.autograd.grad((y * g_all).sum(), list(leaves.values())), strict=True))

    def step():
        xi = x.bfloat16().requires_grad_()
        o = moe(xi).out
        names = ["w13", "w2", "b13", "b2"]
        gr = torch.autograd.grad((o.double() * g).sum(), [xi, moe.w13, moe.w2, moe.b13, moe.b2],
                                 materialize_grads=True)
        return o, gr[0], dict(zip(names, gr[1:], strict=True))

    o, dx, mine = step()
    with no_host_reads():  # warm: no host read of device data in forward or backward
        o2, dx2, mine2 = step()
    same = torch.equal(o, o2) and torch.equal(dx, dx2) and all(torch.equal(mine[k], mine2[k]) for k in mine)
    errs = {"out": _rel(o, y[lo:lo + tokens[rank]]) if tokens[rank] else 0.0}
    for k in mine:
        errs[k] = _rel(gather_experts(moe, mine[k]), ref[k])
    return errs, same


@pytest.mark.parametrize("world,backend,opts", [
    (1, "split", {}), (2, "split", {}),
    (2, "split", {"presum_combine": True}),  # the expert rank pre-sums (bias inside the pre-summed rows)
    (1, "fused", {}), (2, "fused", {}),
    (1, "fused", {"ring_blocks": 4}), (2, "fused", {"ring_blocks": 4}),  # the ring cycles; the backward recomputes h
], ids=["split-w1", "split-w2", "split-w2-presum", "fused-w1", "fused-w2", "fused-w1-ring", "fused-w2-ring"])
def test_expert_parallel_sync_free(world, backend, opts):
    # world 2: rank 1 has no tokens, expert 3 none; every expert's gradient complete on its owner; the warm step
    # reads nothing on the host and repeats bitwise
    for errs, same in spawn(_bf16_ep_rank, world, backend, opts, timeout_s=600):
        assert same, "not bitwise reproducible"
        assert max(errs.values()) < SPLIT_BOUND, errs


def test_fused_takes_the_triton_items_for_gpt_oss(monkeypatch):
    # as on Hopper (device check left out, the GPU's default config): a SwiGLU layer gets the Gluon items, a gpt-oss
    # one the Triton items, and a config pinning kernel="gluon" on gpt-oss experts raises before anything is staged
    import megamoe.backends.fused as fused
    from megamoe.kernels.fused_moe import FusedConfig, fused_forward
    from megamoe.kernels.gluon import fused as gluon_fused

    reason = gluon_fused.gluon_fused_reason
    assert "Triton megakernel" in reason(FusedConfig(), H=2048, I=768, gpt_oss=True)
    monkeypatch.setattr(gluon_fused, "interpreting", lambda: False)
    assert reason(FusedConfig(), H=2048, I=768) is None
    assert "Triton megakernel" in reason(FusedConfig(), H=2048, I=768, gpt_oss=True)
    monkeypatch.setattr(fused, "gluon_fused_reason", lambda cfg, **kw: reason(FusedConfig(), **{**kw, "device": None}))
    swiglu = preset("qwen3-30b-a3b", hidden=64, intermediate=32, num_experts=4, top_k=2, max_tokens_per_rank=8)
    assert MoE(swiglu, backend="fused", device="cpu").backend.config.kernel == "gluon"
    moe = MoE(_cfg(dtype=torch.bfloat16, max_tokens_per_rank=8), backend="fused", device="cpu")
    assert moe.backend.config.kernel == "triton"
    monkeypatch.undo()
    b = moe.backend
    x, idx = torch.zeros(2, moe.config.hidden, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int64)
    args = (b.heap, x, idx, torch.ones(2, 2), moe.w13.detach(), moe.w2.detach())
    bias = dict(b13=moe.b13.detach(), b2=moe.b2.detach(), clamp=b.clamp)
    with pytest.raises(ValueError, match="kernel='gluon'.*Triton megakernel"):
        fused_forward(*args, b.config.with_(kernel="gluon"), **bias)
    with pytest.raises(ValueError, match="b13, b2 and clamp together"):
        fused_forward(*args, b.config, b13=moe.b13.detach(), b2=moe.b2.detach())
    with pytest.raises(ValueError, match="b2 must be a contiguous bf16"):
        fused_forward(*args, b.config, **{**bias, "b2": moe.b2.detach().float()})
    with pytest.raises(ValueError, match="b13 and b2 are given exactly for gpt_oss experts"):
        moe.backend(x, idx, torch.ones(2, 2), moe.w13.detach(), moe.w2.detach())


def test_output_bias_reaches_ds_without_the_clamp():
    # ds differentiates the whole expert row, its output bias b2 included, whether or not the SwiGLU is gpt-oss's
    # clamped one: the kernel and its twin agree on the plain SwiGLU too (the twin once dropped b2 there)
    import megamoe.experts as X

    gen = torch.Generator().manual_seed(5)
    E, R, H, I = 2, 40, 64, 32
    offs = torch.tensor([0, 17, 40], dtype=torch.int32)
    dy, h = torch.randn(R, H, generator=gen).bfloat16(), torch.randn(R, 2 * I, generator=gen).bfloat16()
    w2, b2 = (torch.randn(E, H, I, generator=gen) * 0.1).bfloat16(), torch.randn(E, H, generator=gen).bfloat16()
    s = torch.rand(R, generator=gen)
    dh, ds = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, b2=b2)
    rdh, rds = X.gemm2_dgrad_swiglu_ref(dy.double(), w2.double(), h.double(), offs, scale=s.double(), b2=b2.double())
    _, no_bias = X.gemm2_dgrad_swiglu_ref(dy.double(), w2.double(), h.double(), offs, scale=s.double())
    assert _rel(ds, rds) < 1e-6 < _rel(ds, no_bias)
    assert _rel(dh, rdh.bfloat16()) < 3e-4
