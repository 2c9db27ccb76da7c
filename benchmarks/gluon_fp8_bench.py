"""Time the EXPERIMENTAL Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8.py) next to our Triton FP8 and bf16
grouped GEMMs (one GPU, one device call). Plain GEMMs (no SwiGLU epilogue) at every preset's GEMM2 shape
[R, I] x [E_l, H, I]^T and GEMM1 shape [R, H] x [E_l, 2I, H]^T, R = 4096 * k rows, multinomial group sizes.
Prints ms, TFLOP/s and the speed-up over our bf16 kernel; checks the Gluon output against the Triton FP8 one.

    python benchmarks/gluon_fp8_bench.py [--shapes deepseek-v3:2,qwen3-30b-a3b:2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

import megamoe.experts as X
from megamoe.kernels.gluon_fp8 import grouped_gemm_fp8_gluon
from megamoe.perf import run_metadata

PRESETS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8),
           "mixtral-8x7b": (4096, 14336, 8, 2)}
GLUON = [(128, 4), (128, 3), (64, 4)]  # (block_m, stages)


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def run_op(spec: str, op: str, N: int, K: int, offs: torch.Tensor, used: int, rows: list) -> None:
    R, E_l = used, offs.numel() - 1  # every row belongs to a group (no padding rows here)
    a = torch.randn(R, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(E_l, N, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
    aq, a_s = X.quantize_act(a)
    wq, w_s = X.quantize_weight(w)
    flops = 2.0 * R * N * K
    t_bf16 = bench(lambda: X.grouped_gemm(a, w, offs))
    ref = X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs)
    t_fp8 = bench(lambda: X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs))
    base = {"shape": spec, "op": op, "R": R, "N": N, "K": K, "E_l": E_l}
    new = [dict(base, kernel="triton-bf16", ms=t_bf16, tflops=flops / t_bf16 / 1e9),
           dict(base, kernel="triton-fp8", ms=t_fp8, tflops=flops / t_fp8 / 1e9)]
    for bm, st in GLUON:
        label = f"gluon-fp8 bm{bm} s{st}"
        try:
            out = grouped_gemm_fp8_gluon(aq, a_s, wq, w_s, offs, block_m=bm, stages=st)
            torch.cuda.synchronize()
            diff = float((out.float() - ref.float()).norm() / ref.float().norm())
            t = bench(lambda bm=bm, st=st: grouped_gemm_fp8_gluon(aq, a_s, wq, w_s, offs, block_m=bm, stages=st))
            new.append(dict(base, kernel=label, ms=t, tflops=flops / t / 1e9, rel_diff_vs_triton_fp8=diff))
        except Exception as exc:  # noqa: BLE001 - reported, the other configs still run
            new.append(dict(base, kernel=label, error=f"{type(exc).__name__}: {exc}"[:300]))
    for r in new:
        if "ms" in r:
            txt = f"{r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s {t_bf16 / r['ms']:5.2f}x bf16"
            if "rel_diff_vs_triton_fp8" in r:
                txt += f"  diff vs triton fp8 {r['rel_diff_vs_triton_fp8']:.1e}"
        else:
            txt = r["error"]
        print(f"{spec:18} {op:12} {r['kernel']:22} {txt}", flush=True)
    rows.extend(new)


def run_shape(name: str, ep: int, tokens: int, rows: list) -> None:
    H, I, E, k = PRESETS[name]
    E_l, R = E // ep, tokens * k
    gen = torch.Generator().manual_seed(0)
    sizes = torch.multinomial(torch.full((E_l,), 1.0 / E_l), R, replacement=True, generator=gen).bincount(
        minlength=E_l)
    offs = torch.tensor([0] + sizes.cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    for op, (N, K) in (("gemm2", (H, I)), ("gemm1-plain", (2 * I, H))):
        run_op(f"{name}:{ep}", op, N, K, offs, R, rows)
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v3:2,deepseek-v3:4,qwen3-30b-a3b:2,mixtral-8x7b:2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict] = []
    for spec in args.shapes.split(","):
        name, ep = spec.split(":")
        run_shape(name, int(ep), args.tokens, rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": run_metadata(torch.device("cuda"), 1), "tokens": args.tokens, "rows": rows}, f,
                          indent=1)


if __name__ == "__main__":
    main()
