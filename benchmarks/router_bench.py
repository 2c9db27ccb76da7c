"""Device time of the router (megamoe.router.route) per implementation, forward and forward + backward.

    python benchmarks/router_bench.py [--tokens 4096] [--json out.json]     (one GPU)

Eager timings of route() measure the host's launches, not the GPU, so this sums the device time of every kernel
(torch.profiler) per iteration and counts the kernels: in a CUDA graph (how training runs the layer) each
kernel adds ~1-2 us of gap on top of its device time. The logit GEMM is included (the same in both impls).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.apps.perf import write_results
from megamoe.config import preset
from megamoe.router import route


def device_time(fn, iters: int = 20) -> tuple[float, float, dict]:
    """(us of kernel time per iteration, kernels per iteration, {kernel: us per iteration})."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_time_total > 0]
    per = {e.key[:40]: round(e.device_time_total / iters, 2) for e in evs}
    return (sum(e.device_time_total for e in evs) / iters, sum(e.count for e in evs) / iters, per)


def measure(cfg, x, w, bias, dg, impl: str) -> tuple:
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    one = torch.ones((), device=x.device)

    def fwd():
        with torch.no_grad():
            route(x, w, cfg, bias, impl=impl)

    def fwd_bwd():
        r = route(xr, wr, cfg, bias, impl=impl)
        torch.autograd.backward([r.topk_w, r.aux_loss], [dg, one])
        xr.grad = wr.grad = None

    return (*device_time(fwd), *device_time(fwd_bwd))


SWEEP = [(bt, ch, w) for bt in (2, 4, 8, 16, 32) for ch in (1, 4) for w in (4, 8) if bt * ch <= 64]


def sweep(cfg, x, w, bias, dev) -> list[dict]:
    """Every forward-kernel config of SWEEP: checked against the torch path (same experts and counts, gates and
    loss within float rounding), then timed (the forward kernel alone, profiler)."""
    from megamoe.kernels import router_topk

    with torch.no_grad():
        ref = route(x, w, cfg, bias, impl="torch")
    rows = []
    for bt, ch, wp in SWEEP:
        router_topk.PIN = (bt, ch, wp)
        try:
            with torch.no_grad():
                r = route(x, w, cfg, bias, impl="triton")
            ok = (torch.equal(r.topk_idx, ref.topk_idx) and torch.equal(r.tokens_per_expert, ref.tokens_per_expert)
                  and torch.allclose(r.topk_w, ref.topk_w, rtol=2e-6, atol=1e-7)
                  and torch.allclose(r.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-9))

            def fwd():
                with torch.no_grad():
                    route(x, w, cfg, bias, impl="triton")

            per = device_time(fwd)[2]
            us = sum(v for k, v in per.items() if k.startswith("_route_fwd"))
        finally:
            router_topk.PIN = None
        rows.append({"block_t": bt, "chunks": ch, "warps": wp, "correct": bool(ok), "fwd_kernel_us": us})
        print(f"    BLOCK_T {bt:3d} CHUNKS {ch} warps {wp}: {us:7.2f} us  {'ok' if ok else 'WRONG'}", flush=True)
    return rows


SWEEP_BWD = [(bt, w) for bt in (1, 2, 4, 8, 16) for w in (4, 8)]


def sweep_bwd(cfg, x, w, bias, dg) -> list[dict]:
    """Every backward-kernel config of SWEEP_BWD: d(logits) checked against the torch path's (via dx and dw of the
    router's logit GEMM, which only see d(logits)), then timed (the backward kernel alone, profiler)."""
    from megamoe.kernels import router_topk

    one = torch.ones((), device=x.device)

    def grads(impl):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = route(xr, wr, cfg, bias, impl=impl)
        torch.autograd.backward([r.topk_w, r.aux_loss], [dg, one])
        return xr.grad.float(), wr.grad.float()

    ref = grads("torch")
    rows = []
    for bt, wp in SWEEP_BWD:
        router_topk.PIN_BWD = (bt, wp)
        try:
            got = grads("triton")
            ok = all(((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 1e-2 for a, b in zip(got, ref, strict=True))
            per = device_time(lambda: grads("triton"))[2]
            us = sum(v for k, v in per.items() if k.startswith("_route_bwd"))
        finally:
            router_topk.PIN_BWD = None
        rows.append({"block_t": bt, "warps": wp, "correct": bool(ok), "bwd_kernel_us": us})
        print(f"    backward BLOCK_T {bt:3d} warps {wp}: {us:7.2f} us  {'ok' if ok else 'WRONG'}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the forward kernel's configs (SWEEP)")
    ap.add_argument("--sweep-bwd", action="store_true", help="also time the backward kernel's configs (SWEEP_BWD)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in args.presets.split(","):
        cfg = preset(name)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(args.tokens, cfg.hidden, device=dev, generator=g, dtype=torch.bfloat16)
        w = (torch.randn(cfg.num_experts, cfg.hidden, device=dev, generator=g) * cfg.hidden ** -0.5).to(torch.bfloat16)
        bias = torch.zeros(cfg.num_experts, device=dev) if cfg.router == "sigmoid" else None
        dg = torch.randn(args.tokens, cfg.top_k, device=dev, generator=g)
        for impl in ("torch", "triton"):
            f_us, f_n, f_per, fb_us, fb_n, fb_per = measure(cfg, x, w, bias, dg, impl)
            rows.append({"preset": name, "impl": impl, "tokens": args.tokens, "fwd_us": f_us, "fwd_kernels": f_n,
                         "fwd_bwd_us": fb_us, "fwd_bwd_kernels": fb_n, "fwd_bwd_per_kernel_us": fb_per})
            print(f"{name:15s} {impl:6s} forward {f_us:7.1f} us ({f_n:4.1f} kernels)   "
                  f"forward+backward {fb_us:7.1f} us ({fb_n:4.1f} kernels)", flush=True)
            if impl == "triton":
                print("    " + ", ".join(f"{k} {v}" for k, v in sorted(fb_per.items(), key=lambda kv: -kv[1])))
                if args.sweep:
                    rows[-1]["sweep"] = sweep(cfg, x, w, bias, dev)
                if args.sweep_bwd:
                    rows[-1]["sweep_bwd"] = sweep_bwd(cfg, x, w, bias, dg)
    write_results(args.json, dev, __doc__, rows)


if __name__ == "__main__":
    main()
