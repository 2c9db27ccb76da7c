"""Can W ranks share one GPU for correctness runs (MEGAMOE_SHARE_GPUS=1, see megamoe.dist)? Probes, in order:
the symmetric heap's CUDA backend on a gloo group with two processes on one device (peer reads), the device-side
barrier across the two contexts (time-sliced spin waits), then one layer case per backend against float64.

    MEGAMOE_SHARE_GPUS=1 python benchmarks/shared_gpu_probe.py [--world 2] [--backends split,fused,fused:kernel=gluon]

Prints one line per rank and step; exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from megamoe.backends import parse_backend
from megamoe.dist import rank_device, spawn


def _rank(rank: int, world: int, specs: list[str]) -> list[str]:
    import torch.distributed as dist

    from megamoe.comm import signals as S
    from megamoe.comm.heap import CommShape, SymmetricHeap
    from megamoe.testing import TOLERANCE, gpu_cases, layer_case

    dev = rank_device()
    lines = [f"rank {rank}: device {dev}, group {dist.get_backend()}"]
    heap = SymmetricHeap(CommShape(world, 64, 256, 2, 4 * world), device=dev, timeout_s=30)
    heap.buffer("tok").fill_(rank + 1)
    torch.cuda.synchronize()
    dist.barrier()
    seen = [float(heap.peer_buffer("tok", p).float().mean()) for p in range(world)]
    lines.append(f"rank {rank}: heap {heap.backend}, peers' tok {seen} (expect {list(range(1, world + 1))})")
    t = time.perf_counter()
    for _ in range(20):
        S.barrier(heap)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    lines.append(f"rank {rank}: 20 device barriers {ms:.1f} ms, error {heap._read_error()}")
    ok = seen == [float(p + 1) for p in range(world)] and heap._read_error() is None
    heap.close()
    case = gpu_cases(world)[0]
    for spec in specs:
        name, kw = parse_backend(spec)
        t = time.perf_counter()
        try:
            r = layer_case(case, name, dev, **kw)
        except Exception as exc:  # noqa: BLE001 - reported, then the next backend
            lines.append(f"rank {rank}: {spec}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            ok = False
            continue
        errs = {k: r[k] for k in ("out", "dx", "drouter", "dw13", "dw2")}
        good = all(v < TOLERANCE["bf16"] for v in errs.values()) and r["counts_ok"]
        ok &= good
        lines.append(f"rank {rank}: {spec} {case.name}: {'ok' if good else 'BAD'} "
                     + " ".join(f"{k} {v:.2e}" for k, v in errs.items())
                     + f" ({time.perf_counter() - t:.0f} s)")
    lines.append(f"rank {rank}: {'ALL OK' if ok else 'FAILED'}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backends", default="split,fused,fused:kernel=gluon")
    args = p.parse_args()
    os.environ["MEGAMOE_SHARE_GPUS"] = "1"
    res = spawn(_rank, args.world, args.backends.split(","), device="cuda", timeout_s=540)
    for lines in res:
        print("\n".join(lines))
    sys.exit(0 if all(lines[-1].endswith("ALL OK") for lines in res) else 1)


if __name__ == "__main__":
    main()
