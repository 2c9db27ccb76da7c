"""An FP8 ``split`` layer in a CUDA graph, its weights quantised in every replay (the layer's own copies, which a graph
cannot check) against copies kept by the optimizer (MasterAdamW.maintain_fp8 + SplitBackend.fp8_copies: the graph
reads them as they are), with bf16 beside them; each rank its own layer.

    torchrun --nproc_per_node 1 benchmarks/fp8_graph_bench.py --preset qwen3-30b-a3b --tokens 4096 [--json out.json]

Timed per variant (median of --iters replays after warm-up, CUDA events, max over ranks):
    fwd         a graphed forward under no_grad (evaluation; a graph replayed between updates)
    fwd+bwd     a graphed forward + backward (a micro-batch of gradient accumulation)
    step        fwd+bwd replay + the optimizer step (eager, MasterAdamW; with managed copies it requantises the weights
                right after updating them): one training step without accumulation
The outputs of the two FP8 variants are compared bitwise after a step (same weights, same quantisation).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from megamoe.apps.perf import write_results
from megamoe.config import preset
from megamoe.dist import init_from_env
from megamoe.layer import MoE
from megamoe.optim import MasterAdamW


def graphed(fn, dev, before_capture=None):
    """fn captured in a CUDA graph after warm-up on a side stream; returns (replay, static output)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    side.synchronize()
    if before_capture is not None:
        before_capture()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        out = fn()
    torch.cuda.synchronize()
    return g.replay, out


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def variant(name: str, cfg, dev, x, dy, iters: int) -> tuple[dict, torch.Tensor]:
    fp8, managed = name != "bf16", name == "fp8-managed"
    moe = MoE(cfg, backend="split", device=dev, seed=1, **({"fp8": True} if fp8 else {}))
    opt = MasterAdamW([[moe.w13, moe.w2], [moe.router.weight]], lr=1e-4)
    if managed:
        for p, c in moe.backend.fp8_copies():
            opt.maintain_fp8(p, c)

    def fwd():
        with torch.no_grad():
            return moe(x).out

    def fwd_bwd():
        out = moe(x).out
        out.backward(dy)
        return out

    row = {"variant": name}
    replay, _ = graphed(fwd, dev)
    row["fwd_ms"] = timed(replay, iters)
    def clear_grads():  # the graph then allocates the grads and overwrites them in every replay (no accumulation)
        for p in moe.parameters():
            p.grad = None

    replay, out = graphed(fwd_bwd, dev, clear_grads)
    row["fwd_bwd_ms"] = timed(replay, iters)

    def step():
        replay()
        opt.step()  # the grads the graph wrote stay in place: no zero_grad between replays

    row["step_ms"] = timed(step, iters)
    replay()
    torch.cuda.synchronize()
    return row, out.detach().clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = init_from_env()
    world = dist.get_world_size()
    cfg = preset(args.preset, max_tokens_per_rank=args.tokens)
    gen = torch.Generator(device=dev).manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    dy = torch.randn(args.tokens, cfg.hidden, device=dev, dtype=cfg.dtype, generator=gen)
    rows, outs = [], {}
    for name in ("bf16", "fp8-layer", "fp8-managed"):
        row, outs[name] = variant(name, cfg, dev, x, dy, args.iters)
        row.update(preset=args.preset, tokens=args.tokens, ep=world)
        rows.append(row)
        torch.cuda.empty_cache()
    same = torch.equal(outs["fp8-layer"], outs["fp8-managed"])
    if dist.get_rank() == 0:
        print(f"{args.preset} EP {world}, {args.tokens} tokens/GPU, graphed; FP8 outputs after the same steps "
              f"bitwise equal: {same}")
        print(f"{'variant':12s} {'fwd ms':>8s} {'fwd+bwd':>8s} {'step':>8s}")
        for r in rows:
            r["fp8_outputs_equal"] = same
            print(f"{r['variant']:12s} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} {r['step_ms']:8.3f}")
        write_results(args.json, dev, "fp8_graph", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
