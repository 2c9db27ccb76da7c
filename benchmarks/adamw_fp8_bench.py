"""The expert-weight update of an FP8 training step, two ways, at every preset's expert weights at EP 4 (one GPU):

    separate  MasterAdamW.step (the flat kernel), then quantize_weight_both (what a ``split:fp8=1`` layer runs at its
              first call after the update, or in every replay of a CUDA graph)
    fused     MasterAdamW.step with maintain_fp8: one kernel per 128x128 block updates it and writes both e4m3
              orientations (megamoe/optim.py, _adamw_fp8_kernel)

each with float32 and bf16 Adam moments, checked bitwise equal (parameter, master, moments, q, s, q^T, s^T) and timed
with CUDA events (median of --iters steps after warm-up; every weight is larger than L2 except qwen3's w2).

    python benchmarks/adamw_fp8_bench.py [--json out.json] [--presets qwen3-30b-a3b,deepseek-v3]

Bytes counted per element (HBM floor at the measured 4258 GB/s copy ceiling, shared/MEASURED.md): the update reads the
bf16 grad, fp32 master and two moments and writes master, moments and the bf16 parameter: 28 B (fp32 moments) or 20 B
(bf16); the separate quantisation reads the parameter again and writes two fp8 copies: +4 B; the fused kernel writes
the two copies only: +2 B (scales: 8 B per 128x128 block, counted).
"""

from __future__ import annotations

import argparse
import gc

import torch

from megamoe import optim
from megamoe.config import preset
from megamoe.kernels.fp8_quant import Fp8Weight, quantize_weight_both
from megamoe.optim import MasterAdamW, _adamw_fp8_kernel, _adamw_kernel
from megamoe.perf import event_median_s, write_results
from megamoe.testing import fp8_bits

HBM = 4258e9
#: (CHUNK, CHUNK_Q, num_warps) of the fused kernel; sm_90a registers (fp32 / bf16 moments, compiled on CPU):
#: (32, 32, 8) 176 / 242, (8, 32, 8) 65 / 71, (8, 16, 8) 55 / 64, (4, 16, 8) 55 / 57, (16, 32, 16) 49 / 95,
#: (8, 8, 8) 40 / 64, (4, 8, 4) 46 / 48
VARIANTS = [(32, 32, 8), (8, 32, 8), (8, 16, 8), (4, 16, 8), (16, 32, 16), (8, 8, 8), (4, 8, 4)]


def timed(fn, iters: int) -> float:
    return event_median_s(fn, iters, warmup=2)


def run(shape, moments: torch.dtype, iters: int, variants) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w0 = (torch.randn(shape, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    grad = (torch.randn(shape, device=dev, generator=gen) * 1e-3).to(torch.bfloat16)
    mult = torch.tensor(0.5, device=dev)
    n = w0.numel()
    nblk = shape[0] * -(-shape[1] // 128) * -(-shape[2] // 128)
    upd = 28 if moments == torch.float32 else 20
    rows, results = [], {}
    for mode, cfg in [("separate", None)] + [("fused", v) for v in variants]:
        rows.append(run_mode(mode, cfg, w0, grad, mult, moments, iters, results))
        gc.collect()
        torch.cuda.empty_cache()
        r = rows[-1]
        nbytes = n * (upd + (4 if mode == "separate" else 2)) + nblk * 8
        r.update(bytes=nbytes, gb_s=nbytes / (r["ms"] * 1e-3) / 1e9, floor_ms=nbytes / HBM * 1e3)
        r["of_hbm"] = r["floor_ms"] / r["ms"]
    return rows


def run_mode(mode, cfg, w0, grad, mult, moments, iters, results) -> dict:
    """One optimizer over a copy of w0: a step compared bitwise (each fused variant against the separate run's
    clones kept in ``results``), then the timing."""
    p = torch.nn.Parameter(w0.clone())
    opt = MasterAdamW([[p]], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, moments_dtype=moments)
    copy = Fp8Weight.empty_like(p)
    if mode == "fused":
        opt.fp8_update, opt.fp8_config = "fused", cfg
        opt.maintain_fp8(p, copy)

    def step():
        p.grad = grad
        opt.step([mult])
        if mode == "separate":
            quantize_weight_both(p.detach(), out=copy)

    step()  # one step each from the same state
    s = opt.sets[0][0]
    state = (p.detach(), s.master, s.exp_avg, s.exp_avg_sq, *copy.tensors())
    if mode == "separate":
        results["separate"] = [t.clone() for t in state]
        same = True
    else:
        same = all(torch.equal(fp8_bits(a), fp8_bits(b)) for a, b in zip(results["separate"], state, strict=True))
    del state
    t = timed(step, iters)
    return {"mode": mode, "config": cfg, "moments": str(moments).removeprefix("torch."), "ms": t * 1e3,
            "bitwise_equal": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--variants", default=None, help="fused-kernel configs 'c,cq,w;...' (default: VARIANTS)")
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = ([tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")] if args.variants
                else VARIANTS)
    out = []
    print(f"default fused configs {optim.FP8_UPDATE_CONFIG}")
    print(f"{'weight':36s} {'moments':8s} {'mode':8s} {'config':12s} {'ms':>8s} {'floor':>7s} {'x HBM':>6s} equal")
    for name in args.presets.split(","):
        cfg = preset(name)
        e_l = cfg.num_experts // args.ep
        shapes = (("w13", (e_l, 2 * cfg.intermediate, cfg.hidden)), ("w2", (e_l, cfg.hidden, cfg.intermediate)))
        for wname, shape in shapes:
            for moments in (torch.float32, torch.bfloat16):
                for r in run(shape, moments, args.iters, variants):
                    r.update(preset=name, weight=wname, shape=list(shape), ep=args.ep)
                    out.append(r)
                    print(f"{name[:8] + ' ' + wname + ' ' + str(shape):36s} {r['moments']:8s} {r['mode']:8s} "
                          f"{str(r['config'] or '-'):12s} {r['ms']:8.3f} {r['floor_ms']:7.3f} {r['of_hbm']:6.2f} "
                          f"{r['bitwise_equal']}")
    regs = compiled_usage()
    print("compiled (registers / spills per thread, shared memory):", regs)
    write_results(args.json, torch.device("cuda"), "adamw_fp8", out + [{"compiled": regs}])


def compiled_usage() -> dict:
    """n_regs / n_spills / shared bytes of every compiled variant of the two update kernels (Triton's own cache)."""
    usage = {}
    for name, fn in (("flat", _adamw_kernel), ("fp8", _adamw_fp8_kernel)):
        for caches in fn.device_caches.values():
            for i, k in enumerate(caches[0].values()):
                usage[f"{name}[{i}]"] = {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                                         "shared": getattr(k.metadata, "shared", None), "warps": k.metadata.num_warps}
    return usage


if __name__ == "__main__":
    main()
