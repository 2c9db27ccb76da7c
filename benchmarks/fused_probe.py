"""Compile report, correctness against `split` and forward time of megakernel config variants (one device call).

    torchrun --nproc_per_node N benchmarks/fused_probe.py [--presets qwen3-30b-a3b,deepseek-v3] [--tokens 4096]
        [--variants a,b] [--profile] [--timeline [--out DIR]]

For each preset: the split layer's forward output is the reference (same seed, same weights); each variant of
the fused backend's FusedConfig (and ring size) runs the forward, prints its relative difference to split,
its median forward time (CUDA events, 10 iterations, max over ranks) and the kernel's registers / spills /
shared memory. A variant that fails to compile prints the error and the run goes on.

--timeline: each variant also runs once with FusedConfig.timeline (per item: program, kind, block and
%globaltimer stamps) and rank 0 prints where the kernel's program time went per item kind (claim, wait, loop,
epilogue), the programs' busy share and the phases' spans; the raw records go to DIR/timeline-<preset>-<variant>.pt.
"""

from __future__ import annotations

import argparse
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamoe.comm.signals import barrier  # noqa: E402
from megamoe.config import preset  # noqa: E402
from megamoe.dist import init_from_env  # noqa: E402
from megamoe.kernels import gluon_fused  # noqa: E402
from megamoe.kernels.gemm_config import LAST_COMPILED  # noqa: E402
from megamoe.layer import MoE  # noqa: E402

VARIANTS = [
    ("default", {}, None),
    ("gpuscope", {"counter_scope": "gpu"}, None),
    ("prologue", {"prologue": True}, None),  # the first L1 steps' blocks pulled in finer parts
    ("pullpf", {"pull_prefetch": True}, None),  # pull items load every row's address up front
    ("pf+pro", {"pull_prefetch": True, "prologue": True}, None),
    ("la6", {"lookahead": 6}, None),
    ("lag2", {"lag": 2}, None),
    ("la6lag2", {"lookahead": 6, "lag": 2}, None),
    ("split2", {"pull_split": 2}, None),
    ("split2la6", {"pull_split": 2, "lookahead": 6}, None),
    ("pe32k", {"pull_elems": 32768}, None),
    ("la4lag2", {"lookahead": 4, "lag": 2}, None),
    ("la8lag2", {"lookahead": 8, "lag": 2}, None),
    ("la8lag3", {"lookahead": 8, "lag": 3}, None),
    ("la12lag3", {"lookahead": 12, "lag": 3}, None),
    ("la6lag2s2", {"lookahead": 6, "lag": 2, "pull_split": 2}, None),
    ("la6lag2e2", {"lookahead": 6, "lag": 2, "epi_split2": 2}, None),
    ("lag2s2", {"lag": 2, "pull_split": 2}, None),
    ("pull", {"combine": "pull"}, None),
    ("group16", {"group": 16}, None),
    ("group1", {"group": 1}, None),
    ("group2", {"group": 2}, None),
    ("g8la16", {"group": 8, "lookahead": 16}, None),
    ("epi2", {"epi_split2": 2}, None),
    ("split4", {"pull_split": 4}, None),
    ("stages3", {"num_stages": 3}, None),  # the default before 2026-11-30 (4 since: split's GEMM1 runs 4)
    ("s4g16", {"num_stages": 4, "group": 16}, None),
    ("bk128s2", {"block_k": 128, "num_stages": 2}, None),
    ("nopull", {"ablate": 1}, None),  # ablations: timing only, results wrong
    ("nopush", {"ablate": 2}, None),  # skips GEMM2's store (local rows, or the push)
    ("nog2", {"ablate": 6}, None),
    ("nocomm", {"ablate": 3}, None),
    ("ring16", {}, 16),
    ("ring64", {}, 64),
    ("gluon", {"kernel": "gluon"}, None),  # the items in kernels/gluon_fused.py (warp-specialised), Hopper only
    ("gluon-ring16", {"kernel": "gluon"}, 16),
    ("gluon-lag4", {"kernel": "gluon", "lag": 4}, None),
    ("gluon-lag5", {"kernel": "gluon", "lag": 5}, None),  # the Gluon items' schedule knobs (the loader claims ahead of
    ("gluon-lag8", {"kernel": "gluon", "lag": 8}, None),  # its consumers, so its input waits come earlier)
    ("gluon-la12", {"kernel": "gluon", "lookahead": 12}, None),
    ("gluon-g16", {"kernel": "gluon", "group": 16}, None),
    ("gluon-g4", {"kernel": "gluon", "group": 4}, None),
    ("gluon-split2", {"kernel": "gluon", "pull_split": 2}, None),
    ("gluon-g16lag5", {"kernel": "gluon", "group": 16, "lag": 5}, None),
    ("gluon-g16la12lag5", {"kernel": "gluon", "group": 16, "lookahead": 12, "lag": 5}, None),
    # 4th: kernels.gluon_fused attributes set for the run; QD: the loader's queue depth (items it may claim ahead)
    ("gluon-qd1", {"kernel": "gluon"}, None, {"QD": 1}),
    ("gluon-qd2", {"kernel": "gluon"}, None, {"QD": 2}),
    ("gluon-qd4", {"kernel": "gluon"}, None, {"QD": 4}),
    ("gluon-qd1-lag5", {"kernel": "gluon", "lag": 5}, None, {"QD": 1}),
    ("gluon-qd1-g16", {"kernel": "gluon", "group": 16}, None, {"QD": 1}),
    # timing probe (results may be wrong): GEMM1 does not wait for its TMA stores to land before signalling
    ("gluon-p1", {"kernel": "gluon"}, None, {"PROBE": 1}),
    ("gluon-pe16k", {"kernel": "gluon"}, None, {"PULL_ELEMS": 16384}),  # pull chunks per consumer warpgroup
    ("gluon-pe4k", {"kernel": "gluon"}, None, {"PULL_ELEMS": 4096}),
    ("gluon-reg", {"kernel": "gluon"}, None, {"BULK_PULL": 0}),  # the pulls in the consumers' registers (before TMA)
    ("gluon-reg-ring16", {"kernel": "gluon"}, 16, {"BULK_PULL": 0}),
    # consumer 1 runs its empty half of the blocks of <= 64 rows (before 2026-12-03), then idles on them (the default)
    ("gluon-noidle", {"kernel": "gluon"}, None, {"IDLE_HALF": 0}),
    ("gluon-idle", {"kernel": "gluon"}, None, {"IDLE_HALF": 1}),
    ("lag5", {"lag": 5}, None),
    ("g16lag5", {"group": 16, "lag": 5}, None),
]


