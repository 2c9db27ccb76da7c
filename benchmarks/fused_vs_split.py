"""Fused against split on GPUs, forward and every gradient, for each fused variant (one quick device check).

    torchrun --nproc_per_node N benchmarks/fused_vs_split.py [--preset qwen3-30b-a3b] [--tokens 1024]

Same seed, weights and inputs for every layer; prints, per fused variant, whether the output and the gradients
(x, router, w13, w2) are bitwise equal to split's and their largest relative difference. On CPU ranks the two
backends agree bit for bit (tests/test_fused_backend.py); on GPUs the forward did at every measured commit.
"""

from __future__ import annotations

import argparse
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamoe.config import preset  # noqa: E402
from megamoe.dist import init_from_env  # noqa: E402
from megamoe.layer import MoE  # noqa: E402

VARIANTS = [("fused", {}), ("fused:fused_backward=1", {"fused_backward": True}),
            ("fused:combine=pull", {"combine": "pull"}),
            ("fused:combine=pull:fused_backward=1", {"combine": "pull", "fused_backward": True}),
            ("fused:ring_blocks=16", {"ring_blocks": 16})]


def run(cfg, backend, dev, x, dy, **opts):
    moe = MoE(cfg, backend=backend, device=dev, seed=1, **opts)
    xi = x.clone().requires_grad_()
    out = moe(xi).out
    out.backward(dy)
    return [out.detach(), xi.grad, moe.router.weight.grad, moe.w13.grad, moe.w2.grad]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    dev = init_from_env()
    rank = dist.get_rank()
    cfg = preset(args.preset, max_tokens_per_rank=args.tokens)
    gen = torch.Generator(device=dev).manual_seed(rank + 3)
    x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    dy = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    ref = run(cfg, "split", dev, x, dy)
    names = ["out", "dx", "drouter", "dw13", "dw2"]
    for label, opts in VARIANTS:
        got = run(cfg, "fused", dev, x, dy, **opts)
        equal = torch.tensor([int(torch.equal(a, b)) for a, b in zip(got, ref, strict=True)], device=dev)
        diff = torch.tensor([((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                             for a, b in zip(got, ref, strict=True)], device=dev)
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if rank == 0:
            cells = "  ".join(f"{n} {'=' if e else f'{d:.1e}'}" for n, e, d in zip(names, equal.tolist(),
                                                                                 diff.tolist(), strict=True))
            print(f"{label:38s} {cells}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
