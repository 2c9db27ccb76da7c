"""dgrad2+SwiGLU with and without the gated-activation output (``acts_out``), one GPU, the split backend's shapes.

    python benchmarks/dgrad_acts_bench.py [--json out.json]

Times gemm2_dgrad_swiglu(dy, w2, h, offs, scale=gate) at the receive-buffer shapes of qwen3-30b-a3b and
deepseek-v3 at EP 2 (uniform routing, 4096 tokens per rank): the bf16 backward's epilogue variants (epi_split 2, the
op's default, and 4) against the same call without ``acts_out``; do_bench median, with registers / spills.
"""

from __future__ import annotations

import argparse

import torch
import triton

from megamoe import experts as X
from megamoe.kernels.gemm_config import LAST_COMPILED, default_config
from megamoe.perf import write_results

SHAPES = {"qwen3-30b-a3b": (2048, 768, 64), "deepseek-v3": (7168, 2048, 128)}  # H, I, local experts at EP 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (H, I, E_l) in SHAPES.items():
        R = 2 * args.tokens * 8  # rows received at EP 2, top-8, uniform (the buffer holds this)
        g = torch.Generator(device=dev).manual_seed(0)
        dy = torch.randn(R, H, device=dev, generator=g).to(torch.bfloat16)
        w2 = (torch.randn(E_l, H, I, device=dev, generator=g) * I ** -0.5).to(torch.bfloat16)
        h = torch.randn(R, 2 * I, device=dev, generator=g).to(torch.bfloat16)
        gate = torch.rand(R, device=dev, generator=g)
        offs = torch.arange(0, E_l + 1, device=dev, dtype=torch.int32) * (R // E_l)
        acts = torch.empty(R, I, device=dev, dtype=torch.bfloat16)
        base = default_config("dgrad_swiglu", R, I, H)
        ref = None
        for label, cfg, a in (("no acts (epi 2)", base, None), ("acts epi 2", base, acts),
                              ("acts epi 4", base.with_(epi_split=4), acts)):
            def fn(cfg=cfg, a=a, dy=dy, w2=w2, h=h, offs=offs, gate=gate):
                return X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=gate, config=cfg, acts_out=a)

            dh, ds = fn()
            if ref is None:
                ref = (dh.clone(), ds.clone())
            same = bool(torch.equal(dh, ref[0]) and torch.equal(ds, ref[1]))
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            k = LAST_COMPILED.get("_grouped_gemm_kernel")
            flops = 2 * R * H * I
            rows.append({"preset": name, "variant": label, "ms": ms, "tflops": flops / ms / 1e9, "same_dh_ds": same,
                         "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None)})
            print(f"{name:14s} {label:16s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  dh/ds equal {same}  "
                  f"regs {rows[-1]['regs']} spills {rows[-1]['spills']}", flush=True)
    write_results(args.json, dev, __doc__, rows)


if __name__ == "__main__":
    main()
