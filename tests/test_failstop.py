"""Fail-stop communication on CPU ranks (gloo + host heap + interpreter): a peer that stops in the forward or in the
backward's last operation makes every survivor raise CommTimeoutError naming op, call, rank and peer in that step,
before an optimizer step could consume the outputs; later calls raise at once; a host error of an op is raised before
the op publishes anything (no peer waits for it); no kernel waits for programs that may not be resident (the
interpreter runs a launch's programs one after another: only one is ever resident)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from megamoe.dist import spawn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # spawned CPU ranks inherit it before importing triton

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; GPUs run tests/test_gpu_*.py")

TIMEOUT_S = 1.5


class _Stopped(Exception):
    """The simulated death of a rank: it never enters the op, so it never signals again."""


def _step(rank: int, world: int, backend: str, where: str) -> dict:
    """One training step (forward, backward, SGD step) on each rank; rank 1 stops before ``where`` ("forward": the
    layer's call; "backward-last": dispatch_backward, the backward's last communication op). What the survivors saw."""
    from megamoe import MoE, preset
    from megamoe.comm import CommTimeoutError

    torch.manual_seed(rank)
    moe = MoE(preset("tiny", max_tokens_per_rank=8), backend=backend, timeout_s=TIMEOUT_S, seed=0)
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in moe.parameters()]
    if rank == 1 and where == "backward-last":
        import megamoe.backends.common as common

        def stop(*args, **kwargs):
            raise _Stopped

        common.dispatch_backward = stop  # (heap_backward's, for split and fused)
    x = torch.randn(8, moe.config.hidden).to(torch.bfloat16).requires_grad_()
    out = {"stepped": False, "error": None, "phase": None}
    t0 = time.monotonic()
    try:
        if rank == 1 and where == "forward":
            raise _Stopped
        out["phase"] = "forward"
        y = moe(x).out
        out["phase"] = "backward"
        (y.float() ** 2).sum().backward()
        out["phase"] = "step"
        opt.step()
        out["stepped"] = True
    except _Stopped:
        return {"stopped": True}
    except CommTimeoutError as exc:
        out["error"] = str(exc)
    out["took"] = time.monotonic() - t0
    out["params_unchanged"] = all(torch.equal(a, b.detach()) for a, b in zip(before, moe.parameters(), strict=True))
    # fail-stop is sticky: the next call raises at once, whatever it is
    t1 = time.monotonic()
    try:
        moe(x)
        out["next"] = "no error"
    except CommTimeoutError as exc:
        out["next"] = str(exc)
    out["next_took"] = time.monotonic() - t1
    return out


@CPU_ONLY
@pytest.mark.parametrize("backend", ["split", "fused"])
@pytest.mark.parametrize("where,op,phase", [
    ("forward", "schedule", "forward"),  # the peer never stages its tokens: the schedule's READY wait
    ("backward-last", "dispatch_backward", "backward"),  # the peer never stages its dx rows: dx's gather
])
def test_peer_stops_survivor_raises_in_that_step(backend, where, op, phase):
    res = spawn(_step, 2, backend, where, timeout_s=300)
    assert res[1] == {"stopped": True}
    r = res[0]
    assert r["error"] is not None, r
    assert not r["stepped"] and r["params_unchanged"], r  # the optimizer never ran on the outputs
    assert r["phase"] == phase, r
    assert f"timeout in {op} (call " in r["error"] and "on rank 0: peer rank 1 never signalled READY" in r["error"], r
    assert r["took"] < TIMEOUT_S + 10, r
    assert "megamoe comm timeout" in r["next"] and r["next_took"] < 1.0, r


def _error_before_ready(rank: int, world: int) -> dict:
    """Rank 0's dispatch runs out of memory allocating its receive buffer: it must raise before its stage publishes
    (its call counter unchanged), so both ranks then dispatch normally, with no timeout."""
    import importlib

    from megamoe.comm import CommShape, SymmetricHeap, dispatch

    dmod = importlib.import_module("megamoe.comm.dispatch")  # (the package's ``dispatch`` is the function)

    heap = SymmetricHeap(CommShape(world, 4, 16, 2, 2 * world), timeout_s=60, num_sms=2)  # (a slow first call)
    try:
        x = torch.randn(4, 16).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(2 * world)[:2] for _ in range(4)])
        seq = int(heap.buffer("ctrl")[0])
        raised = None
        if rank == 0:
            real = dmod.row_buffer

            def oom(*args, **kwargs):
                raise torch.OutOfMemoryError("simulated")

            dmod.row_buffer = oom
            try:
                dispatch(x, idx, heap)
            except torch.OutOfMemoryError as exc:
                raised = str(exc)
            finally:
                dmod.row_buffer = real
        after = int(heap.buffer("ctrl")[0])
        recv, handle = dispatch(x, idx, heap)
        return {"raised": raised, "seq_before": seq, "seq_after_error": after, "ok": int(handle.offs[-1]) >= 0}
    finally:
        heap.close()


@CPU_ONLY
def test_host_error_raised_before_ready():
    r0, r1 = spawn(_error_before_ready, 2, timeout_s=120)
    assert r0["raised"] == "simulated", r0
    assert r0["seq_after_error"] == r0["seq_before"], r0  # nothing staged, no READY published
    assert r0["ok"] and r1["ok"]


def _rows_busy(rank: int, world: int) -> list[bool]:
    """heap.rows_busy through dispatch -> combine -> dispatch: GEMMs may write ``rows`` only while it is False."""
    from megamoe.backends.common import heap_rows
    from megamoe.comm import CommShape, SymmetricHeap, combine, dispatch

    sh = CommShape(world, 4, 16, 2, 2 * world)
    heap = SymmetricHeap(sh, timeout_s=60, num_sms=2)
    try:
        x = torch.randn(4, 16).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(2 * world)[:2] for _ in range(4)])
        w = torch.rand(4, 2)
        seen = [heap.rows_busy]
        recv, handle = dispatch(x, idx, heap)
        seen.append(heap_rows(heap, recv.shape, recv.dtype) is None)
        combine(recv, w, handle)
        seen += [heap.rows_busy, heap_rows(heap, recv.shape, recv.dtype) is None]
        dispatch(x, idx, heap)
        seen.append(heap.rows_busy)
        return seen
    finally:
        heap.close()


@CPU_ONLY
def test_rows_written_only_when_no_peer_reads_them():
    for seen in spawn(_rows_busy, 2, timeout_s=120):
        assert seen == [False, False, True, True, False], seen


def _stale_call(rank: int, world: int) -> str:
    """One rank; its call counter pushed ahead of its DONE (what a GPU test does inside a captured graph to force a
    timeout): the stage times out naming itself, within the timeout."""
    from megamoe.comm import CommShape, CommTimeoutError, SymmetricHeap, dispatch

    heap = SymmetricHeap(CommShape(1, 4, 16, 2, 2), timeout_s=TIMEOUT_S, num_sms=2)
    try:
        x = torch.randn(4, 16).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(2)[:2] for _ in range(4)])
        dispatch(x, idx, heap)
        heap.buffer("ctrl")[0] += 5
        try:
            dispatch(x, idx, heap)
        except CommTimeoutError as exc:
            return str(exc)
        return "no error"
    finally:
        heap.close()


@CPU_ONLY
def test_stale_call_counter_times_out_in_stage():
    (msg,) = spawn(_stale_call, 1, timeout_s=120)
    assert "timeout in stage (call 6) on rank 0: peer rank 0 never signalled DONE" in msg, msg


def _programs(rank: int, world: int) -> dict:
    """The fused layer with 3 megakernel programs and 3 communication programs, against 1 and 2: the interpreter
    runs one program at a time, so a kernel waiting for another program to arrive would hang; bitwise equal."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_fused_backend import fused_config

    from megamoe import preset
    from megamoe.testing import compare_runs, layer_runs

    cfg = preset("tiny", max_tokens_per_rank=24)
    base = layer_runs(cfg, 17 + rank, torch.device("cpu"), [("fused", {})], input_seed=rank, weight_seed=3)
    with fused_config(programs=3) as made:
        many = layer_runs(cfg, 17 + rank, torch.device("cpu"), [("fused", {"comm_sms": 3})], input_seed=rank,
                          weight_seed=3)
    assert made and made[0].programs == 3
    return compare_runs(many[0], base[0])


