"""Compile report, correctness against `split` and forward time of megakernel config variants (one device call).

    torchrun --nproc_per_node N benchmarks/fused_probe.py [--presets qwen3-30b-a3b,deepseek-v3] [--tokens 4096]

For each preset: the split layer's forward output is the reference (same seed, same weights); each variant of
the fused backend's FusedConfig (and ring size) runs the forward, prints its relative difference to split,
its median forward time (CUDA events, 10 iterations, max over ranks) and the kernel's registers / spills /
shared memory. A variant that fails to compile prints the error and the run goes on.
"""

from __future__ import annotations

import argparse
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamoe.comm.signals import barrier  # noqa: E402
from megamoe.config import preset  # noqa: E402
from megamoe.dist import init_from_env  # noqa: E402
from megamoe.kernels.gemm_config import LAST_COMPILED  # noqa: E402
from megamoe.layer import MoE  # noqa: E402

VARIANTS = [
    ("default", {}, None),
    ("pull", {"combine": "pull"}, None),
    ("group16", {"group": 16}, None),
    ("group1", {"group": 1}, None),
    ("group2", {"group": 2}, None),
    ("g8la16", {"group": 8, "lookahead": 16}, None),
    ("epi2", {"epi_split2": 2}, None),
    ("split4", {"pull_split": 4}, None),
    ("stages4", {"num_stages": 4}, None),  # split's GEMM1 runs 4 stages; the megakernel's default is 3
    ("s4g16", {"num_stages": 4, "group": 16}, None),
    ("bk128s2", {"block_k": 128, "num_stages": 2}, None),
    ("nopull", {"ablate": 1}, None),  # ablations: timing only, results wrong
    ("nopush", {"ablate": 2}, None),  # skips GEMM2's store (local rows, or the push)
    ("nog2", {"ablate": 6}, None),
    ("nocomm", {"ablate": 3}, None),
    ("ring16", {}, 16),
    ("ring64", {}, 64),
]


def profile(fn, iters=3) -> list[tuple[str, float]]:
    """Device time per iteration of every kernel of ``fn`` (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:48], e.device_time_total / 1e3 / iters) for e in p.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:8]


def timed(fn, iters=10):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    t = torch.tensor(sorted(ts)[len(ts) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variants", default="")
    p.add_argument("--profile", action="store_true", help="per-kernel device times of split and fused (default)")
    args = p.parse_args()
    dev = init_from_env()
    rank = dist.get_rank()
    names = set(args.variants.split(",")) if args.variants else None
    for name in args.presets.split(","):
        cfg = preset(name, max_tokens_per_rank=args.tokens)
        split = MoE(cfg, backend="split", device=dev, seed=1)
        gen = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
        with torch.no_grad():
            ref = split(x).out.float()
            t_split = timed(lambda m=split, x=x: m(x))
        if rank == 0:
            print(f"== {name} {args.tokens} tok/rank, W={dist.get_world_size()}: split forward {t_split:.3f} ms")
        fused = MoE(cfg, backend="fused", device=dev, seed=1, timeout_s=20)  # push combine: its heap serves both
        base = fused.backend.config
        if args.profile:
            with torch.no_grad():
                fused(x)
                for label, m in (("split", split), ("fused", fused)):
                    rows = profile(lambda m=m, x=x: m(x))
                    if rank == 0:
                        print(f"-- {label} kernels (ms/iter): " + ", ".join(f"{k} {v:.3f}" for k, v in rows))
        for vname, kw, ring in VARIANTS:
            if names and vname not in names:
                continue
            fused.backend.config = base.with_(**kw)
            fused.backend.ring_blocks = ring
            try:
                with torch.no_grad():
                    y = fused(x).out.float()
                    torch.cuda.synchronize()
                    err = ((y - ref).norm() / ref.norm()).item()
                    t = timed(lambda m=fused, x=x: m(x))
                k = LAST_COMPILED.get("_fused_fwd_kernel")
                rep = (f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                       f"smem {k.metadata.shared if k is not None else '?'}")
                kt = ""
                if args.profile:
                    with torch.no_grad():
                        kt = dict(profile(lambda m=fused, x=x: m(x))).get("_fused_fwd_kernel", float("nan"))
                    kt = f" kernel {kt:.3f} ms"
                line = f"{vname:10s} fwd {t:8.3f} ms{kt}  vs split {err:.2e}  {rep}"
            except Exception as exc:  # noqa: BLE001 - report and go on to the next variant
                line = f"{vname:10s} FAILED: {type(exc).__name__}: {str(exc)[:300]}"
                barrier(fused.backend.heap)  # the failed call never published DONE: close it on every rank
            if rank == 0:
                print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
