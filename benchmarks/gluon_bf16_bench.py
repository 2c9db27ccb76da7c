"""Time the Gluon bf16 grouped GEMM (megamoe/kernels/gluon_bf16.py) against our Triton bf16 kernel with its default
configs, on the four expert-MLP GEMMs (one GPU, one device call each), R = 4096 * k rows per GPU (--tokens),
multinomial group sizes over E_l = E / EP experts:
    gemm1-swiglu   x [R, H] x w13 [E_l, 2I, H]^T -> act [R, I] and h [R, 2I]        flops 2*R*H*2I
    gemm2          act [R, I] x w2 [E_l, H, I]^T, gate scale -> [R, H]             flops 2*R*I*H
    dgrad2-swiglu  dy [R, H] x w2 [E_l, H, I] (kn) -> dh [R, 2I] and ds [R]        flops 2*R*H*I
    dgrad1         dh [R, 2I] x w13 [E_l, 2I, H] (kn) -> dx [R, H]                 flops 2*R*2I*H
Each op: the Triton kernel (kernel=None, default_config) and a few Gluon configs (GLUON below, forced with
GemmConfig(kernel="gluon")); prints ms, TFLOP/s, the speed-up over Triton and the relative difference of the Gluon
outputs from Triton's; --json writes every row (config included) with the run's commit, GPU, versions and date.

    python benchmarks/gluon_bf16_bench.py [--shapes qwen3-30b-a3b:2,deepseek-v3:4] [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
import triton

import megamoe.experts as X
from megamoe.kernels.gemm_config import GemmConfig
from megamoe.perf import print_kernel_rows, run_shapes

PRESETS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8),
           "mixtral-8x7b": (4096, 14336, 8, 2), "gpt-oss-120b": (2880, 2880, 128, 4)}  # (H, I, E, k)


def _g(bm, bn, bk, st, wp=8):
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=st, num_warps=wp, kernel="gluon")


GLUON = {  # op: Gluon configs timed (block_m, block_n, block_k, stages)
    "gemm1-swiglu": [_g(128, 128, 64, 4), _g(128, 128, 64, 3), _g(128, 64, 64, 4)],
    "gemm2": [_g(128, 256, 64, 3), _g(128, 256, 64, 4), _g(128, 128, 64, 4)],
    "dgrad2-swiglu": [_g(128, 128, 64, 4), _g(128, 128, 64, 3), _g(128, 64, 64, 4)],
    "dgrad1": [_g(128, 256, 64, 3), _g(128, 256, 64, 4), _g(128, 128, 64, 4)],
}


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _label(c: GemmConfig) -> str:
    return f"gluon {c.block_m}x{c.block_n}x{c.block_k} s{c.num_stages}"


def run_shape(name: str, ep: int, tokens: int, rows: list) -> None:
    H, I, E, k = PRESETS[name]
    E_l, R = E // ep, tokens * k
    gen = torch.Generator().manual_seed(0)
    sizes = torch.multinomial(torch.full((E_l,), 1.0 / E_l), R, replacement=True, generator=gen).bincount(
        minlength=E_l)
    offs = torch.tensor([0] + sizes.cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    bf = torch.bfloat16
    x = torch.randn(R, H, device="cuda").to(bf)
    dy = torch.randn(R, H, device="cuda").to(bf)
    w13 = (torch.randn(E_l, 2 * I, H, device="cuda") / math.sqrt(H)).to(bf)
    w2 = (torch.randn(E_l, H, I, device="cuda") / math.sqrt(I)).to(bf)
    s = torch.rand(R, device="cuda") + 0.5
    act, h = X.gemm1_swiglu(x, w13, offs)
    dh = torch.randn(R, 2 * I, device="cuda").to(bf)
    # the Triton kernel's defaults pinned for the forward ops (their default is the warp-specialised kernel since
    # 2026-12-01); the backward ops default to Triton
    t1 = X.default_config("gemm1_swiglu", R, I, H).with_(kernel="triton")
    t2 = X.default_config("gemm2", R, H, I).with_(kernel="triton")
    ops = {  # op: (flops, call with a config (None: Triton default) returning its outputs)
        "gemm1-swiglu": (2.0 * R * H * 2 * I, lambda c: X.gemm1_swiglu(x, w13, offs, config=c or t1)),
        "gemm2": (2.0 * R * I * H, lambda c: (X.gemm2(act, w2, offs, scale=s, config=c or t2),)),
        "dgrad2-swiglu": (2.0 * R * H * I, lambda c: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, config=c)),
        "dgrad1": (2.0 * R * 2 * I * H, lambda c: (X.gemm1_dgrad(dh, w13, offs, config=c),)),
    }
    spec = f"{name}:{ep}"
    for op, (flops, call) in ops.items():
        base = {"shape": spec, "op": op, "R": R, "H": H, "I": I, "E_l": E_l, "tokens": tokens,
                "group_min": int(sizes.min()), "group_max": int(sizes.max())}
        ref = call(None)
        t_tri = bench(lambda call=call: call(None))
        new = [dict(base, kernel="triton default", ms=t_tri, tflops=flops / t_tri / 1e9, config=None)]
        for cfg in GLUON[op]:
            row = dict(base, kernel=_label(cfg), config=asdict(cfg))
            try:
                out = call(cfg)
                torch.cuda.synchronize()
                row["rel_diff_vs_triton"] = max(_rel(o, r) for o, r in zip(out, ref, strict=True) if o is not None)
                t = bench(lambda call=call, cfg=cfg: call(cfg))
                row.update(ms=t, tflops=flops / t / 1e9, speedup=t_tri / t)
            except Exception as exc:  # noqa: BLE001 - reported, the other configs still run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            new.append(row)
        print_kernel_rows(spec, op, new, t_tri, diff_key="rel_diff_vs_triton", op_w=14, kernel_w=26)
        rows.extend(new)
        del ref
        torch.cuda.empty_cache()


def main() -> None:
    run_shapes(run_shape, "qwen3-30b-a3b:2,qwen3-30b-a3b:4,deepseek-v3:2,deepseek-v3:4")


if __name__ == "__main__":
    main()
