"""Per-kernel time of one MoE layer backend, forward and backward (torch.profiler, CUDA activity).

    torchrun --nproc_per_node 4 benchmarks/profile_layer.py --preset qwen3-30b-a3b --tokens 4096 \
        --backend split --out $OUT

Prints, for rank 0, the device time of every kernel summed over the profiled iterations (divided by their
number) next to the iteration's wall time, so the gap (launch latency, host work, waits) is visible; writes a
Chrome trace per rank to --out. Inputs and weights as in `megamoe bench`.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megamoe.backends import parse_backend
from megamoe.config import preset
from megamoe.dist import init_from_env
from megamoe.layer import MoE
from megamoe.perf import kernel_table, safe_name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--backend", default="split", help="backend spec with options, e.g. split:presum_combine=1")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="out/profile")
    args = p.parse_args()
    dev = init_from_env()
    rank = dist.get_rank()
    cfg = preset(args.preset, max_tokens_per_rank=args.tokens)
    name, options = parse_backend(args.backend)  # e.g. split:presum_combine=1
    moe = MoE(cfg, backend=name, device=dev, **options)
    x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype).requires_grad_()
    dy = torch.randn_like(x)
    def clear_grads() -> None:  # as a training step does: without it each backward adds into the old grads, an
        # elementwise read-modify-write of every weight gradient that shows up as the layer's time (0.44 ms per
        # qwen3 fwd+bwd at EP 2 until 2026-11-30)
        x.grad = None
        for prm in moe.parameters():
            prm.grad = None

    for _ in range(3):
        clear_grads()
        moe(x).out.backward(dy)
    torch.cuda.synchronize()
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    marks = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            clear_grads()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            out = moe(x)
            ev[1].record()
            out.out.backward(dy)
            ev[2].record()
            torch.cuda.synchronize()
            marks.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"trace-{safe_name(args.backend)}-rank{rank}.json"))
    if rank == 0:
        fwd = sum(m[0] for m in marks) / len(marks)
        bwd = sum(m[1] for m in marks) / len(marks)
        print(f"{args.backend} {args.preset} {args.tokens} tok/rank: forward {fwd:.3f} ms, backward {bwd:.3f} ms "
              f"(wall, mean of {args.iters})")
        print(kernel_table(prof, args.iters))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
