"""Checks shared by the tests of every backend: one rank's side of "layer vs float64 reference".

:func:`layer_case` runs on each rank of a process group: unsharded weights from a seed, this rank's experts, the
backend's forward and backward on this rank's tokens, :mod:`megamoe.reference` in float64 on the global batch.
It returns relative errors (||a - ref|| / ||ref|| in float64; 0 when both are 0, NaN as inf), the worse of two
calls for a case with ``then``:

* ``out``: this rank's rows of y; ``out_stored``: against the reference rounded where the kernels store, so only
  accumulation order is left and a few-ulp precision bug shows;
* ``aux``: the load-balancing loss on this rank's tokens;
* ``dx``: this rank's rows of dL/dx, L = sum(y * g) + AUX_WEIGHT * (sum of the ranks' aux losses), g fixed random;
* ``drouter``: dL/d router weight summed over ranks; ``dw13``, ``dw2``: gathered from all ranks;
* ``counts_ok``: tokens_per_expert equals the reference routing's count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from megamoe.config import MoEConfig, parse_dtype, preset
from megamoe.dist import gpu_world, group_world_rank, rank_device  # noqa: F401 - the GPU tests take them from here
from megamoe.layer import MoE, gather_experts, load_full_weights
from megamoe.reference import experts_ref, moe_forward, route_ref, shared_ref


def note_error(key: str, err: float) -> None:
    """Append {key, err} as a JSON line to $MEGAMOE_ERRLOG if set: the bounds come from the worst per key."""
    if path := os.environ.get("MEGAMOE_ERRLOG"):
        with open(path, "a") as f:
            f.write(json.dumps({"key": key, "err": err}) + "\n")


def seed_offset() -> int:
    """MEGAMOE_SEED_OFFSET (default 0) shifts the checks' seeds (tools/measure_bounds.py: fresh inputs)."""
    return int(os.environ.get("MEGAMOE_SEED_OFFSET", "0"))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    if a.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(ref.shape)}")
    if not torch.isfinite(a).all():
        return math.inf
    num, denom = (a - ref).norm().item(), ref.norm().item()
    return num / denom if denom else (0.0 if num == 0.0 else math.inf)


@dataclass(frozen=True)
class LayerCase:
    """One layer check. ``tokens``: tokens per rank (length W; 0: an empty rank). ``offset``: {expert: logit
    offset} to force routing. ``then``: tokens per rank of a second call on the same layer. ``repeat``: run the first
    call twice and require bitwise-equal outputs and gradients (``deterministic`` in the result)."""

    name: str
    preset: str = "tiny"
    dtype: str = "fp32"
    tokens: tuple[int, ...] = (24, 24)
    overrides: dict = field(default_factory=dict)
    offset: dict = field(default_factory=dict)
    seed: int = 0
    then: tuple[int, ...] | None = None
    repeat: bool = False

    def config(self) -> MoEConfig:
        return preset(self.preset, dtype=parse_dtype(self.dtype), **self.overrides)


def logit_offset(offset: dict, num_experts: int) -> torch.Tensor:
    """float64 [E]: a case's {expert: logit offset}, 0 for the other experts."""
    if any(not 0 <= e < num_experts for e in offset):  # a mistyped case must not run unskewed
        raise ValueError(f"logit offset for experts {sorted(offset)} outside [0, {num_experts})")
    return torch.tensor([float(offset.get(e, 0.0)) for e in range(num_experts)], dtype=torch.float64)


