"""FP8 weight quantisation (megamoe/kernels/fp8_quant.py, 128x128 blocks) at the expert-weight shapes of every preset
at EP 4: the (CHUNK, num_warps, COLS_T) variants of ``_quant_weight_kernel`` (the first of each mode: the kernel before
f4e9d64) against the default, each checked bitwise equal to it, timed with CUDA events (median of --iters after
warm-up; every weight is larger than L2 except qwen3's w2).

    python benchmarks/quant_bench.py [--json out.json]       (one GPU)

Bytes counted: the bf16 weight read once, and per orientation written its e4m3 copy (1 byte per element) and its
scales; GB/s against the measured HBM copy ceiling (4258 GB/s read + write, shared/MEASURED.md). Why it matters:
a training step (or a CUDA-graph replay) of ``split:fp8=1`` quantises every expert weight in both orientations once.
"""

from __future__ import annotations

import argparse

import torch

from megamoe.apps.perf import event_median_s, write_results
from megamoe.config import preset
from megamoe.kernels import fp8_quant

HBM = 4258e9
#: (CHUNK, num_warps, COLS_T); the first of each mode is the kernel before f4e9d64, the COLS_T ones 2026-12-02's
#: transposed orientation from column slices (full 128-byte rows per store)
VARIANTS = {"both": [(128, 16, False), (64, 16, False), (32, 8, False), (32, 16, False), (32, 8, True),
                     (16, 8, True), (32, 16, True), (64, 16, True)],
            "one": [(128, 8, False), (32, 8, False)], "one-t": [(32, 8, False), (32, 8, True), (16, 8, True)]}


def timed(fn, iters: int) -> float:
    return event_median_s(fn, iters, warmup=3)


def run(mode: str, w: torch.Tensor, iters: int) -> list[dict]:
    """Every variant of ``mode``: "both" (quantize_weight_both), "one" (quantize_weight) or "one-t" (quantize_weight
    with transpose=True, the config of "one"), each checked bitwise against the mode's default and timed."""
    if mode == "both":
        fn, key = fp8_quant.quantize_weight_both, "both"
    else:
        key = "one"
        fn = (lambda x: fp8_quant.quantize_weight(x, transpose=True)) if mode == "one-t" else fp8_quant.quantize_weight
    default = fp8_quant.WEIGHT_QUANT_CONFIG[key]
    ref = fn(w)
    nbytes = w.numel() * (2 + (2 if mode == "both" else 1)) + sum(t.numel() * 4 for t in ref[1::2])
    rows = []
    for variant in VARIANTS[mode]:
        fp8_quant.WEIGHT_QUANT_CONFIG[key] = variant
        try:
            got = fn(w)
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(got, ref, strict=True))
            t = timed(lambda: fn(w), iters)
        finally:
            fp8_quant.WEIGHT_QUANT_CONFIG[key] = default
        chunk, warps, cols_t = variant
        rows.append({"mode": mode, "chunk": chunk, "warps": warps, "cols_t": cols_t, "bitwise_equal": same,
                     "ms": t * 1e3, "gb_s": nbytes / t / 1e9, "of_hbm": nbytes / t / HBM})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = []
    print(f"{'shape':34s} {'mode':5s} {'chunk':>5s} {'warps':>5s} cols {'ms':>8s} {'GB/s':>7s} {'x HBM':>6s} equal")
    for name in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"):
        cfg = preset(name)
        e_l = cfg.num_experts // args.ep
        shapes = (("w13", (e_l, 2 * cfg.intermediate, cfg.hidden)), ("w2", (e_l, cfg.hidden, cfg.intermediate)))
        for wname, shape in shapes:
            w = (torch.randn(shape, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
            for mode in ("both", "one", "one-t"):
                for r in run(mode, w, args.iters):
                    r.update(preset=name, weight=wname, shape=list(shape))
                    out.append(r)
                    print(f"{name + ' ' + wname + ' ' + str(shape):34s} {mode:5s} {r['chunk']:5d} {r['warps']:5d} "
                          f"{'T' if r['cols_t'] else '-':4s} {r['ms']:8.3f} {r['gb_s']:7.0f} {r['of_hbm']:6.2f} "
                          f"{r['bitwise_equal']}")
            del w
            torch.cuda.empty_cache()
    write_results(args.json, dev, "fp8 weight quantisation variants", out)


if __name__ == "__main__":
    main()
