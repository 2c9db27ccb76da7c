"""Backend ``fused`` (the forward megakernel) on 1, 2, 3, 4 and 8 gloo CPU ranks under the Triton interpreter,
against the float64 reference on the global batch: dense buffers and macrobatch rings that must cycle
(skewed routing, rings of 1x, 2x and 4x a minibatch and the smallest ring), bitwise determinism, bounded
waits, clear errors."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from megamoe.dist import spawn
from megamoe.testing import (
    LayerCase,
    bf16_cases,
    check_bounds,
    compare_runs,
    determinism_case,
    layer_case,
    layer_runs,
    tiny_experts,
    twin_runs,
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # spawned CPU ranks inherit it before importing triton

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; GPUs run test_gpu_fused.py")

# the interpreter is slow: every edge case on 2 ranks, a subset on 1, 3, 4 and 8 (CI runs on 2 cores)
SUBSET = {1: ("bf16:bf16-ragged", "bf16:fp64-one-expert-k1", "bf16:fp32-empty-rank"),
          3: ("bf16:bf16-ragged",),
          4: ("bf16:bf16-ragged", "bf16:fp32-empty-rank", "bf16:fp32-starved-expert"),
          8: ("bf16:bf16-ragged",)}  # EP = 8 (DeepEP's intranode config) before an 8-GPU machine is lent

BM_INTERP = 32  # rows of a block under the interpreter (kernels/fused_moe.default_fused_config)


def skewed_case(world: int) -> LayerCase:
    """Most rows land on rank 0: experts 0 and 1 (both on rank 0) get a large logit offset."""
    return LayerCase("bf16:skewed", dtype="bf16", tokens=tuple([96] + [40] * (world - 1)),
                     overrides={"num_experts": tiny_experts(world)}, offset={0: 4.0, 1: 4.0})


def blocks_on_rank(counts: list[int], rank: int, world: int, bm: int = BM_INTERP) -> int:
    """Blocks the megakernel walks on ``rank``: cdiv(rows, BM) per local expert."""
    e_l = len(counts) // world
    return sum(-(-c // bm) for c in counts[rank * e_l:(rank + 1) * e_l])


def _rank(rank: int, world: int) -> tuple[list[dict], list[bool]]:
    import megamoe.backends.split as split_backend

    split_backend.POISON_PADDING = True  # d_recv's padding rows NaN (the backward on split's kernels)
    dev = torch.device("cpu")
    cases = [c for c in bf16_cases(world) if world not in SUBSET or c.name in SUBSET[world]]
    results = [layer_case(c, "fused", dev) for c in cases]
    det_case = LayerCase("det", dtype="bf16", tokens=tuple(17 + r for r in range(world)),
                         overrides={"num_experts": tiny_experts(world)})
    if world == 8:  # 8 ranks on 2 CI cores: the determinism check rides on the one case (a second fwd + bwd)
        results.append(dict(layer_case(dataclasses.replace(cases[0], repeat=True), "fused", dev),
                            case="repeat:" + cases[0].name))
        return results, []
    dets = [determinism_case(det_case, "fused", dev)]
    if world == 2:
        sk = skewed_case(world)
        # a minibatch: the blocks uniform routing gives one rank (T * k rows of 32); rings of 1x, 2x, 4x it
        mini = max(4, -(-(sum(sk.tokens) // world) * 2 // BM_INTERP))
        for ring in (4, mini, 2 * mini, 4 * mini):  # 4 = the smallest ring (lag + 3)
            r = layer_case(sk, "fused", dev, ring_blocks=ring)
            r["case"] = f"ring{ring}:" + r["case"]
            r["ring"] = ring
            r["blocks"] = blocks_on_rank(r["counts"], rank, world)
            results.append(r)
        dets.append(determinism_case(sk, "fused", dev, ring_blocks=4))
        r = layer_case(cases[1], "fused", dev, pull_split=2, lookahead=1)  # two pull items per block
        r["case"] = "pull_split2:" + r["case"]
        results.append(r)
        # the GPU's default distances (the interpreter's default config uses lookahead 2 / lag 1: fewer empty items)
        r = layer_case(cases[1], "fused", dev, lookahead=8, lag=3)
        r["case"] = "lookahead8-lag3:" + r["case"]
        results.append(r)
        r = layer_case(sk, "fused", dev, prologue=True)  # the first steps' blocks pulled in finer parts
        r["case"] = "prologue:" + r["case"]
        results.append(r)
        # row addresses loaded up front, with the prologue and a cycling ring (bitwise vs the default pull:
        # test_fused_pull_prefetch_copies_the_same_rows)
        r = layer_case(sk, "fused", dev, pull_prefetch=True, prologue=True, ring_blocks=8, group_blocks=2)
        r["case"] = "pull-prefetch-prologue-ring8:" + r["case"]
        results.append(r)
        r = layer_case(cases[1], "fused", dev, pull_prefetch=True, fused_backward=True)  # the gated pull
        r["case"] = "pull-prefetch-bwd:" + r["case"]
        results.append(r)
        # 2 blocks per step, cycling ring; ld.acquire.gpu on the tile counters
        r = layer_case(sk, "fused", dev, group_blocks=2, ring_blocks=8, counter_scope="gpu")
        r["case"] = "group2-ring8-counter-scope-gpu:" + r["case"]
        results.append(r)
        for c in cases:  # the backward megakernel (fused_backward=True) on the edge cases of this rank count
            if c.name in ("bf16:bf16-ragged", "bf16:fp32-empty-rank", "bf16:fp32-k5"):
                r = layer_case(c, "fused", dev, fused_backward=True)
                r["case"] = "bwd-megakernel:" + r["case"]
                results.append(r)
        dets.append(determinism_case(det_case, "fused", dev, fused_backward=True))
        for c in cases:  # the owner-pull combine (GEMM2's rows stay local, owners pull them), with the
            # backward megakernel
            if c.name in ("bf16:bf16-ragged", "bf16:fp32-empty-rank"):
                r = layer_case(c, "fused", dev, combine="pull", fused_backward=True)
                r["case"] = "pull-combine:" + r["case"]
                results.append(r)
        r = layer_case(sk, "fused", dev, combine="pull", ring_blocks=4)
        r["case"] = "pull-combine-ring4:" + r["case"]
        results.append(r)
        # dense pull combine with the default backward: the forward reads peers' rows after its DONE, and the
        # backward's dgrad then writes d_recv into this rank's rows region (split.dgrad_buffer)
        r = layer_case(cases[1], "fused", dev, combine="pull")
        r["case"] = "pull-combine-default-bwd:" + r["case"]
        results.append(r)
    return results, dets


def check(results) -> None:
    cycled = 0
    for rank_results, dets in results:
        assert all(dets), "fused backend: two runs differ bitwise"
        cycled += check_bounds(rank_results)
        for r in rank_results:
            if r["case"].endswith("starved-expert"):
                assert r["counts"][3] == 0 and r["counts"][6] == 0
    if any("ring" in r for rr, _ in results for r in rr):
        assert cycled >= 2, "the skewed case should make the smallest rings cycle"


@CPU_ONLY
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])  # 3: not a power of two; 8: one local expert per rank
def test_fused_matches_reference_cpu(world):
    check(spawn(_rank, world, timeout_s=900))


# FP8 (fp8=1): x quantised once per token on its home rank, the packed rows pulled, both GEMMs on e4m3 operands in the
# megakernel (act quantised by GEMM1's epilogue), the backward on split's FP8 kernels. Against the split layer with
# fp8=1, fp8_dispatch=1 (the same recipe in separate kernels) every output and gradient must be bitwise equal on
# CPU ranks (the same Triton FP8 arithmetic; on GPUs split runs Gluon kernels: tests/test_gpu_fused.py); against
# float64 the FP8 bounds of megamoe.testing.
FP8_CASES = ("bf16:fp32-empty-rank",      # a rank with zero tokens
             "bf16:fp64-one-expert-k1",   # k = 1, one expert takes every token
             "bf16:fp32-odd-widths")      # H = 100, I = 40: partial scale blocks, rows not TMA-aligned


def fp8_multiblock(world: int) -> LayerCase:
    """Several scale blocks per weight, each dimension ending in a partial one (H = 160, I = 144)."""
    return LayerCase("bf16-multiblock-ragged", dtype="bf16", tokens=tuple(13 + 4 * r for r in range(world)),
                     overrides={"num_experts": 4, "hidden": 160, "intermediate": 144})


def _rank_fp8(rank: int, world: int):
    dev = torch.device("cpu")
    split_fp8 = ("split", {"fp8": True, "fp8_dispatch": True})
    cases = [c for c in bf16_cases(world) if c.name in FP8_CASES] + [fp8_multiblock(world)]
    refs = [dict(layer_case(c, "fused", dev, fp8=True), case="fp8:" + c.name) for c in cases]
    twins = [(c.name, twin_runs(c, dev, ("fused", {"fp8": True}), split_fp8)) for c in cases]
    sk = skewed_case(world)
    for ring in (4, 8):  # the smallest ring, and one that cycles less
        r = layer_case(sk, "fused", dev, fp8=True, ring_blocks=ring)
        r.update(case=f"fp8-ring{ring}:{r['case']}", ring=ring, blocks=blocks_on_rank(r["counts"], rank, world))
        refs.append(r)
        twins.append((f"ring{ring}", twin_runs(sk, dev, ("fused", {"fp8": True, "ring_blocks": ring}), split_fp8)))
    # the owner-pull combine, and the prefetching pull with the prologue on a cycling ring, on the packed FP8 rows
    for name, opts in (("pull-combine", {"combine": "pull"}),
                       ("pull-prefetch-prologue-ring8", {"pull_prefetch": True, "prologue": True, "ring_blocks": 8,
                                                         "group_blocks": 2})):
        twins.append((name, twin_runs(sk, dev, ("fused", {"fp8": True, **opts}), split_fp8)))
    dets = [determinism_case(sk, "fused", dev, fp8=True), determinism_case(sk, "fused", dev, fp8=True, ring_blocks=4)]
    return refs, twins, dets


@CPU_ONLY
def test_fused_fp8_matches_split_fp8_cpu():
    cycled = 0
    for refs, twins, dets in spawn(_rank_fp8, 2, timeout_s=900):
        assert all(dets), "fused fp8: two runs differ bitwise"
        cycled += check_bounds(refs)
        for name, t in twins:
            diff = {k: v for k, v in t.items() if not v[0]}
            assert not diff, f"{name}: fused fp8 differs from split fp8 + fp8_dispatch: {diff}"
    assert cycled >= 1, "the skewed case should make the smallest ring cycle"


def _presum_backward(rank: int, world: int) -> tuple[dict, dict, dict, dict, list]:
    """fused:presum_backward=1 (dx gathered with split's presum) against float64 on a cycling ring with the
    owner-pull combine (the forward's rows stay in the heap's rows region, which presum's stage then writes), and on
    the same weights and inputs against split:presum_combine=1 (the same backward kernels) and fused's default; FP8
    against split's FP8 layer with presum. Also returns every presum gather's ``gated`` flag, in call order (a
    presum dx can equal the plain gather's bits, so only the calls show that the option took effect)."""
    import megamoe.comm.presum as presum

    dev = torch.device("cpu")
    sk = skewed_case(world)
    case = next(c for c in bf16_cases(world) if c.name == "bf16:bf16-ragged")
    gather, calls = presum.presum_gather, []

    def counted(*args, **kwargs):
        calls.append(args[2])  # gated: True in combine's forward, False in dispatch's backward (dx)
        return gather(*args, **kwargs)

    def runs(specs):
        return layer_runs(case.config(), case.tokens[rank], dev, specs, input_seed=case.seed + 20 + rank,
                          weight_seed=case.seed)

    presum.presum_gather = counted
    try:
        ref = layer_case(sk, "fused", dev, presum_backward=True, ring_blocks=4, combine="pull")
        mine, split, default = runs([("fused", {"presum_backward": True}), ("split", {"presum_combine": True}),
                                     ("fused", {})])
        fp8, split_fp8 = runs([("fused", {"presum_backward": True, "fp8": True}),
                               ("split", {"presum_combine": True, "fp8": True, "fp8_dispatch": True})])
    finally:
        presum.presum_gather = gather
    ref.update(ring=4, blocks=blocks_on_rank(ref["counts"], rank, world))
    return ref, compare_runs(mine, split), compare_runs(mine, default), compare_runs(fp8, split_fp8), calls


@CPU_ONLY
def test_fused_presum_backward_cpu():
    cycled = 0
    for ref, split, default, fp8, calls in spawn(_presum_backward, 2, timeout_s=600):
        check_bounds([ref])
        cycled += ref["blocks"] > ref["ring"]
        # one ungated gather (dx) per fused presum_backward run (ring, dense, FP8), none in fused's default; split's
        # presum runs a gated one (combine) and an ungated one (dx)
        assert calls == [False, False, True, False, False, True, False], calls
        for twin, what in ((split, "split presum_combine"), (fp8, "split fp8 + fp8_dispatch + presum_combine")):
            for key in ("dx", "drouter", "dw13", "dw2"):  # the same backward kernels (out is summed differently:
                # split's combine pre-sums too)
                assert twin[key][0], f"fused presum_backward vs {what}: {key} differs ({twin[key][1]:.3g})"
        for key in ("out", "drouter", "dw13", "dw2"):  # against fused's default only dx's summation order changes
            assert default[key][0], f"presum_backward changed {key}"
        assert default["dx"][1] < 1e-2  # (here even bitwise: hence the count of presum calls above)
    assert cycled >= 1, "the skewed case should make the ring cycle on rank 0"


def _absent(rank: int, world: int):
    """Rank 1 builds the layer but never runs it; rank 0 must raise naming it, within the timeout."""
    from megamoe import MoE, preset
    from megamoe.comm import CommTimeoutError

    moe = MoE(preset("tiny", max_tokens_per_rank=8), backend="fused", timeout_s=1.5)
    if rank == 1:
        time.sleep(0.5)
        return None
    x = torch.randn(8, moe.config.hidden).to(torch.bfloat16)
    t0 = time.monotonic()
    try:
        moe(x)
    except CommTimeoutError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


@CPU_ONLY
def test_fused_absent_rank_raises():
    msg, took = spawn(_absent, 2, timeout_s=120)[0]
    assert "peer rank 1 never signalled" in msg, msg
    assert took < 1.5 + 10, took


def _timeline(rank: int, world: int):
    """FusedConfig.timeline: the forward's output is unchanged and the item records account for every block."""
    import triton

    from megamoe import MoE, preset
    from megamoe.kernels import fused_moe

    moe = MoE(preset("tiny", max_tokens_per_rank=24), backend="fused", seed=3)
    x = torch.randn(20 + 3 * rank, moe.config.hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with torch.no_grad():
        ref = moe(x).out
        cfg = moe.backend.config
        moe.backend.config = cfg.with_(timeline=True)
        out = moe(x).out
    info = dict(fused_moe.LAST_TIMELINE)
    items = info["items"]
    taken = items[items[:, 7] > 0]
    kinds = {k: taken[taken[:, 1] == k] for k in range(4)}
    nb = int(kinds[0][:, 2].max().item()) + 1 if len(kinds[0]) else 0
    H, I = moe.config.hidden, moe.config.intermediate
    per_block = (cfg.pull_split, triton.cdiv(I, cfg.bn1), triton.cdiv(H, cfg.bn2))
    counts_ok = all(sorted(kinds[k][:, 2].tolist()) == sorted(list(range(nb)) * per_block[k]) for k in range(3))
    stamps = taken[:, 3:8]
    monotone = bool((stamps[:, 1:] >= stamps[:, :-1]).all())
    pids_ok = bool(((taken[:, 0] >= 0) & (taken[:, 0] < info["programs"])).all())
    pp = info["per_program"]  # entry, READY seen, items done, DONE seen, end: in order, around the items
    monotone = monotone and bool((pp[:, 1:5] >= pp[:, 0:4]).all()) and bool(pp[:, 2].max() >= taken[:, 7].max())
    return torch.equal(ref, out), nb, counts_ok, monotone, pids_ok


@CPU_ONLY
def test_fused_timeline_cpu():
    for equal, nb, counts_ok, monotone, pids_ok in spawn(_timeline, 2, timeout_s=600):
        assert equal, "the timeline records changed the forward's output"
        assert nb > 0 and counts_ok, "every block must have its pull, GEMM1 and GEMM2 items recorded"
        assert monotone and pids_ok


def _pull_variants(rank: int, world: int):
    """The pull with every row address loaded up front (pull_prefetch) copies the same rows as the default pull,
    also with several row groups per block (small pull_elems: 2 rows per chunk) and gated (the backward
    megakernel's pull of w * dy): forward output and input gradient bitwise equal."""
    from megamoe import MoE, preset

    x = torch.randn(21 + 2 * rank, 40, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank)).to(torch.bfloat16)
    outs = []
    for pf in (False, True):
        moe = MoE(preset("tiny", hidden=40, max_tokens_per_rank=24), backend="fused", seed=3, fused_backward=True)
        moe.backend.config = moe.backend.config.with_(pull_elems=128, pull_prefetch=pf)  # 2 rows per chunk
        xi = x.clone().requires_grad_()
        y = moe(xi).out
        y.backward(dy)
        outs.append((y.detach(), xi.grad))
    return all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@CPU_ONLY
def test_fused_pull_prefetch_copies_the_same_rows():
    assert all(spawn(_pull_variants, 2, timeout_s=600))


def _bad_options(rank, world):
    from megamoe import MoE, preset

    msgs = []
    for kw in ({"ring_blocks": 2}, {"programs": 0}, {"lookahead": 0}, {"group_blocks": 0},
               {"fused_backward": True, "ring_blocks": 8}, {"combine": "both"}):
        try:
            MoE(preset("tiny"), backend="fused", **kw)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    try:
        MoE(preset("tiny", dtype=torch.float32), backend="fused")
        msgs.append(None)
    except ValueError as exc:
        msgs.append(str(exc))
    try:  # MoEConfig.ring_rows and ring_blocks must agree
        MoE(preset("tiny", ring_rows=1000), backend="fused", ring_blocks=5)
        msgs.append(None)
    except ValueError as exc:
        msgs.append(str(exc))
    b = MoE(preset("tiny", ring_rows=1000), backend="fused").backend  # rows rounded up to whole blocks
    msgs.append((b.ring_blocks, -(-1000 // b.config.block_m)))
    from megamoe.kernels.fused_moe import fused_forward

    m = MoE(preset("tiny"), backend="fused", combine="pull")  # its heap has no slot buffers
    x = torch.zeros(2, m.config.hidden, dtype=m.config.dtype)
    idx = torch.zeros(2, m.config.top_k, dtype=torch.int64)
    try:  # a push launch on it must be refused before any kernel runs
        fused_forward(m.backend.heap, x, idx, torch.ones(2, m.config.top_k), m.w13.detach(), m.w2.detach(),
                      m.backend.config.with_(combine="push"))
        msgs.append(None)
    except ValueError as exc:
        msgs.append(str(exc))
    for kw in ({"stages": 5}, {"counter_scope": "cta"}, {"lag": 0}, {"lag": 2, "ring_blocks": 4}, {"prologue": 2},
               {"pull_prefetch": "yes"}, {"fp8": 2}, {"fp8": True, "fused_backward": True},
               {"fp8": True, "hidden": 20}, {"kernel": "cuda"}, {"kernel": "gluon"}, {"kernel": "gluon", "fp8": True},
               {"presum_backward": 2}, {"presum_backward": True, "fused_backward": True}):
        cfg_kw = {"hidden": kw.pop("hidden")} if "hidden" in kw else {}  # a layer-config field, not an option
        try:
            MoE(preset("tiny", **cfg_kw), backend="fused", **kw)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_fused_rejects_bad_options():
    (msgs,) = spawn(_bad_options, 1)
    assert msgs[0] is not None and "ring_blocks" in msgs[0]
    assert msgs[1] is not None and "programs" in msgs[1]
    assert msgs[2] is not None and "lookahead" in msgs[2]
    assert msgs[3] is not None and "group_blocks" in msgs[3]
    assert msgs[4] is not None and "fused_backward" in msgs[4]
    assert msgs[5] is not None and "combine" in msgs[5]
    assert msgs[6] is not None and "bfloat16" in msgs[6]
    assert msgs[7] is not None and "ring_rows" in msgs[7]
    assert msgs[8][0] == msgs[8][1]
    assert msgs[9] is not None and "slots" in msgs[9]
    assert msgs[10] is not None and "stages" in msgs[10]
    assert msgs[11] is not None and "counter_scope" in msgs[11]
    assert msgs[12] is not None and "lag" in msgs[12]
    assert msgs[13] is not None and "ring_blocks must be >= 5" in msgs[13]
    assert msgs[14] is not None and "prologue" in msgs[14]
    assert msgs[15] is not None and "pull_prefetch" in msgs[15]
    assert msgs[16] is not None and "fp8" in msgs[16]
    assert msgs[17] is not None and "fused_backward" in msgs[17] and "bf16 only" in msgs[17]
    assert msgs[18] is not None and "packed FP8 row" in msgs[18] and "hidden = 20" in msgs[18]
    assert msgs[19] is not None and "kernel must be 'triton' or 'gluon'" in msgs[19]
    if os.environ.get("TRITON_INTERPRET") == "1":  # (a GPU machine runs the layer's kernels: no error there)
        assert msgs[20] is not None and "kernel='gluon'" in msgs[20] and "interpreter" in msgs[20]
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert msgs[21] is not None and "kernel='gluon'" in msgs[21] and "interpreter" in msgs[21]
    assert msgs[22] is not None and "presum_backward must be a flag" in msgs[22]
    assert msgs[23] is not None and "presum_backward" in msgs[23] and "fused_backward" in msgs[23]


def test_gluon_fused_reasons(monkeypatch):
    """kernel='gluon' names what it cannot run: the interpreter, then sizes and options (checked here as on a GPU)."""
    from megamoe.kernels import gluon_fused
    from megamoe.kernels.fused_moe import FusedConfig
    from megamoe.kernels.gluon_fused import gluon_fused_reason
    from megamoe.kernels.gluon_fused import stages_of as gluon_fused_stages

    ok = FusedConfig()
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert "interpreter" in gluon_fused_reason(ok, H=2048, I=768)
    monkeypatch.setattr(gluon_fused, "interpreting", lambda: False)
    assert gluon_fused_reason(ok, H=2048, I=768) is None
    assert "block_m=128" in gluon_fused_reason(ok.with_(bn1=64), H=2048, I=768)
    assert "bn2" in gluon_fused_reason(ok.with_(bn2=64), H=2048, I=768)
    assert "multiples of 8" in gluon_fused_reason(ok, H=100, I=40)
    assert "shared memory" in gluon_fused_reason(ok.with_(num_stages=5), H=2048, I=768)
    assert "num_stages" in gluon_fused_reason(ok.with_(num_stages=1), H=2048, I=768)
    assert gluon_fused_reason(ok.with_(timeline=True), H=2048, I=768) is None  # (the timeline works on both)
    assert "Triton megakernel only" in gluon_fused_reason(ok.with_(ablate=2), H=2048, I=768)
    f8 = ok.with_(bn2=128)  # the FP8 items: GEMM2 tiles inside one weight scale block, I % 128, at most 4 stages
    assert gluon_fused_reason(f8, H=2048, I=768, fp8=True) is None
    assert gluon_fused_stages(f8.with_(num_stages=6), fp8=True) == 4 and gluon_fused_stages(f8) == 4
    assert "bn2 128" in gluon_fused_reason(ok, H=2048, I=768, fp8=True)
    assert "I of 128" in gluon_fused_reason(f8, H=2880, I=2880, fp8=True)
    assert "H must be a multiple of 16" in gluon_fused_reason(f8, H=2056, I=768, fp8=True)
    assert "push their rows" in gluon_fused_reason(f8.with_(combine="pull"), H=2048, I=768, fp8=True)


def test_gluon_bulk_pull_plan(monkeypatch):
    """The Gluon items' TMA pull plan: rows per ring stage, row boxes, one tok descriptor per rank (over that rank's
    region), or None (the register pull) where TMA cannot move the rows."""
    from types import SimpleNamespace

    from megamoe.kernels import gluon_fused
    from megamoe.kernels.fused_moe import FusedConfig

    cfg = FusedConfig()

    def plan(H, W=1, fp8=False, a=None, c=cfg):
        bufs = [torch.full((5, H), float(r), dtype=torch.bfloat16) for r in range(W)]
        heap = SimpleNamespace(shape=SimpleNamespace(hidden=H), world=W, peer_buffer=lambda name, r: bufs[r])
        p = gluon_fused._bulk_pull_plan(heap, c, torch.zeros(11, H, dtype=torch.bfloat16) if a is None else a, fp8)
        if p is not None:  # every rank's descriptor is over that rank's region, as [T_max * RV, C] rows
            xv, toks, ra, rb, rv, cw, br = p
            assert len(toks) == W and all(t.base is bufs[r] for r, t in enumerate(toks))
            assert [t.shape for t in toks] == [[5 * rv, cw]] * W and xv.shape == [11 * rv, cw]
            assert rv * cw == H and rv % br == 0 and rv // br <= 8 and br <= 256 and 1 <= ra + rb <= 16
            assert xv.block_shape == [br, cw] and all(t.block_shape == [br, cw] for t in toks)
            # a stage's rows fit its tiles: RA rows in the [BM, 64] A tile, RB in the [2 * BN1, 64] weight tile
            assert ra * H <= c.block_m * 64 and rb * H <= max(2 * c.bn1, c.bn2) * 64
            return ra, rb, rv, cw, br
        return None

    assert plan(2048) == (4, 8, 8, 256, 8)  # qwen3: 12 rows of 4 KB per stage, a row one [8, 256] box
    assert plan(4096, W=2) == (2, 4, 16, 256, 16)  # mixtral
    assert plan(7168, W=4) == (1, 2, 28, 256, 4)  # deepseek-v3: a row is 7 boxes of [4, 256]
    assert plan(1024, W=8) == (8, 8, 4, 256, 4)
    assert plan(64) == (8, 8, 1, 64, 1)
    assert plan(2880, W=2) is None  # gpt-oss: 45 boxes of [1, 64] per row, more than 8
    assert plan(96) is None and plan(9) is None  # H % 64: a row would not start 128-byte aligned in its stage
    assert plan(2048, fp8=True) is None  # packed FP8 rows: the register pull
    assert plan(2048, W=9) is None  # at most 8 tok descriptors
    assert plan(2048, a=torch.zeros(11, 4096, dtype=torch.bfloat16)[:, :2048]) is None  # a strided receive buffer
    monkeypatch.setattr(gluon_fused, "BULK_PULL", 0)
    assert plan(2048) is None
