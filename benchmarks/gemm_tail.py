"""Tile-quantisation waste of the grouped GEMMs, and configs that cut it (one GPU, one device call).

With random routing an expert's row count is ~ mean +- sqrt(mean); each expert's last m-block is partly
padding. At EP = 2 on deepseek-v3 (128 local experts, ~256 rows each) 128-row tiles issue 1.24x the MMA work
the rows need. This times GEMM1+SwiGLU, GEMM2, dgrad2+SwiGLU and dgrad1 per preset shape (R = 4096 * k rows per rank,
multinomial group sizes, no alignment) with the default config and 64-row configs; checks each output against
the default's. (Commit 78f4528 also timed a `half_tail` kernel option, an expert's last block of <= 64 rows run
as a 64-row tile: slower, removed; results in benchmarks/results/gemm-tail-h200-2026-11-30-78f4528.json.)

    python benchmarks/gemm_tail.py [--shapes deepseek-v3:2,qwen3-30b-a3b:2] [--json out.json]
"""

from __future__ import annotations

import math

import torch
import triton

import megamoe.experts as X
from megamoe.kernels.gemm_config import GemmConfig, default_config, pin_config
from megamoe.perf import run_shapes

PRESETS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8),
           "mixtral-8x7b": (4096, 14336, 8, 2)}


def C(bm, bn, st, wp, sp=1, fl=False):  # noqa: N802
    return GemmConfig(block_m=bm, block_n=bn, block_k=64, num_stages=st, num_warps=wp, epi_split=sp, flatten=fl)


def configs(op, R, n, k):
    d = default_config(op, R, n, k)
    out = [("default", d)]
    if op == "gemm1_swiglu":
        out += [("64x128 w4", C(64, 128, 4, 4)), ("64x128 w8 sp2", C(64, 128, 4, 8, 2)),
                ("64x256 w8 sp2", C(64, 256, 3, 8, 2))]
    elif op in ("gemm2", "dgrad1"):
        out += [("default nofl", d.with_(flatten=False))] if d.flatten else []
        out += [("64x256 w8 fl", C(64, 256, 4, 8, fl=True)), ("64x128 w4 fl", C(64, 128, 4, 4, fl=True)),
                ("64x256 w4", C(64, 256, 3, 4))]
    elif op == "dgrad_swiglu":
        out += [("default sp4", d.with_(epi_split=4)), ("64x128 w4", C(64, 128, 4, 4)),
                ("64x128 w8 sp2", C(64, 128, 4, 8, 2))]
    return out


def run_shape(name: str, ep: int, tokens: int, rows: list) -> None:
    dev = torch.device("cuda")
    H, I, E, k = PRESETS[name]
    E_l, R = E // ep, tokens * k
    spec = f"{name}:{ep}"
    gen = torch.Generator().manual_seed(0)
    sizes = torch.multinomial(torch.full((E_l,), 1.0 / E_l), R, replacement=True, generator=gen).bincount(
        minlength=E_l)
    offs = torch.tensor([0] + sizes.cumsum(0).tolist(), dtype=torch.int32, device=dev)
    t128 = int(((sizes + 127) // 128).sum())
    t64 = int(((sizes + 63) // 64).sum())
    print(f"== {name} EP={ep}: E_l={E_l} R={R} rows/expert {sizes.float().mean():.0f} +- "
          f"{sizes.float().std():.0f}; 128-row m-tiles {t128} (ideal {R / 128:.0f}), 64-row {t64} "
          f"(ideal {R / 64:.0f})", flush=True)
    x = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
    w13 = (torch.randn(E_l, 2 * I, H, device=dev) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E_l, H, I, device=dev) / math.sqrt(I)).to(torch.bfloat16)
    s = torch.rand(R, device=dev) + 0.5
    act, h = X.gemm1_swiglu(x, w13, offs)
    dy = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
    ops = {
        "gemm1_swiglu": (lambda: X.gemm1_swiglu(x, w13, offs)[0], 2.0 * R * H * 2 * I, (R, I, H)),
        "gemm2": (lambda: X.gemm2(act, w2, offs, scale=s), 2.0 * R * I * H, (R, H, I)),
        "dgrad_swiglu": (lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s)[0], 2.0 * R * H * I, (R, I, H)),
        "dgrad1": (lambda: X.gemm1_dgrad(h, w13, offs), 2.0 * R * 2 * I * H, (R, H, 2 * I)),
    }
    for op, (fn, flops, shp) in ops.items():
        ref = None  # the default config's output; if the default fails, no config gets a diff
        for i, (label, cfg) in enumerate(configs(op, *shp)):
            try:
                with pin_config(op, cfg):
                    out = fn()
                    torch.cuda.synchronize()
                    if i == 0:
                        ref = out.float()
                    diff = float((out.float() - ref).abs().max()) if ref is not None else float("nan")
                    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                row = {"shape": spec, "op": op, "config": label, "ms": ms, "tflops": flops / ms / 1e9,
                       "max_abs_diff_vs_default": diff, "cfg": cfg.__dict__, "m_tiles_128": t128, "m_tiles_64": t64}
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                row = {"shape": spec, "op": op, "config": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(f"{spec:18} {op:14} {label:20} " + (f"{row['ms']:7.3f} ms {row['tflops']:6.0f} TFLOP/s "
                  f"diff {row['max_abs_diff_vs_default']:.2e}" if "ms" in row else row["error"]), flush=True)


def main() -> None:
    run_shapes(run_shape, "deepseek-v3:2,qwen3-30b-a3b:2,deepseek-v3:4,mixtral-8x7b:2")


if __name__ == "__main__":
    main()
