"""Per-kernel device times of a CUDA-graph replay of one layer step (captured as `megamoe bench --cuda-graph` does:
megamoe.apps.bench.capture_step), one GPU: where a graphed forward's time goes, beside the replay's wall time (CUDA
events).

    python benchmarks/graph_profile.py --preset qwen3-30b-a3b --tokens 4096 --backends split,fused
        [--mode forward|forward+backward] [--iters 20] [--experts N]
"""

from __future__ import annotations

import argparse
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from megamoe.apps.bench import capture_step  # noqa: E402
from megamoe.backends import parse_backend  # noqa: E402
from megamoe.config import preset  # noqa: E402
from megamoe.dist import init_from_env, under_torchrun  # noqa: E402
from megamoe.layer import MoE  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=None, help="replace the preset's expert count (bench --experts)")
    p.add_argument("--backends", default="split,fused")
    p.add_argument("--mode", default="forward", choices=["forward", "forward+backward"])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    dev = init_from_env() if under_torchrun() else torch.device("cuda")  # world 1 needs no group
    cfg = preset(args.preset, max_tokens_per_rank=args.tokens)
    if args.experts is not None:
        cfg = cfg.replace(num_experts=args.experts)
    gen = torch.Generator(dev).manual_seed(0)
    x0 = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    for spec in args.backends.split(","):
        name, opts = parse_backend(spec)
        graph, moe, _, _ = capture_step(lambda name=name, opts=opts: MoE(cfg, backend=name, device=dev, seed=0, **opts),
                                        x0, torch.randn_like(x0), dev, args.mode)
        ts = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        with profile(activities=[ProfilerActivity.CUDA]) as pr:
            for _ in range(args.iters):
                graph.replay()
            torch.cuda.synchronize()
        rows = sorted(((e.key[:44], e.device_time_total / 1e3 / args.iters, e.count // args.iters)
                       for e in pr.key_averages() if e.device_time_total > 0), key=lambda r: -r[1])
        tot = sum(r[1] for r in rows)
        print(f"== {spec} {args.mode}: replay {ts[len(ts) // 2]:.3f} ms (min {ts[0]:.3f}); kernels sum {tot:.3f} ms",
              flush=True)
        for k, t, n in rows[:14]:
            print(f"   {t:7.3f} ms  x{n:<3d} {k}")
        del graph, moe


if __name__ == "__main__":
    main()
