"""The layer as a drop-in: inputs of any leading shape, autocast, world 1 without a process group for every backend,
experts on external routing, creation without random init, freeing the backend's memory, and a clear error where the
Triton backends cannot run. Numbers are checked against the float64 reference."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from megamoe import MoE, preset
from megamoe.layer import load_full_weights
from megamoe.reference import experts_ref, moe_forward
from megamoe.testing import layer_case, rel_err, standard_cases


def _grads(out, g, params):
    return torch.autograd.grad((out.double() * g).sum(), params, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("backend", ["torch", "split", "fused"])
def test_leading_shape_matches_flat_bitwise(backend):
    # [B, S, H] (and a non-contiguous view of it) give the flat [T, H] call's numbers, forward and backward
    cfg = preset("tiny", max_tokens_per_rank=64)
    moe = MoE(cfg, backend=backend, device="cpu", seed=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(3, 7, cfg.hidden, generator=gen, dtype=torch.float64)
    params = (moe.router.weight, moe.w13, moe.w2)
    flat = x.reshape(21, cfg.hidden).clone().requires_grad_()
    ref_out = moe(flat).out
    ref = _grads(ref_out, g.reshape(21, -1), (flat,) + params)
    for xin in (x.clone(), x.transpose(0, 1).contiguous().transpose(0, 1)):  # contiguous, then a strided view
        xin.requires_grad_()
        out = moe(xin).out
        assert out.shape == (3, 7, cfg.hidden)
        got = _grads(out, g, (xin,) + params)
        assert torch.equal(out.reshape(21, -1), ref_out)
        assert torch.equal(got[0].reshape(21, -1), ref[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1:], ref[1:], strict=True))


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_world_one_without_process_group(backend):
    # no torch.distributed at all in this process: the Triton backends run as world 1 against the float64 reference
    import torch.distributed as dist

    assert not dist.is_initialized()
    case = next(c for c in standard_cases(1) if c.name == "bf16-ragged")
    from megamoe.testing import check_bounds

    check_bounds([layer_case(case, backend, torch.device("cpu"))])


def test_autocast_follows_linear():
    # an fp32 layer under bf16 autocast computes in bf16 (x and the expert weights cast per call, the router in fp32)
    # and returns bf16; gradients reach the fp32 parameters
    cfg = preset("tiny", dtype=torch.float32)
    moe = MoE(cfg, seed=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, cfg.hidden, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x).out
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    out.float().sum().backward()
    assert moe.w13.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    xb = x.detach().to(torch.bfloat16).double().reshape(-1, cfg.hidden)
    y, _ = moe_forward(xb, moe.router.weight.double(), moe.w13.to(torch.bfloat16).double(),
                       moe.w2.to(torch.bfloat16).double(), cfg.replace(dtype=torch.float64))
    assert rel_err(out.reshape(-1, cfg.hidden), y) < 1e-2
    # a bf16 layer: fp32 input under autocast is the bf16 input's call, bit for bit; outside autocast a TypeError
    moe16 = MoE(preset("tiny"), seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = moe16(x.detach()).out
    assert torch.equal(a, moe16(x.detach().to(torch.bfloat16)).out)
    with pytest.raises(TypeError, match="autocast"):
        moe16(x.detach())


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("split", torch.bfloat16)])
def test_experts_forward_on_external_routing(backend, dtype):
    cfg = preset("tiny", dtype=dtype, max_tokens_per_rank=64)
    moe = MoE(cfg, backend=backend, device="cpu", seed=2)
    gen = torch.Generator().manual_seed(2)
    T, k, E = 20, cfg.top_k, cfg.num_experts
    x = torch.randn(4, 5, cfg.hidden, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).view(4, 5, k)
    idx[0, :, 0] = 5  # one expert gets several tokens, others none
    idx[0, :, 1] = 6
    w = torch.rand(4, 5, k, generator=gen, dtype=torch.float64)
    g = torch.randn(4, 5, cfg.hidden, generator=gen, dtype=torch.float64)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = moe.experts_forward(xi, idx, wi)
    assert y.shape == x.shape and y.dtype == dtype
    got = _grads(y, g, (xi, wi, moe.w13, moe.w2))
    xr, wr, r13, r2 = (t.detach().double().requires_grad_() for t in (x, w, moe.w13, moe.w2))
    yr = experts_ref(xr.view(T, -1), idx.view(T, k), wr.view(T, k), r13, r2)
    ref = _grads(yr.view(4, 5, -1), g, (xr, wr, r13, r2))
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    assert rel_err(y, yr.view(4, 5, -1)) < tol
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < tol


def test_init_none_draws_nothing_and_loads():
    cfg = preset("tiny", dtype=torch.float32, shared_intermediate=32, shared_gate=True)
    calls = []
    real = MoE.reset_parameters
    MoE.reset_parameters = lambda self, seed=0: calls.append(seed)
    try:
        empty = MoE(cfg, init="none")
    finally:
        MoE.reset_parameters = real
    assert calls == []
    full = MoE(cfg, seed=4)
    load_full_weights(empty, full.router.weight, full.w13, full.w2,
                      shared=(full.shared_w13, full.shared_w2, full.shared_gate))
    x = torch.randn(6, cfg.hidden)
    assert torch.equal(empty(x).out, full(x).out)
    with pytest.raises(ValueError, match="gate exactly when the layer's shared expert is gated"):
        load_full_weights(empty, full.router.weight, full.w13, full.w2, shared=(full.shared_w13, full.shared_w2, None))
    ungated = MoE(cfg.replace(shared_gate=False), init="none")
    with pytest.raises(ValueError, match="gate exactly when the layer's shared expert is gated"):  # not dropped
        load_full_weights(ungated, full.router.weight, full.w13, full.w2,
                          shared=(full.shared_w13, full.shared_w2, full.shared_gate))
    with pytest.raises(ValueError, match="init must be"):
        MoE(cfg, init="zeros")


def test_close_and_delete_free_the_heap():
    cfg = preset("tiny", max_tokens_per_rank=16)
    a = MoE(cfg, backend="split", device="cpu")
    b = MoE(cfg, backend="split", device="cpu")
    heap = a.backend.heap
    assert b.backend.heap is heap and heap.users == 2
    a.close()
    assert not heap._closed and heap.users == 1  # b still uses it
    with pytest.raises(ValueError, match="closed"):
        a(torch.randn(2, cfg.hidden, dtype=cfg.dtype))
    a.close()  # twice is fine
    del b
    gc.collect()
    assert heap._closed and heap.users == 0
    # the comm API on the closed heap says so instead of a KeyError deep inside a launcher
    from megamoe.comm import dispatch

    for use in (heap.tokens_buffer, heap.rows_buffer, lambda: heap.peer_buffer("tok", 0),
                lambda: dispatch(torch.randn(2, cfg.hidden, dtype=cfg.dtype), torch.zeros(2, 2, dtype=torch.int64),
                                 heap)):
        with pytest.raises(RuntimeError, match="SymmetricHeap is closed"):
            use()


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_backward_outlives_the_layer(backend):
    # a one-rank layer freed right after its forward: the pending backward still has its heap (as with "torch")
    cfg = preset("tiny", max_tokens_per_rank=16)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    kept = MoE(cfg, backend=backend, device="cpu", seed=6)
    xi = x.clone().requires_grad_()
    kept(xi).out.backward(g)
    kept.close()
    layer = MoE(cfg, backend=backend, device="cpu", seed=6)
    heap = layer.backend.heap
    xd = x.clone().requires_grad_()
    out = layer(xd).out
    del layer
    gc.collect()
    assert not heap._closed  # the autograd graph still uses it
    out.backward(g)
    assert torch.equal(xd.grad, xi.grad)
    del out
    gc.collect()
    assert heap._closed and heap.users == 0


def _saved_rows(out):
    """(received rows, h) that the backend's autograd node saved for the backward of ``out``."""
    node = out.grad_fn
    while not type(node).__name__.endswith("MoEBackward"):  # the backend's node, below the layer's reshapes
        node = next(f for f, _ in node.next_functions if f is not None and "Accumulate" not in type(f).__name__)
    saved = node.saved_tensors
    return saved[:2] if "Split" in type(node).__name__ else saved[7:9]


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_backward_frees_h_before_the_weight_gradients(backend, monkeypatch):
    # GEMM1's pre-activation h [R, 2I] is the largest saved buffer: the backward frees its memory once GEMM2's dgrad
    # has read it, so the peak never holds it beside dW13 and dW2; with retain_graph a second backward still has it
    import megamoe.backends.common as common

    cfg = preset("tiny", max_tokens_per_rank=16)
    moe = MoE(cfg, backend=backend, device="cpu", seed=6)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype).requires_grad_()
    g = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    held, wgrad = [], common.grouped_wgrad

    def spy(*args, **kwargs):
        held.append(h_storage.nbytes() > 0)
        return wgrad(*args, **kwargs)

    monkeypatch.setattr(common, "grouped_wgrad", spy)
    grads = []
    for retain in (True, False):
        out = moe(x).out
        h_storage = _saved_rows(out)[1].untyped_storage()
        held.clear()
        grads.append(torch.autograd.grad(out, x, g, retain_graph=retain)[0])
        assert held == [retain, retain]  # (dW2, dW13)
        if retain:
            assert torch.equal(torch.autograd.grad(out, x, g)[0], grads[0])  # the retained graph, again
            assert held[2:] == [False, False]
        del out
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_saved_rows_go_through_saved_tensor_hooks(backend):
    # non-reentrant checkpointing and activation offloading act on saved tensors through saved-tensor hooks: the
    # layer's received rows and h must be among them, and a checkpointed layer computes the plain run's gradients
    from torch.utils.checkpoint import checkpoint

    cfg = preset("tiny", max_tokens_per_rank=16)
    moe = MoE(cfg, backend=backend, device="cpu", seed=7)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    xi = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = moe(xi).out
    rows = 5 * cfg.top_k
    assert (rows, cfg.hidden) in packed and (rows, 2 * cfg.intermediate) in packed, packed
    out.backward(g)
    xc = x.clone().requires_grad_()
    checkpoint(lambda t: moe(t).out, xc, use_reentrant=False).backward(g)
    assert torch.equal(xc.grad, xi.grad)


