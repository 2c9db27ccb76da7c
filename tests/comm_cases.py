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
        # gates of no special form (not exact in bf16, not dyadic), distinct per slot: a gate applied to the wrong
        # slot or rounded on the way shows in the fp32 combine
        ws.append(torch.rand(T, k, generator=g) * 0.9 + 0.05)
    return xs, idxs, ws


def _rel(a, b):
    import torch

    a, b = a.double().cpu(), b.double().cpu()
    if torch.isnan(a).any():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


#: Relative-error bounds of the communication checks against float64 references: the worst error measured over
#: the cases of test_comm.py on 2 and 4 ranks and three seed sets (tools/measure_bounds.py), plus 30%. The fp32
#: combine sums k gate * row products in fp32 (worst 6.0e-8); the gate gradient sent home is one fp32 rounding of
#: each float64 <dy, out_j> (at most 2^-24 = 6.0e-8 per entry); dispatch's backward sums at most k bf16 rows in fp32,
#: exact so far (bound: one fp32 rounding). A gate rounded to bf16 costs ~1e-3, a gate on the wrong slot O(1).
COMBINE_FP32 = 8e-8
GATE_GRAD_FP32 = 8.5e-8
SUM_FP32 = 1.2e-7
#: the pre-summing combine rounds each rank's partial sum to bf16 once (worst 2.02e-3)
PRESUM_BF16 = 2.7e-3


def _bounded(fails, key, err, bound, msg):
    """Record ``err`` under ``key`` (megamoe.testing.note_error: the measured worst errors the bounds are set
    from) and fail when it is not below ``bound`` (NaN fails)."""
    from megamoe.testing import note_error

    note_error(key, err)
    if not err < bound:
        fails.append(f"{msg}: {key} rel err {err:.3g} >= {bound:.3g}")


def _late(rank, case, what):
    """Sleep on the case's late rank before ``what`` ("stage": before an op's staging, so peers that do not wait
    for its READY read stale rows; "pull": before its pull, so a peer that restages its source buffer without
    waiting for this rank's DONE overwrites rows still to be read)."""
    if case.get("late") == (rank, what):
        time.sleep(case.get("late_s", 1.0))


