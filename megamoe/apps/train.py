"""``megamoe train``: train a small MoE language model with expert parallelism; tokens/s/GPU per backend.

Under ``torchrun`` on GPUs (bf16 autocast, bf16 MoE layers, float32 masters); alone it spawns ``--world`` gloo CPU
ranks (default 2) with a tiny float32 model. Experts are sharded and left out of DDP; everything else is replicated
and DDP-averaged. Loss: mean next-byte cross-entropy + the load-balancing losses. Expert gradients collect every
rank's tokens, so they are divided by W. MasterAdamW gets the clip coefficient and 1/W as device multipliers: no
host sync, no extra pass over the grads.

``--backends torch,split`` repeats the same run (seed, data) per backend in one group. ``--out`` gets
``summary.json`` (tokens/s/GPU, step breakdown, peak memory, losses, expert load), ``loss.png`` and, with
``--ckpt-every``, per-rank checkpoints in ``ckpt-<backend as a file name>`` (``--resume`` continues from them).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from megamoe.apps.data import ByteCorpus
from megamoe.apps.model import ModelConfig, MoETransformer
from megamoe.apps.perf import Marks, run_metadata, run_ranks, write_json
from megamoe.backends import parse_backend
from megamoe.comm import close_heaps
from megamoe.config import PRESETS, parse_dtype, preset
from megamoe.layer import capture_moe_layers
from megamoe.optim import MasterAdamW


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megamoe train", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="text files to train on (default: the Python stdlib sources)")
    p.add_argument("--backends", default="torch", help="comma-separated MoE backends, run one after another; "
                   "options as in megamoe bench (e.g. torch,split,split:presum_combine=1,fused)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="expert shapes (default: tiny on CPU, qwen3-30b-a3b on GPU)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default 2 CPU, 4 GPU)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4 CPU, 16 GPU)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 64 CPU, 4096 GPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 4 CPU, 1 GPU)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 30 CPU, 200 GPU)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3 CPU, 1e-3 GPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--adam-moments", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of AdamW's moments: bf16 (DeepSeek-V3's recipe, stochastically rounded) moves 20 "
                        "instead of 28 bytes per bf16 parameter per step")
    p.add_argument("--fp8", action="store_true",
                   help="also train each listed backend that has an FP8 form (split) in FP8 (fp8=1; the optimizer "
                        "keeps the FP8 weight copies in its update), after its bf16 run: both loss curves in one PNG")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 for the dense "
                        "parts, which otherwise make same-seed GPU runs drift apart; megamoe's kernels are "
                        "deterministic either way")
    p.add_argument("--eval-every", type=int, default=None, help="evaluation period in steps (default steps//5)")
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (to test resuming)")
    p.add_argument("--out", default="out/train", help="output folder")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to spawn when not under torchrun (CPU default 2; GPU default: all GPUs)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks even if GPUs are present")
    p.add_argument("--dtype", default=None, help="MoE layer dtype (default bf16 on GPU, fp32 on CPU; the split "
                                                  "backend needs bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-skip", type=int, default=None, help="first steps left out of tokens/s")
    p.add_argument("--graph-moe", action="store_true",
                   help="capture each MoE layer's forward and backward in CUDA graphs (GPU; split and fused; torch "
                        "runs eager)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile each block's attention half (Block.dense) with torch.compile's BACKEND "
                        "(default inductor; 'eager' only traces); the MoE layers stay eager")
    p.add_argument("--quiet", action="store_true")
    return p


def with_fp8(backends: str) -> str:
    """--fp8: after each split backend without an fp8 option its FP8 twin; with no such backend listed, split and
    split:fp8=1 are added (FP8 beside the bf16 layer it replaces). Other backends have no FP8 form."""
    out = []
    for spec in backends.split(","):
        name, options = parse_backend(spec)
        out.append(spec)
        if name == "split" and "fp8" not in options:
            out.append(spec + ":fp8=1")
    if len(out) == len(backends.split(",")):
        out += ["split", "split:fp8=1"]
    return ",".join(dict.fromkeys(out))


def _defaults(a, on_gpu: bool) -> argparse.Namespace:
    if a.fp8:
        a.backends = with_fp8(a.backends)
    a.preset = a.preset or ("qwen3-30b-a3b" if on_gpu else "tiny")
    for name, gpu, cpu in (("layers", 4, 2), ("heads", 16, 4), ("seq", 4096, 64), ("batch", 1, 4),
                           ("steps", 200, 30), ("lr", 1e-3, 3e-3)):
        if getattr(a, name) is None:
            setattr(a, name, gpu if on_gpu else cpu)
        elif not getattr(a, name) > 0:
            raise SystemExit(f"megamoe train: --{name} must be > 0, got {getattr(a, name)}")
    a.warmup = a.warmup if a.warmup is not None else max(1, a.steps // 10)
    a.eval_every = a.eval_every if a.eval_every is not None else max(1, a.steps // 5)
    if a.eval_every < 1 or a.warmup < 0:
        raise SystemExit(f"megamoe train: --eval-every must be >= 1 and --warmup >= 0, got {a.eval_every}, {a.warmup}")
    a.timing_skip = a.timing_skip if a.timing_skip is not None else (10 if on_gpu else 2)
    a.dtype = a.dtype or ("bf16" if on_gpu else "fp32")
    return a


def lr_at(step: int, args) -> float:
    """Linear warm-up to args.lr, then cosine decay to 10% of it at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def clip_multipliers(replicated: list[torch.Tensor], local: list[torch.Tensor], max_norm: float,
                     world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global norm, replicated multiplier, expert multiplier) as device scalars: min(1, max_norm / norm) and that
    over W. Replicated grads (DDP-averaged) count once; expert grads are divided by W and their squares summed over
    the ranks. Nothing is scaled here: MasterAdamW.step applies the multipliers."""
    dev = (replicated + local)[0].device

    def sq(ts):
        grads = [t.grad for t in ts if t.grad is not None]
        if not grads:
            return torch.zeros((), device=dev)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).pow(2).sum()

    rep, loc = sq(replicated), sq(local)
    dist.all_reduce(loc)
    norm = (rep + loc / world**2).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return norm, coef, coef / world


def train_step(ddp, data: torch.Tensor, opt: MasterAdamW, replicated: list[torch.Tensor], experts: list[torch.Tensor],
               clip: float, world: int, autocast, marks: Marks):
    """One step on ``data`` int64 [B, S + 1] (inputs [:, :-1], targets [:, 1:]): forward, backward, clip
    multipliers, update, grads cleared. No host reads (tests/test_sync_free_cpu.py checks), so it returns detached
    device tensors (cross-entropy, aux loss, tokens per expert [L, E], grad norm). ``marks``: timing marks after the
    forward, the backward and the update."""
    with autocast:
        logits, aux, load = ddp(data[:, :-1])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        loss = ce + aux
    marks.mark()
    loss.backward()
    marks.mark()
    gnorm, mult_rep, mult_exp = clip_multipliers(replicated, experts, clip, world)
    opt.step([mult_rep, mult_exp])  # the multipliers scale the grads as the update reads them
    opt.zero_grad()
    marks.mark()
    return ce.detach(), aux.detach(), load.detach(), gnorm


def train_backend(backend: str, args, device: torch.device, corpus: ByteCorpus) -> dict:
    """Train one model with ``backend``; returns this rank's summary (rank 0's is the one reported)."""
    W, rank = dist.get_world_size(), dist.get_rank()
    on_gpu = device.type == "cuda"
    ep_group = dist.new_group(list(range(W)))  # the MoE layers' own communicator, apart from DDP's
    moe_cfg = preset(args.preset, dtype=parse_dtype(args.dtype), max_tokens_per_rank=args.batch * args.seq)
    cfg = ModelConfig(moe_cfg, layers=args.layers, heads=args.heads, max_seq=args.seq)
    model = MoETransformer(cfg, group=ep_group, backend=backend, device=device, seed=args.seed)
    graphed = bool(args.graph_moe) and model.blocks[0].moe.backend_name != "torch"
    # make_graphed_callables needs autocast's weight-cast cache off (each weight is cast once per forward anyway)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not graphed) if on_gpu
                else contextlib.nullcontext())
    if args.compile:
        for blk in model.blocks:
            blk.dense = torch.compile(blk.dense, backend=args.compile)
    expert_names = model.expert_parameter_names()
    experts = [model.get_parameter(name) for name in expert_names]
    replicated = [p for name, p in model.named_parameters() if name not in expert_names]
    opt = MasterAdamW([replicated, experts], lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                      moments_dtype=torch.bfloat16 if args.adam_moments == "bf16" else torch.float32)
    fp8_layers = [blk.moe for blk in model.blocks if getattr(blk.moe.backend, "fp8", False)]
    for moe in fp8_layers:  # the update pass refreshes the FP8 weights: the layers never quantise them
        for p, copy in moe.backend.fp8_copies():
            opt.maintain_fp8(p, copy)
    if graphed:  # after maintain_fp8: a layer whose FP8 copies the optimizer keeps reads them in its graphs
        capture_moe_layers([blk.moe for blk in model.blocks], args.batch * args.seq, autocast)
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    # buffers are equal on every rank: no broadcast per forward (torch 2.13 warns on the older broadcast_buffers)
    no_sync = next(k for k in ("forward_sync_buffers", "broadcast_buffers") if k in inspect.signature(DDP).parameters)
    ddp = DDP(model, device_ids=[device.index] if on_gpu else None, **{no_sync: False})
    opt.reload_masters(replicated)  # the masters follow DDP's broadcast of rank 0's replicated parameters

    history, start = {"step": [], "loss": [], "aux": [], "lr": [], "grad_norm": [], "eval": []}, 0
    ckpt = os.path.join(args.out, "ckpt-" + re.sub(r"[^A-Za-z0-9_.-]", "_", backend), f"rank{rank}.pt")
    if args.resume and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])  # also sets the bf16 parameters from the float32 masters
        history, start = state["history"], state["step"]
    times = {"forward": [], "backward": [], "optimizer": [], "step": []}
    load_sum = None
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    show = rank == 0 and not args.quiet
    t_run = time.perf_counter()
    end = min(args.steps, args.stop_at) if args.stop_at else args.steps
    tokens_per_step = args.batch * args.seq
    for step in range(start, end):
        opt.lr = lr = lr_at(step, args)
        data = corpus.batch("train", args.batch, args.seq, args.seed, step, rank).to(device)
        marks = Marks(device)
        ce, aux, load, gnorm = train_step(ddp, data, opt, replicated, experts, args.clip, W, autocast, marks)
        # what follows reads the step's results on the host (logging, timing): kept out of train_step
        load_sum = load.clone() if load_sum is None else load_sum + load
        stats = torch.stack([ce.float(), aux.float()])
        dist.all_reduce(stats)
        stats = (stats / W).tolist()
        fwd, bwd, optim = marks.elapsed()
        if step - start >= args.timing_skip:
            for key, v in zip(times, (fwd, bwd, optim, fwd + bwd + optim), strict=True):
                times[key].append(v)
        for key, v in zip(("step", "loss", "aux", "lr", "grad_norm"), (step, *stats, lr, float(gnorm)), strict=True):
            history[key].append(v)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            history["eval"].append((step, evaluate(ddp, corpus, args, device, autocast, rank, W)))
        if show:
            tps = tokens_per_step / statistics.median(times["step"]) if times["step"] else float("nan")
            bar = "#" * int(30 * (step + 1) / args.steps)
            sys.stderr.write(f"\r[{backend}] [{bar:<30}] step {step + 1}/{args.steps} loss {stats[0]:.4f} "
                             f"aux {stats[1]:.4f} lr {lr:.2e} {tps:,.0f} tok/s/GPU")
            if not sys.stderr.isatty() or step + 1 == end:
                sys.stderr.write("\n")
            sys.stderr.flush()
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            os.makedirs(os.path.dirname(ckpt), exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "history": history}, ckpt)
    wall = time.perf_counter() - t_run
    med = {k: (statistics.median(v) if v else None) for k, v in times.items()}
    dist.all_reduce(load_sum if load_sum is not None else torch.zeros(1, device=device))
    summary = {
        "backend": backend, "moe_cuda_graph": graphed,
        "compiled_dense": args.compile,  # torch.compile backend of the dense parts, or None
        "fp8": bool(fp8_layers),  # FP8 layers, their weight copies kept by the optimizer
        "steps_run": end - start, "tokens_per_step_per_gpu": tokens_per_step,
        "tokens_per_s_per_gpu": tokens_per_step / med["step"] if med["step"] else None,
        "step_time_s": med, "wall_s": wall,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
        "history": history, "expert_load": load_sum.sum(0).tolist() if load_sum is not None else None,
        "final_loss": history["loss"][-1] if history["loss"] else None,
    }
    del ddp, model, opt
    # make_graphed_callables leaves reference cycles: free the graphs and pool before the next backend's run
    gc.collect()
    torch.cuda.empty_cache()
    close_heaps()  # the split and fused backends' symmetric heaps belong to ep_group
    dist.destroy_process_group(ep_group)
    return summary


@torch.no_grad()
def evaluate(ddp, corpus, args, device, autocast, rank, W) -> float:
    losses = []
    for i in range(args.eval_batches):
        data = corpus.batch("eval", args.batch, args.seq, args.seed, i, rank).to(device)
        with autocast:
            logits, _, _ = ddp.module(data[:, :-1])
        losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1)))
    loss = torch.stack(losses).mean()
    dist.all_reduce(loss)
    return float(loss / W)


def run_rank(args, device: torch.device) -> dict | None:
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when this process's cuBLAS starts
        torch.use_deterministic_algorithms(True)
        # no NaN fill of every torch.empty (a kernel per allocation): megamoe's kernels write what they read
        torch.utils.deterministic.fill_uninitialized_memory = False
    corpus = ByteCorpus(args.files or None)
    results = []
    for b in args.backends.split(","):
        results.append(train_backend(b, args, device, corpus))
        gc.collect()  # what the finished run's locals held (graphs, their pool) goes before the next run
        torch.cuda.empty_cache()
    if dist.get_rank() != 0:
        return None
    return {"meta": run_metadata(device, dist.get_world_size()),
            "config": {k: v for k, v in vars(args).items() if k not in ("quiet",)},
            "corpus": {"files": len(corpus.files), "train_bytes": len(corpus.train), "eval_bytes": len(corpus.eval)},
            "results": results}


def _finish(report: dict, args) -> None:
    path = os.path.join(args.out, "summary.json")
    write_json(path, report)
    bw = max([8] + [len(r["backend"]) for r in report["results"]])
    lines = [f"{'backend':<{bw}} {'tok/s/GPU':>10} {'step ms':>8} {'fwd':>7} {'bwd':>7} {'opt':>7} {'peak GiB':>9} "
             f"{'final loss':>10}"]
    ms = lambda v: f"{v * 1e3:7.1f}" if v else f"{'n/a':>7}"
    for r in report["results"]:
        st = r["step_time_s"]
        peak = f"{r['peak_memory_bytes'] / 2**30:9.2f}" if r["peak_memory_bytes"] else f"{'n/a':>9}"
        tps = f"{r['tokens_per_s_per_gpu']:10,.0f}" if r["tokens_per_s_per_gpu"] else f"{'n/a':>10}"
        lines.append(f"{r['backend']:<{bw}} {tps} {ms(st['step']):>8} {ms(st['forward'])} {ms(st['backward'])} "
                     f"{ms(st['optimizer'])} {peak} {r['final_loss']:10.4f}")
    print("\n".join(lines))
    print(f"wrote {path}")
    try:
        from matplotlib.figure import Figure  # no pyplot: no backend to choose, no figure to close
    except ImportError:
        print("matplotlib not installed: no loss.png")
        return
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for r in report["results"]:
        h = r["history"]
        ax.plot(h["step"], h["loss"], label=f"{r['backend']} train", lw=1)
        if h["eval"]:
            ax.plot([s for s, _ in h["eval"]], [v for _, v in h["eval"]], "o--", ms=3, label=f"{r['backend']} eval")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=120)
    print(f"wrote {os.path.join(args.out, 'loss.png')}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    raw = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not raw.cpu
    if raw.graph_moe and not on_gpu:
        parser.error("--graph-moe captures CUDA graphs and needs CUDA GPUs")
    args = _defaults(raw, on_gpu)
    report = run_ranks(run_rank, args, on_gpu, lambda world: preset(args.preset).validate_world(world), timeout_s=7200)
    if report is not None:
        _finish(report, args)
    return 0
