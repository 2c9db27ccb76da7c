"""Time the warp-specialised Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8_ws.py) next to the single-stream
Gluon FP8 kernel (gluon_fp8.py, its default config), our bf16 grouped GEMM and torch._scaled_grouped_mm (row-wise
scales: a cheaper recipe, for reference), on the plain ops of every preset: GEMM2 [R, I] x [E_l, H, I]^T and GEMM1
without SwiGLU [R, H] x [E_l, 2I, H]^T; R = tokens * k rows, multinomial group sizes (multiples of 16 rows, so that
torch's kernel accepts them); and GEMM1 + SwiGLU (bf16, single-stream Gluon, warp-specialised). Checks every
warp-specialised output against the single-stream kernel's.

    python benchmarks/gluon_fp8_ws_bench.py [--shapes deepseek-v3:4,mixtral-8x7b:4] [--json out.json]
"""

from __future__ import annotations

import math

import torch
import triton

import megamoe.experts as X
from megamoe.bench_gemm import PRESETS
from megamoe.kernels.gluon_fp8 import grouped_gemm_fp8_gluon
from megamoe.kernels.gluon_fp8_ws import grouped_gemm_fp8_ws
from megamoe.perf import expert_offsets, report_kernel_rows, run_shapes

WS = [(128, 4, 232), (256, 4, 240), (256, 3, 240), (256, 4, 232)]  # (block_n, stages, consumer registers)


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def run_op(spec: str, op: str, N: int, K: int, offs: torch.Tensor, R: int, rows: list) -> None:
    E_l = offs.numel() - 1
    a = torch.randn(R, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(E_l, N, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
    aq, a_s = X.quantize_act(a)
    wq, w_s = X.quantize_weight(w)
    flops = 2.0 * R * N * K
    base = {"shape": spec, "op": op, "R": R, "N": N, "K": K, "E_l": E_l}
    t_bf16 = bench(lambda: X.grouped_gemm(a, w, offs))
    ref = grouped_gemm_fp8_gluon(aq, a_s, wq, w_s, offs)
    t_single = bench(lambda: grouped_gemm_fp8_gluon(aq, a_s, wq, w_s, offs))
    new = [dict(base, kernel="bf16", ms=t_bf16), dict(base, kernel="gluon-fp8", ms=t_single)]
    try:  # torch's row-wise FP8 grouped GEMM (offsets of group ends, w as [E, K, N] column-major)
        a8 = a.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn).transpose(1, 2)
        sa = torch.ones(R, device="cuda")
        sw = torch.ones(E_l, N, device="cuda")
        ends = offs[1:].contiguous()
        t = bench(lambda: torch._scaled_grouped_mm(a8, w8, sa, sw, offs=ends, out_dtype=torch.bfloat16))
        new.append(dict(base, kernel="torch-rowwise-fp8", ms=t))
    except Exception as exc:  # noqa: BLE001 - reported
        new.append(dict(base, kernel="torch-rowwise-fp8", error=f"{type(exc).__name__}: {exc}"[:200]))
    for bn, st, regs in WS:
        label = f"ws bn{bn} s{st} r{regs}"
        try:
            out = grouped_gemm_fp8_ws(aq, a_s, wq, w_s, offs, block_n=bn, stages=st, consumer_regs=regs)
            torch.cuda.synchronize()
            diff = float((out.float() - ref.float()).norm() / ref.float().norm())
            t = bench(lambda bn=bn, st=st, regs=regs: grouped_gemm_fp8_ws(aq, a_s, wq, w_s, offs, block_n=bn,
                                                                          stages=st, consumer_regs=regs))
            new.append(dict(base, kernel=label, ms=t, rel_diff_vs_gluon=diff))
        except Exception as exc:  # noqa: BLE001 - reported, the other configs still run
            new.append(dict(base, kernel=label, error=f"{type(exc).__name__}: {exc}"[:300]))
    _report(spec, op, flops, t_bf16, new, rows)


def run_swiglu(spec: str, H: int, I: int, offs: torch.Tensor, R: int, rows: list) -> None:
    """GEMM1 + SwiGLU (keeps h): bf16, the single-stream Gluon FP8 kernel, the warp-specialised one (4 and 6
    stages); act and h checked against the single-stream kernel's."""
    E_l = offs.numel() - 1
    x = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(E_l, 2 * I, H, device="cuda") / math.sqrt(H)).to(torch.bfloat16)
    xq, xs = X.quantize_act(x)
    w13q, w13s = X.quantize_weight(w13)
    flops = 2.0 * R * H * 2 * I
    base = {"shape": spec, "op": "gemm1-swiglu", "R": R, "H": H, "I": I, "E_l": E_l}
    t_bf16 = bench(lambda: X.gemm1_swiglu(x, w13, offs))
    one = X.default_config("gemm1_swiglu_fp8", R, I, H, kernel="gluon")
    ref = X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=one)
    new = [dict(base, kernel="bf16", ms=t_bf16),
           dict(base, kernel="gluon-fp8", ms=bench(lambda: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=one)))]
    for bn, st in ((64, 4), (64, 6), (128, 4), (128, 3)):
        cfg = X.default_config("gemm1_swiglu_fp8", R, I, H, kernel="gluon_ws").with_(block_n=bn, num_stages=st)
        label = f"ws bn{bn} s{st}"
        try:
            out = X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=cfg)
            torch.cuda.synchronize()
            diff = max(float((o.float() - r.float()).norm() / r.float().norm()) for o, r in zip(out, ref, strict=True))
            t = bench(lambda cfg=cfg: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=cfg))
            new.append(dict(base, kernel=label, ms=t, rel_diff_vs_gluon=diff))
        except Exception as exc:  # noqa: BLE001 - reported
            new.append(dict(base, kernel=label, error=f"{type(exc).__name__}: {exc}"[:300]))
    _report(spec, "gemm1-swiglu", flops, t_bf16, new, rows)


def _report(spec: str, op: str, flops: float, t_bf16: float, new: list, rows: list) -> None:
    report_kernel_rows(spec, op, flops, t_bf16, new, rows, base="bf16", diff_key="rel_diff_vs_gluon")


def run_shape(name: str, ep: int, tokens: int, rows: list) -> None:
    H, I, E, k = PRESETS[name]
    E_l, R = E // ep, tokens * k
    offs = expert_offsets(R, E_l)
    for op, (N, K) in (("gemm2", (H, I)), ("gemm1-plain", (2 * I, H))):
        if N % 128 == 0:  # the single-stream kernel's limit (gpt-oss: 2880 columns)
            run_op(f"{name}:{ep}", op, N, K, offs, R, rows)
        torch.cuda.empty_cache()
    if I % 64 == 0:
        run_swiglu(f"{name}:{ep}", H, I, offs, R, rows)


def main() -> None:
    run_shapes(run_shape, "mixtral-8x7b:4,deepseek-v3:4,qwen3-30b-a3b:4,gpt-oss-120b:4")


if __name__ == "__main__":
    main()
