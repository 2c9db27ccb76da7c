"""``megamoe bench``: the MoE layer forward and forward+backward, backends side by side on the same inputs.

Under ``torchrun`` it joins that group; otherwise it spawns ``--world N`` gloo CPU ranks (no GPU; default 2, preset
``tiny``) or one NCCL rank per GPU. Per backend, from the same weights and rotating inputs:
* time: CUDA events (CPU: perf_counter) per iteration, ranks started together (sync + barrier), max over ranks,
  median over iterations;
* TFLOP/s: forward expert flops of all ranks / W / time (x3 for forward+backward);
* ratio to the floor (megamoe.apps.perf.layer_floor_seconds; only the experts a rank's rows use are charged), the
  lowest floor over the input sets, a bound for every timed iteration;
* relative error against the float64 reference on the global batch (each rank evaluates its own experts, the
  partial sums are all-reduced);
* peak memory (GPU): the most allocated during each mode's eager iterations, with only that backend's layer (and
  its heap) alive; ``resident_bytes`` is what was allocated before them (weights, heap, inputs).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

from megamoe.apps.peers import HFPeer, SonicPeer
from megamoe.apps.perf import Marks, ceilings_for, layer_floor_seconds, run_metadata, run_ranks, write_json
from megamoe.backends import available_backends, parse_backend
from megamoe.config import PRESETS, parse_dtype, preset
from megamoe.reference import expert_act, experts_ref, shared_ref


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megamoe bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="layer shape (default: tiny without GPUs, deepseek-v3 with GPUs)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: 64 on CPU, 4096 on GPU)")
    p.add_argument("--experts", type=int, default=None,
                   help="experts in the layer (E), replacing the preset's; E/W on one GPU times one rank's expert "
                        "work of an EP W run under uniform routing, without its communication (a per-rank proxy)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="routing skew: a logit offset falling linearly from SKEW to 0 across the experts")
    p.add_argument("--dtype", default="bf16", help="layer dtype (bf16, fp32, ...)")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends (default: every backend available here); options after a "
                        "colon, e.g. split:fp8=1:presum_combine=1 (megamoe.backends lists each backend's options)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: 20 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: 5 GPU, 1 CPU)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to spawn when not under torchrun (CPU default 2; GPU default: all GPUs)")
    p.add_argument("--cpu", action="store_true", help="use CPU ranks even if GPUs are present")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    p.add_argument("--fp8-weights", choices=("layer", "pinned"), default="layer",
                   help="FP8 layers (fp8=1): 'layer' quantises as a layer without an optimizer-kept copy does "
                        "(cached eagerly, every CUDA-graph replay); 'pinned' quantises once (pin_fp8_weights), so "
                        "replays time the layer alone, as with MasterAdamW.maintain_fp8 or inference")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time graph-capturable backends (split, fused) as CUDA-graph replays: no launch latency")
    p.add_argument("--interleave", action="store_true",
                   help="with --cuda-graph: capture every backend's graph, then replay them in turn (A B C A B C "
                        "...) so clock or temperature drift falls on each alike; holds all graphs at once")
    p.add_argument("--peers", action="store_true",
                   help="also time transformers' MoE modules of the preset's architecture (grouped_mm experts) on "
                        "the same weights and inputs; one process only")
    p.add_argument("--json", default=None, help="write results here (default: benchmarks/results/<auto>.json "
                                                 "on GPU, nothing on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _defaults(args, on_gpu: bool) -> argparse.Namespace:
    for name, gpu, cpu in (("preset", "deepseek-v3", "tiny"), ("tokens", 4096, 64), ("iters", 20, 3), ("warmup", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    if args.cuda_graph and not on_gpu:
        raise ValueError("--cuda-graph needs CUDA GPUs")
    if args.interleave and not args.cuda_graph:
        raise SystemExit("megamoe bench: --interleave orders CUDA-graph replays; it needs --cuda-graph")
    if args.peers and (args.world or 1) != 1:
        raise SystemExit("megamoe bench: --peers runs on one process (--world 1)")
    if args.tokens < 0 or args.iters < 1 or args.warmup < 0:
        raise SystemExit("megamoe bench: --tokens must be >= 0, --iters >= 1, --warmup >= 0")
    return args


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> Marks:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return Marks(self.device)

    def stop(self, t0: Marks) -> float:
        t0.mark()
        return t0.elapsed()[0]


def _progress(msg: str, enabled: bool, step: bool = False) -> None:
    """One updating line on a terminal; on a pipe or log file, one line per stage (``step`` False)."""
    if not enabled:
        return
    if sys.stderr.isatty():
        sys.stderr.write(f"\r[megamoe bench] {msg:<70}")
    elif not step:
        sys.stderr.write(f"[megamoe bench] {msg}\n")
    sys.stderr.flush()


def _max_over_ranks(times: list[float], device) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _reference_error(moe, x: torch.Tensor, y: torch.Tensor) -> float:
    """||y - y_ref|| / ||y_ref|| over the global batch; the routing is the layer's own (shared by backends), the
    experts' form (biases, activation) and the shared expert the layer's config's."""
    W = moe.world
    with torch.no_grad():
        r = moe.router(x)
        Ts = [0] * W  # tokens per rank
        dist.all_gather_object(Ts, x.shape[0])

        def gather(t):
            pad = t.new_zeros((max(Ts),) + tuple(t.shape[1:]))
            pad[: t.shape[0]] = t
            parts = [torch.empty_like(pad) for _ in range(W)]
            dist.all_gather(parts, pad)
            return torch.cat([p[:n] for p, n in zip(parts, Ts, strict=True)])

        x_all, idx_all, w_all = (gather(t) for t in (x.double(), r.topk_idx, r.topk_w.double()))
        w13, w2, b13, b2 = moe.expert_weights(torch.float64)
        y_part = experts_ref(x_all, idx_all, w_all, w13, w2, moe.expert_offset, b13=b13, b2=b2,
                             act=expert_act(moe.config))
        dist.all_reduce(y_part)
        lo = sum(Ts[: moe.rank])
        ref = y_part[lo: lo + x.shape[0]]
        if moe.shared_w13 is not None:  # replicated: every rank adds it for its own tokens
            ref = ref + shared_ref(x.double(), moe.shared_w13, moe.shared_w2, moe.shared_gate)
        nd = torch.stack([(y.double() - ref).norm() ** 2, ref.norm() ** 2])
        dist.all_reduce(nd)
        num, den = nd.tolist()
        return math.sqrt(num / den) if math.isfinite(num) and den > 0 else (0.0 if num == 0 else math.inf)