def _full_weights(cfg: MoEConfig, seed: int, device: torch.device):
    """Unsharded weights, the same on every rank (drawn on ``device``: fast for full-width cases) in float64 and
    rounded as the layer keeps them: to its dtype, the router bias to float32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, I = cfg.num_experts, cfg.hidden, cfg.intermediate
    kw = dict(generator=gen, dtype=torch.float64, device=device)
    router = torch.randn(E, H, **kw) * H ** -0.5
    w13 = torch.randn(E, 2 * I, H, **kw) * H ** -0.5
    w2 = torch.randn(E, H, I, **kw) * I ** -0.5
    bias = (torch.randn(E, **kw) * 0.1).float() if cfg.router == "sigmoid" else None
    shared = None
    if S := cfg.shared_intermediate:
        gate = torch.randn(1, H, **kw) * H ** -0.5 if cfg.shared_gate else None
        shared = (torch.randn(2 * S, H, **kw) * H ** -0.5, torch.randn(H, S, **kw) * S ** -0.5, gate)
        shared = tuple(None if t is None else t.to(cfg.dtype) for t in shared)
    return router.to(cfg.dtype), w13.to(cfg.dtype), w2.to(cfg.dtype), bias, shared


#: weight of the aux loss in the checked loss: large enough that its gradient is a visible part of the router's
AUX_WEIGHT = 10.0
QUANTITIES = ("out", "out_stored", "aux", "dx", "drouter", "dw13", "dw2")


def layer_case(case: LayerCase, backend: str, device: torch.device, group=None, tag: str | None = None,
               **backend_options) -> dict:
    """Run ``case`` on this rank -> {"case", "rank", "tag", errors...}. ``tag``: its :data:`BOUNDS` entry (default
    "<backend>.<dtype>", or "<backend>.fp8" with fp8=1, + ".cuda" on a GPU)."""
    _, world, rank = group_world_rank(group)
    calls = [case.tokens] + ([case.then] if case.then is not None else [])
    if any(len(t) != world for t in calls):
        raise ValueError(f"case {case.name}: token counts {calls} for {world} ranks")
    cfg = case.config()
    seed = case.seed + 1000 * seed_offset()
    router_w, w13, w2, bias, shared = _full_weights(cfg, seed, device)
    offset = logit_offset(case.offset, cfg.num_experts).float() if case.offset else None
    moe = MoE(cfg, group=group, backend=backend, device=device, **backend_options)
    load_full_weights(moe, router_w, w13, w2, bias, shared=shared)
    if offset is not None:
        moe.router.set_logit_offset(offset.to(device))
    ref_weights = (router_w, w13, w2, bias, offset, shared)
    errs: dict = {"case": case.name, "rank": rank, "counts_ok": True}
    for i, tokens in enumerate(calls):
        r = _call(moe, tokens, rank, world, group, device, ref_weights, seed + 1 + 100 * i,
                  repeat=case.repeat and i == 0)
        errs |= {**r, **{key: max(errs.get(key, 0.0), r[key]) for key in QUANTITIES},
                 "counts_ok": errs["counts_ok"] and r["counts_ok"]}
    if tag is None:
        tag = f"{backend}.{'fp8' if backend_options.get('fp8') else case.dtype}"
        tag += ".cuda" if torch.device(device).type == "cuda" else ""
    errs["tag"] = tag
    for key in QUANTITIES:
        note_error(f"{tag}.{key}", errs[key])
    return errs


def _call(moe: MoE, tokens: tuple[int, ...], rank: int, world: int, group, device, ref_weights, seed: int,
          repeat: bool) -> dict:
    """One forward + backward on this rank's share of a global batch from ``seed``, against the reference."""
    cfg, (router_w, w13, w2, bias, offset, shared) = moe.config, ref_weights
    gen = torch.Generator().manual_seed(seed)
    x_all, g_all = (torch.randn(sum(tokens), cfg.hidden, generator=gen, dtype=torch.float64) for _ in range(2))
    bounds = [sum(tokens[:q]) for q in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]

    # --- the layer under test (twice with ``repeat``: bitwise the same) ---
    runs = []
    for _ in range(2 if repeat else 1):
        # rounded to the layer dtype once, so the reference sees exactly what the layer sees
        x = x_all[lo:hi].to(cfg.dtype).to(device).clone().requires_grad_()
        out = moe(x)
        loss = (out.out.double() * g_all[lo:hi].to(device)).sum() + AUX_WEIGHT * out.aux_loss.double()
        runs.append((out, out.out, out.aux_loss, *_grads(loss, (x, moe.router.weight, moe.w13, moe.w2))))
    out, _, _, dx, drouter, dw13, dw2 = runs[0]

    # --- float64 reference on the global batch, from the same (rounded) weights ---
    ref_cfg = dataclasses.replace(cfg, dtype=torch.float64)
    xr, rw, r13, r2 = (t.to(cfg.dtype).double().to(device).requires_grad_() for t in (x_all, router_w, w13, w2))
    rb, ro = (None if t is None else t.double().to(device) for t in (bias, offset))
    sh = None if shared is None else tuple(None if t is None else t.double().to(device) for t in shared)
    y_ref, rr = moe_forward(xr, rw, r13, r2, ref_cfg, rb, ro, shared=sh)
    per_rank = [route_ref(xr[bounds[q]:bounds[q + 1]], rw, ref_cfg, rb, ro) for q in range(world)]
    loss_ref = (y_ref * g_all.to(device)).sum() + AUX_WEIGHT * sum(r.aux_loss for r in per_rank)
    ref_grads = _grads(loss_ref, (xr, rw, r13, r2))
    with torch.no_grad():
        y_stored = experts_ref(xr, rr.topk_idx, rr.topk_w, r13, r2, store_dtype=cfg.dtype)
        if sh is not None:  # the layer rounds the routed sum, then adds the shared expert's output
            y_stored = (y_stored + shared_ref(xr.to(cfg.dtype), *sh).double()).to(cfg.dtype).double()

    drouter = drouter.double()
    if world > 1:
        drouter = drouter.to(device)
        dist.all_reduce(drouter, group=group)
    mine = per_rank[rank]
    res = {
        "out": rel_err(out.out, y_ref[lo:hi]),
        "out_stored": rel_err(out.out, y_stored[lo:hi]),
        "aux": rel_err(out.aux_loss, mine.aux_loss),
        "dx": rel_err(dx, ref_grads[0][lo:hi]),
        "drouter": rel_err(drouter, ref_grads[1]),
        "dw13": rel_err(gather_experts(moe, dw13), ref_grads[2]),
        "dw2": rel_err(gather_experts(moe, dw2), ref_grads[3]),
        "max_expert_share": (out.tokens_per_expert.max().item() / max(1, (hi - lo) * cfg.top_k)),
        "tokens": hi - lo,
        "counts": out.tokens_per_expert.cpu().tolist(),
        "counts_ok": torch.equal(out.tokens_per_expert.cpu(), mine.counts.cpu()),
    }
    if repeat:
        res["deterministic"] = all(torch.equal(p, q) for p, q in zip(runs[0][1:], runs[1][1:], strict=True))
    return res


