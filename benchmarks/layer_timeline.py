"""Timeline of one layer forward (and with --backward its backward) per backend: each kernel's start and end on
the device, the gaps between them, and when the host launched it (torch.profiler trace, one device call).

    torchrun --nproc_per_node N benchmarks/layer_timeline.py [--preset deepseek-v3] [--tokens 4096]
             [--backends split:presum_combine=1,fused] [--backward] [--out DIR]

Why: on 2x H200 (2026-11-30, docs/perf-notes.md) the fused forward took 2.1 ms more than its kernels' device
time, split 0.8 ms more; kernel sums (fused_probe.py --profile) cannot say whether that is the device idling
for the host (launch latency), waiting for the peer (skewed ranks), or something else. Per backend this prints,
for the last of ``--iters`` forwards on rank 0: every kernel launched in it, with its device start / duration
relative to the first one, the idle gap before it, and how long after its host launch call it started (a small
number there and a large gap means the device waited for the host). The chrome traces (every rank) go to
``--out``, for a look at both ranks side by side.
"""

from __future__ import annotations

import argparse
import json
import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamoe.backends import parse_backend  # noqa: E402
from megamoe.config import preset  # noqa: E402
from megamoe.dist import init_from_env  # noqa: E402
from megamoe.layer import MoE  # noqa: E402


def timeline(trace_path: str, step_marker: str) -> list[dict]:
    """Kernels of the last ``step_marker`` range in a chrome trace: name, device start/end and the host launch
    call's start (us), the launch matched to its kernel by the trace's correlation ids."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    marks = [e for e in events if e.get("name") == step_marker and e.get("ph") == "X"
             and e.get("cat") in ("user_annotation", "cpu_op")]
    if not marks:
        return []
    last = max(marks, key=lambda e: e["ts"])
    t0, t1 = last["ts"], last["ts"] + last.get("dur", 0)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    rows = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy") or e.get("ph") != "X":
            continue
        corr = e.get("args", {}).get("correlation")
        launched = launches.get(corr)
        if launched is None or not (t0 <= launched <= t1):  # kernels launched inside the last forward
            continue
        rows.append({"name": e["name"][:60], "start": e["ts"], "end": e["ts"] + e.get("dur", 0),
                     "launched": launched})
    rows.sort(key=lambda r: r["start"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--backends", default="split:presum_combine=1,fused")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "out/timeline"))
    p.add_argument("--backward", action="store_true", help="also time the backward (gradients set to None first)")
    args = p.parse_args()
    dev = init_from_env()
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    cfg = preset(args.preset, max_tokens_per_rank=args.tokens)
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    from torch.profiler import ProfilerActivity, profile

    for spec in args.backends.split(","):
        name, opts = parse_backend(spec)
        moe = MoE(cfg, backend=name, device=dev, seed=1, **opts)
        xin = x.detach().requires_grad_(args.backward)
        dy = torch.randn_like(x)

        with torch.set_grad_enabled(args.backward):
            for _ in range(3):
                _step(moe, xin, dy, args.backward)
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    _step(moe, xin, dy, args.backward)
                torch.cuda.synchronize()
        path = os.path.join(args.out, f"trace-{spec.replace(':', '_').replace('=', '')}-rank{rank}.json")
        prof.export_chrome_trace(path)
        for phase in ("forward", "backward") if args.backward else ("forward",):
            if rank == 0:
                _print_phase(path, spec, phase, args)
        del moe
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


def _step(moe, xin, dy, backward: bool) -> None:
    """One forward (and backward) inside named ranges, ranks aligned before each; gradients set to None first, as a
    training step does (else the backward's accumulation into old gradients counts as the layer's time)."""
    from torch.profiler import record_function

    torch.cuda.synchronize()
    dist.barrier()
    with record_function("layer_forward"):
        out = moe(xin).out
    if backward:
        xin.grad = None
        for prm in moe.parameters():
            prm.grad = None
        torch.cuda.synchronize()
        dist.barrier()
        with record_function("layer_backward"):
            out.backward(dy)


def _print_phase(path: str, spec: str, phase: str, args) -> None:
    rows = timeline(path, f"layer_{phase}")
    if not rows:
        print(f"== {spec}: no device events found")
        return
    base = rows[0]["start"]
    print(f"== {spec} ({args.preset}, {args.tokens} tokens/rank): last {phase}, rank 0, us")
    print(f"{'kernel':60s} {'start':>8s} {'dur':>8s} {'gap':>7s} {'after launch':>12s}")
    prev_end = base
    for r in rows:
        gap = r["start"] - prev_end
        lag = "" if r["launched"] is None else f"{r['start'] - r['launched']:12.1f}"
        print(f"{r['name']:60s} {r['start'] - base:8.1f} {r['end'] - r['start']:8.1f} {gap:7.1f} {lag}")
        prev_end = max(prev_end, r["end"])
    busy = sum(r["end"] - r["start"] for r in rows)
    print(f"span {prev_end - base:.1f} us, kernels {busy:.1f} us, idle {prev_end - base - busy:.1f} us")


if __name__ == "__main__":
    main()
