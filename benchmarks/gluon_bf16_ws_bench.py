"""Time the warp-specialised Gluon bf16 grouped GEMM (megamoe/kernels/gluon_bf16_ws.py; cooperative and ping-pong
schedules, several tiles and ring depths) next to our Triton bf16 kernel (its default config) and torch._grouped_mm on
the forward ops of every preset: GEMM1 + SwiGLU (ours also writes act; torch writes h only) and GEMM2 [R, I] x [E_l, H,
I]^T (with the gate scale; torch without); GEMM1's dgrad [R, 2I] x [E_l, 2I, H] (kn weights) and the SwiGLU backward
(dgrad2 with the gate scale and acts, as the layer runs it; torch: the plain product). R = tokens * k rows, multinomial
group sizes in multiples of 16 rows (torch's alignment). Every warp-specialised output is checked against the Triton
kernel's.

    python benchmarks/gluon_bf16_ws_bench.py [--shapes deepseek-v3:4,mixtral-8x7b:4] [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import math

import torch
import triton

import megamoe.experts as X
from megamoe.bench_gemm import PRESETS
from megamoe.kernels.gemm_config import GemmConfig
from megamoe.perf import expert_offsets, report_kernel_rows, run_shapes

#: (label, ping-pong, block_n, stages)
SWIGLU = [("coop bn128 s4", False, 128, 4), ("coop bn128 s3", False, 128, 3), ("coop bn64 s6", False, 64, 6),
          ("pp bn64 s5", True, 64, 5), ("pp bn64 s4", True, 64, 4)]
KN = [("coop bn256 s4", False, 256, 4), ("coop bn256 s3", False, 256, 3), ("pp bn128 s5", True, 128, 5),
      ("pp bn128 s4", True, 128, 4)]
DSWIGLU = [("coop bn128 s4", False, 128, 4), ("coop bn128 s3", False, 128, 3), ("coop bn64 s4", False, 64, 4)]
PLAIN = [("coop bn256 s4", False, 256, 4), ("coop bn256 s3", False, 256, 3), ("coop bn128 s6", False, 128, 6),
         ("pp bn128 s5", True, 128, 5), ("pp bn128 s4", True, 128, 4)]


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _cfg(pp: bool, bn: int, st: int) -> GemmConfig:
    return GemmConfig(block_m=128, block_n=bn, block_k=64, num_stages=st, num_warps=4, kernel="gluon_ws", pingpong=pp)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _variants(spec, op, flops, base, t_tri, variants, run, ref, rows) -> None:
    new = [dict(base, kernel="triton", ms=t_tri)]
    try:
        new.append(dict(base, kernel="torch", ms=bench(run["torch"])))
    except Exception as exc:  # noqa: BLE001 - reported
        new.append(dict(base, kernel="torch", error=f"{type(exc).__name__}: {exc}"[:200]))
    for label, pp, bn, st in variants:
        cfg = _cfg(pp, bn, st)
        try:
            got = run["ours"](cfg)()
            torch.cuda.synchronize()
            diff = max(_rel(g, r) for g, r in zip(got, ref, strict=True))
            new.append(dict(base, kernel=label, ms=bench(run["ours"](cfg)), rel_diff_vs_triton=diff))
        except Exception as exc:  # noqa: BLE001 - reported, the other configs still run
            new.append(dict(base, kernel=label, error=f"{type(exc).__name__}: {exc}"[:300]))
    report_kernel_rows(spec, op, flops, t_tri, new, rows, base="triton", diff_key="rel_diff_vs_triton")


def run_shape(name: str, ep: int, tokens: int, rows: list) -> None:
    H, I, E, k = PRESETS[name]
    E_l, R = E // ep, tokens * k
    offs = expert_offsets(R, E_l)
    ends = offs[1:].contiguous()
    spec = f"{name}:{ep}:{tokens}"
    x = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(E_l, 2 * I, H, device="cuda") / math.sqrt(H)).to(torch.bfloat16)
    tri1 = X.default_config("gemm1_swiglu", R, I, H).with_(kernel="triton")  # (the default is the ws kernel)
    act, h = X.gemm1_swiglu(x, w13, offs, config=tri1)
    t_tri = bench(lambda: X.gemm1_swiglu(x, w13, offs, out=act, h_out=h, config=tri1))
    base = {"shape": spec, "op": "gemm1-swiglu", "R": R, "H": H, "I": I, "E_l": E_l}
    act2, h2 = torch.empty_like(act), torch.empty_like(h)
    run = {"torch": lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16),
           "ours": lambda cfg: (lambda: X.gemm1_swiglu(x, w13, offs, out=act2, h_out=h2, config=cfg))}
    _variants(spec, "gemm1-swiglu", 2.0 * R * H * 2 * I, base, t_tri, SWIGLU, run, (act, h), rows)
    w2 = (torch.randn(E_l, H, I, device="cuda") / math.sqrt(I)).to(torch.bfloat16)
    s = torch.rand(R, device="cuda") + 0.5
    tri2 = X.default_config("gemm2", R, H, I).with_(kernel="triton")
    out = X.gemm2(act, w2, offs, scale=s, config=tri2)
    t_tri = bench(lambda: X.gemm2(act, w2, offs, scale=s, out=out, config=tri2))
    base = {"shape": spec, "op": "gemm2", "R": R, "H": H, "I": I, "E_l": E_l}
    out2 = torch.empty_like(out)
    run = {"torch": lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16),
           "ours": lambda cfg: (lambda: (X.gemm2(act, w2, offs, scale=s, out=out2, config=cfg),))}
    _variants(spec, "gemm2", 2.0 * R * I * H, base, t_tri, PLAIN, run, (out,), rows)
    # GEMM1's dgrad (kn weights, opt-in on the ws kernel): dx [R, H] = dh [R, 2I] @ w13[e] viewed [2I, H]
    dh = torch.randn(R, 2 * I, device="cuda").to(torch.bfloat16)
    w13k = w13  # the layers' w13 [E_l, 2I, H] is the kn operand [E_l, K, N] of the dgrad
    tri3 = X.default_config("dgrad1", R, H, 2 * I)
    dx = X.gemm1_dgrad(dh, w13k, offs, config=tri3)
    t_tri = bench(lambda: X.gemm1_dgrad(dh, w13k, offs, out=dx, config=tri3))
    base = {"shape": spec, "op": "dgrad1", "R": R, "H": H, "I": I, "E_l": E_l}
    dx2 = torch.empty_like(dx)
    run = {"torch": lambda: torch._grouped_mm(dh, w13k, offs=ends, out_dtype=torch.bfloat16),
           "ours": lambda cfg: (lambda: (X.gemm1_dgrad(dh, w13k, offs, out=dx2, config=cfg),))}
    _variants(spec, "dgrad1", 2.0 * R * I * H * 2, base, t_tri, KN, run, (dx,), rows)
    # the SwiGLU backward as the layer runs it (gate scale, acts for dW2): dh [R, 2I] from dy [R, H] @ w2[e] [H, I]
    dy = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    tri4 = X.default_config("dgrad_swiglu", R, I, H)
    acts = torch.empty(R, I, device="cuda", dtype=torch.bfloat16)
    dh4, ds4 = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, acts_out=acts, config=tri4)
    t_tri = bench(lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, out=dh4, acts_out=acts, config=tri4))
    base = {"shape": spec, "op": "dgrad2", "R": R, "H": H, "I": I, "E_l": E_l}
    dh5, acts5 = torch.empty_like(dh4), torch.empty_like(acts)
    run = {"torch": lambda: torch._grouped_mm(dy, w2, offs=ends, out_dtype=torch.bfloat16),
           "ours": lambda cfg: (lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, out=dh5, acts_out=acts5,
                                                             config=cfg) + (acts5,))}
    _variants(spec, "dgrad2", 2.0 * R * I * H, base, t_tri, DSWIGLU, run, (dh4, ds4, acts), rows)


def main() -> None:
    run_shapes(run_shape, "qwen3-30b-a3b:4,deepseek-v3:4,mixtral-8x7b:4,gpt-oss-120b:4")


if __name__ == "__main__":
    main()