def _grads(loss: torch.Tensor, inputs: tuple) -> tuple:
    """d loss / d inputs, zeros for inputs the loss does not reach (an empty batch reaches none)."""
    if not loss.requires_grad:
        return tuple(torch.zeros_like(t) for t in inputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


def run_grads(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """[out, dx, drouter, dw13, dw2] of one forward + backward of ``moe`` on x with L = sum(out * g)."""
    xi = x.clone().requires_grad_()
    out = moe(xi).out
    return [out.detach(), *_grads((out.float() * g.float()).sum(), (xi, moe.router.weight, moe.w13, moe.w2))]


def tiny_experts(world: int) -> int:
    """Experts of the tiny test layer on ``world`` ranks: 8, or 4*world when world does not divide 8."""
    return 8 if 8 % world == 0 else 4 * world


def standard_cases(world: int) -> list[LayerCase]:
    """The edge cases every backend is checked on: tiny preset, ``world`` ranks, E = :func:`tiny_experts`."""
    even = tuple([24] * world)
    ragged = tuple(13 + 7 * r for r in range(world))  # token counts not multiples of any block size
    empty_rank = tuple(0 if r == world - 1 else 19 for r in range(world)) if world > 1 else (0,)
    # one rank: the empty call compares only shapes and zero gradients, so a second call with tokens follows
    after_empty = (19,) if world == 1 else None
    cases = [
        LayerCase("fp32-even", dtype="fp32", tokens=even),
        LayerCase("bf16-ragged", dtype="bf16", tokens=ragged),
        LayerCase("fp32-empty-rank", dtype="fp32", tokens=empty_rank, then=after_empty),  # a rank with zero tokens
        LayerCase("fp32-starved-expert", dtype="fp32", tokens=even, offset={3: -1e4, 6: -1e4}),  # experts get nothing
        LayerCase("fp64-one-expert-k1", dtype="fp64", tokens=ragged, overrides={"top_k": 1, "norm_topk": False},
                  offset={5: 12.0}),  # k=1 and every token on expert 5 (fp64: the router grad is ~1e-5)
        LayerCase("bf16-k1", dtype="bf16", tokens=even, overrides={"top_k": 1, "norm_topk": False}),  # top-1 (gate = p)
        LayerCase("fp32-sigmoid-bias", dtype="fp32", tokens=ragged,
                  overrides={"router": "sigmoid", "route_scale": 2.5}),  # DeepSeek-style router
        LayerCase("fp32-odd-widths", dtype="fp32", tokens=ragged,
                  overrides={"hidden": 100, "intermediate": 40}),  # H, I not multiples of 16 (no TMA)
        LayerCase("fp32-k5", dtype="fp32", tokens=ragged, overrides={"top_k": 5}),  # k > E_l on 2+ ranks
        # no tokens anywhere (zero gradients of the right shapes), then a call with tokens on the same layer
        LayerCase("fp32-all-empty", dtype="fp32", tokens=tuple([0] * world), then=even),
        # DeepSeek-V3 routing: sigmoid + bias, 4 groups of which 2 are open to each token, plus a shared expert
        LayerCase("fp32-groups-shared", dtype="fp32", tokens=ragged,
                  overrides={"router": "sigmoid", "route_scale": 2.5, "n_group": 4, "topk_group": 2,
                             "shared_intermediate": 48}),
        # Qwen2-MoE: softmax without renormalisation, a sigmoid-gated shared expert
        LayerCase("bf16-gated-shared", dtype="bf16", tokens=even,
                  overrides={"norm_topk": False, "shared_intermediate": 40, "shared_gate": True}),
    ]
    return [dataclasses.replace(c, overrides={"num_experts": tiny_experts(world), **c.overrides}) for c in cases]


def bf16_cases(world: int) -> list[LayerCase]:
    """The standard edge cases in bf16 (for backends whose kernels are bf16-only)."""
    return [dataclasses.replace(c, name="bf16:" + c.name, dtype="bf16") for c in standard_cases(world)]


def determinism_case(case: LayerCase, backend: str, device: torch.device, **backend_options) -> bool:
    """Whether two forward+backward passes on the same inputs (routed as ``offset`` forces) are bitwise equal."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    a, b = layer_runs(case.config(), case.tokens[rank], device, [(backend, backend_options)], calls=2,
                      input_seed=case.seed + 10 + rank, weight_seed=case.seed, offset=case.offset)
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def qwen3_experts(world: int) -> int:
    """Experts of the full-width GPU cases: 128, or the nearest multiple of world below it (126 for 3 ranks)."""
    return world * (128 // world)


def gpu_cases(world: int) -> list[LayerCase]:
    """Full-width shapes for GPU runs: qwen3-30b-a3b experts (H 2048, I 768, 128 experts, top-8) in bf16."""
    kw = dict(preset="qwen3-30b-a3b", dtype="bf16", overrides={"num_experts": qwen3_experts(world)})
    return [LayerCase("bf16-qwen3-512", tokens=tuple([512] * world), **kw),
            LayerCase("bf16-qwen3-ragged-skew", tokens=tuple(300 + 77 * r for r in range(world)),
                      offset={0: 3.0, 1: 2.5, 2: 2.0}, **kw)]


#: Bounds on :func:`layer_case`'s errors per backend and dtype ("fp8": bf16 layers with FP8 GEMMs): the worst over
#: the backend tests' cases, world sizes and three seed sets (tools/measure_bounds.py), plus 30%.
BOUNDS: dict[str, dict[str, float]] = {
    # drouter: the k = 1 case's router gradient is ~1e-5 and cancels
    "torch.fp64": dict(out=3.4e-16, out_stored=3.4e-16, aux=4.6e-16, dx=5.6e-16, drouter=2.2e-12, dw13=4.7e-16,
                       dw2=3.4e-16),
    "torch.fp32": dict(out=5.5e-7, out_stored=5.5e-7, aux=2.9e-7, dx=5.4e-7, drouter=6.8e-7, dw13=4.6e-7, dw2=4.8e-7),
    # out_stored no closer than out: torch rounds h before the SwiGLU, another storage model
    "torch.bf16": dict(out=6.5e-3, out_stored=7.4e-3, aux=1.8e-7, dx=7.5e-3, drouter=1.1e-2, dw13=6.3e-3, dw2=6.5e-3),
    "split.bf16": dict(out=4.3e-3, out_stored=3.9e-4, aux=2.4e-7, dx=6.1e-3, drouter=7.4e-3, dw13=5.3e-3, dw2=5.5e-3),
    # the pre-summing combine rounds each rank's partial sum to bf16 (out_stored), the rest as split's
    "split.bf16.presum": dict(out=4.6e-3, out_stored=4.2e-3, aux=2.4e-7, dx=6.1e-3, drouter=7.4e-3, dw13=5.3e-3,
                              dw2=5.5e-3),
    "split.fp8": dict(out=9.5e-2, out_stored=9.5e-2, aux=2.8e-7, dx=9.6e-2, drouter=0.19, dw13=8.5e-2, dw2=8.1e-2),
}
# fused shares split's storage points and backward kernels, hence its bounds; FP8 with the pre-summing combine: FP8's
BOUNDS |= {"fused.bf16": BOUNDS["split.bf16"], "split.fp8.presum": BOUNDS["split.fp8"]}
#: On one H200 (world 1, benchmarks/gpu.sh tests) the worst error plus 30%, in BOUNDS' order; a CUDA bound is the larger
#: of that and the CPU bound, which also covers world sizes 2-8 (multi-rank GPU cases: 2+ GPUs or MEGAMOE_SHARE_GPUS=1).
_CUDA = {"torch.bf16": (6.1e-3, 7.0e-3, 3.5e-7, 8.1e-3, 6.8e-3, 6.0e-3, 6.2e-3),
         "split.bf16": (5.1e-3, 9.8e-4, 3.5e-7, 6.7e-3, 5.6e-3, 5.0e-3, 5.9e-3),
         "split.bf16.presum": (3.8e-3, 9.8e-4, 3.5e-7, 5.6e-3, 5.1e-3, 4.5e-3, 5.1e-3),
         "split.fp8": (8.8e-2, 8.8e-2, 3.5e-7, 9.7e-2, 0.15, 8.5e-2, 7.3e-2)}
_CUDA |= {"fused.bf16": _CUDA["split.bf16"], "split.fp8.presum": _CUDA["split.fp8"]}  # presum: none at world 1
BOUNDS |= {"torch.fp64.cuda": BOUNDS["torch.fp64"], "torch.fp32.cuda": BOUNDS["torch.fp32"]} | {
    f"{t}.cuda": {q: max(v, BOUNDS[t][q]) for q, v in zip(BOUNDS[t], m, strict=True)} for t, m in _CUDA.items()}
# The FP8 bounds are the e4m3 recipe's error, not a wiring error (which gives O(1)): each FP8 GEMM costs ~0.037 (two
# operands at 3 mantissa bits), SwiGLU compounds GEMM1's two halves and GEMM2 adds its own, ~0.064 at the output;
# the router gradient, a difference of gate-weighted expert outputs, cancels and so amplifies the relative error.
FP8_MIN_COSINE_VS_BF16 = 0.995  # measured >= 0.9965 (router), >= 0.9979 for the rest


def check_bounds(results: list[dict]) -> int:
    """Assert every :func:`layer_case` result within :data:`BOUNDS`, its counts right and (``repeat``) bitwise
    deterministic; returns how many were ring runs that cycled (more "blocks" on the rank than "ring" slots)."""
    cycled = 0
    for r in results:
        for key, tol in BOUNDS[r["tag"]].items():
            assert r[key] < tol, f"{r['case']} rank {r['rank']} ({r['tag']}): {key} rel err {r[key]:.3g} >= {tol}"
        assert r["counts_ok"], f"{r['case']} rank {r['rank']}: tokens_per_expert differs from the routing"
        assert r.get("deterministic", True), f"{r['case']} rank {r['rank']}: two runs differ bitwise"
        cycled += int("ring" in r and r["blocks"] > r["ring"])
    return cycled


def layer_runs(cfg: MoEConfig, tokens: int, device: torch.device, specs: list[tuple[str, dict]], *, input_seed: int,
               weight_seed: int, offset: dict | None = None, calls: int = 1) -> list[list[torch.Tensor]]:
    """Per (backend, options) of ``specs``, ``calls`` times in turn on one layer: this rank's [out, dx, drouter, dw13,
    dw2] of a forward + backward with L = sum(out * g); weights from ``weight_seed``, x and g from ``input_seed``;
    ``offset``: {expert: logit offset}."""
    gen = torch.Generator().manual_seed(input_seed)
    x = torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype).to(device)
    g = torch.randn(tokens, cfg.hidden, generator=gen).to(cfg.dtype).to(device)
    runs = []
    for backend, opts in specs:
        moe = MoE(cfg, backend=backend, device=device, seed=weight_seed, **opts)
        if offset:
            moe.router.set_logit_offset(logit_offset(offset, cfg.num_experts).float().to(device))
        runs += [run_grads(moe, x, g) for _ in range(calls)]
        del moe
    return runs


def compare_runs(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """{out, dx, drouter, dw13, dw2: (bitwise equal, relative difference of a vs b, cosine)} of two layer_runs."""
    res = {}
    for name, p, q in zip(("out", "dx", "drouter", "dw13", "dw2"), a, b, strict=True):
        pd, qd = p.detach().double().flatten().cpu(), q.detach().double().flatten().cpu()
        den = (pd.norm() * qd.norm()).item()
        res[name] = (torch.equal(p, q), rel_err(p, q), (pd @ qd).item() / den if den else 1.0)
    return res


def twin_runs(case: LayerCase, device: torch.device, a: tuple[str, dict], b: tuple[str, dict]) -> dict:
    """:func:`compare_runs` of layers ``a`` and ``b`` ((backend, options)) on ``case``'s weights and inputs."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return compare_runs(*layer_runs(case.config(), case.tokens[rank], device, [a, b], input_seed=case.seed + 20 + rank,
                                    weight_seed=case.seed, offset=case.offset))