def run_case(rank, world, case, device, timeout_s=30.0, num_sms=None):
    """One case: dispatch -> expert outputs distinct per row -> combine, the backward's communication, and a
    repetition with other inputs (bitwise determinism, and stale data from an earlier call never passes); then the
    pull on other program counts and the FP8 dispatch."""
    import importlib

    import torch

    from megamoe.comm import CommShape, SymmetricHeap, combine, dispatch
    from megamoe.comm import schedule as SCH
    from megamoe.comm import signals as S
    from megamoe.comm.reference import combine_ref, dispatch_ref, gather_rows_ref

    D = importlib.import_module("megamoe.comm.dispatch")
    name = case["name"]
    T_list, H, k, E = case["T"], case["H"], case["k"], case["E"]
    saved_tiles, saved_one = dict(S.TILES), SCH.ONE_LAUNCH_ITEMS
    if "tiles" in case:  # force a tile shape on every row-moving kernel (e.g. BLOCK_H < H: chunked rows)
        S.TILES.update({op: case["tiles"] for op in S.TILES})
    if case.get("four_launches"):  # the schedule's four kernels where its one-program kernel would run
        SCH.ONE_LAUNCH_ITEMS = 0
    SCH.ONE_LAUNCH_ITEMS = case.get("one_launch_items", SCH.ONE_LAUNCH_ITEMS)
    dtype = torch.bfloat16
    fails = []
    from megamoe.testing import seed_offset

    seed = case.get("seed", 0) + 1000 * seed_offset()
    reps = [_inputs(world, T_list, H, k, E, seed + 97 * rep, case.get("routing", "uniform"), dtype, device)
            for rep in range(2)]
    T = T_list[rank]
    shape = CommShape(world, case.get("max_tokens", max(T_list)), H, k, E, dtype)
    heap = SymmetricHeap(shape, device=device, timeout_s=timeout_s, num_sms=num_sms or case.get("sms", 3))
    dev = heap.device
    real_pull = D.pull_rows

    def late_pull(*args, **kw):
        _late(rank, case, "pull")
        return real_pull(*args, **kw)

    D.pull_rows = late_pull
    try:
        outs = []
        for rep, (xs, idxs, ws) in enumerate(reps):
            x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
            ref, offs, src, tok, slot = dispatch_ref(xs, idxs, rank, E)
            R = ref.shape[0]
            recv = torch.full((shape.rows_cap, H), float("nan"), dtype=dtype, device=dev)  # poison
            _late(rank, case, "stage")
            recv, h = dispatch(x, idx, heap, recv=recv)
            tag = f"{name} rank {rank} call {rep}"
            if not torch.equal(h.offs.long().cpu(), offs):
                fails.append(f"{tag}: offs {h.offs.tolist()} != {offs.tolist()}")
            if not torch.equal(recv[:R].cpu(), ref):
                fails.append(f"{tag}: receive rows differ from the reference permutation")
            if not torch.isnan(recv[R:].float()).all():
                fails.append(f"{tag}: rows past the received ones were written")
            sch = h.schedule
            for nm, got, want in (("row_src", sch.row_src, src), ("row_tok", sch.row_tok, tok),
                                  ("row_slot", sch.row_slot, slot)):
                if not torch.equal(got[:R].long().cpu(), want):
                    fails.append(f"{tag}: {nm} differs")
            # expert outputs distinct per received row (every rank draws every rank's, from one seed); the
            # padding past them is NaN, which the combine must never read
            g = torch.Generator().manual_seed(500 + seed + rep)
            Rs = [dispatch_ref(xs, idxs, q, E)[0].shape[0] for q in range(world)]
            expert_out = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
            out_full = torch.full((shape.rows_cap, H), float("nan"), dtype=dtype, device=dev)
            out_full[:R] = expert_out[rank].to(dev)
            y32 = combine(out_full, w, h, out_dtype=torch.float32)
            y = combine(out_full, w, h)
            rows_j = gather_rows_ref(expert_out, idxs, rank, E)
            ref_y = combine_ref(ws[rank].double(), [r.double() for r in rows_j]) if T else torch.zeros(0, H)
            if T:
                _bounded(fails, "comm.combine_fp32", _rel(y32, ref_y), COMBINE_FP32, tag)
            if not torch.equal(y.cpu(), y32.to(dtype).cpu()):  # one rounding of the fp32 sum
                fails.append(f"{tag}: bf16 combine is not the fp32 sum rounded once")
            outs.append((recv[:R].clone(), h.offs.clone(), y32.clone(), y.clone()))
            fails += _presum_checks(tag, rank, world, x, idx, w, xs, idxs, ws, heap, recv, R, k, E, H, dtype, dev)
            if case.get("backward", True):
                fails += _backward_checks(tag, rank, world, case, xs, idxs, ws, heap, h, w, src, tok, slot, R, dev)
        if case.get("back_to_back"):  # two dispatches with no op between: the second's staging must wait
            # until every peer finished reading the first's rows (DONE), however late a peer reads
            got = []
            for xs, idxs, _ in reps:
                _late(rank, case, "stage")
                got.append(dispatch(xs[rank].to(dev), idxs[rank].to(dev), heap)[0])
            for rep, ((xs, idxs, _), recv) in enumerate(zip(reps, got, strict=True)):
                ref = dispatch_ref(xs, idxs, rank, E)[0]
                if not torch.equal(recv[:ref.shape[0]].cpu(), ref):
                    fails.append(f"{name} rank {rank}: back-to-back dispatch {rep} received other rows")
        xs, idxs, ws = reps[0]  # the first call's inputs once more: bitwise its results
        recv, h = dispatch(xs[rank].to(dev), idxs[rank].to(dev), heap)
        g = torch.Generator().manual_seed(500 + seed)
        Rs = [dispatch_ref(xs, idxs, q, E)[0].shape[0] for q in range(world)]
        expert_out = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
        out_full = torch.zeros(shape.rows_cap, H, dtype=dtype, device=dev)
        out_full[:Rs[rank]] = expert_out[rank].to(dev)
        w = ws[rank].to(dev)
        again = (recv[:Rs[rank]], h.offs, combine(out_full, w, h, out_dtype=torch.float32), combine(out_full, w, h))
        if not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(outs[0], again, strict=True)):
            fails.append(f"{name} rank {rank}: a repeated call differs bitwise from the first")
        if case.get("backward", True):
            fails += _pull_checks(name, rank, xs[rank].to(dev), idxs[rank].to(dev), w, heap, recv, Rs[rank], case)
    finally:
        D.pull_rows = real_pull
        heap.close()
        S.TILES.clear()
        S.TILES.update(saved_tiles)
        SCH.ONE_LAUNCH_ITEMS = saved_one
    return fails


