"""Time the Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8.py) next to our Triton FP8 and bf16 grouped GEMMs (one
GPU, one device call), at every preset's shapes, R = 4096 * k rows, multinomial group sizes:
    gemm2         plain   [R, I] x [E_l, H, I]^T          (configs GLUON: block_m, stages)
    gemm1-plain   plain   [R, H] x [E_l, 2I, H]^T         (the same)
    gemm1-swiglu  SwiGLU  [R, H] x w13 [E_l, 2I, H]^T -> act [R, I] and h [R, 2I]   (the ops' default configs)
    dgrad2-swiglu SwiGLU backward: dy [R, H] x w2 [E_l, H, I] -> dh [R, 2I], with the gate scale (the same)
Prints ms, TFLOP/s and the speed-up over our bf16 kernel; checks the Gluon output against the Triton FP8 one (both
forced with GemmConfig.kernel).

    python benchmarks/gluon_fp8_bench.py [--shapes deepseek-v3:2,qwen3-30b-a3b:2] [--json out.json]
"""

from __future__ import annotations

import math

import torch
import triton

import megamoe.experts as X
from megamoe.kernels.gluon_fp8 import grouped_gemm_fp8_gluon
from megamoe.perf import print_kernel_rows, run_shapes

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
    tri = X.default_config("grouped_gemm_fp8", R, N, K, kernel="triton")
    ref = X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, config=tri)
    t_fp8 = bench(lambda: X.grouped_gemm_fp8(aq, a_s, wq, w_s, offs, config=tri))
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
    _print(spec, op, t_bf16, new)
    rows.extend(new)


def _print(spec: str, op: str, t_bf16: float, new: list) -> None:
    print_kernel_rows(spec, op, new, t_bf16, base="bf16", diff_key="rel_diff_vs_triton_fp8",
                      diff_label="diff vs triton fp8")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_swiglu(spec: str, H: int, I: int, offs: torch.Tensor, R: int, rows: list) -> None:
    """GEMM1 + SwiGLU (keeps h) and the SwiGLU backward of GEMM2 (with the gate scale): bf16, Triton FP8, Gluon FP8,
    each op's default config of its kernel."""
    E_l = offs.numel() - 1
    x = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(E_l, 2 * I, H, device="cuda") / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E_l, H, I, device="cuda") / math.sqrt(I)).to(torch.bfloat16)
    s = torch.rand(R, device="cuda") + 0.5
    xq, xs = X.quantize_act(x)
    dyq, dys = X.quantize_act(dy)
    w13q, w13s = X.quantize_weight(w13)
    w2tq, w2ts = X.quantize_weight(w2.transpose(1, 2))
    _, h = X.gemm1_swiglu(x, w13, offs)
    cfg = {k: {op: X.default_config(op, R, I, H, kernel=k) for op in ("gemm1_swiglu_fp8", "dgrad_swiglu_fp8")}
           for k in ("triton", "gluon")}
    ops = {  # op: (flops, bf16 call, fp8 call with a kernel)
        "gemm1-swiglu": (2.0 * R * H * 2 * I, lambda: X.gemm1_swiglu(x, w13, offs),
                         lambda k: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=cfg[k]["gemm1_swiglu_fp8"])),
        "dgrad2-swiglu": (2.0 * R * H * I, lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s),
                          lambda k: X.gemm2_dgrad_swiglu_fp8(dyq, dys, w2tq, w2ts, h, offs, scale=s,
                                                             config=cfg[k]["dgrad_swiglu_fp8"])),
    }
    for op, (flops, bf16_call, fp8_call) in ops.items():
        cfg_op = "gemm1_swiglu_fp8" if op == "gemm1-swiglu" else "dgrad_swiglu_fp8"
        base = {"shape": spec, "op": op, "R": R, "H": H, "I": I, "E_l": E_l}
        t_bf16 = bench(bf16_call)
        new = [dict(base, kernel="triton-bf16", ms=t_bf16, tflops=flops / t_bf16 / 1e9)]
        ref = fp8_call("triton")
        for k in ("triton", "gluon"):
            label = f"{k}-fp8 default"
            try:
                out = fp8_call(k)
                torch.cuda.synchronize()
                t = bench(lambda k=k, call=fp8_call: call(k))
                row = dict(base, kernel=label, ms=t, tflops=flops / t / 1e9, config=cfg[k][cfg_op].__dict__)
                if k == "gluon":
                    row["rel_diff_vs_triton_fp8"] = max(_rel(o, r) for o, r in zip(out, ref, strict=True)
                                                        if o is not None)
                new.append(row)
            except Exception as exc:  # noqa: BLE001 - reported, the other kernel still runs
                new.append(dict(base, kernel=label, error=f"{type(exc).__name__}: {exc}"[:300]))
        _print(spec, op, t_bf16, new)
        rows.extend(new)
        torch.cuda.empty_cache()


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
    run_swiglu(f"{name}:{ep}", H, I, offs, R, rows)


def main() -> None:
    run_shapes(run_shape, "deepseek-v3:2,deepseek-v3:4,qwen3-30b-a3b:2,mixtral-8x7b:2")


if __name__ == "__main__":
    main()