def capture_step(make_moe, x0: torch.Tensor, dy0: torch.Tensor, device, mode: str):
    """A fresh module's ``mode`` step ("forward" or "forward+backward") captured in a CUDA graph -> (graph, module,
    x, dy): copy inputs into the static ``x`` / ``dy``, then replay (keep the module alive with the graph). Built,
    warmed up and captured on one side stream: a module first run on the legacy default stream fails to capture
    later ("operation would make the legacy stream depend on a capturing blocking stream")."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        moe = make_moe()
        x = x0.detach().clone().requires_grad_()
        dy = dy0.clone()

        def body():
            out = moe(x)
            if mode == "forward+backward":
                out.out.backward(dy)

        for _ in range(2):
            body()
        # as the eager loop does: with .grad set, each replay would accumulate into dW, a read-modify-write the
        # eager timing does not have (~20% of a deepseek-v3 step)
        moe.zero_grad(set_to_none=True)
        x.grad = None
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        body()
    return graph, moe, x, dy


def _replay_times(captured: list, xs, dys, args, timer) -> list[list[float]]:
    """Per-iteration times of capture_step's graphs replayed in turn, inputs copied in outside the timed region."""
    times: list[list[float]] = [[] for _ in captured]
    for it in range(args.warmup + args.iters):
        for i, (graph, _moe, x, dy) in enumerate(captured):
            with torch.no_grad():
                x.copy_(xs[it % len(xs)])
                dy.copy_(dys[it % len(dys)])
            t0 = timer.start()
            graph.replay()
            times[i].append(timer.stop(t0))
    return [t[args.warmup:] for t in times]