@CPU_ONLY
def test_fused_completes_with_programs_that_are_never_resident_together():
    for cmp in spawn(_programs, 2, timeout_s=300):
        assert all(v[0] for v in cmp.values()), cmp


def test_close_after_a_timeout_still_stops_the_process(monkeypatch):
    # the CUDA watchdog: once a timeout is recorded (the kernel trapped, the context is lost) the process stops after
    # the grace period even if the heap is closed meanwhile (a `finally: close_heaps()` would otherwise let it go on
    # into a collective with the dead peer). Driven on a heap object without memory; os._exit is recorded.
    import threading

    from megamoe.comm import heap as heap_mod

    exits = []
    monkeypatch.setattr(heap_mod, "STOP_GRACE_S", 0.3)
    monkeypatch.setattr(heap_mod.os, "_exit", exits.append)
    heap = heap_mod.SymmetricHeap.__new__(heap_mod.SymmetricHeap)
    heap.backend, heap._closed, heap._error, heap.timeout_s = "cuda", False, None, 1.0
    record = []
    heap._read_error = lambda: record[0] if record else None
    heap._watchdog_stop = threading.Event()
    heap._watchdog = threading.Thread(target=heap._watch, daemon=True)
    heap._watchdog.start()
    record.append("megamoe comm timeout in combine (call 3) on rank 0: peer rank 1 never signalled READY")
    deadline = time.monotonic() + 5
    while heap._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    heap.close()  # during the grace period
    heap._watchdog.join(timeout=5)
    assert exits == [heap_mod.STOP_EXIT_CODE]