def test_split_keeps_no_h_without_a_backward(monkeypatch):
    # GEMM1's pre-activation is kept only for a backward: under no_grad (or with nothing requiring grad) split neither
    # allocates nor writes its R x 2I values, and the output is bitwise the training forward's
    import megamoe.backends.common as common

    cfg = preset("tiny", max_tokens_per_rank=16)
    moe = MoE(cfg, backend="split", device="cpu", seed=9)
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(9)).to(cfg.dtype)
    kept, gemm1 = [], common.gemm1_swiglu

    def spy(*args, store_h, **kwargs):
        kept.append(store_h)
        return gemm1(*args, store_h=store_h, **kwargs)

    monkeypatch.setattr(common, "gemm1_swiglu", spy)
    train = moe(x.clone().requires_grad_()).out
    with torch.no_grad():
        infer = moe(x).out
    for p in moe.parameters():
        p.requires_grad_(False)
    frozen = moe(x).out
    assert kept == [True, False, False]
    assert torch.equal(train.detach(), infer) and torch.equal(infer, frozen)


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_one_rank_sizes_its_rows_by_the_call(backend):
    # one rank receives exactly its own T * k slots: a layer built for 64 tokens called with 5 holds 5 * k rows per
    # buffer (not R_cap = 64 * k) and computes bitwise what a layer built for 5 tokens does
    gen = torch.Generator().manual_seed(8)
    cfg = preset("tiny", max_tokens_per_rank=64)
    x = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(5, cfg.hidden, generator=gen).to(cfg.dtype)
    runs = []
    for max_tokens in (64, 5):
        moe = MoE(preset("tiny", max_tokens_per_rank=max_tokens), backend=backend, device="cpu", seed=8)
        xi = x.clone().requires_grad_()
        out = moe(xi).out
        recv, h = _saved_rows(out)
        assert recv.shape[0] == h.shape[0] == 5 * cfg.top_k
        del recv, h
        out.backward(g)
        runs.append([out.detach(), xi.grad, moe.router.weight.grad, moe.w13.grad, moe.w2.grad])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_close_undoes_the_captured_forward():
    # capture_moe_layers (torch.cuda.make_graphed_callables) sets the module's forward to a graph replay, which would
    # address the freed heap after close(); stand-in for it on a CPU: a closed layer raises instead of replaying
    cfg = preset("tiny", max_tokens_per_rank=16)
    moe = MoE(cfg, backend="split", device="cpu")

    def replay(*args, **kwargs):
        raise AssertionError("replayed a captured graph of a closed layer")

    moe.forward = replay
    moe.close()
    with pytest.raises(ValueError, match="closed"):
        moe(torch.randn(2, cfg.hidden, dtype=cfg.dtype))


