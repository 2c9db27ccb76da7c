"""One forward of fused:kernel=gluon with a watchdog, on one GPU: the whole layer runs on a side stream; if it has not
finished after --wait seconds, the item counters (items claimed, blocks pulled / GEMM1 tiles / GEMM2 tiles done)
and each program's queue are read on another stream and printed, then the process exits (a hung kernel cannot be
stopped). If it finishes: the output against the Triton megakernel's on the same weights and inputs, and forward
times of both. Run it under `timeout`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from megamoe.dist import spawn


def _rank(rank: int, world: int, args) -> int:
    from megamoe.config import preset
    from megamoe.kernels import gluon_fused
    from megamoe.layer import MoE

    dev = torch.device("cuda", rank)
    cfg = preset(args.preset, num_experts=args.experts, max_tokens_per_rank=max(args.tokens, 1))
    opts = {"kernel": "gluon", **({"ring_blocks": args.ring} if args.ring else {})}
    if args.fp8:
        opts["fp8"] = True
    opts.update(json.loads(args.opts))
    t0 = time.time()
    moe = MoE(cfg, backend="fused", device=dev, seed=0, **opts)
    x = torch.randn(args.tokens, cfg.hidden, generator=torch.Generator().manual_seed(1)).to(cfg.dtype).to(dev)
    torch.cuda.synchronize()
    print(f"[{time.time() - t0:6.1f}s] layer built ({args.preset}, {args.experts} experts, {args.tokens} tokens, "
          f"{opts})", flush=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(s1):
        y = moe(x).out
        ev = torch.cuda.Event()
        ev.record()
    print(f"[{time.time() - t0:6.1f}s] launched (compiles included)", flush=True)
    t1 = time.time()
    while not ev.query() and time.time() - t1 < args.wait:
        time.sleep(0.2)
    if not ev.query():
        L = gluon_fused.LAST_LAUNCH
        with torch.cuda.stream(s2):
            ctr = torch.empty(L["ctr"].shape, dtype=torch.int64, pin_memory=True)
            q = torch.empty(L["q"].shape, dtype=torch.int64, pin_memory=True)
            ctr.copy_(L["ctr"], non_blocking=True)
            q.copy_(L["q"], non_blocking=True)
        s2.synchronize()
        nbm = L["nb_max"]
        rdy, g1, g2 = ctr[1:1 + nbm], ctr[1 + nbm:1 + 2 * nbm], ctr[1 + 2 * nbm:]
        print(f"NOT DONE after {args.wait}s: items claimed {int(ctr[0])}; ready>0 on {int((rdy > 0).sum())} blocks, "
              f"g1>0 on {int((g1 > 0).sum())}, g2>0 on {int((g2 > 0).sum())} (nb_max {nbm}); "
              f"ready[:8] {rdy[:8].tolist()} g1[:8] {g1[:8].tolist()} g2[:8] {g2[:8].tolist()}", flush=True)
        print(f"queues (program: last QD items) {q.view(L['programs'], -1)[:6].tolist()}", flush=True)
        sys.stdout.flush()
        os._exit(3)
    print(f"[{time.time() - t0:6.1f}s] done", flush=True)
    ref = MoE(cfg, backend="fused", device=dev, seed=0, **{k: v for k, v in opts.items() if k != "kernel"})
    with torch.no_grad():
        yr = ref(x).out
    torch.cuda.synchronize()
    d = (y.float() - yr.float()).norm().item() / max(yr.float().norm().item(), 1e-30)
    print(f"vs triton megakernel: bitwise {torch.equal(y, yr)}, rel {d:.3g}", flush=True)
    for label, m in (("gluon", moe), ("triton", ref)):
        ts = []
        with torch.no_grad():
            for i in range(args.iters + 3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                m(x)
                b.record()
                torch.cuda.synchronize()
                if i >= 3:
                    ts.append(a.elapsed_time(b))
        ts.sort()
        print(f"forward {label}: {ts[len(ts) // 2]:.3f} ms (eager, median of {len(ts)})", flush=True)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ring", type=int, default=0)
    ap.add_argument("--wait", type=float, default=10.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fp8", action="store_true", help="the FP8 items (against the Triton FP8 megakernel)")
    ap.add_argument("--opts", default="{}", help='more backend options, JSON (e.g. \'{"group_blocks": 16}\')')
    args = ap.parse_args()
    spawn(_rank, 1, args, device="cuda", timeout_s=600)


if __name__ == "__main__":
    main()
