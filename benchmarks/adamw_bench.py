"""Time megamoe.optim.MasterAdamW's step on the expert parameters of `megamoe train`'s GPU model (4 layers of
qwen3-30b-a3b experts at EP = 2: 1.2 G bf16 parameters) for several kernel block sizes and warp counts, with float32
and with bf16 moments (28 and 20 bytes per parameter), next to the recipe it replaced (upcast copy, torch fused
AdamW on float32 masters, downcast copy). One GPU.

    python benchmarks/adamw_bench.py [--layers 4] [--ep 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from megamoe.apps.perf import run_metadata
from megamoe.config import preset
from megamoe.optim import MasterAdamW


def _time(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(iters):
        fn()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = preset("qwen3-30b-a3b")
    E_l, H, I = cfg.num_experts // args.ep, cfg.hidden, cfg.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _ in range(args.layers):
        for shape in ((E_l, 2 * I, H), (E_l, H, I)):
            w = (torch.randn(shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
            w.grad = (torch.randn(shape, device="cuda", generator=gen) * 1e-3).to(torch.bfloat16)
            params.append(w)
    n = sum(w.numel() for w in params)
    mult = torch.tensor(0.5, device="cuda")
    rows = []
    floor_ms = n * 28 / 4.3e12 * 1e3
    print(f"{n / 1e9:.2f} G bf16 parameters; 28 B each at 4.3 TB/s: {floor_ms:.2f} ms (bf16 moments, 20 B: "
          f"{floor_ms * 20 / 28:.2f} ms)")
    for moments, nbytes in ((torch.float32, 28), (torch.bfloat16, 20)):
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)):
            opt = MasterAdamW([params], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, moments_dtype=moments)
            opt.block, opt.num_warps = block, warps
            ms = _time(lambda opt=opt: opt.step([mult]))
            rows.append({"impl": f"MasterAdamW {str(moments)[6:]} moments block {block} warps {warps}", "ms": ms,
                         "TB/s": n * nbytes / ms / 1e9})
            del opt
            torch.cuda.empty_cache()
    # the replaced recipe: fp32 grads of the masters, fused AdamW with grad_scale, masters copied down
    masters = [w.detach().float().requires_grad_() for w in params]
    for m in masters:
        m.grad = torch.empty_like(m)
    topt = torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def old():
        torch._foreach_copy_([m.grad for m in masters], [w.grad for w in params])
        topt.grad_scale = 1.0 / mult
        topt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)

    ms = _time(old)
    rows.append({"impl": "upcast + torch fused AdamW(grad_scale) + downcast", "ms": ms, "TB/s": n * 46 / ms / 1e9})
    for r in rows:
        print(f"{r['impl']:<56} {r['ms']:8.3f} ms  {r['TB/s']:6.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            report = {"meta": run_metadata(torch.device("cuda"), 1), "params": n, "floor_ms": floor_ms, "rows": rows}
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