def test_captured_forward_refuses_another_shape():
    # a graph copies its input into the static one it was captured with: a [1, H] input would be broadcast into it
    # silently, so the installed forward refuses any shape but the captured one and passes that one through
    from megamoe.layer import _same_shape_only

    forward = _same_shape_only("capture_moe_layers", 4, (4, 8), lambda x, *a, **k: (x.sum().item(), a, k))
    assert forward(torch.ones(4, 8), 1, b=2) == (32.0, (1,), {"b": 2})
    for shape in ((1, 8), (2, 2, 8), (4, 7)):
        with pytest.raises(ValueError, match=r"captured for 4 tokens per call \(input \(4, 8\)\), got \("):
            forward(torch.ones(shape))


def test_triton_backend_on_cpu_without_interpreter_refuses_at_construction():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = ("import torch\nfrom megamoe import MoE, preset\nfrom megamoe.backends import BackendUnavailable\n"
            "try:\n    MoE(preset('tiny'), backend='split', device='cpu')\nexcept BackendUnavailable as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "refused:" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


def test_groups_shared_and_leading_shape_read_nothing_on_host():
    # group-limited routing, a gated shared expert and [B, S, H] input add no host read of device data to a step
    from megamoe.testing.sync_guard import no_host_reads

    cfg = preset("tiny", router="sigmoid", n_group=4, topk_group=2, shared_intermediate=32, shared_gate=True,
                 max_tokens_per_rank=64)
    moe = MoE(cfg, backend="split", device="cpu", seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(2, 8, cfg.hidden, generator=gen).to(cfg.dtype)

    def step():
        xi = x.clone().requires_grad_()
        moe.zero_grad(set_to_none=True)
        out = moe(xi).out
        out.backward(g)
        return [out.detach(), xi.grad, moe.w13.grad, moe.shared_w13.grad, moe.shared_gate.grad, moe.router.weight.grad]

    warm = step()
    with no_host_reads():
        guarded = step()
    assert all(torch.equal(a, b) for a, b in zip(warm, guarded, strict=True))


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_fp32_layer_under_bf16_autocast_on_triton_backends(backend):
    # mixed-precision training's setup: fp32 parameters, bf16 autocast. The layer casts the expert weights per call
    # (autograd carries the gradients back to fp32), so it computes exactly what a bf16 layer holding the rounded
    # weights computes; against float64 within the bf16 bounds; no host read; outside autocast a clear error.
    from megamoe.testing.sync_guard import no_host_reads

    shared = dict(shared_intermediate=32, shared_gate=True) if backend == "split" else {}
    cfg = preset("tiny", dtype=torch.float32, max_tokens_per_rank=64, **shared)
    moe = MoE(cfg, backend=backend, device="cpu", seed=6)
    with torch.no_grad():  # bf16-representable fp32 weights, so a bf16 twin holds the same numbers
        for p in moe.parameters():
            p.copy_(p.to(torch.bfloat16))
    twin = MoE(cfg.replace(dtype=torch.bfloat16), backend=backend, device="cpu", init="none")
    twin.load_state_dict({k: v.to(torch.bfloat16) for k, v in moe.state_dict().items()})
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 7, cfg.hidden, generator=gen)
    g = torch.randn(3, 7, cfg.hidden, generator=gen, dtype=torch.float64)
    names = [n for n, _ in moe.named_parameters()]

    def step():
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(xi).out
        grads = _grads(out, g, [xi] + list(moe.parameters()))
        return out.detach(), grads

    out, grads = step()
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert all(gr.dtype == torch.float32 for gr in grads)
    with no_host_reads():
        again = step()
    assert torch.equal(again[0], out) and all(torch.equal(a, b) for a, b in zip(again[1], grads, strict=True))
    # the bf16 twin on the rounded input: the same numbers, bit for bit
    xb = x.to(torch.bfloat16).requires_grad_()
    out16 = twin(xb).out
    grads16 = _grads(out16, g, [xb] + list(twin.parameters()))
    assert torch.equal(out, out16)
    for n, a, b in zip(["x"] + names, grads, grads16, strict=True):  # (fp32 routing and gate grads stay fp32 here)
        assert torch.equal(a.to(torch.bfloat16), b), n
    # float64 reference on the bf16-rounded operands (the router's weight is fp32, its logits fp32 in the layer)
    leaves = {n: p.detach().to(torch.bfloat16).double().requires_grad_() for n, p in moe.named_parameters()}
    x64 = x.to(torch.bfloat16).double().requires_grad_()
    sh = (leaves["shared_w13"], leaves["shared_w2"], leaves["shared_gate"]) if shared else None
    y64, _ = moe_forward(x64.view(-1, cfg.hidden), leaves["router.weight"], leaves["w13"], leaves["w2"],
                         cfg.replace(dtype=torch.float64), shared=sh)
    ref = _grads(y64.view(x.shape), g, [x64] + list(leaves.values()))
    assert rel_err(out, y64.view(x.shape)) < 1e-2
    for n, a, b in zip(["x"] + names, grads, ref, strict=True):
        assert rel_err(a, b) < 1e-2, n
    with pytest.raises(ValueError, match="autocast"):
        moe(x)


def test_meta_device_then_to_empty_and_load():
    # built without memory, moved with to_empty, loaded: the numbers of the layer it was loaded from (gpt-oss's
    # biases and router bias included); what cannot work on meta says how
    cfg = preset("gpt-oss-20b", hidden=40, intermediate=24, num_experts=8, top_k=2, dtype=torch.float32)
    meta = MoE(cfg, device="meta", init="none")
    assert meta.w13.is_meta and meta.device.type == "meta"
    meta.to_empty(device="cpu")
    assert meta.device.type == "cpu"
    src = MoE(cfg, seed=8)
    meta.load_state_dict(src.state_dict())
    x = torch.randn(2, 5, cfg.hidden, generator=torch.Generator().manual_seed(8))
    assert torch.equal(meta(x).out, src(x).out)
    for kw in (dict(init="random"), dict(init="none", backend="split")):
        with pytest.raises(ValueError, match="meta device.*to_empty"):
            MoE(preset("tiny"), device="meta", **kw)
