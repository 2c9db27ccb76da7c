"""Per-rank bodies of the communication tests (imported by the spawned ranks of test_comm*.py).

Every rank builds the same global inputs from one seed, runs the ops on its own share, and checks against
megamoe.comm.reference on the global batch. A rank returns a list of failure strings (empty: passed), so the
parent sees every rank's failures at once.
"""

from __future__ import annotations

import os
import time


def _inputs(world, T_list, H, k, E, seed, routing, dtype, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for T in T_list:
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        rows = []
        for _ in range(T):
            perm = torch.randperm(E, generator=g)[:k]
            if routing == "hot":  # expert 0 in every token's list: it receives everything
                if 0 not in perm.tolist():
                    perm[0] = 0
            elif routing == "narrow":  # only experts of rank 0 (others receive nothing)
                perm = torch.randperm(E // world, generator=g)[:k]
            rows.append(perm)
        idxs.append(torch.stack(rows) if T else torch.empty(0, k, dtype=torch.long))
        # dyadic gates: every product w * x is exact in fp32, so "exact" holds with and without FMA
        ws.append(torch.randint(1, 16, (T, k), generator=g).float() / 16)
    return xs, idxs, ws


def _rel(a, b):
    import torch

    a, b = a.double().cpu(), b.double().cpu()
    if torch.isnan(a).any():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def run_case(rank, world, case, device, timeout_s=30.0, num_sms=None):
    """One case: dispatch -> identity experts -> combine, both backward twins, twice for determinism."""
    import torch

    from megamoe.comm import CommShape, SymmetricHeap, combine, combine_backward, dispatch, dispatch_backward
    from megamoe.comm import signals as S
    from megamoe.comm.reference import combine_ref, dispatch_ref, gather_rows_ref

    name = case["name"]
    T_list, H, k, E = case["T"], case["H"], case["k"], case["E"]
    saved_tiles = dict(S.TILES)
    if "tiles" in case:  # force a tile shape on every row-moving kernel (e.g. BLOCK_H < H: chunked rows)
        S.TILES.update({op: case["tiles"] for op in S.TILES})
    dtype = torch.bfloat16
    fails = []
    xs, idxs, ws = _inputs(world, T_list, H, k, E, case.get("seed", 0), case.get("routing", "uniform"), dtype, device)
    T = T_list[rank]
    shape = CommShape(world, case.get("max_tokens", max(T_list)), H, k, E, dtype)
    heap = SymmetricHeap(shape, device=device, timeout_s=timeout_s, num_sms=num_sms or case.get("sms", 3))
    dev = heap.device
    try:
        x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
        outs = []
        for _rep in range(2):
            recv = torch.full((shape.rows_cap, H), float("nan"), dtype=dtype, device=dev)  # poison
            recv, h = dispatch(x, idx, heap, recv=recv)
            y32 = combine(recv, w, h, out_dtype=torch.float32)
            y = combine(recv, w, h)
            outs.append((recv.clone(), h.offs.clone(), y32.clone(), y.clone()))
        ref, offs, src, tok, slot = dispatch_ref(xs, idxs, rank, E)
        R = ref.shape[0]
        recv, offs_dev, y32, y = outs[0]
        if not torch.equal(offs_dev.long().cpu(), offs):
            fails.append(f"{name} rank {rank}: offs {offs_dev.tolist()} != {offs.tolist()}")
        if not torch.equal(recv[:R].cpu(), ref):
            fails.append(f"{name} rank {rank}: receive rows differ from the reference permutation")
        sch = h.schedule
        triples = (("row_src", sch.row_src, src), ("row_tok", sch.row_tok, tok), ("row_slot", sch.row_slot, slot))
        for nm, got, want in triples:
            if not torch.equal(got[:R].long().cpu(), want):
                fails.append(f"{name} rank {rank}: {nm} differs")
        ref_y = combine_ref(ws[rank], [xs[rank]] * k)  # identity experts: every slot returns x
        if not torch.equal(y32.cpu(), ref_y):
            fails.append(f"{name} rank {rank}: fp32 combine not exact, max err {(y32.cpu() - ref_y).abs().max()}")
        if T and _rel(y, ref_y) > 1e-2:
            fails.append(f"{name} rank {rank}: bf16 combine rel err {_rel(y, ref_y)}")
        for a, b in zip(outs[0], outs[1], strict=False):
            if not torch.equal(a[: R if a.shape[0] == shape.rows_cap else a.shape[0]].cpu(),
                               b[: R if b.shape[0] == shape.rows_cap else b.shape[0]].cpu()):
                fails.append(f"{name} rank {rank}: second run differs bitwise")
                break

        fails += _presum_checks(name, rank, world, x, idx, w, xs, idxs, ws, heap, recv, R, k, E, H, dtype, dev)

        if not case.get("backward", True):
            return fails
        # backward twins: every rank knows every rank's gradient rows (same seed)
        g = torch.Generator().manual_seed(1000 + case.get("seed", 0))
        Rs = [dispatch_ref(xs, idxs, q, E)[0].shape[0] for q in range(world)]
        grads = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
        dys = [torch.randn(Tq, H, generator=g).to(dtype) for Tq in T_list]
        expert_out = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
        grad_recv = torch.full((shape.rows_cap, H), float("nan"), dtype=dtype, device=dev)  # padding is NaN
        grad_recv[: Rs[rank]] = grads[rank].to(dev)
        gx = dispatch_backward(grad_recv, h, out_dtype=torch.float32)
        ref_gx = combine_ref(None, gather_rows_ref(grads, idxs, rank, E))
        if not torch.equal(gx.cpu(), ref_gx) and _rel(gx, ref_gx) > 1e-6:
            fails.append(f"{name} rank {rank}: dispatch_backward rel err {_rel(gx, ref_gx)}")
        out_full = torch.zeros(shape.rows_cap, H, dtype=dtype, device=dev)
        out_full[: Rs[rank]] = expert_out[rank].to(dev)
        g_out, g_w = combine_backward(dys[rank].to(dev), out_full, w, h)
        # grad_out[r] = w_s[t, j] * dy_s[t] for row r = (s, t, j)
        want_gout = torch.empty(R, H)
        for s in range(world):
            m = src == s
            want_gout[m] = ws[s][tok[m], slot[m]][:, None] * dys[s][tok[m]].float()
        if _rel(g_out[:R], want_gout) > 1e-2:
            fails.append(f"{name} rank {rank}: combine_backward grad_out rel err {_rel(g_out[:R], want_gout)}")
        rows_j = gather_rows_ref(expert_out, idxs, rank, E)
        want_gw = torch.stack([(dys[rank].double() * r.double()).sum(1) for r in rows_j], 1) if T else torch.zeros(0, k)
        if T and _rel(g_w, want_gw) > 1e-5:
            fails.append(f"{name} rank {rank}: combine_backward grad_w rel err {_rel(g_w, want_gw)}")
        fails += _pull_variant_checks(name, rank, x, idx, w, dys[rank].to(dev), heap, h, recv, g_out, want_gout, R)
    finally:
        heap.close()
        S.TILES.clear()
        S.TILES.update(saved_tiles)
    return fails


def _pull_variant_checks(name, rank, x, idx, w, dy, heap, h, recv_ref, g_out, want_gout, R):
    """Both pull loops (pipelined or not) give bitwise the same rows; the scale-only pull (no d(topk_w), no
    ``out``) writes bitwise the rows combine_backward writes, and they match w_s[t, j] * dy_s[t]."""
    import importlib

    import torch

    from megamoe.comm import dispatch
    from megamoe.comm import signals as S

    D = importlib.import_module("megamoe.comm.dispatch")  # the module (the package exports the function)
    fails = []
    saved = D.PULL_PIPELINE
    try:
        D.PULL_PIPELINE = not saved
        recv = torch.full_like(recv_ref, float("nan"))
        recv, _ = dispatch(x, idx, heap, recv=recv)
        if not torch.equal(recv[:R].cpu(), recv_ref[:R].cpu()):
            fails.append(f"{name} rank {rank}: dispatch with PULL_PIPELINE={not saved} differs bitwise")
    finally:
        D.PULL_PIPELINE = saved
    w32 = w.to(torch.float32).contiguous().view(torch.int32)
    for pipe in (True, False):
        # the same staging as combine_backward: dy -> tok, gates -> w (the schedule of dispatch is reused)
        S.stage(heap, act=dy.contiguous(), act_reg=S.REG_TOK.value, small=w32, small_reg=S.REG_W.value, ntok=-1,
                programs=h.num_sms)
        dst = torch.full_like(recv_ref, float("nan"))
        D.pull_rows(heap, h.schedule, dst, h.num_sms, scale_only=True, pipeline=pipe)
        if not torch.equal(dst[:R].cpu(), g_out[:R].cpu()):
            fails.append(f"{name} rank {rank}: scale-only pull (pipeline={pipe}) differs bitwise from "
                         "combine_backward's grad_out")
        if _rel(dst[:R], want_gout) > 1e-2:
            fails.append(f"{name} rank {rank}: scale-only pull (pipeline={pipe}) rel err {_rel(dst[:R], want_gout)}")
    return fails


def _presum_checks(name, rank, world, x, idx, w, xs, idxs, ws, heap, recv_plain, R, k, E, H, dtype, dev):
    """Dispatch with gates + pre-summing combine and dispatch backward (presum.py) against the references."""
    import torch

    from megamoe.comm import combine, dispatch, dispatch_backward
    from megamoe.comm.reference import combine_ref, dispatch_ref, gather_rows_ref

    fails = []
    _, _, src, tok, slot = dispatch_ref(xs, idxs, rank, E)
    runs = []
    for _rep in range(2):
        recv = torch.full_like(recv_plain, float("nan"))
        recv, h = dispatch(x, idx, heap, recv=recv, topk_w=w)
        y = combine(recv, None, h, out_dtype=torch.float32, presum=True)
        gx = dispatch_backward(recv, h, out_dtype=torch.float32, presum=True)
        runs.append((y.clone(), gx.clone(), h.row_gate[:R].clone()))
    y, gx, gate = runs[0]
    if not torch.equal(recv[:R].cpu(), recv_plain[:R].cpu()):
        fails.append(f"{name} rank {rank}: dispatch with gates moved other rows")
    want_gate = torch.stack([ws[int(s_)][int(t_), int(j_)] for s_, t_, j_ in zip(src, tok, slot, strict=True)]) \
        if R else torch.zeros(0)
    if not torch.equal(gate.cpu(), want_gate):
        fails.append(f"{name} rank {rank}: row gates differ from the owners' gates")
    ref_y = combine_ref(ws[rank], [xs[rank]] * k)
    if x.shape[0] and _rel(y, ref_y) > 1e-2:  # per-rank partials are rounded to bf16 once
        fails.append(f"{name} rank {rank}: presum combine rel err {_rel(y, ref_y)}")
    ref_gx = combine_ref(None, gather_rows_ref([dispatch_ref(xs, idxs, q, E)[0] for q in range(world)], idxs, rank, E))
    if x.shape[0] and _rel(gx, ref_gx) > 1e-2:
        fails.append(f"{name} rank {rank}: presum dispatch_backward rel err {_rel(gx, ref_gx)}")
    if not all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)):
        fails.append(f"{name} rank {rank}: presum second run differs bitwise")
    return fails