def _backward_checks(tag, rank, world, case, xs, idxs, ws, heap, h, w, src, tok, slot, R, dev):
    """The backward's communication against float64 references on rows distinct per slot: dispatch_backward
    (unweighted sum of each token's k gradient rows), pull_grad (each received row's dy row and gate, exactly) and
    send_gate_grad (each row's d(topk_w) value into its owner's slot): d(topk_w)[t, j] = <dy_t, out_j(t)>, each
    rounded once to fp32 on the expert rank, as the dgrad epilogue computes it."""
    import torch

    from megamoe.comm import dispatch_backward, pull_grad, send_gate_grad
    from megamoe.comm.reference import combine_ref, dispatch_ref, gather_rows_ref
    from megamoe.testing import seed_offset

    fails = []
    sh = heap.shape
    H, E, T = sh.hidden, sh.num_experts, xs[rank].shape[0]
    dtype = sh.dtype
    g = torch.Generator().manual_seed(1000 + case.get("seed", 0) + 7 * len(tag) + 1000 * seed_offset())
    Rs = [dispatch_ref(xs, idxs, q, E)[0].shape[0] for q in range(world)]
    grads = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
    dys = [torch.randn(xq.shape[0], H, generator=g).to(dtype) for xq in xs]
    expert_out = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
    grad_recv = torch.full((sh.rows_cap, H), float("nan"), dtype=dtype, device=dev)  # padding is NaN
    grad_recv[:R] = grads[rank].to(dev)
    gx = dispatch_backward(grad_recv, h, out_dtype=torch.float32)
    ref_gx = combine_ref(None, [r.double() for r in gather_rows_ref(grads, idxs, rank, E)]) if T \
        else torch.zeros(0, H)
    if T:
        _bounded(fails, "comm.dispatch_backward_fp32", _rel(gx, ref_gx), SUM_FP32, tag)
    _late(rank, case, "stage")  # no schedule runs between this staging and the pull: the pull's own READY wait
    dy_rows, gate = pull_grad(dys[rank].to(dev), w, h)
    # row r = (s, t, j) holds dy_s[t] unscaled and its gate w_s[t, j]
    want_rows = torch.empty(R, H, dtype=dtype)
    want_gate = torch.empty(R)
    for s in range(world):
        m = src == s
        want_rows[m] = dys[s][tok[m]]
        want_gate[m] = ws[s][tok[m], slot[m]]
    if not torch.equal(dy_rows[:R].cpu(), want_rows):
        fails.append(f"{tag}: pull_grad rows are not the owners' dy rows (rel {_rel(dy_rows[:R], want_rows):.3g})")
    if not torch.equal(gate[:R].cpu(), want_gate):
        fails.append(f"{tag}: pull_grad gates are not the owners' gates (rel {_rel(gate[:R], want_gate):.3g})")
    # d(topk_w) of row r from the rows as pulled, in float64 rounded once; the padding past R is NaN, which must
    # never be sent
    ds = torch.full((sh.rows_cap,), float("nan"), dtype=torch.float32)
    ds[:R] = (dy_rows[:R].double().cpu() * expert_out[rank].double()).sum(1).float()
    g_w = send_gate_grad(ds.to(dev), h)
    rows_j = gather_rows_ref(expert_out, idxs, rank, E)
    if tuple(g_w.shape) != (T, sh.topk) or g_w.dtype != torch.float32:
        fails.append(f"{tag}: send_gate_grad gave {tuple(g_w.shape)} {g_w.dtype}, not [T, k] fp32")
    elif T:
        want_gw = torch.stack([(dys[rank].double() * r.double()).sum(1) for r in rows_j], 1)
        _bounded(fails, "comm.gate_grad_fp32", _rel(g_w, want_gw), GATE_GRAD_FP32, tag)
    return fails


