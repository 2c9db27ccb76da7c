"""Which op of the split backend breaks CUDA-graph capture? Captures each piece alone on one GPU rank."""
import sys
import traceback

import torch

from megamoe.dist import spawn


def _try(name, fn, dev):
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            fn()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        return f"{name}: OK"
    except Exception as exc:  # noqa: BLE001
        return f"{name}: FAIL {type(exc).__name__}: {str(exc).splitlines()[0]} @ " + \
            " | ".join(l.strip() for l in traceback.format_exc().splitlines() if "megamoe" in l)[-600:]


def run(rank, world, which):
    from megamoe import MoE, preset
    from megamoe import experts as X

    dev = torch.device("cuda", rank)
    cfg = preset("qwen3-30b-a3b", max_tokens_per_rank=1024)
    moe = MoE(cfg, backend="split", device=dev, seed=1)
    x = torch.randn(1024, cfg.hidden, device=dev, dtype=cfg.dtype)
    dy = torch.randn_like(x)
    R, H, I, E = 8192, cfg.hidden, cfg.intermediate, moe.local_experts
    offs = torch.linspace(0, R, E + 1, device=dev).to(torch.int32)
    a = torch.randn(R, H, device=dev, dtype=cfg.dtype)
    h = torch.randn(R, 2 * I, device=dev, dtype=cfg.dtype)
    act = torch.randn(R, I, device=dev, dtype=cfg.dtype)
    dout = torch.randn(R, H, device=dev, dtype=cfg.dtype)
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    opt_loop = torch.optim.SGD(moe.parameters(), lr=1e-3, foreach=False)

    def step(o):
        o.zero_grad(set_to_none=False)
        moe(x.requires_grad_()).out.backward(dy)
        o.step()

    def manual():
        for p in moe.parameters():
            if p.grad is not None:
                p.grad.zero_()
        moe(x.requires_grad_()).out.backward(dy)
        with torch.no_grad():
            for p in moe.parameters():
                p.add_(p.grad, alpha=-1e-3)

    tests = {
        "gemm1_swiglu": lambda: X.gemm1_swiglu(a, moe.w13.data, offs),
        "gemm2": lambda: X.gemm2(act, moe.w2.data, offs),
        "gemm2_dgrad_swiglu": lambda: X.gemm2_dgrad_swiglu(dout, moe.w2.data, h, offs),
        "gemm1_dgrad": lambda: X.gemm1_dgrad(h, moe.w13.data, offs, out=torch.zeros_like(a)),
        "wgrad_w2": lambda: X.grouped_wgrad(dout, act, offs, out_dtype=cfg.dtype),
        "wgrad_w13": lambda: X.grouped_wgrad(h, a, offs, out_dtype=cfg.dtype),
        "fwd": lambda: moe(x),
        "fwd+bwd": lambda: moe(x.requires_grad_()).out.backward(dy),
        "step-manual": manual,
        "step-sgd-loop": lambda: step(opt_loop),
        "step-sgd-foreach": lambda: step(opt),
    }
    return [_try(n, f, dev) for n, f in tests.items() if which in ("all", n)]


if __name__ == "__main__":
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for r, lines in enumerate(spawn(run, world, sys.argv[1] if len(sys.argv) > 1 else "all", device="cuda",
                                    timeout_s=200)):
        for line in lines:
            print(f"rank {r} of {world}: {line}")
