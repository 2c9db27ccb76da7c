"""Sweep of the dispatch pull kernel (megamoe/comm/dispatch.py `_pull_kernel`): loop variant x tile x programs.

    torchrun --nproc_per_node 4 benchmarks/pull_sweep.py            # or 2 GPUs; ~1 minute
    torchrun --nproc_per_node 2 benchmarks/pull_sweep.py --configs qwen3-30b-a3b --programs 32 --json out.json
    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 benchmarks/pull_sweep.py --device cpu --configs tiny \
        --tokens 16 --programs 3 --iters 2 --warmup 0                  # CPU smoke run of the script

For each config (qwen3-30b-a3b: H 2048, 128 experts; deepseek-v3: H 7168, 256 experts; top-8, bf16, uniform
random routing, ``--tokens`` per GPU) it dispatches once (stage, device schedule, pull), then times the pull
kernel alone (``pull_rows`` on the same schedule) for every
    pipeline  0: the loop as measured 2026-11-29 (index loads -> remote row -> stores, one step at a time)
              1: software-pipelined loop (next unit's remote row and indices in flight while storing)
    tile      ``elements x warps x max rows`` per step, ROWS x BLOCK_H ~ elements (signals.TILES["pull"] for
              loop 0, --old-tiles, default its 2026-11-29 best; TILES["pull_pipe"] for loop 1, --tiles)
    programs  CTAs of the launch (--programs 32,64,132)
and the combine-backward pull without d(topk_w) (``pull_rows(scale_only=True)``: dst = w * dy rows) at its
default tile (TILES["pull_scale"]), both loops. Every variant's output is compared bitwise with the first
variant's (loop 0, first tile): any difference is reported and makes the exit status 1. The first run on a
machine spends most of its time compiling (about 12 kernels); Triton's cache makes later runs faster.

Time: CUDA events around each call; every iteration starts after a host barrier; an iteration's time is the
max over ranks; the figure is the median over iterations (us). Bytes: ``write`` = rows this rank writes x H x 2
(local stores), ``remote`` = deduplicated rows it reads from other ranks x H x 2 (NVLink); GB/s = bytes / time
of the slowest rank's bytes.
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # NVLink multicast stays off (shared/MEASURED.md), before torch.distributed

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

CONFIGS = {
    "qwen3-30b-a3b": dict(hidden=2048, num_experts=128, topk=8),
    "deepseek-v3": dict(hidden=7168, num_experts=256, topk=8),
    "tiny": dict(hidden=64, num_experts=8, topk=2),  # CPU smoke run of this script (--device cpu)
}


def _tiles(spec: str) -> list[tuple[int, int, int, int]]:
    """'32768x16x8,...' -> [(elements, warps, max BLOCK_H 8192, max ROWS)]"""
    out = []
    for item in spec.split(","):
        parts = [int(p) for p in item.split("x")]
        elems, warps, rows_cap = (parts + [16, 8][len(parts) - 1:])[:3]
        out.append((elems, warps, 8192, rows_cap))
    return out


def _time(fn, iters: int, warmup: int, dev) -> float:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    if dev.type != "cuda":  # CPU smoke run: wall clock
        t = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
        t = torch.tensor(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.median())
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = torch.tensor([a.elapsed_time(b) * 1e3 for a, b in ev], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # per-iteration max over ranks
    return float(t.median())


def run_config(name: str, args, tiles: dict, programs: list[int], pipelines: list[int], dev) -> tuple[dict, bool]:
    import torch
    import torch.distributed as dist

    from megamoe.comm import CommShape, SymmetricHeap, dispatch
    from megamoe.comm import signals as S
    from megamoe.comm.dispatch import pull_rows

    cfg = CONFIGS[name]
    H, E, k, T = cfg["hidden"], cfg["num_experts"], cfg["topk"], args.tokens
    rank, W = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(args.seed * 100 + rank)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].to(dev)  # uniform: k distinct experts per token
    w = torch.rand(T, k, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    dy = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    heap = SymmetricHeap(CommShape(W, T, H, k, E), device=dev, timeout_s=60.0, num_sms=max(programs))
    saved = dict(S.TILES)
    ok = True
    res = {"config": name, "hidden": H, "num_experts": E, "topk": k, "tokens_per_rank": T, "world": W, "rows": []}
    try:
        recv_ref, h = dispatch(x, idx, heap, num_sms=max(programs))
        sched = h.schedule
        R = int(h.offs[-1])  # rows this rank writes (host read outside any timing)
        rr = sched.recv_row[:, :T].reshape(W, T, k)
        need = (rr >= 0).any(-1)  # [W, T]: (source, token) pairs this rank reads
        need[rank] = False
        nb = torch.tensor([R * H * 2, int(need.sum()) * H * 2], device=dev)
        dist.all_reduce(nb, op=dist.ReduceOp.MAX)
        wbytes, rbytes = int(nb[0]), int(nb[1])
        res.update(write_bytes=wbytes, remote_bytes=rbytes)
        out = torch.empty_like(recv_ref)
        ref_out: dict[str, torch.Tensor] = {}

        def record(op, pipe, tile, P, us, same):
            nonlocal ok
            rows_, bh, warps = S.launch_config(H, "pull_scale" if op == "scale" else ("pull_pipe" if pipe else "pull"))
            row = {"op": op, "pipeline": pipe, "tile": list(tile), "rows": rows_, "block_h": bh, "warps": warps,
                   "programs": P, "us": round(us, 1), "write_GBps": round(wbytes / us / 1e3, 1),
                   "remote_GBps": round(rbytes / us / 1e3, 1), "bitwise_equal": same}
            res["rows"].append(row)
            ok = ok and same
            if rank == 0:
                print(f"{name:14s} {op:5s} pipe={pipe} {rows_:2d}x{bh:<5d} w{warps:<2d} P={P:<4d} {us:8.1f} us "
                      f"write {row['write_GBps']:6.1f} GB/s remote {row['remote_GBps']:6.1f} GB/s"
                      f"{'' if same else '  OUTPUT DIFFERS'}", flush=True)

        def check(key, buf):
            if key not in ref_out:  # the first variant timed is the reference of the others
                ref_out[key] = buf[:R].clone()
            flag = torch.tensor([1 if torch.equal(buf[:R], ref_out[key]) else 0], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

        # dispatch pull: x already staged by dispatch(); the schedule is reused, nothing restages tok
        for pipe, tile in [(pp, tt) for pp in pipelines for tt in tiles[pp]]:
            S.TILES["pull_pipe" if pipe else "pull"] = tile
            for P in programs:
                out.fill_(float("nan"))
                pull_rows(heap, sched, out, P, pipeline=bool(pipe))  # also compiles
                us = _time(lambda P=P, pipe=pipe: pull_rows(heap, sched, out, P, pipeline=bool(pipe)),
                           args.iters, args.warmup, dev)
                record("pull", pipe, tile, P, us, check("pull", out))
        S.TILES.clear()
        S.TILES.update(saved)
        if not torch.equal(ref_out["pull"], recv_ref[:R]):
            ok = False
            if rank == 0:
                print(f"{name}: pull differs from dispatch()'s own pull", flush=True)
        if not args.no_scale:
            # combine-backward pull without d(topk_w): stage dy -> tok, gates -> w (as combine_backward does)
            S.stage(heap, act=dy, act_reg=S.REG_TOK.value, small=w.contiguous().view(torch.int32),
                    small_reg=S.REG_W.value, ntok=-1, programs=max(programs))
            for pipe in pipelines:
                for P in programs:
                    out.fill_(float("nan"))
                    pull_rows(heap, sched, out, P, scale_only=True, pipeline=bool(pipe))
                    us = _time(lambda P=P, pipe=pipe: pull_rows(heap, sched, out, P, scale_only=True,
                                                                pipeline=bool(pipe)), args.iters, args.warmup, dev)
                    record("scale", pipe, S.TILES["pull_scale"], P, us, check("scale", out))
        heap.check()
    finally:
        S.TILES.clear()
        S.TILES.update(saved)
        heap.close()
    return res, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--programs", default="32,64,132", help="comma list of CTAs for the pull")
    p.add_argument("--pipeline", default="0,1", help="loop variants to time (0: as before, 1: pipelined)")
    p.add_argument("--tiles", default="16384x16x8,32768x16x8,16384x8x8",
                   help="tiles of the pipelined loop: elements x warps x max rows per step (BLOCK_H <= 8192)")
    p.add_argument("--old-tiles", default="32768x16x8", help="tiles of the loop as before (its default first)")
    p.add_argument("--no-scale", action="store_true", help="skip the scale-only (combine backward) pull")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here (rank 0)")
    p.add_argument("--device", default="cuda", help="cpu: smoke run on gloo ranks (set TRITON_INTERPRET=1)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import triton

    from megamoe.dist import init_from_env

    t0 = time.monotonic()
    dev = init_from_env(args.device)
    programs = [int(v) for v in args.programs.split(",")]
    pipelines = [int(v) for v in args.pipeline.split(",")]
    tiles = {0: _tiles(args.old_tiles), 1: _tiles(args.tiles)}
    if dist.get_rank() == 0:
        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        print(f"pull sweep: {dist.get_world_size()} x {gpu}, {args.tokens} tokens/GPU, "
              f"bf16, top-k uniform; time = median over {args.iters} iterations of the max over ranks", flush=True)
    results, all_ok = [], True
    for name in args.configs.split(","):
        res, ok = run_config(name, args, tiles, programs, pipelines, dev)
        results.append(res)
        all_ok = all_ok and ok
    if dist.get_rank() == 0:
        for res in results:  # summary: best time per (op, pipeline)
            best = {}
            for row in res["rows"]:
                key = (row["op"], row["pipeline"])
                if key not in best or row["us"] < best[key]["us"]:
                    best[key] = row
            for (op, pipe), row in sorted(best.items()):
                print(f"best {res['config']:14s} {op:5s} pipe={pipe}: {row['us']:8.1f} us at "
                      f"{row['rows']}x{row['block_h']} w{row['warps']} P={row['programs']}", flush=True)
        print(f"outputs bitwise equal across variants: {all_ok}; wall {time.monotonic() - t0:.1f} s", flush=True)
        if args.json:
            from megamoe.perf import git_commit

            with open(args.json, "w") as f:
                json.dump({"bench": "pull_sweep", "commit": git_commit(), "gpu": gpu,
                           "world": dist.get_world_size(), "torch": torch.__version__,
                           "triton": triton.__version__,
                           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "results": results, "bitwise_equal": all_ok}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
