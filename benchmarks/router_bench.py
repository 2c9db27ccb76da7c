"""Time the router (megamoe.router.route) forward and forward+backward on one GPU, with the logit GEMM on the tensor
cores (bf16 operands, float32 output: the default on CUDA) against the float32 GEMM of upcast operands (what the
router ran before 2026-11-30), for every preset at 4096 tokens.

    python benchmarks/router_bench.py [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

import megamoe.router as R
from megamoe.config import PRESETS, preset
from megamoe.perf import run_metadata


def _upcast_logits(x, weight, cdt):
    return F.linear(x.to(cdt), weight.to(cdt))


def _fwd_bwd(x, w, cfg, bias, g) -> None:
    torch.autograd.grad((R.route(x, w, cfg, bias).topk_w * g).sum(), (x, w))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    fast = R._logits
    for name in sorted(PRESETS):
        cfg = preset(name)
        if cfg.hidden < 256:
            continue
        x = torch.randn(args.tokens, cfg.hidden, device=dev).bfloat16().requires_grad_()
        w = (torch.randn(cfg.num_experts, cfg.hidden, device=dev) * cfg.hidden ** -0.5).bfloat16().requires_grad_()
        bias = torch.zeros(cfg.num_experts, device=dev) if cfg.router == "sigmoid" else None
        g = torch.randn(args.tokens, cfg.top_k, device=dev)
        row = {"preset": name, "tokens": args.tokens, "hidden": cfg.hidden, "experts": cfg.num_experts}
        for label, fn in (("tensor_core", fast), ("upcast_fp32", _upcast_logits)):
            R._logits = fn
            try:
                row[f"{label}_fwd_ms"] = triton.testing.do_bench(lambda c=(x, w, cfg, bias): R.route(*c), warmup=20,
                                                                 rep=100, return_mode="median")
                row[f"{label}_fwd_bwd_ms"] = triton.testing.do_bench(lambda c=(x, w, cfg, bias, g): _fwd_bwd(*c),
                                                                     warmup=20, rep=100, return_mode="median")
            finally:
                R._logits = fast
        rows.append(row)
        print(f"{name:16s} fwd {row['upcast_fp32_fwd_ms']:.3f} -> {row['tensor_core_fwd_ms']:.3f} ms, fwd+bwd "
              f"{row['upcast_fp32_fwd_bwd_ms']:.3f} -> {row['tensor_core_fwd_bwd_ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_metadata(dev, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