def _graph_times(makers: list, xs, dys, args, timer, device, show: bool) -> list[dict]:
    """Per (spec, make_moe) of ``makers`` ({mode: _stats, max over ranks}): each mode's graphs captured, then
    replayed in turn (``--interleave`` passes every graph-capturable backend, otherwise one)."""
    out: list[dict] = [{} for _ in makers]
    for mode in ("forward", "forward+backward"):
        captured = []
        for spec, make in makers:
            _progress(f"{spec} {mode} (CUDA graph)", show)
            captured.append(capture_step(make, xs[0], dys[0], device, mode))
        if len(captured) > 1:
            _progress(f"{len(captured)} graphs {mode}: replays in turn", show)
        for i, times in enumerate(_replay_times(captured, xs, dys, args, timer)):
            out[i][mode] = _stats(_max_over_ranks(times, device))
        del captured
        torch.cuda.empty_cache()
    return out


def _stats(per_iter: list[float]) -> dict:
    return {"median_s": statistics.median(per_iter), "min_s": min(per_iter), "max_s": max(per_iter),
            "iters": len(per_iter)}


def bench_config(args: argparse.Namespace):
    """The preset at --dtype with --experts (MoEConfig checks top_k <= E), split's and fused's buffers for --tokens."""
    cfg = preset(args.preset, dtype=parse_dtype(args.dtype), max_tokens_per_rank=max(1, args.tokens))
    return cfg if args.experts is None else cfg.replace(num_experts=args.experts)


def _eager_entry(spec: str, module, ref_moe, xs, dys, args, timer, device, show: bool) -> dict:
    """Eager timings of ``module`` (a MoE or a peer: ``module(x).out``), its peak memory per mode and its error
    against the float64 reference of ``ref_moe``'s routing and weights."""
    entry: dict = {"backend": spec, "timing": "eager"}
    cuda = device.type == "cuda"
    for mode in ("forward", "forward+backward"):
        times = []
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            entry["resident_bytes"] = torch.cuda.memory_allocated(device)
        for it in range(args.warmup + args.iters):
            x = xs[it % len(xs)].detach().requires_grad_()
            module.zero_grad(set_to_none=True)
            t0 = timer.start()
            out = module(x)
            if mode == "forward+backward":
                out.out.backward(dys[it % len(dys)])
            times.append(timer.stop(t0))
            _progress(f"{spec} {mode} {it + 1}/{args.warmup + args.iters}", show, step=it > 0)
            del out
        entry[mode] = _stats(_max_over_ranks(times[args.warmup:], device))
        entry[mode]["peak_bytes"] = _max_over_ranks([torch.cuda.max_memory_allocated(device)], device)[0] \
            if cuda else None
    module.zero_grad(set_to_none=True)
    if not args.no_check:
        _progress(f"{spec} reference check", show)
        with torch.no_grad():
            y = module(xs[0]).out
        entry["rel_err"] = _reference_error(ref_moe, xs[0], y)
    return entry


def _graphed_entry(spec: str, make, rel_err, interleaved: list, xs, dys, args, timer, device, show: bool) -> dict:
    """The CUDA-graph entry of ``make``'s module: timed now, or with ``--interleave`` left on ``interleaved`` to be
    timed after the loop, every backend's replays in turn."""
    graphed = {"backend": spec, "timing": "cuda-graph", "rel_err": rel_err}
    if args.interleave:
        graphed["interleaved"] = True
        interleaved.append((graphed, (spec, make)))
    else:
        graphed.update(_graph_times([(spec, make)], xs, dys, args, timer, device, show)[0])
    return graphed


def _peers(cfg, args, xs, dys, offset, timer, device, show, results, interleaved) -> None:
    """--peers: transformers' modules on the torch backend's weights (same seed as every backend), timed as the
    backends are; under --cuda-graph also graphed."""
    from megamoe.layer import MoE

    if offset is not None:
        raise SystemExit("megamoe bench: --peers with --skew is not supported (the peers route on their own)")
    ref = MoE(cfg, backend="torch", device=device, seed=args.seed)
    try:
        peer = HFPeer(ref)
    except ValueError as exc:
        raise SystemExit(f"megamoe bench --peers: {exc}") from None
    if peer.family != "gpt_oss":  # same layout: the reference check reads the peer's copies, its memory its own
        ref.w13.data, ref.w2.data = peer.experts.gate_up_proj.data, peer.experts.down_proj.data
    peers = [peer]
    try:
        peers.append(SonicPeer(ref))
    except ValueError as exc:
        print(f"megamoe bench --peers: no SonicMoE peer ({exc})", flush=True)
    for peer in peers:
        sonic, make = isinstance(peer, SonicPeer), functools.partial(type(peer), ref)  # a fresh one per capture
        torch.cuda.empty_cache()
        try:  # SonicMoE may fail at its first launch or capture: dropped with the reason, the rest still timed
            entry = _eager_entry(peer.name, peer, ref, xs, dys, args, timer, device, show)
            if sonic and args.cuda_graph and args.interleave:  # captured after this loop, outside this try: try it now
                capture_step(make, xs[0], dys[0], device, "forward+backward")
            graphed = _graphed_entry(peer.name, make, entry.get("rel_err"), interleaved, xs, dys, args, timer, device,
                                     show) if args.cuda_graph else None
        except Exception as exc:  # noqa: BLE001
            if not sonic:
                raise
            print(f"megamoe bench --peers: SonicMoE dropped ({type(exc).__name__}: {exc})", flush=True)
            continue
        results += [entry] if graphed is None else [entry, graphed]


