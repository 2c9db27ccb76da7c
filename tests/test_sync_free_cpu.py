"""The split and fused backends read no tensor data on the host in forward or backward (what makes a step
CUDA-graph capturable), checked on gloo CPU ranks with megamoe.testing.sync_guard.no_host_reads: a layer's forward +
backward, one `megamoe train` step, and the guard itself (planted reads are caught, the torch backend's split sizes
are caught)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from megamoe.dist import spawn
from megamoe.testing import LayerCase, tiny_experts

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # spawned CPU ranks inherit it before importing triton

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU guard; GPUs run torch's sync debug mode")


def _case(tokens: tuple[int, ...]) -> LayerCase:
    return LayerCase("sync", dtype="bf16", tokens=tokens, overrides={"num_experts": tiny_experts(len(tokens))})


def _layer_step(moe, x, g):
    """One forward + backward of ``moe`` on ``x`` with output gradient ``g``: (out, dx, dw13, dw2)."""
    xi = x.clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    out = moe(xi)
    out.out.backward(g)
    return [out.out.detach(), xi.grad, moe.w13.grad, moe.w2.grad]


def _guarded_layer(rank: int, world: int, backend: str, tokens: tuple[int, ...], options: dict) -> bool:
    """A warm-up forward + backward (compiles the kernels, builds the heap), then the same under the guard: it
    must raise nothing and give bitwise the warm-up's results."""
    from megamoe.layer import MoE
    from megamoe.testing.sync_guard import no_host_reads

    cfg = _case(tokens).config()
    moe = MoE(cfg, backend=backend, device=torch.device("cpu"), seed=3, **options)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(tokens[rank], cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(tokens[rank], cfg.hidden, generator=gen).to(cfg.dtype)
    warm = _layer_step(moe, x, g)
    with no_host_reads():
        guarded = _layer_step(moe, x, g)
    return all(torch.equal(a, b) for a, b in zip(warm, guarded, strict=True))


@CPU_ONLY
@pytest.mark.parametrize("backend, tokens, options", [
    ("split", (16, 16), {}),
    ("split", (16, 0), {}),  # a rank with no tokens
    ("fused", (16, 16), {}),
    ("fused", (0, 16), {}),
])
def test_backend_forward_backward_reads_nothing_on_host(backend, tokens, options):
    assert all(spawn(_guarded_layer, len(tokens), backend, tokens, options, timeout_s=600))


def _guarded_training(rank: int, world: int, argv: list[str]) -> list[str]:
    """`megamoe train`'s own loop on this rank, its train_step wrapped: the first call (kernel compilation) runs
    as it is, every later one under the guard; the loop's logging stays outside. Returns the backends whose steps
    ran guarded."""
    import megamoe.apps.train as train
    from megamoe.testing.sync_guard import no_host_reads

    step, guarded = train.train_step, []

    def wrapped(ddp, *args, **kwargs):
        name = ddp.module.blocks[0].moe.backend_name
        if name not in seen:
            seen.add(name)
            return step(ddp, *args, **kwargs)
        with no_host_reads():
            out = step(ddp, *args, **kwargs)
        guarded.append(name)
        return out

    seen: set[str] = set()
    train.train_step = wrapped
    args = train._defaults(train.build_parser().parse_args(argv), on_gpu=False)
    train.run_rank(args, torch.device("cpu"))
    return guarded


@CPU_ONLY
def test_training_step_reads_nothing_on_host(tmp_path):
    # one transformer block, 16 tokens per rank, two steps per backend: the second under the guard
    argv = ["--steps", "2", "--layers", "1", "--seq", "16", "--batch", "1", "--dtype", "bf16", "--cpu", "--quiet",
            "--backends", "split,fused", "--out", str(tmp_path)]
    for guarded in spawn(_guarded_training, 2, argv, timeout_s=600):
        assert guarded == ["split", "fused"]


def _plant_read(module, name: str) -> None:
    """Replace ``module.name`` by a function that reads its first tensor argument on the host (``.item()``), then calls
    the original. It runs in ``module``'s namespace, as code of that module would (the guard charges a frame to the
    module whose globals it runs in)."""
    import types

    original = getattr(module, name)

    def planted(*args, **kwargs):
        t = next(a for a in args if isinstance(a, torch.Tensor))
        t.float().sum().item()  # the planted host read
        return original(*args, **kwargs)

    code = planted.__code__.replace(co_name=name, co_qualname=name)
    setattr(module, name, types.FunctionType(code, vars(module), name, None, planted.__closure__))


def _guard_catches(rank: int, world: int, backend: str, plant: tuple[str, str] | None) -> tuple[str, str]:
    """A warm-up forward + backward, then ``plant`` = (module, function) made to read on the host (None: nothing
    planted) and the forward + backward again under the guard. Returns (the phase that raised or "none", message)."""
    import importlib

    from megamoe.layer import MoE
    from megamoe.testing.sync_guard import HostSyncError, no_host_reads

    tokens = (16, 16)
    cfg = _case(tokens).config()
    moe = MoE(cfg, backend=backend, device=torch.device("cpu"), seed=3)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(tokens[rank], cfg.hidden, generator=gen).to(cfg.dtype)
    g = torch.randn(tokens[rank], cfg.hidden, generator=gen).to(cfg.dtype)
    _layer_step(moe, x, g)
    if plant is not None:
        _plant_read(importlib.import_module(plant[0]), plant[1])
    phase = "forward"
    try:
        with no_host_reads():
            out = moe(x.clone().requires_grad_())
            phase = "backward"
            out.out.backward(g)
    except HostSyncError as exc:  # (every rank raises at the same point: none is left waiting for a peer)
        return phase, str(exc)
    return "none", ""


@CPU_ONLY
@pytest.mark.parametrize("backend, plant, phase", [
    ("split", ("megamoe.backends.split", "expert_forward"), "forward"),  # called by _SplitMoE.forward
    ("split", ("megamoe.backends.split", "heap_backward"), "backward"),  # called by _SplitMoE.backward
    ("fused", ("megamoe.backends.fused", "fused_forward"), "forward"),  # called by _FusedMoE.forward
    ("fused", ("megamoe.backends.fused", "heap_backward"), "backward"),  # called by _FusedMoE.backward
])
def test_guard_catches_planted_reads(backend, plant, phase):
    for got, msg in spawn(_guard_catches, 2, backend, plant, timeout_s=600):
        assert got == phase, msg
        assert msg.startswith("Tensor.item reads tensor data on the host"), msg
        assert f"(module {plant[0]}) in {plant[1]}: t.float().sum().item()" in msg, msg


@CPU_ONLY
def test_guard_catches_the_torch_backend():
    # the torch backend reads its all-to-all split sizes on the host by design (torchtitan's recipe)
    for got, msg in spawn(_guard_catches, 2, "torch", None, timeout_s=600):
        assert got == "forward", msg
        assert msg.startswith("Tensor.tolist reads tensor data on the host"), msg
        assert "megamoe/backends/torch_a2a.py:" in msg and "in __call__: splits = torch.stack(" in msg, msg


def _as_megamoe(fn):
    """``fn`` re-bound to a megamoe module's namespace, so the guard charges its calls to megamoe."""
    import types

    import megamoe.layer

    return types.FunctionType(fn.__code__, vars(megamoe.layer), fn.__name__, fn.__defaults__, fn.__closure__)


def test_guard_op_list():
    # every kind of read the guard names, from megamoe code, and ops it must let through; one process, no ranks
    from megamoe.testing.sync_guard import HostSyncError, no_host_reads

    t, one, i1 = torch.randn(3), torch.tensor([2.0]), torch.tensor(1)
    b, idx = t > 0, torch.tensor([1, 0, 1])
    reads = {
        "Tensor.item": lambda: t[0].item(), "Tensor.tolist": lambda: t.tolist(), "Tensor.numpy": lambda: t.numpy(),
        "Tensor.__bool__": lambda: bool(one), "Tensor.__int__": lambda: int(one),
        "Tensor.__float__": lambda: float(one),
        "Tensor.__index__": lambda: [1, 2, 3][i1], "Tensor.cpu": lambda: t.cpu(), "Tensor.to(cpu)": lambda: t.to("cpu"),
        "torch.nonzero": lambda: torch.nonzero(t), "Tensor.nonzero": lambda: t.nonzero(),
        "torch.argwhere": lambda: torch.argwhere(t), "torch.where(condition)": lambda: torch.where(b),
        "torch.unique": lambda: torch.unique(t), "Tensor.unique_consecutive": lambda: t.unique_consecutive(),
        "torch.masked_select": lambda: torch.masked_select(t, b),
        "Tensor.__getitem__ with a boolean mask": lambda: t[b],
        "Tensor.__setitem__ with a boolean mask": lambda: t.__setitem__(b, 0.0),
        "Tensor.repeat_interleave without output_size": lambda: idx.repeat_interleave(idx),
        "torch.bincount": lambda: torch.bincount(idx), "torch.equal": lambda: torch.equal(t, t),
        "torch.allclose": lambda: torch.allclose(t, t), "torch.is_nonzero": lambda: torch.is_nonzero(one),
        "Tensor.__repr__": lambda: str(t), "Tensor.__format__": lambda: f"{one[0]:.2f}",
    }
    for op, fn in reads.items():
        with pytest.raises(HostSyncError, match="^" + re.escape(op) + " reads"):
            with no_host_reads():
                _as_megamoe(fn)()
        with no_host_reads():
            fn()  # the same read from the test's own code: not megamoe's, not counted
    free = [lambda: t.to(torch.float64), lambda: torch.where(b, t, -t), lambda: t[i1], lambda: t[idx], lambda: t[1:],
            lambda: idx.repeat_interleave(idx, output_size=2), lambda: idx.repeat_interleave(2), lambda: t.topk(2),
            lambda: torch.nonzero_static(t, size=3), lambda: t.__setitem__(idx, 1.0)]
    with no_host_reads():
        for fn in free:
            _as_megamoe(fn)()