def assert_no_failures(results):
    """The spawned ranks' failure strings (one list per rank, as the rank_* functions return): none, or all in the
    assertion message."""
    flat = [f for rank_fails in results for f in rank_fails]
    assert not flat, "\n".join(flat)


def rank_cases(rank, world, cases, device="cpu"):
    """Run ``cases`` (see run_case) on this rank; returns the failure strings."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    fails = []
    for case in cases:
        try:
            fails += run_case(rank, world, case, device)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            import traceback

            fails.append(f"{case['name']} rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    return fails


def rank_absent(rank, world, absent, timeout_s, device="cpu"):
    """Rank ``absent`` builds the heap but never enters dispatch; the others must raise naming it."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from megamoe.comm import CommShape, CommTimeoutError, SymmetricHeap, dispatch

    heap = SymmetricHeap(CommShape(world, 4, 16, 2, 2 * world), device=None, timeout_s=timeout_s, num_sms=2)
    try:
        if rank == absent:
            return ("absent", 0.0)
        dev = heap.device
        x = torch.randn(4, 16).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(2 * world)[:2] for _ in range(4)]).to(dev)
        t0 = time.monotonic()
        try:
            dispatch(x, idx, heap)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            heap.check()
        except CommTimeoutError as exc:
            return (str(exc), time.monotonic() - t0)
        return ("no error", time.monotonic() - t0)
    finally:
        heap.close()


