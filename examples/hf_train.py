"""Train a transformers MoE model built from a config (random init, no download) in one run as transformers runs it
(its fastest built-in experts implementation), patched with ``megamoe.hf.patch``, and on a GPU also with the patched
experts captured in CUDA graphs (``megamoe.hf.capture``); report tokens/s, peak memory and the loss curves (JSON, and
a PNG with matplotlib).

    python examples/hf_train.py                        # one GPU: 4 layers of Qwen3-30B-A3B's MoE shape, seq 4096
    python examples/hf_train.py --tiny --steps 3       # a few seconds on a CPU (the tests run this)

Data: byte windows of the Python standard library's sources (megamoe.apps.data), so the vocabulary is 256 and the
attention, embedding and head cost stays small next to the MoE layers whose speed is compared. Both runs start from
the same weights and see the same batches; AdamW in float32 masters is left out on purpose: bf16 parameters and
torch.optim.AdamW, fused on a GPU (transformers' Trainer default, ``adamw_torch_fused``), as a transformers user would
start.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from megamoe.apps.perf import Marks

QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                     norm_topk_prob=True)
TINY = dict(hidden_size=48, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, intermediate_size=64, norm_topk_prob=True)


def build(args):
    import transformers

    if args.arch != "qwen3_moe":
        raise SystemExit(f"--arch {args.arch}: this example builds qwen3_moe models only")
    dims = TINY if args.tiny else QWEN3_30B_A3B
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, num_hidden_layers=args.layers, max_position_embeddings=args.seq,
                                      output_router_logits=True, router_aux_loss_coef=0.001, **dims)
    cfg._experts_implementation = args.baseline_experts
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(args.device, getattr(torch, args.dtype))


def run(model, name, args, corpus) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    losses, t0, marks = [], None, []
    for step in range(args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        batch = corpus.batch("train", args.batch, args.seq, args.seed, step, 0).to(dev)
        # where a step's time goes (read after the loop: reading an event per step would stop the host running ahead)
        m = Marks(dev) if t0 is not None else None
        out = model(batch[:, :-1], labels=batch[:, :-1].contiguous())
        if m:
            m.mark()
        out.loss.backward()
        if m:
            m.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if m:
            m.mark()
            marks.append(m)
        losses.append(out.loss.detach())
    if cuda:
        torch.cuda.synchronize()
    timed = args.steps - args.warmup
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    phases = [m.elapsed() for m in marks]
    res = {"name": name, "losses": [float(v) for v in losses],
           "tokens_per_s": timed * args.batch * args.seq / secs if timed > 0 else None,
           "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
           "phase_ms": {k: 1e3 * statistics.median(p[i] for p in phases)
                        for i, k in enumerate(("forward", "backward", "optimizer"))} if phases else None}
    split = " / ".join(f"{v:.1f}" for v in res["phase_ms"].values()) if phases else "-"
    print(f"{name}: final loss {res['losses'][-1]:.4f}, {res['tokens_per_s'] or 0:.0f} tokens/s, "
          f"peak {res['peak_memory_gib'] or 0:.2f} GiB, forward / backward / optimizer {split} ms", flush=True)
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10, help="steps before the clock starts")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="split", help="megamoe backend of the patched run (name[:opt=value...])")
    p.add_argument("--baseline-experts", default="grouped_mm", help="transformers' experts implementation")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--ceiling", action="store_true",
                   help="also the model with its experts skipped: the speed-up no experts implementation can pass")
    p.add_argument("--json", default="hf_train.json")
    p.add_argument("--png", default="hf_train.png")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.warmup = min(args.seq, 32), min(args.warmup, 1)
    from megamoe import hf
    from megamoe.apps.data import ByteCorpus
    from megamoe.backends import parse_backend

    corpus = ByteCorpus(max_bytes=8 << 20)
    backend, options = parse_backend(args.backend)
    tokens = args.batch * args.seq

    def patched():
        return hf.patch(build(args), backend, max_tokens_per_rank=tokens, **options)

    def ceiling():  # the experts reduced to what any implementation does: read the weights, write their gradients
        model = build(args)
        for m in model.modules():
            if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"):
                def skip(hs, idx, w, m=m):
                    touch = (m.gate_up_proj.sum() + m.down_proj.sum()) * 0
                    return hs * w.sum(-1, keepdim=True).to(hs.dtype) + touch.to(hs.dtype)
                m.forward = skip
        return model

    # every run builds the same model from the seed, alone on the device (its peak memory is its own)
    runs = [(f"transformers ({args.baseline_experts})", lambda: build(args))]
    if args.ceiling:
        runs.append(("experts skipped (weights read, gradients written: the ceiling)", ceiling))
    runs.append((f"megamoe ({args.backend})", patched))
    if args.device == "cuda":  # eager training pays the experts' kernel chain from Python per layer: graph it
        runs.append((f"megamoe ({args.backend}, experts graphed)", lambda: hf.capture(patched(), tokens)))
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"config": vars(args), "device": dev_name, "torch": torch.__version__, "runs": []}
    for name, make in runs:
        model = make()
        report["runs"].append(run(model, name, args, corpus))
        del model
        gc.collect()  # (a run's cycles, e.g. the ceiling's forwards, would hold its weights into the next run)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        with open(args.json, "w") as f:  # after every run: a run cut short leaves the finished ones
            json.dump(report, f, indent=1)
    results = report["runs"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            ax.plot(r["losses"], label=f"{r['name']}: {r['tokens_per_s'] or 0:.0f} tok/s")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.savefig(args.png, dpi=120, bbox_inches="tight")
    except ImportError:
        print("matplotlib not installed: no PNG")
    return report


if __name__ == "__main__":
    main()
