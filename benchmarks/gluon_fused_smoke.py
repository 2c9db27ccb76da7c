"""Quick check of the Gluon megakernel items (fused:kernel=gluon) on one GPU before the full tests: the qwen3 layer
(EP = 1) against the Triton megakernel on the same weights and inputs (forward + backward, dense and a cycling
ring), then forward times of both (CUDA events, eager, median of 20). Prints a short table."""

from __future__ import annotations

import argparse
import os

import torch

from megamoe.dist import spawn
from megamoe.testing import LayerCase, twin_runs


def _rank(rank: int, world: int, preset: str, experts: int, tokens: int) -> list[str]:
    dev = torch.device("cuda", rank)
    case = LayerCase("smoke", preset=preset, dtype="bf16", tokens=tuple([tokens] * world),
                     overrides={"num_experts": experts})
    out = []
    for label, a, b in (("dense", {}, {"kernel": "gluon"}),
                        ("ring8", {"ring_blocks": 8}, {"ring_blocks": 8, "kernel": "gluon"}),
                        ("pull", {"combine": "pull"}, {"combine": "pull", "kernel": "gluon"})):
        t = twin_runs(case, dev, ("fused", a), ("fused", b))
        out.append(f"{label}: " + ", ".join(f"{k} {'==' if eq else f'{rel:.2e}'}" for k, (eq, rel, _c) in t.items()))
    from megamoe.layer import MoE
    cfg = case.config()
    x = torch.randn(tokens, cfg.hidden, device=dev, dtype=cfg.dtype)
    for label, opts in (("triton", {}), ("gluon", {"kernel": "gluon"})):
        moe = MoE(cfg, backend="fused", device=dev, seed=0, **opts)
        times = []
        with torch.no_grad():
            for i in range(25):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                moe(x)
                e.record()
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(s.elapsed_time(e))
        times.sort()
        out.append(f"forward {label}: {times[len(times) // 2]:.3f} ms (eager, median of 20)")
        del moe
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    for line in spawn(_rank, 1, args.preset, args.experts, args.tokens, device="cuda", timeout_s=600)[0]:
        print(line, flush=True)


if __name__ == "__main__":
    main()
