"""Per-kernel device times of a CUDA-graph replay of one layer step (captured as `megamoe bench --cuda-graph` does:
megamoe.apps.bench.capture_step), one GPU: where a graphed forward's time goes, beside the replay's wall time (CUDA
events).

    python benchmarks/graph_profile.py --preset qwen3-30b-a3b --tokens 4096 --backends split,fused
        [--mode forward|forward+backward] [--iters 20] [--experts N] [--eager]

--eager profiles eager steps instead: host time per step beside the GPU's busy time, and the host's most expensive
operations (an eager step whose host time exceeds its kernels' time is launch-bound).
"""

from __future__ import annotations

import argparse
import os
import time

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
    p.add_argument("--eager", action="store_true", help="profile eager steps' host time instead of graph replays")
    args = p.parse_args()
    dev = init_from_env() if under_torchrun() else torch.device("cuda")  # world 1 needs no group
    cfg = preset(args.preset, max_tokens_per_rank=args.tokens)
    if args.experts is not None:
        cfg = cfg.replace(num_experts=args.experts)
    gen = torch.Generator(dev).manual_seed(0)
    x0 = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    for spec in args.backends.split(","):
        name, opts = parse_backend(spec)
        if args.eager:
            eager_profile(MoE(cfg, backend=name, device=dev, seed=0, **opts), x0, spec, args)
            continue
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


def eager_profile(moe, x0: torch.Tensor, spec: str, args) -> None:
    dy = torch.ones_like(x0)

    def step():  # as a training step: gradients set, not accumulated; no copy or fill of its own among the kernels
        moe.zero_grad(set_to_none=True)
        out = moe(x0.detach().requires_grad_())
        if args.mode == "forward+backward":
            out.out.backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    host = (time.perf_counter() - t0) / args.iters  # the host's time to issue a step (the GPU runs behind)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    events = pr.key_averages()
    # kernels only: the profiler credits a kernel's time to the operator that launched it as well
    gpu = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / \
        args.iters
    print(f"== {spec} eager {args.mode}: host {host * 1e3:.3f} ms per step, kernels {gpu:.3f} ms", flush=True)
    rows = sorted(((e.key[:44], e.self_cpu_time_total / 1e3 / args.iters, e.count // args.iters) for e in events),
                  key=lambda r: -r[1])
    for k, t, n in rows[:14]:
        print(f"   {t:7.3f} ms host  x{n:<3d} {k}")


if __name__ == "__main__":
    main()