def run_rank(args: argparse.Namespace, device: torch.device) -> dict | None:
    """The benchmark on one rank of an initialised process group; rank 0 returns the results."""
    from megamoe.layer import MoE

    W, rank = dist.get_world_size(), dist.get_rank()
    cfg = bench_config(args)
    cfg.validate_world(W)
    backends = args.backends.split(",") if args.backends else available_backends(device)
    show = rank == 0 and not args.quiet
    ceil = ceilings_for(device)

    gen = torch.Generator(device=device).manual_seed(args.seed * 7 + rank + 1)
    n_sets = 4 if device.type == "cuda" else 2  # rotate inputs so L2 does not flatter
    xs, dys = ([torch.randn(args.tokens, cfg.hidden, generator=gen, device=device, dtype=cfg.dtype)
                for _ in range(n_sets)] for _ in range(2))
    offset = torch.linspace(args.skew, 0.0, cfg.num_experts, device=device) if args.skew else None

    timer = _Timer(device)
    results = []
    interleaved = []  # --interleave: (graphed entry to fill, (spec, make_moe)) per graph-capturable backend
    rows_per_rank = experts_per_rank = None
    for spec in backends:
        name, options = parse_backend(spec)

        def make_moe(name=name, options=options):
            m = MoE(cfg, backend=name, device=device, seed=args.seed, **options)
            if args.fp8_weights == "pinned" and getattr(m.backend, "fp8", False):  # quantised once (see the option)
                m.backend.pin_fp8_weights()
            if offset is not None:
                m.router.set_logit_offset(offset)
            return m

        moe = make_moe()
        if rows_per_rank is None:  # per input set: the timings rotate over all of them
            with torch.no_grad():
                counts = torch.stack([moe.router(x).tokens_per_expert for x in xs])
            dist.all_reduce(counts)
            rows_per_rank = counts.view(len(xs), W, -1).sum(2).tolist()
            experts_per_rank = (counts.view(len(xs), W, -1) > 0).sum(2).tolist()
        entry = _eager_entry(spec, moe, moe, xs, dys, args, timer, device, show)
        results.append(entry)
        if args.cuda_graph and getattr(moe.backend, "graph_capturable", False):
            results.append(_graphed_entry(spec, make_moe, entry.get("rel_err"), interleaved, xs, dys, args, timer,
                                          device, show))
        moe.close()  # its heap too (on every rank): the next backend's memory is its own
        del moe
        torch.cuda.empty_cache()
    if args.peers:
        _peers(cfg, args, xs, dys, offset, timer, device, show, results, interleaved)
    if interleaved:
        per_backend = _graph_times([m for _, m in interleaved], xs, dys, args, timer, device, show)
        for (graphed, _), modes in zip(interleaved, per_backend, strict=True):
            graphed.update(modes)
    if show and sys.stderr.isatty():
        sys.stderr.write("\n")

    total_rows = sum(rows_per_rank[0])  # the same in every input set: tokens x k x W
    for entry in results:
        for mode, passes in (("forward", 1.0), ("forward+backward", 3.0)):
            m = entry[mode]
            m["tflops"] = passes * float(cfg.flops_forward(total_rows)) / W / m["median_s"] / 1e12
            # the lowest input set's floor: a bound for every iteration the median is taken over
            m["floor_s"] = floor = None if ceil is None else min(
                layer_floor_seconds(cfg, r, W, ceil, passes, e)
                for r, e in zip(rows_per_rank, experts_per_rank, strict=True))
            m["x_floor"] = m["median_s"] / floor if floor else None
    if rank != 0:
        return None
    return {
        "meta": run_metadata(device, W),
        "config": {"preset": args.preset, "tokens_per_rank": args.tokens, "skew": args.skew,
                   "dtype": str(cfg.dtype).replace("torch.", ""), "world": W, "iters": args.iters,
                   "warmup": args.warmup, "seed": args.seed, "hidden": cfg.hidden,
                   "intermediate": cfg.intermediate, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                   "preset_num_experts": PRESETS[args.preset].num_experts,
                   "rows_per_rank": rows_per_rank[0], "experts_per_rank": experts_per_rank[0],
                   "rows_per_rank_sets": rows_per_rank, "experts_per_rank_sets": experts_per_rank,
                   "floor": "the lowest over the input sets of the largest rank floor (perf.layer_floor_seconds)",
                   "fp8_weights": args.fp8_weights, "peers": args.peers, "interleave": args.interleave},
        "timing": "CUDA events (CPU: perf_counter) per iteration after device sync + barrier; "
                  "max over ranks per iteration; median over iterations; entries with interleaved: true were "
                  "replayed in turn with the other backends' graphs (--interleave)",
        "results": results,
    }