def profile(fn, iters=10) -> list[tuple[str, float]]:
    """Device time per iteration of every kernel of ``fn`` (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:48], e.device_time_total / 1e3 / iters) for e in p.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:8]


def loop_share(it: torch.Tensor, P: int, t0: int, window_us: float = 100.0) -> str:
    """Share of the programs' time in GEMM k-loops (first stage landed .. loop done; pull items: the copy) in
    consecutive windows from t0: where the schedule leaves the tensor cores idle (start, steady state, drain)."""
    a = (it[:, 5] - t0).double() / 1e3
    b = (it[:, 6] - t0).double() / 1e3
    live = it[:, 1] < 3
    a, b = a[live], b[live]
    end = float((it[:, 7].max() - t0) / 1e3)
    out = []
    w0 = 0.0
    while w0 < end:
        w1 = min(w0 + window_us, end)
        ov = (torch.minimum(b, torch.tensor(w1)) - torch.maximum(a, torch.tensor(w0))).clamp(min=0).sum().item()
        out.append(f"{ov / (P * max(w1 - w0, 1e-9)):.0%}")
        w0 = w1
    return " ".join(out)


def timeline_report(info: dict) -> str:
    """Where the megakernel's program time went, from fused_moe.LAST_TIMELINE (us; one rank). kernel "gluon": the
    columns are consumer 0's view (claim: waiting for the loader to hand the item over; wait: for its first stage)
    and a second table has the loader's claim, input wait and load issue per kind."""
    gluon = info.get("kernel") == "gluon"
    mask = info["items"].cpu()[:, 7] > 0
    it = info["items"].cpu()[mask]
    t0 = int(it[:, 3].min())
    span = (int(it[:, 7].max()) - t0) / 1e3
    P = info["programs"]
    busy = (it[:, 7] - it[:, 3]).sum().item() / 1e3
    lines = [f"   items {len(it)}, programs {P}, item span {span:.1f} us, programs busy {busy / (P * span):.1%} "
             f"of P x span (the rest: before the first claim and after the last item)"]
    lines.append(f"   {'kind':6s} {'n':>6s} {'claim':>7s} {'wait':>7s} {'loop':>8s} {'epilog':>7s} {'total':>8s} "
                 f"{'sum ms':>7s} {'first':>8s} {'last end':>8s}   (mean us per item; first / last end from item 0)")
    for k, name in enumerate(("PULL", "GEMM1", "GEMM2", "none")):
        r = it[it[:, 1] == k]
        if len(r) == 0:
            continue
        d = (r[:, 4:8] - r[:, 3:7]).double() / 1e3
        m = d.mean(0).tolist()
        tot = (r[:, 7] - r[:, 3]).double() / 1e3
        lines.append(f"   {name:6s} {len(r):6d} {m[0]:7.2f} {m[1]:7.2f} {m[2]:8.2f} {m[3]:7.2f} {tot.mean():8.2f} "
                     f"{tot.sum() / 1e3:7.3f} {(r[:, 3].min() - t0) / 1e3:8.1f} {(r[:, 7].max() - t0) / 1e3:8.1f}")
    if gluon:  # the loader: claim, inputs (counters) ready and handed over, loads issued
        lo = info["loader"].cpu()[mask].double()
        lines.append(f"   loader {'kind':6s} {'claim':>7s} {'inputs':>7s} {'issue':>7s}   (mean us per item)")
        for k, name in enumerate(("PULL", "GEMM1", "GEMM2", "none")):
            r = lo[it[:, 1] == k]
            if len(r):
                d = (r[:, 1:4] - r[:, 0:3]) / 1e3
                m = d.mean(0).tolist()
                lines.append(f"   loader {name:6s} {m[0]:7.2f} {m[1]:7.2f} {m[2]:7.2f}")
        w = (lo[:, 2] - lo[:, 1]) / 1e3  # input waits (counters) of the GEMM items: the long ones stop a program
        w = w[(it[:, 1] == 1) | (it[:, 1] == 2)]
        lines.append(f"   loader GEMM input waits > 10 us: {(w > 10).sum().item()} of {len(w)}, "
                     f"{w[w > 10].sum() / 1e3:.3f} ms of program time (all waits {w.sum() / 1e3:.3f} ms)")
        pp = info["per_program"].cpu().double()
        d = (pp[:, 1:3] - pp[:, 0:2]) / 1e3
        lines.append(f"   per program (mean / max us): READY wait {d[:, 0].mean():.1f} / {d[:, 0].max():.1f}, items "
                     f"{d[:, 1].mean():.1f} / {d[:, 1].max():.1f} (the tail is its own kernel)")
    pp = None if gluon else info.get("per_program")
    if pp is not None:
        pp = pp.cpu().double()
        e0 = pp[:, 0].min()
        d = (pp[:, 1:5] - pp[:, 0:4]) / 1e3
        lines.append(f"   per program (mean / max us): READY wait {d[:, 0].mean():.1f} / {d[:, 0].max():.1f}, "
                     f"items {d[:, 1].mean():.1f}, DONE wait {d[:, 2].mean():.1f} / {d[:, 2].max():.1f}, "
                     f"slot sum {d[:, 3].mean():.1f} / {d[:, 3].max():.1f}; kernel entry to last end "
                     f"{(pp[:, 4].max() - e0) / 1e3:.1f} us, entries spread over {(pp[:, 0].max() - e0) / 1e3:.1f} us")
    lines.append("   k-loop share of P x window, per 100 us from the first claim: " + loop_share(it, P, t0))
    g = it[it[:, 1] > 0]
    g = g[g[:, 1] < 3]
    if len(g):
        w = (g[:, 5] - g[:, 4]).double() / 1e3
        lines.append(f"   GEMM waits > 2 us: {(w > 2).sum().item()} of {len(g)} (their mean {w[w > 2].mean():.1f} us)"
                     if (w > 2).any() else f"   GEMM waits > 2 us: none of {len(g)}")
    return "\n".join(lines)


