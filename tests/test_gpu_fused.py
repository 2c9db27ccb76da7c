"""Backend ``fused`` on 1-4 GPUs: reference checks at full width (dense buffers and cycling rings under skewed
routing), bitwise determinism, no host sync in a training step, and a training step captured in a CUDA graph
replaying like eager; on Hopper the default (the Gluon items where they can run) and the Triton items forced."""

from __future__ import annotations

import pytest
import torch

from megamoe.dist import gpu_ranks_possible, spawn
from megamoe.layer import MoE
from megamoe.testing import (
    LayerCase,
    bf16_cases,
    check_bounds,
    compare_runs,
    determinism_case,
    gpu_cases,
    gpu_world,
    graph_replay_vs_eager,
    layer_case,
    layer_runs,
    qwen3_experts,
    rank_device,
    sync_free_step,
    training_step,
)

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
BM = 128  # rows of a block on GPUs


def _skewed(world: int) -> LayerCase:
    """qwen3 experts; experts 0-7 (on rank 0) get a large logit offset, so rank 0 receives most rows."""
    return LayerCase("skewed-qwen3", preset="qwen3-30b-a3b", dtype="bf16", tokens=tuple([2048] * world),
                     overrides={"num_experts": qwen3_experts(world)}, offset={e: 3.0 for e in range(8)})


MINI = 2048 * 8 // BM  # a minibatch: the blocks uniform routing gives a rank in the skewed case


