"""A/B of the idle consumer on one GPU (or more, under torchrun): consumer 1 of the cooperative warp-specialised
kernels frees the ring stages of tiles where it holds no row (an expert's last m-tile of <= 64 rows) instead of
running its empty half (``gluon_bf16_ws.IDLE_HALF``: split's GEMMs; ``gluon_fused.IDLE_HALF``: the fused Gluon
items). For each preset and layer (split; fused with the Gluon items), settings 0, 1, 0, 1 in turn: the device time
per iteration of the forward (with autograd on: GEMM1 also stores h) and of forward + backward, summed over the
kernels (torch.profiler, 10 iterations) and for the GEMM kernels alone, and whether the output and the gradients
(input, w13, w2) are bitwise equal to the first setting's. Both flags change together: the fused layer's backward
runs split's GEMMs (gluon_bf16_ws), so only its forward column isolates gluon_fused.IDLE_HALF.

    torchrun --nproc_per_node 1 benchmarks/idle_ab.py [--presets qwen3-30b-a3b,mixtral-8x7b] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402
from torch.profiler import profile as prof  # noqa: E402

from megamoe.config import preset  # noqa: E402
from megamoe.dist import init_from_env  # noqa: E402
from megamoe.kernels import gluon_bf16_ws, gluon_fused  # noqa: E402
from megamoe.layer import MoE  # noqa: E402

GEMMS = ("_gluon_bf16_ws_kernel", "_gluon_fused_fwd_kernel", "_grouped_gemm_kernel", "_gluon_wgrad")


def kernel_ms(fn, iters: int = 10) -> tuple[float, float, list[float]]:
    """(all kernels, GEMM kernels) device ms per iteration of fn, and the GEMM launches' mean us in launch order."""
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / iters) for e in p.key_averages() if e.device_time_total > 0]
    try:
        gemm = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in p.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith(GEMMS))
    except Exception as exc:  # noqa: BLE001 - a profiler without these fields: totals only
        print(f"(no per-launch times: {type(exc).__name__}: {exc})")
        gemm = []
    per = len(gemm) // iters
    launches = [sum(gemm[i * per + j][1] for i in range(iters)) / iters for j in range(per)] if per else []
    return sum(t for _, t in rows), sum(t for k, t in rows if k.startswith(GEMMS)), launches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", default="split,fused-gluon")
    args = p.parse_args()
    dev = init_from_env()
    rank = dist.get_rank()
    defaults = gluon_bf16_ws.IDLE_HALF, gluon_fused.IDLE_HALF
    for name in args.presets.split(","):
        cfg = preset(name, max_tokens_per_rank=args.tokens)
        gen = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
        dy = torch.randn(x.shape, device=dev, dtype=cfg.dtype, generator=gen)
        for lname, opts in (("split", {"backend": "split"}), ("fused-gluon", {"backend": "fused", "kernel": "gluon"})):
            if lname not in args.layers.split(","):
                continue
            m = MoE(cfg, device=dev, seed=1, **opts)
            xg = x.detach().requires_grad_()

            def fwd(m=m, xg=xg):
                return m(xg).out

            def step(m=m, x=x, dy=dy):
                xs = x.detach().requires_grad_()
                m.zero_grad(set_to_none=True)
                y = m(xs).out
                y.backward(dy)
                return y.detach(), [xs.grad, m.w13.grad, m.w2.grad]

            ref = None
            for idle in (0, 1, 0, 1):
                gluon_bf16_ws.IDLE_HALF = idle
                gluon_fused.IDLE_HALF = idle
                y, grads = step()
                torch.cuda.synchronize()
                if ref is None:
                    ref, same = (y.clone(), [g.clone() for g in grads]), "reference"
                else:
                    eq = torch.equal(y, ref[0]) and all(torch.equal(a, b) for a, b in zip(grads, ref[1], strict=True))
                    same = "bitwise equal" if eq else "DIFFER"
                f_all, f_gemm, _ = kernel_ms(fwd)
                b_all, b_gemm, launches = kernel_ms(step)
                if rank == 0:
                    print(f"{name:14s} {lname:11s} idle {idle}: fwd {f_all:7.3f} ms (GEMMs {f_gemm:7.3f})  fwd+bwd "
                          f"{b_all:7.3f} ms (GEMMs {b_gemm:7.3f})  out+grads {same}\n    GEMM launches of fwd+bwd "
                          f"(us, in order): " + ", ".join(f"{t:.0f}" for t in launches), flush=True)
            del m
            torch.cuda.empty_cache()
    gluon_bf16_ws.IDLE_HALF, gluon_fused.IDLE_HALF = defaults
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