def format_table(report: dict) -> str:
    c = report["config"]
    head = (f"megamoe bench: {c['preset']} (H={c['hidden']} I={c['intermediate']} E={c['num_experts']} "
            f"k={c['top_k']}), {c['tokens_per_rank']} tokens/rank x {c['world']} ranks, {c['dtype']}, "
            f"skew {c['skew']}, on {report['meta'].get('gpu') or 'CPU (gloo ranks)'}")
    labels = [e["backend"] + ("/graph" if e.get("timing") == "cuda-graph" else "") for e in report["results"]]
    w = max([8] + [len(label) for label in labels])
    lines = [head, f"{'backend':<{w}} {'fwd ms':>9} {'TFLOP/s':>8} {'x floor':>8} {'fwd+bwd ms':>11} "
                   f"{'TFLOP/s':>8} {'x floor':>8} {'rel err':>9} {'peak GiB':>8}"]
    fx = lambda v: f"{v:8.2f}" if v is not None else f"{'n/a':>8}"
    for label, e in zip(labels, report["results"], strict=True):
        f, b = e["forward"], e["forward+backward"]
        err = e.get("rel_err")
        peak = b.get("peak_bytes")  # forward+backward's, eager entries on a GPU
        lines.append(f"{label:<{w}} {f['median_s'] * 1e3:9.3f} {f['tflops']:8.4g} {fx(f['x_floor'])} "
                     f"{b['median_s'] * 1e3:11.3f} {b['tflops']:8.4g} {fx(b['x_floor'])} "
                     f"{(f'{err:9.2e}' if err is not None else 'skipped'):>9} "
                     f"{fx(peak / 2**30 if peak is not None else None)}")
    floor = report["results"][0]["forward"]["floor_s"] if report["results"] else None
    if floor:
        lines.append(f"floor (largest rank floor, measured ceilings): forward {floor * 1e3:.3f} ms, "
                     f"forward+backward {report['results'][0]['forward+backward']['floor_s'] * 1e3:.3f} ms")
    else:
        lines.append("floor: n/a (no measured ceilings for this device)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    raw = build_parser().parse_args(argv)
    on_gpu = torch.cuda.is_available() and not raw.cpu
    args = _defaults(raw, on_gpu)

    def check_world(world: int) -> None:
        if on_gpu and world > torch.cuda.device_count():
            raise SystemExit(f"megamoe bench: --world {world} but only {torch.cuda.device_count()} GPUs")
        bench_config(args).validate_world(world)

    report = run_ranks(run_rank, args, on_gpu, check_world, timeout_s=3600)
    if report is None:
        return 0
    print(format_table(report))
    path = args.json
    if path is None and on_gpu:
        path = os.path.join("benchmarks", "results",
                            f"bench-{args.preset}{'' if args.experts is None else f'-E{args.experts}'}-{args.tokens}-"
                            f"{report['config']['world']}gpu-{report['meta']['date'][:10]}.json")
    if path:
        write_json(path, report)
        print(f"wrote {path}")
    return 0