def _ring_case(rank: int, world: int, dev: torch.device, ring: int, label: str, **opts) -> dict:
    """The skewed case on a ring of ``ring`` blocks: layer_case's result with the ring size and this rank's block
    count (check_reference counts the runs whose ring cycled)."""
    r = layer_case(_skewed(world), "fused", dev, ring_blocks=ring, **opts)
    e_l = len(r["counts"]) // world
    r.update(case=f"{label}ring{ring}:{r['case']}", ring=ring,
             blocks=sum(-(-c // BM) for c in r["counts"][rank * e_l:(rank + 1) * e_l]))
    return r


def _det_case(world: int) -> LayerCase:
    """The determinism case: qwen3 experts, 1024 tokens per rank."""
    return LayerCase("det", preset="qwen3-30b-a3b", dtype="bf16", tokens=tuple([1024] * world),
                     overrides={"num_experts": qwen3_experts(world)})


def _rank_cases(rank: int, world: int) -> tuple[list[dict], list[bool]]:
    dev = rank_device()
    results = [layer_case(c, "fused", dev) for c in bf16_cases(world) + gpu_cases(world)]
    sk = _skewed(world)
    # 4 = the smallest ring; 1x, 2x, 4x a minibatch
    results += [_ring_case(rank, world, dev, ring, "") for ring in (4, MINI, 2 * MINI, 4 * MINI)]
    det_case = _det_case(world)
    dets = [determinism_case(det_case, "fused", dev), determinism_case(sk, "fused", dev, ring_blocks=8)]
    return results, dets


@pytest.mark.skipif(NGPU == 0, reason="needs CUDA GPUs")
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fused_on_gpus(world):
    if not gpu_ranks_possible(world):
        pytest.skip(f"needs {world} GPUs (or MEGAMOE_SHARE_GPUS=1), {NGPU} visible")
    cycled = 0
    for rank_results, dets in spawn(_rank_cases, world, device="cuda", timeout_s=900):
        assert all(dets), "fused backend: two runs differ bitwise"
        cycled += check_bounds(rank_results)
    assert cycled >= 1, "the skewed case should make the smallest ring cycle"


def _sync_free(rank: int, world: int) -> bool:
    for opts in ({}, {"ring_blocks": 16}):
        sync_free_step(training_step(rank, "fused", **opts)[2])
    return True


def _graph_step(rank: int, world: int) -> dict:
    return graph_replay_vs_eager(*training_step(rank, "fused"))


@pytest.mark.skipif(NGPU < 1, reason="needs a GPU")
def test_fused_sync_free():
    assert all(spawn(_sync_free, gpu_world(4, 2) or NGPU, device="cuda", timeout_s=600))


@pytest.mark.skipif(NGPU < 1, reason="needs a GPU")
def test_fused_graph_capturable():
    for r in spawn(_graph_step, gpu_world(4, 2) or NGPU, device="cuda", timeout_s=600):
        assert r["graph_out_equal"], "graph replay output differs from eager"
        assert r["graph_w_equal"], "graph replay parameters differ from eager"


# ------------------------------------------------------------------------------ the Triton items on Hopper
# On Hopper the backend runs the warp-specialised Gluon items (kernels/gluon/fused.py) wherever they can run, so the
# tests above check those; here the Triton items, forced (test_fused_backend.fused_config), against float64 and
# against the default on the same weights and inputs (same tiles and k order: expected bitwise equal, asserted
# close), dense and cycling rings under skew, determinism, no host sync, CUDA-graph replay; and the choice itself.
GLUON_TWIN_REL = 1e-3


def _gluon_ok() -> bool:
    return NGPU > 0 and torch.cuda.get_device_capability(0)[0] == 9


def _triton_twin(case: LayerCase, dev: torch.device, opts: dict) -> dict:
    """compare_runs of the default fused layer (options ``opts``) and the one with the Triton items forced, on the
    same weights and this rank's inputs of ``case``."""
    import torch.distributed as dist
    from test_fused_backend import fused_config

    rank = dist.get_rank() if dist.is_initialized() else 0
    kw = dict(input_seed=case.seed + 20 + rank, weight_seed=case.seed, offset=case.offset)
    (default,) = layer_runs(case.config(), case.tokens[rank], dev, [("fused", opts)], **kw)
    with fused_config(triton_items=True) as made:
        (forced,) = layer_runs(case.config(), case.tokens[rank], dev, [("fused", opts)], **kw)
    assert made
    return compare_runs(default, forced)


def _rank_triton(rank: int, world: int) -> tuple[list[dict], list, list[bool], dict]:
    from test_fused_backend import fused_config

    from megamoe import MoE

    dev = rank_device()
    # the choice: Gluon where H and I are multiples of 8 (TMA row strides), the Triton items for the odd widths
    odd = [c for c in bf16_cases(world) if c.overrides.get("hidden", 96) % 8]
    assert odd, "the standard cases lost their odd-width case"
    chosen = {name: MoE(c.config(), backend="fused", device=dev).backend.config.kernel
              for name, c in (("odd", odd[0]), ("qwen3", gpu_cases(world)[0]))}
    sk = _skewed(world)
    with fused_config(triton_items=True) as made:
        refs = [dict(layer_case(c, "fused", dev), case="triton:" + c.name)
                for c in bf16_cases(world) + gpu_cases(world)]
        refs += [_ring_case(rank, world, dev, ring, "triton-") for ring in (4, MINI, 4 * MINI)]
        dets = [determinism_case(_det_case(world), "fused", dev), determinism_case(sk, "fused", dev, ring_blocks=8)]
    assert made
    twins = [(c.name, _triton_twin(c, dev, {})) for c in gpu_cases(world)]
    twins.append(("ring4", _triton_twin(sk, dev, {"ring_blocks": 4})))
    return refs, twins, dets, chosen


@pytest.mark.skipif(not _gluon_ok(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_triton_items_on_hopper(world):
    if not gpu_ranks_possible(world):
        pytest.skip(f"needs {world} GPUs (or MEGAMOE_SHARE_GPUS=1), {NGPU} visible")
    cycled = 0
    for refs, twins, dets, chosen in spawn(_rank_triton, world, device="cuda", timeout_s=900):
        assert chosen == {"odd": "triton", "qwen3": "gluon"}, chosen
        assert all(dets), "fused with the Triton items: two runs differ bitwise"
        cycled += check_bounds(refs)
        for name, t in twins:
            for key, (_, rel, _cos) in t.items():
                assert rel < GLUON_TWIN_REL, f"{name}: gluon vs triton megakernel {key}: rel {rel:.3g}"
            print(f"gluon vs triton {name}: bitwise {all(eq for eq, _, _ in t.values())}, "
                  f"max rel {max(rel for _, rel, _ in t.values()):.3g}")
    assert cycled >= 1, "the skewed case should make the smallest ring cycle"


def _triton_step_checks(rank: int, world: int) -> dict:
    from test_fused_backend import fused_config

    with fused_config(triton_items=True) as made:
        sync_free_step(training_step(rank, "fused")[2])
        sync_free_step(training_step(rank, "fused", ring_blocks=16)[2])
        graph = graph_replay_vs_eager(*training_step(rank, "fused"))
    assert made
    return graph


@pytest.mark.skipif(not _gluon_ok(), reason="needs a Hopper GPU")
def test_fused_triton_items_sync_free_and_graph_capturable():
    for r in spawn(_triton_step_checks, gpu_world(4, 2) or NGPU, device="cuda", timeout_s=600):
        assert r["graph_out_equal"], "graph replay output differs from eager"
        assert r["graph_w_equal"], "graph replay parameters differ from eager"


# ------------------------------------------------------------------------------ residency (comm/signals.py)
# No kernel waits for programs that may not be resident: with twice as many megakernel programs as SMs, and with
# another stream's kernel holding most SMs, the layer completes with the same bits.


def _occupier():
    """A Triton kernel that holds a whole SM until ``*flag != 0`` (bounded by ``limit_ns``) and records its SM: 512
    threads keep KEEP fp32 values live across the spin, so ptxas gives each the 128 registers the launch bounds allow
    (compiled for sm_90a: 128 registers, 96 B spilled), i.e. the SM's whole register file. No second program of any
    kernel fits beside it, so a grid of n programs holds exactly n SMs and leaves the rest wholly free."""
    import triton
    import triton.language as tl

    @triton.jit
    def hog(flag_ptr, sm_ptr, out_ptr, keep_ptr, limit_ns, KEEP: tl.constexpr):
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                       pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(sm_ptr + tl.program_id(0), sm)
        v = tl.load(keep_ptr + tl.arange(0, KEEP))
        seen = tl.load(flag_ptr, volatile=True)
        now = t0
        while (seen == 0) & (now - t0 < limit_ns):
            v = v * 1.5 + seen.to(tl.float32)
            seen = tl.load(flag_ptr, volatile=True)
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                            is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), seen)  # 0: it ran out its time (the layer did not finish under it)
        tl.store(keep_ptr + tl.program_id(0), tl.sum(v, axis=0))  # keeps v live

    return hog


def _residency(rank: int, world: int) -> dict:
    import os
    import sys
    import time

    sys.path.insert(0, os.path.dirname(__file__))
    from test_fused_backend import fused_config

    from megamoe import preset

    dev = rank_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = preset("qwen3-30b-a3b", num_experts=qwen3_experts(world), max_tokens_per_rank=1024)
    run = dict(cfg=cfg, tokens=1024, device=dev, input_seed=rank, weight_seed=5)
    base = layer_runs(specs=[("fused", {})], **run)[0]
    out = {}
    with fused_config(programs=2 * sms) as made:  # more programs than can ever be resident
        out["2x_programs"] = compare_runs(layer_runs(specs=[("fused", {})], **run)[0], base)
    out["programs"] = made[0].programs if made else None
    # The layer is built and run once before the occupier starts, and lives until the occupier is released: making
    # or freeing a layer synchronises the whole device (its heap), which would wait for the occupier itself. The
    # routing is computed before it too: the router's logits GEMM is cuBLAS, whose Hopper kernels launch clusters of
    # up to 8 CTAs that need 8 free SMs in one GPC, so with most SMs held they wait for the occupier (seen on one
    # H200, in every backend, torch's included). What runs under it is megamoe's own kernels, forward and backward.
    moe = MoE(cfg, backend="fused", device=dev, seed=5)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1024, cfg.hidden, generator=gen).to(cfg.dtype).to(dev)
    g = torch.randn(1024, cfg.hidden, generator=gen).to(cfg.dtype).to(dev)
    with torch.no_grad():
        r = moe.router(x)
    idx, w = r.topk_idx.clone(), r.topk_w.detach().clone()

    def fwd_bwd() -> list[torch.Tensor]:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = moe.experts_forward(xi, idx, wi)
        grads = torch.autograd.grad((y.float() * g.float()).sum(), (xi, wi, moe.w13, moe.w2))
        return [y.detach(), *grads]

    before = fwd_bwd()
    fwd_bwd()  # the caching allocator now holds a second set of outputs' blocks: no cudaMalloc (which can
    # serialise against the occupier's stream) while the occupier runs
    # all SMs but 16 held by a kernel on another stream (one program per SM, nothing beside it): the layer's kernels
    # get 16 SMs, far fewer than their grids' programs (16, not 8: a cuBLAS kernel of 2-CTA clusters needs two free
    # SMs in one GPC)
    from megamoe.dist import share_gpus

    hog = _occupier()
    n = (sms - 16) // (world if share_gpus() else 1)  # ranks sharing a GPU split its SMs
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    where = torch.full((n,), -1, dtype=torch.int32, device=dev)
    ended = torch.zeros(n, dtype=torch.int32, device=dev)
    keep = torch.zeros(65536, device=dev)
    side = torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)
    t0 = time.monotonic()
    with torch.cuda.stream(side):
        compiled = hog[(n,)](flag, where, ended, keep, 30 * 10**9, KEEP=65536, num_warps=16)
    time.sleep(0.5)  # the occupier is resident before the layer starts
    held = fwd_bwd()
    out["launched_s"] = time.monotonic() - t0
    flag.fill_(1)  # on the layer's stream: only once the layer is done
    torch.cuda.synchronize(dev)
    out["held_s"] = time.monotonic() - t0
    out["held"] = compare_runs(held, before)
    out["occupier_released_by_flag"] = bool((ended == 1).all())
    out["sms_held"], out["occupier_programs"] = len(set(where.tolist())), n
    out["occupier_regs"] = compiled.n_regs  # 128: the whole register file for 512 threads
    moe.close()
    return out


def _check_residency(results) -> None:
    for r in results:
        assert r["programs"] is not None, r
        for key in ("2x_programs", "held"):
            assert all(v[0] for v in r[key].values()), (key, r[key])
        # the layer finished under the occupier
        timing = {k: r[k] for k in ("launched_s", "held_s", "occupier_released_by_flag", "sms_held", "programs",
                                    "occupier_regs")}
        assert r["occupier_regs"] == 128 and r["sms_held"] == r["occupier_programs"], timing  # one per SM
        assert r["occupier_released_by_flag"] and r["held_s"] < 20, timing


@pytest.mark.skipif(NGPU < 1, reason="needs a GPU")
def test_fused_completes_with_more_programs_than_resident_one_rank(monkeypatch):
    # every stream its own hardware queue: with the default 8 the occupier's stream may share one with the layer's,
    # whose kernels would then wait behind it
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    _check_residency(spawn(_residency, 1, device="cuda", timeout_s=600))


@pytest.mark.skipif(not gpu_ranks_possible(2), reason="needs 2 GPUs or MEGAMOE_SHARE_GPUS=1")
def test_fused_completes_with_more_programs_than_resident_two_ranks(monkeypatch):
    # with MEGAMOE_SHARE_GPUS=1 on one GPU: the two ranks' kernels share its SMs as well
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    _check_residency(spawn(_residency, 2, device="cuda", timeout_s=900))
