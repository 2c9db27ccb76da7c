"""``megamoe bench-comm``: dispatch and combine alone, next to NCCL all_to_all_single moving the same rows.

``torchrun --nproc_per_node 4 -m megamoe.apps.bench_comm --json comm.json``. Per config of CONFIGS at ``--tokens``
per GPU, uniform random routing, bf16:
* dispatch: x already in the heap's token buffer (stage, schedule, pull); ``dispatch+copy`` also stages x;
  ``pull`` is the pull kernel alone;
* combine: expert outputs already in the heap's rows buffer; ``gather`` is the gather-sum kernel alone;
* nccl a2a: the same rows (dispatch: one per (token, destination rank); combine: one per (token, slot)), splits
  computed on the host before timing.
Time: CUDA events per call after a host barrier, max over ranks, median over iterations. GB/s = rows received from
other ranks x H x 2 / time, per rank (the slowest rank's bytes).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from megamoe.apps.perf import Marks, run_metadata, write_json
from megamoe.dist import init_from_env

CONFIGS = {"deepseek-v3": dict(hidden=7168, num_experts=256, topk=8),
           "qwen3-30b-a3b": dict(hidden=2048, num_experts=128, topk=8)}


def _time(fn, iters: int, warmup: int):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        marks = Marks(torch.device("cuda"))
        fn()
        marks.mark()
        times.append(marks.elapsed()[0] * 1e6)  # us
    per_iter_max = torch.tensor(times, device="cuda")
    dist.all_reduce(per_iter_max, op=dist.ReduceOp.MAX)
    return float(per_iter_max.median()), per_iter_max.tolist()


def run_config(name: str, tokens: int, sms_list: list[int], iters: int, warmup: int, seed: int) -> dict:
    from megamoe.comm import CommShape, SymmetricHeap, combine, dispatch
    from megamoe.comm.dispatch import pull_rows
    from megamoe.comm.schedule import build_schedule, schedule_buffers

    cfg = CONFIGS[name]
    H, E, k = cfg["hidden"], cfg["num_experts"], cfg["topk"]
    rank, W = dist.get_rank(), dist.get_world_size()
    E_l = E // W
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(seed + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(dev)
    w = torch.rand(tokens, k, generator=g).to(dev)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16).to(dev)
    heap = SymmetricHeap(CommShape(W, tokens, H, k, E), device=dev, timeout_s=60.0, num_sms=max(sms_list))
    x_heap = heap.tokens_buffer()[:tokens].copy_(x)

    # bytes: rows received from other ranks (dispatch: deduplicated (token, dest rank); combine: (token, slot))
    dest = idx // E_l  # [T, k]
    send_dedup = torch.zeros(tokens, W, dtype=torch.bool, device=dev).scatter_(1, dest, True).sum(0)  # sent per rank
    send_slots = torch.bincount(dest.reshape(-1), minlength=W)  # rows this rank receives back per rank in combine
    recv_dedup, recv_slots = torch.empty_like(send_dedup), torch.empty_like(send_slots)
    dist.all_to_all_single(recv_dedup, send_dedup)  # from each source q: its send_dedup[rank]
    dist.all_to_all_single(recv_slots, send_slots)  # combine: expert rank q sends back these rows to me
    # remote rows of dispatch, combine and the presum combine (one row per (token, remote rank)), slowest rank's
    remote = torch.tensor([int(t.sum() - t[rank]) for t in (recv_dedup, send_slots, send_dedup)], device=dev)
    dist.all_reduce(remote, op=dist.ReduceOp.MAX)
    disp_bytes, comb_bytes, presum_bytes = (int(r) * H * 2 for r in remote)

    res = {"config": name, "hidden": H, "num_experts": E, "topk": k, "tokens_per_rank": tokens, "world": W,
           "dispatch_remote_bytes": disp_bytes, "combine_remote_bytes": comb_bytes,
           "combine_presum_remote_bytes": presum_bytes, "rows": []}

    def add(op, sms, fn, nbytes, graph=False):
        if graph:  # fn captured in a CUDA graph, its replays timed
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            fn = g.replay
        us, samples = _time(fn, iters, warmup)
        row = {"op": op, "sms": sms, "us": round(us, 2), "GBps": round(nbytes / (us * 1e-6) / 1e9, 1),
               "bytes": nbytes, "samples_us": [round(s, 2) for s in samples]}
        res["rows"].append(row)
        if rank == 0:
            print(f"{name:14s} {op:14s} sms={str(sms):>4s} {us:9.1f} us {row['GBps']:7.1f} GB/s", flush=True)

    def a2a(send: list[int], recv: list[int]):
        """NCCL all_to_all_single of send[q] rows to and recv[q] rows from each rank q, buffers made before timing."""
        a2a_in = torch.randn(sum(send), H, device=dev).to(torch.bfloat16)
        a2a_out = torch.empty(sum(recv), H, device=dev, dtype=torch.bfloat16)
        return lambda: dist.all_to_all_single(a2a_out, a2a_in, recv, send)

    add("nccl_a2a_dispatch", "nccl", a2a(send_dedup.tolist(), recv_dedup.tolist()), disp_bytes)
    # combine: as the expert rank I send rows of source s back to s
    add("nccl_a2a_combine", "nccl", a2a(recv_slots.tolist(), send_slots.tolist()), comb_bytes)

    recv = torch.empty(heap.shape.rows_cap, H, dtype=torch.bfloat16, device=dev)
    rows = heap.rows_buffer()
    state = {}

    def disp(sms):
        _, state["h"] = dispatch(x_heap, idx, heap, num_sms=sms, recv=recv)
        return state["h"]

    for sms in sms_list:
        h = disp(sms)
        rows.copy_(recv)  # identity experts, written where combine reads them
        add("pull", sms, functools.partial(pull_rows, heap, h.schedule, recv, sms), disp_bytes)
        add("gather", sms, functools.partial(combine, rows, w, h, num_sms=sms), comb_bytes)
        add("dispatch", sms, functools.partial(disp, sms), disp_bytes)
        add("dispatch+copy", sms, functools.partial(dispatch, x, idx, heap, num_sms=sms, recv=recv), disp_bytes)
        add("schedule", sms, functools.partial(build_schedule, heap, schedule_buffers(heap)), 0)
        add("dispatch(graph)", sms, functools.partial(disp, sms), disp_bytes, graph=True)
        comb = functools.partial(combine, rows, w, state["h"], num_sms=sms)
        add("combine", sms, comb, comb_bytes)
        add("combine(graph)", sms, comb, comb_bytes, graph=True)
        # pre-summing combine: gates travel with dispatch, expert ranks pre-sum, owner pulls <= W rows
        _, hp = dispatch(x_heap, idx, heap, num_sms=sms, recv=recv, topk_w=w)
        presum = functools.partial(combine, recv, None, hp, num_sms=sms, presum=True)
        add("combine_presum", sms, presum, presum_bytes)
        add("combine_presum(graph)", sms, presum, presum_bytes, graph=True)
        h = disp(sms)
        rows.copy_(recv)  # the pre-summing combine wrote partial sums over the identity rows
    # correctness spot check of the last combine (identity experts): y = sum_j w_j x
    y = combine(rows, w, h)
    ref = (w.float()[:, :, None] * x.float()[:, None, :]).sum(1)
    res["combine_rel_err_identity"] = ((y.float() - ref).norm() / ref.norm()).item()
    torch.cuda.synchronize()
    heap.check()
    heap.close()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megamoe bench-comm", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="deepseek-v3,qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sms", default="16,24,32,48,64", help="comma list of programs for the comm kernels")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here (rank 0)")
    args = p.parse_args(argv)
    init_from_env("cuda")
    sms_list = [int(s) for s in args.sms.split(",")]
    if dist.get_rank() == 0:
        print("bytes = rows received from other ranks x H x 2 (bf16); time = median over iterations of the max "
              "over ranks (CUDA events)", flush=True)
    results = [run_config(name, args.tokens, sms_list, args.iters, args.warmup, args.seed)
               for name in args.configs.split(",")]
    if dist.get_rank() == 0 and args.json:
        write_json(args.json, {
            "bench": "comm",
            "meta": run_metadata(torch.device("cuda", torch.cuda.current_device()), dist.get_world_size()),
            "bytes_definition": "rows received from other ranks x H x dtype size (2, bf16)",
            "time_definition": "median over iterations of the per-iteration max over ranks, CUDA events, us",
            "results": results})
        print(f"wrote {args.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