def timed(fn, iters=10):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    t = torch.tensor(sorted(ts)[len(ts) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variants", default="")
    p.add_argument("--profile", action="store_true", help="per-kernel device times of split and fused (default)")
    p.add_argument("--timeline", action="store_true", help="per-item phase times of every variant (rank 0)")
    p.add_argument("--out", default=".", help="directory for the --timeline records")
    p.add_argument("--grad", action="store_true", help="the variants' forwards with autograd on (the input requires "
                   "grad, so GEMM1 also stores h, as in training and the layer benchmark); each variant's gradients "
                   "(input, w13, w2; the backward reads h) are compared bitwise with the first variant's")
    args = p.parse_args()
    dev = init_from_env()
    rank = dist.get_rank()
    names = set(args.variants.split(",")) if args.variants else None
    for name in args.presets.split(","):
        cfg = preset(name, max_tokens_per_rank=args.tokens)
        split = MoE(cfg, backend="split", device=dev, seed=1)
        gen = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
        with torch.no_grad():
            ref = split(x).out.float()
            t_split = timed(lambda m=split, x=x: m(x))
        if rank == 0:
            print(f"== {name} {args.tokens} tok/rank, W={dist.get_world_size()}: split forward {t_split:.3f} ms")
        fused = MoE(cfg, backend="fused", device=dev, seed=1, timeout_s=20)  # push combine: its heap serves both
        base = fused.backend.config
        dy = torch.randn(x.shape, device=dev, dtype=cfg.dtype, generator=gen)
        grads0 = None
        if args.profile:
            with torch.no_grad():
                fused(x)
                for label, m in (("split", split), ("fused", fused)):
                    rows = profile(lambda m=m, x=x: m(x))
                    if rank == 0:
                        print(f"-- {label} kernels (ms/iter): " + ", ".join(f"{k} {v:.3f}" for k, v in rows))
        for vname, kw, ring, *mods in VARIANTS:
            if names and vname not in names:
                continue
            fused.backend.config = base.with_(**kw)
            fused.backend.ring_blocks = ring
            mods = mods[0] if mods else {}
            saved = {a: getattr(gluon_fused, a) for a in mods}
            for a, v in mods.items():
                setattr(gluon_fused, a, v)
            try:
                xg = x.detach().requires_grad_() if args.grad else x
                with torch.set_grad_enabled(args.grad):
                    y = fused(xg).out.detach().float()
                    torch.cuda.synchronize()
                    err = ((y - ref).norm() / ref.norm()).item()
                    t = timed(lambda m=fused, x=xg: m(x))
                k = LAST_COMPILED.get("_gluon_fused_fwd_kernel" if kw.get("kernel") == "gluon" else "_fused_fwd_kernel")
                rep = (f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                       f"smem {k.metadata.shared if k is not None else '?'}")
                kt = ""
                if args.profile:
                    with torch.set_grad_enabled(args.grad):
                        prof = dict(profile(lambda m=fused, x=xg: m(x)))
                    if kw.get("kernel") == "gluon":  # the items kernel, then the tail kernel
                        kt = prof.get("_gluon_fused_fwd_kernel", float("nan")) + prof.get("_fused_tail_kernel", 0.0)
                    else:
                        kt = prof.get("_fused_fwd_kernel", float("nan"))
                    kt = f" kernel {kt:.3f} ms"
                line = f"{vname:10s} fwd {t:8.3f} ms{kt}  vs split {err:.2e}  {rep}"
                if args.grad:  # one backward: the gradients against the first variant's
                    xg = x.detach().requires_grad_()
                    fused.zero_grad(set_to_none=True)
                    fused(xg).out.backward(dy)
                    grads = [xg.grad, fused.w13.grad, fused.w2.grad]
                    if grads0 is None:
                        grads0 = [g.clone() for g in grads]
                        line += "  grads: first variant (the reference)"
                    else:
                        same = all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
                        line += f"  grads {'bitwise equal to' if same else 'DIFFER from'} the first variant's"
                if args.timeline:
                    from megamoe.kernels import fused_moe

                    fused.backend.config = fused.backend.config.with_(timeline=True)
                    with torch.set_grad_enabled(args.grad):
                        yt = fused(xg).out.detach().float()
                        torch.cuda.synchronize()
                    same = bool(torch.equal(yt, y))
                    info = dict(fused_moe.LAST_TIMELINE)
                    if rank == 0:
                        torch.save({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in info.items()},
                                   os.path.join(args.out, f"timeline-{name}-{vname}.pt"))
                        line += f"\n   timeline run: output {'equal' if same else 'DIFFERS'}\n" + timeline_report(info)
            except Exception as exc:  # noqa: BLE001 - report and go on to the next variant
                line = f"{vname:10s} FAILED: {type(exc).__name__}: {str(exc)[:300]}"
                barrier(fused.backend.heap)  # the failed call never published DONE: close it on every rank
            for a, v in saved.items():
                setattr(gluon_fused, a, v)
            if rank == 0:
                print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
