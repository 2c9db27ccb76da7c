"""A/B of the warp-specialised FP8 GEMM's epilogue and ring depth (megamoe/kernels/gluon_fp8_ws.py), one GPU.

    python benchmarks/fp8_ws_epilogue_ab.py [--shapes deepseek-v3:4,mixtral-8x7b:4,qwen3-30b-a3b:4]
                                            [--tokens 4096,16384] [--rounds 3] [--json out.json]

GEMM1 + SwiGLU (keeps h; 128 + 128-column tiles) and GEMM2 (256-column tiles, gate scale) at each preset's EP shapes
(R = tokens * k rows, multinomial groups of 16-row units): TMA-store epilogue (the default) against every store masked
through the same staging buffers (epi_tma=False), 3 and 4 stages. The variants run interleaved, ``--rounds`` times
(median of do_bench medians), so drift of the GPU's clock hits them alike; outputs must be bitwise equal across
variants.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

import megamoe.experts as X
from megamoe.bench_gemm import PRESETS
from megamoe.kernels.gemm_config import GemmConfig
from megamoe.kernels.gluon_fp8_ws import launch_gluon_fp8_ws
from megamoe.kernels.grouped_gemm import EPI_NONE, EPI_SWIGLU
from megamoe.perf import expert_offsets, write_results

VARIANTS = [("tma s4", True, 4), ("tma s3", True, 3), ("masked s4", False, 4), ("masked s3", False, 3)]


def run_shape(spec: str, tokens: int, rounds: int, rows: list) -> None:
    name, ep = spec.split(":")
    H, I, E, k = PRESETS[name]
    E_l = E // int(ep)
    R = tokens * k
    offs = expert_offsets(R, E_l)
    used = int(offs[-1])
    xq, xs = X.quantize_act(torch.randn(R, H, device="cuda").to(torch.bfloat16))
    aq, a_s = X.quantize_act(torch.randn(R, I, device="cuda").to(torch.bfloat16))
    w13q, w13s = X.quantize_weight((torch.randn(E_l, 2 * I, H, device="cuda") * H ** -0.5).to(torch.bfloat16))
    w2q, w2s = X.quantize_weight((torch.randn(E_l, H, I, device="cuda") * I ** -0.5).to(torch.bfloat16))
    gate = torch.rand(R, device="cuda") + 0.5

    def gemm1(cfg, tma):
        a1 = torch.empty(R, I, device="cuda", dtype=torch.bfloat16)
        h = torch.empty(R, 2 * I, device="cuda", dtype=torch.bfloat16)
        return (lambda: launch_gluon_fp8_ws(xq, xs, w13q, w13s, offs, a1, cfg, n=I, epilogue=EPI_SWIGLU, h=h,
                                            store_h=True, n_up=I, epi_tma=tma)), (a1, h), 2.0 * R * H * 2 * I

    def gemm2(cfg, tma):
        y = torch.empty(R, H, device="cuda", dtype=torch.bfloat16)
        return (lambda: launch_gluon_fp8_ws(aq, a_s, w2q, w2s, offs, y, cfg, n=H, epilogue=EPI_NONE, scale=gate,
                                            epi_tma=tma)), (y,), 2.0 * R * I * H

    ops = {}
    for label, tma, st in VARIANTS:
        cfg = GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=st, num_warps=4, kernel="gluon_ws")
        if I % 128 == 0:
            ops[("gemm1-swiglu", label)] = gemm1(cfg, tma)
        ops[("gemm2", label)] = gemm2(cfg.with_(block_n=256), tma)
    for fn, _, _ in ops.values():
        fn()
    torch.cuda.synchronize()
    for op in ("gemm1-swiglu", "gemm2"):  # every variant's outputs bitwise equal to the first's
        outs = [v[1] for key, v in ops.items() if key[0] == op]
        for o in outs[1:]:
            for a, b in zip(outs[0], o, strict=True):
                assert torch.equal(a[:used], b[:used]), f"{spec} {tokens} {op}: variants differ"
    times = {key: [] for key in ops}
    for _ in range(rounds):
        for key, (fn, _, _) in ops.items():
            times[key].append(float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")))
    for (op, label), ts in times.items():
        ms = statistics.median(ts)
        flops = ops[(op, label)][2]
        rows.append({"shape": spec, "tokens": tokens, "op": op, "variant": label, "ms": ms, "ms_rounds": ts,
                     "tflops": flops / ms / 1e9, "R": R, "H": H, "I": I, "E_l": E_l})
        print(f"{spec:16s} {tokens:6d} {op:13s} {label:10s} {ms:8.3f} ms {flops / ms / 1e9:7.0f} TFLOP/s  "
              f"(rounds {' '.join(f'{t:.3f}' for t in ts)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v3:4,mixtral-8x7b:4,qwen3-30b-a3b:4")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            run_shape(spec, tokens, args.rounds, rows)
            torch.cuda.empty_cache()
            write_results(args.json, torch.device("cuda"), __doc__, rows)


if __name__ == "__main__":
    main()