def _pull_checks(name, rank, x, idx, w, heap, recv_ref, R, case):
    """The pull on other program counts (another split of the pipelined loop's units among programs, an odd number
    of units on some) moves bitwise the same rows and writes nothing past them; dispatch_fp8 (x quantised once per
    token at home, the packed rows pulled narrower than H) gives bitwise what quantize_act gives on dispatch's
    rows, and the same row gates as dispatch with gates."""
    import torch

    from megamoe.comm import dispatch, dispatch_fp8
    from megamoe.kernels.fp8_quant import quantize_act
    from megamoe.testing import fp8_bits

    fails = []
    for sms in (1, 5):
        recv = torch.full_like(recv_ref, float("nan"))
        _late(rank, case, "stage")  # (late-stager cases: every program count waits for READY)
        recv, _ = dispatch(x, idx, heap, num_sms=sms, recv=recv)
        if not torch.equal(recv[:R].cpu(), recv_ref[:R].cpu()):
            fails.append(f"{name} rank {rank}: dispatch on {sms} programs moved other rows")
        if not torch.isnan(recv[R:].float()).all():
            fails.append(f"{name} rank {rank}: dispatch on {sms} programs wrote rows past the received ones")
    aq, a_s, h8 = dispatch_fp8(x, idx, heap, topk_w=w)
    _, h = dispatch(x, idx, heap, topk_w=w)
    q, s = quantize_act(recv_ref[:R]) if R else (aq[:0], a_s[:0])
    if not (torch.equal(fp8_bits(aq[:R]).cpu(), fp8_bits(q).cpu()) and torch.equal(a_s[:R].cpu(), s.cpu())):
        fails.append(f"{name} rank {rank}: dispatch_fp8 rows differ from quantize_act of dispatch's rows")
    if not torch.equal(h8.offs.cpu(), h.offs.cpu()):
        fails.append(f"{name} rank {rank}: dispatch_fp8 offs {h8.offs.tolist()} != dispatch's {h.offs.tolist()}")
    if not torch.equal(h8.row_gate[:R].cpu(), h.row_gate[:R].cpu()):
        fails.append(f"{name} rank {rank}: dispatch_fp8 row gates differ from dispatch's")
    return fails


def _presum_checks(tag, rank, world, x, idx, w, xs, idxs, ws, heap, recv_plain, R, k, E, H, dtype, dev):
    """Dispatch with gates + pre-summing combine and dispatch backward (presum.py) against float64 references on
    expert outputs distinct per row."""
    import torch

    from megamoe.comm import combine, dispatch, dispatch_backward
    from megamoe.comm.reference import combine_ref, dispatch_ref, gather_rows_ref
    from megamoe.testing import seed_offset

    fails = []
    _, _, src, tok, slot = dispatch_ref(xs, idxs, rank, E)
    g = torch.Generator().manual_seed(2000 + len(tag) + 1000 * seed_offset())
    Rs = [dispatch_ref(xs, idxs, q, E)[0].shape[0] for q in range(world)]
    expert_out = [torch.randn(Rs[q], H, generator=g).to(dtype) for q in range(world)]
    out = torch.full((heap.shape.rows_cap, H), float("nan"), dtype=dtype, device=dev)
    out[:R] = expert_out[rank].to(dev)
    runs = []
    for _rep in range(2):
        recv = torch.full_like(recv_plain, float("nan"))
        recv, h = dispatch(x, idx, heap, recv=recv, topk_w=w)
        y = combine(out, None, h, out_dtype=torch.float32, presum=True)
        gx = dispatch_backward(out, h, out_dtype=torch.float32, presum=True)
        runs.append((y.clone(), gx.clone(), h.row_gate[:R].clone()))
    y, gx, gate = runs[0]
    if not torch.equal(recv[:R].cpu(), recv_plain[:R].cpu()):
        fails.append(f"{tag}: dispatch with gates moved other rows")
    want_gate = torch.stack([ws[int(s_)][int(t_), int(j_)] for s_, t_, j_ in zip(src, tok, slot, strict=True)]) \
        if R else torch.zeros(0)
    if not torch.equal(gate.cpu(), want_gate):
        fails.append(f"{tag}: row gates differ from the owners' gates")
    rows_j = [r.double() for r in gather_rows_ref(expert_out, idxs, rank, E)]
    if x.shape[0]:
        ref_y = combine_ref(ws[rank].double(), rows_j)
        _bounded(fails, "comm.presum_combine", _rel(y, ref_y), PRESUM_BF16, tag)  # partials rounded to bf16
        ref_gx = combine_ref(None, rows_j)
        _bounded(fails, "comm.presum_dispatch_backward", _rel(gx, ref_gx), PRESUM_BF16, tag)
    if not all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True)):
        fails.append(f"{tag}: presum second run differs bitwise")
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
