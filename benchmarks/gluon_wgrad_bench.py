"""Time the warp-specialised Gluon weight-gradient kernel (megamoe/kernels/gluon_wgrad_ws.py) in several configs next
to the Triton wgrad kernel (its default config) on every preset's two weight gradients as the layer runs them (bf16
outputs): dW13 [E_l, 2I, H] = dh^T recv (x = dh [R, 2I], y = recv [R, H]) and dW2 [E_l, H, I] = g_out^T act (x = g_out
[R, H], y = act [R, I]). R = tokens * k rows, multinomial group sizes in multiples of 16 rows (as the other GEMM
benchmarks). Every ws output is checked against the Triton kernel's (relative difference printed and kept).

    python benchmarks/gluon_wgrad_bench.py [--shapes deepseek-v3:4,mixtral-8x7b:4] [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import torch
import triton

import megamoe.experts as X
from megamoe.bench_gemm import PRESETS
from megamoe.kernels.gemm_config import GemmConfig
from megamoe.perf import expert_offsets, report_kernel_rows, run_shapes

#: (label, block_n, block_k, stages, group_m)
VARIANTS = [("ws bn256 bk64 s3", 256, 64, 3, 8), ("ws bn256 bk64 s2", 256, 64, 2, 8),
            ("ws bn256 bk32 s6", 256, 32, 6, 8), ("ws bn128 bk64 s5", 128, 64, 5, 8),
            ("ws bn256 bk64 s3 g16", 256, 64, 3, 16)]


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _one(spec, op, x, y, offs, base, rows) -> None:
    M, N = x.shape[1], y.shape[1]
    R = x.shape[0]
    flops = 2.0 * R * M * N
    tri_cfg = X.default_config("wgrad", R, N, M).with_(kernel="triton")
    ref = X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=tri_cfg)
    t_tri = bench(lambda: X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=tri_cfg))
    new = [dict(base, kernel="triton", ms=t_tri)]
    for label, bn, bk, st, gm in VARIANTS:
        cfg = GemmConfig(block_m=128, block_n=bn, block_k=bk, num_stages=st, num_warps=4, group_m=gm,
                         kernel="gluon_ws")
        try:
            got = X.grouped_wgrad(x, y, offs, out_dtype=torch.bfloat16, config=cfg)
            torch.cuda.synchronize()
            diff = _rel(got, ref)
            del got
            new.append(dict(base, kernel=label, ms=bench(lambda cfg=cfg: X.grouped_wgrad(
                x, y, offs, out_dtype=torch.bfloat16, config=cfg)), rel_diff_vs_triton=diff))
        except Exception as exc:  # noqa: BLE001 - reported, the other configs still run
            new.append(dict(base, kernel=label, error=f"{type(exc).__name__}: {exc}"[:300]))
    report_kernel_rows(spec, op, flops, t_tri, new, rows, base="triton", diff_key="rel_diff_vs_triton")


def run_shape(name: str, ep: int, tokens: int, rows: list) -> None:
    H, I, E, k = PRESETS[name]
    E_l, R = E // ep, tokens * k
    offs = expert_offsets(R, E_l)
    spec = f"{name}:{ep}:{tokens}"
    base = {"shape": spec, "R": R, "H": H, "I": I, "E_l": E_l}
    dh = torch.randn(R, 2 * I, device="cuda").to(torch.bfloat16)
    recv = torch.randn(R, H, device="cuda").to(torch.bfloat16)
    _one(spec, "wgrad1 dW13", dh, recv, offs, dict(base, op="wgrad1"), rows)
    del dh
    act = torch.randn(R, I, device="cuda").to(torch.bfloat16)
    _one(spec, "wgrad2 dW2", recv, act, offs, dict(base, op="wgrad2"), rows)


def main() -> None:
    run_shapes(run_shape, "qwen3-30b-a3b:4,deepseek-v3:4,mixtral-8x7b:4,gpt-oss-120b:4")


if __name__ == "__main__":
    main()