def training_step(rank: int, backend: str, tokens: int = 2048, **backend_options):
    """(device, qwen3-30b-a3b layer on this rank's GPU, closure running one forward + backward + SGD step on fixed
    inputs and returning the output), for the GPU tests' sync-free and CUDA-graph checks."""
    dev = rank_device()
    cfg = preset("qwen3-30b-a3b", max_tokens_per_rank=tokens)
    moe = MoE(cfg, backend=backend, device=dev, seed=1, **backend_options)
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    dy = torch.randn(tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)

    def step():
        opt.zero_grad(set_to_none=False)
        out = moe(x)
        out.out.backward(dy)
        opt.step()
        return out.out

    return dev, moe, step


def sync_free_step(step) -> bool:
    """After two warm-up steps, one step under ``torch.cuda.set_sync_debug_mode("error")``: raises on a host sync."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return True


def graph_replay_vs_eager(dev: torch.device, moe: MoE, step) -> dict:
    """{"graph_out_equal", "graph_w_equal"}: two graph replays of a training step against two eager steps from the
    same parameters, bit for bit. All on one side stream (see megamoe.apps.bench.capture_step for why)."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            step()  # warm-up: compile, allocate gradients on s
        state = {k: v.clone() for k, v in moe.state_dict().items()}
        eager = [step().clone() for _ in range(2)]
        eager_w = moe.w13.detach().clone()
        moe.load_state_dict(state)
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        static_out = step()
    replay = []
    with torch.cuda.stream(s):
        moe.load_state_dict(state)
        for _ in range(2):
            graph.replay()
            replay.append(static_out.clone())
    s.synchronize()
    return {"graph_out_equal": all(torch.equal(a, b) for a, b in zip(eager, replay, strict=True)),
            "graph_w_equal": torch.equal(eager_w, moe.w13.detach())}


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as bytes when it is float8_e4m3fn (so torch.equal compares bits, -0 included), else t."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@contextlib.contextmanager
def counting_weight_quantisations(moe: MoE):
    """Counts fp8_weights.quantize_weight_both calls on ``moe``'s own w13 / w2 in the block: yields {"n": so far}."""
    import megamoe.backends.fp8_weights as split_mod

    mine = {moe.w13.data_ptr(), moe.w2.data_ptr()}
    real = split_mod.quantize_weight_both
    calls = {"n": 0}

    def counting(w, *a, **kw):
        calls["n"] += w.data_ptr() in mine
        return real(w, *a, **kw)

    with mock.patch.object(split_mod, "quantize_weight_both", counting):
        yield calls