def rank_graph(rank, world, device="cuda"):
    """No host sync inside dispatch/combine (sync debug mode "error"), and both replay from a CUDA graph."""
    import torch

    from megamoe.comm import CommShape, SymmetricHeap, combine, dispatch
    from megamoe.comm.reference import combine_ref

    fails = []
    T, H, k, E = 256, 1024, 4, 8 * world
    heap = SymmetricHeap(CommShape(world, T, H, k, E), timeout_s=30, num_sms=16)
    dev = heap.device
    try:
        def make(seed):
            g = torch.Generator().manual_seed(seed * 10 + rank)
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            w = torch.randint(1, 16, (T, k), generator=g).float() / 16
            return x, idx, w

        x0, i0, w0 = make(0)
        sx, si, sw = x0.to(dev), i0.to(dev), w0.to(dev)
        recv, h = dispatch(sx, si, heap)  # warm-up: compiles every kernel
        y = combine(recv, sw, h, out_dtype=torch.float32)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv, h = dispatch(sx, si, heap)
            y = combine(recv, sw, h, out_dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001
            fails.append(f"rank {rank}: sync debug mode raised: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        if not torch.equal(y.cpu(), combine_ref(w0, [x0] * k)):
            fails.append(f"rank {rank}: eager combine under sync debug mode is wrong")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_recv, g_h = dispatch(sx, si, heap)
            g_y = combine(g_recv, sw, g_h, out_dtype=torch.float32)
        for seed in (1, 2, 3):
            x1, i1, w1 = make(seed)
            sx.copy_(x1)
            si.copy_(i1)
            sw.copy_(w1)
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(g_y.cpu(), combine_ref(w1, [x1] * k)):
                fails.append(f"rank {rank}: graph replay {seed} gives a wrong combine")
        heap.check()
    finally:
        heap.close()
    return fails


def rank_peer_buffer(rank, world):
    """heap.peer_buffer: every rank's copy of a region, as written by that rank; bad names and ranks rejected (the
    heap's backend follows the process group's: host on gloo, cuda on nccl or when GPU ranks share GPUs).
    Returns failure strings (empty: passed)."""
    import torch
    import torch.distributed as dist

    from megamoe.comm import CommShape, SymmetricHeap

    fails = []
    heap = SymmetricHeap(CommShape(world, 6, 64, 2, 2 * world), device=None, timeout_s=10.0, num_sms=2)
    try:
        tok = heap.tokens_buffer()

        def written_by(r):
            return torch.arange(tok.numel(), dtype=torch.float32).view(tok.shape).to(tok.dtype) + 100 * r

        tok.copy_(written_by(rank))
        if heap.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        for r in range(world):
            v = heap.peer_buffer("tok", r)
            if v.shape != tok.shape or v.dtype != tok.dtype or v.device != tok.device:
                fails.append(f"rank {rank}: peer_buffer('tok', {r}) is {v.shape} {v.dtype} {v.device}")
            elif not torch.equal(v.cpu(), written_by(r).cpu()):
                fails.append(f"rank {rank}: peer_buffer('tok', {r}) does not hold rank {r}'s tokens")
            elif v.data_ptr() != int(heap.peer_ptrs("tok")[r]):
                fails.append(f"rank {rank}: peer_buffer('tok', {r}) is not at peer_ptrs('tok')[{r}]")
        if heap.peer_buffer("tok", rank).data_ptr() != tok.data_ptr():
            fails.append(f"rank {rank}: peer_buffer of its own rank is not its buffer")
        for bad, exc in ((("tok", world), ValueError), (("tok", -1), ValueError), (("nope", 0), KeyError)):
            try:
                heap.peer_buffer(*bad)
                fails.append(f"rank {rank}: peer_buffer{bad} did not raise")
            except exc:
                pass
        dist.barrier()  # (nobody unmaps while a peer still reads)
    finally:
        heap.close()
    return fails
