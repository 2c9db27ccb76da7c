"""Backend ``fused`` (the forward megakernel) on 1, 2, 3, 4 and 8 gloo CPU ranks under the Triton interpreter,
against the float64 reference on the global batch: dense buffers and macrobatch rings that must cycle
(skewed routing, rings of 1x, 2x and 4x a minibatch and the smallest ring), other launch configs, bitwise equality
with backend ``split``, bitwise determinism, bounded waits, clear errors, and the Gluon items' checks
that need no GPU."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def fused_config(triton_items: bool = False, **fields):
    """Layers of backend ``fused`` built inside the block run the megakernel with these FusedConfig ``fields``
    replaced (the launch config is not an option: the backend picks it, tests force a path) and, with
    ``triton_items``, the Triton items where the Gluon ones would be chosen (Hopper). Yields the list of the configs
    handed to the layers built (empty: the block built none, so it tested nothing of the config)."""
    import megamoe.backends.fused as fused

    real_cfg, real_reason = fused.default_fused_config, fused.gluon_fused_reason
    made = []

    def config(device):
        made.append(real_cfg(device).with_(**fields))
        return made[-1]

    fused.default_fused_config = config
    if triton_items:
        fused.gluon_fused_reason = lambda *args, **kwargs: "the Triton items, forced by a test"
    try:
        yield made
    finally:
        fused.default_fused_config, fused.gluon_fused_reason = real_cfg, real_reason


def _rank(rank: int, world: int) -> tuple[list[dict], list[bool]]:
    import megamoe.backends.common as common

    common.POISON_PADDING = True  # d_recv's padding rows NaN: a read of one would show in dx
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
        for label, fields, case, opts in (
                # the GPU's default distances (the interpreter's default config uses lookahead 2 / lag 1: fewer
                # empty items)
                ("lookahead8-lag3", {"lookahead": 8, "lag": 3}, cases[1], {}),
                ("group2-ring8", {"group": 2}, sk, {"ring_blocks": 8})):  # 2 blocks per step, cycling ring
            with fused_config(**fields) as made:
                r = layer_case(case, "fused", dev, **opts)
            assert made, label
            r["case"] = f"{label}:" + r["case"]
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


def _twins(rank: int, world: int) -> dict:
    """compare_runs of bf16 layer pairs on the same weights and inputs: fused against split (the same GEMM arithmetic
    under the interpreter, the same backward kernels, y summed in j order in fp32 by both), dense and on a cycling
    ring (whose backward recomputes the rows and h); and the megakernel's pull in chunks of 2 rows (several row groups
    per block) against its default."""
    import megamoe.backends.common as common

    common.POISON_PADDING = True
    dev = torch.device("cpu")
    by_name = {c.name: c for c in bf16_cases(world)}
    sk = skewed_case(world)
    out = {name: twin_runs(by_name[name], dev, ("fused", {}), ("split", {}))
           for name in ("bf16:bf16-ragged", "bf16:fp32-empty-rank", "bf16:fp32-odd-widths")}
    out["skewed-ring4"] = twin_runs(sk, dev, ("fused", {"ring_blocks": 4}), ("split", {}))
    case = by_name["bf16:fp32-odd-widths"]  # H = 100: a pull step's row is 128 elements wide, 28 of them masked
    default = layer_runs(case.config(), case.tokens[rank], dev, [("fused", {})], input_seed=rank, weight_seed=3)
    with fused_config(pull_elems=256) as made:  # 2 rows per pull step (default: the block's 32 rows in one)
        chunked = layer_runs(case.config(), case.tokens[rank], dev, [("fused", {})], input_seed=rank, weight_seed=3)
    assert made
    out["pull-2-rows-per-chunk"] = compare_runs(chunked[0], default[0])
    return out


@CPU_ONLY
def test_fused_matches_split_bitwise_cpu():
    for rank, twins in enumerate(spawn(_twins, 2, timeout_s=900)):
        for name, t in twins.items():
            diff = {k: v for k, v in t.items() if not v[0]}
            assert not diff, f"rank {rank} {name}: fused differs from its twin: {diff}"


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


def _bad_options(rank, world) -> dict:
    """The error (or value) of each misuse: {name: ValueError message or None, ...}."""
    import megamoe.backends.fused as fused
    from megamoe import MoE, preset
    from megamoe.kernels.fused_moe import default_fused_config, fused_forward

    msgs = {}

    def err(name, build):
        try:
            build()
            msgs[name] = None
        except ValueError as exc:
            msgs[name] = str(exc)

    tiny = preset("tiny")
    err("ring_small", lambda: MoE(tiny, backend="fused", ring_blocks=2))
    err("ring_float", lambda: MoE(tiny, backend="fused", ring_blocks=8.0))
    err("ring_bool", lambda: MoE(tiny, backend="fused", ring_blocks=True))
    err("fp8", lambda: MoE(tiny, backend="fused", fp8=True))  # an FP8 layer is split's
    err("comm_sms", lambda: MoE(tiny, backend="fused", comm_sms=0))
    err("dtype", lambda: MoE(preset("tiny", dtype=torch.float16), backend="fused"))  # fp32: under autocast only
    with fused_config(lag=2) as made:  # the smallest ring follows the lag
        err("ring_lag", lambda: MoE(tiny, backend="fused", ring_blocks=4))
        err("ring_lag_ok", lambda: MoE(tiny, backend="fused", ring_blocks=5))
    msgs["lag_made"] = [c.lag for c in made]
    m = MoE(tiny, backend="split")  # its heap has no slot buffers: the megakernel's push is refused before staging
    x = torch.zeros(2, tiny.hidden, dtype=tiny.dtype)
    idx = torch.zeros(2, tiny.top_k, dtype=torch.int64)
    err("no_slots", lambda: fused_forward(m.backend.heap, x, idx, torch.ones(2, tiny.top_k), m.w13.detach(),
                                          m.w2.detach(), default_fused_config(m.device)))
    # the kernel is chosen at construction: Gluon items where gluon_fused_reason gives None, else Triton ones
    f = MoE(tiny, backend="fused")
    msgs["kernel"] = f.backend.config.kernel
    real = fused.gluon_fused_reason
    fused.gluon_fused_reason = lambda cfg, **kw: None
    try:
        msgs["kernel_where_gluon_runs"] = MoE(tiny, backend="fused").backend.config.kernel
    finally:
        fused.gluon_fused_reason = real
    f.backend.config = f.backend.config.with_(kernel="gluon")  # forced where it cannot run: the forward names why
    err("gluon_forced", lambda: f(torch.randn(4, tiny.hidden).to(tiny.dtype)))
    return msgs


@CPU_ONLY
def test_fused_rejects_bad_options():
    (m,) = spawn(_bad_options, 1)
    assert m["ring_small"] is not None and "ring_blocks must be >= 4" in m["ring_small"]
    assert m["ring_float"] is not None and "ring_blocks must be None or an int" in m["ring_float"]
    assert m["ring_bool"] is not None and "ring_blocks must be None or an int" in m["ring_bool"]
    assert m["fp8"] is not None and "no option 'fp8'" in m["fp8"]
    assert m["comm_sms"] is not None and "comm_sms" in m["comm_sms"]
    assert m["dtype"] is not None and "bfloat16" in m["dtype"]
    assert m["ring_lag"] is not None and "ring_blocks must be >= 5" in m["ring_lag"]
    assert m["ring_lag_ok"] is None and m["lag_made"] == [2, 2]
    assert m["no_slots"] is not None and "slots" in m["no_slots"]
    assert m["kernel"] == "triton" and m["kernel_where_gluon_runs"] == "gluon"
    assert m["gluon_forced"] is not None and "kernel='gluon'" in m["gluon_forced"]
    assert "interpreter" in m["gluon_forced"]


def test_gluon_fused_reasons(monkeypatch):
    """What keeps the Gluon items from running: the interpreter, the device, then sizes and config (checked here as
    on a GPU)."""
    from megamoe.kernels.fused_moe import FusedConfig
    from megamoe.kernels.gluon import fused as gluon_fused
    from megamoe.kernels.gluon.fused import gluon_fused_reason

    ok = FusedConfig()
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert "interpreter" in gluon_fused_reason(ok, H=2048, I=768)
    monkeypatch.setattr(gluon_fused, "interpreting", lambda: False)
    assert gluon_fused_reason(ok, H=2048, I=768) is None
    assert "CUDA device" in gluon_fused_reason(ok, H=2048, I=768, device=torch.device("cpu"))
    assert "block_m=128" in gluon_fused_reason(ok.with_(bn1=64), H=2048, I=768)
    assert "bn2" in gluon_fused_reason(ok.with_(bn2=64), H=2048, I=768)
    assert "multiples of 8" in gluon_fused_reason(ok, H=100, I=40)
    assert "shared memory" in gluon_fused_reason(ok.with_(num_stages=5), H=2048, I=768)
    assert "num_stages" in gluon_fused_reason(ok.with_(num_stages=1), H=2048, I=768)
    assert gluon_fused_reason(ok.with_(bn2=128), H=2048, I=768) is None


def test_gluon_bulk_pull_plan(monkeypatch):
    """The Gluon items' TMA pull plan: rows per ring stage, row boxes, one tok descriptor per rank (over that rank's
    region), or None (the register pull) where TMA cannot move the rows."""
    from types import SimpleNamespace

    from megamoe.kernels.fused_moe import FusedConfig
    from megamoe.kernels.gluon import fused_io

    cfg = FusedConfig()

    def plan(H, W=1, a=None, c=cfg):
        bufs = [torch.full((5, H), float(r), dtype=torch.bfloat16) for r in range(W)]
        heap = SimpleNamespace(shape=SimpleNamespace(hidden=H), world=W, peer_buffer=lambda name, r: bufs[r])
        p = fused_io.bulk_pull_plan(heap, c, torch.zeros(11, H, dtype=torch.bfloat16) if a is None else a)
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
    assert plan(2048, W=9) is None  # at most 8 tok descriptors
    assert plan(2048, a=torch.zeros(11, 4096, dtype=torch.bfloat16)[:, :2048]) is None  # a strided receive buffer
    monkeypatch.setattr(fused_io, "BULK_PULL", 0)
    assert plan(2048) is None
