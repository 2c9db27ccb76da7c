"""`megamoe bench-gemm`: time the expert grouped GEMMs next to torch._grouped_mm / torch._scaled_grouped_mm.

Shapes: every preset's expert GEMMs at T tokens per GPU under expert parallelism EP: R = T * k rows per rank
(balanced random routing: group sizes drawn multinomially over E_l = E / EP experts, in units of --align
rows so the torch kernels accept them), H hidden, I intermediate.
    GEMM1  [R, H] x w13 [E_l, 2I, H]^T -> h [R, 2I]  (ours also applies SwiGLU and writes act [R, I])
    GEMM2  [R, I] x w2 [E_l, H, I]^T   -> [R, H]     (ours with the per-row gate scale)
flops: GEMM1 2*R*H*2I, GEMM2 2*R*I*H; backward: dgrad2+SwiGLU 2*R*H*I, dgrad1 2*R*2I*H, wgrads the same.
bytes (minimum): each operand read once, each output written once. floor = max(flops / 790 TFLOP/s (bf16)
or 1345 TFLOP/s (fp8), bytes / 4.3 TB/s), the ceilings measured on H200 (shared/MEASURED.md).
Timing: triton.testing.do_bench, median, after warm-up; every operand is larger than L2 except where noted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import math
import operator
import sys
import time

import torch
import triton

from megamoe.apps.perf import git_commit, write_json
from megamoe.config import PRESETS as CONFIGS

#: name -> (H, I, E, k) of megamoe.config's preset
PRESETS = {n: (CONFIGS[n].hidden, CONFIGS[n].intermediate, CONFIGS[n].num_experts, CONFIGS[n].top_k)
           for n in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "gpt-oss-120b")}
TINY = {"tiny": (256, 128, 8, 2)}  # CPU smoke test under the interpreter (--device cpu)
PEAK = {"bf16": 790e12, "fp8": 1345e12}
HBM = 4.3e12


def _group_sizes(R: int, E_l: int, align: int, gen: torch.Generator) -> list[int]:
    probs = torch.full((E_l,), 1.0 / E_l)
    counts = torch.multinomial(probs, R // align, replacement=True, generator=gen).bincount(minlength=E_l) * align
    counts[-1] += R - int(counts.sum())
    return counts.tolist()


def _bench(fn, rep_ms: float) -> float:
    if not torch.cuda.is_available():  # CPU smoke run: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _rowwise_fp8(t: torch.Tensor, dim: int):
    s = t.float().abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 448.0
    return (t.float() / s).to(torch.float8_e4m3fn), s.squeeze(dim)


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _torch_time(a, w, ends, rep_ms: float, extra: dict, fp8: bool, check=None):
    """(ms, None) of torch's grouped GEMM a [R, K] x w [E_l, N, K]^T -> [R, N] bf16 (fp8: both quantised per row to
    e4m3, torch._scaled_grouped_mm), or (None, the error) where torch does not take it; ``check(out)`` first adds
    fields to ``extra``."""
    try:
        if fp8:
            ar, ars = _rowwise_fp8(a, 1)
            wr, wrs = _rowwise_fp8(w, 2)
            fn = lambda: torch._scaled_grouped_mm(ar, wr.transpose(-2, -1), ars, wrs, offs=ends,
                                                  out_dtype=torch.bfloat16, use_fast_accum=True)
        else:
            fn = lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16)
        if check is not None:
            extra.update(check(fn()))
        return _bench(fn, rep_ms), None
    except Exception as exc:  # noqa: BLE001 - a shape or dtype torch does not take is reported
        return None, _failure(exc)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


#: the kernels one op may launch (Gluon where it runs, else Triton); the JSON records which one did
FP8_KERNELS = ("_gluon_fp8_ws_kernel", "_grouped_gemm_fp8_kernel")  # GEMM1 + SwiGLU and GEMM2 in FP8
BF16_KERNELS = ("_gluon_bf16_ws_kernel", "_grouped_gemm_kernel")  # the bf16 forward's and dgrad2's
DGRAD1_KERNELS = ("_grouped_gemm_kernel",)  # GEMM1's dgrad (kn weights): the Triton kernel everywhere
WGRAD_KERNELS = ("_gluon_wgrad_ws_kernel", "_grouped_wgrad_kernel")


def _regs(kernel_names: tuple[str, ...], compiled: dict) -> dict:
    """Registers, spills and shared memory of the first of ``kernel_names`` in ``compiled`` (gemm_config's
    LAST_COMPILED: what the last call launched)."""
    name = next((n for n in kernel_names if n in compiled), None)
    if name is None:
        return {}
    out = {"kernel": name}
    for key, attr in (("n_regs", "n_regs"), ("n_spills", "n_spills"), ("shared_bytes", "metadata.shared")):
        with contextlib.suppress(Exception):  # attribute names differ across triton versions
            out[key] = int(operator.attrgetter(attr)(compiled[name]))
    return out


def _time_ours(call, configs, kernel_names, rep_ms):
    """Time ``call(config)``, one of our ops, with each config (None: the default); returns the rows."""
    from megamoe.kernels.gemm_config import LAST_COMPILED

    results = []
    for cfg in configs:
        try:
            fn = functools.partial(call, cfg)
            for n in kernel_names:
                LAST_COMPILED.pop(n, None)
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            regs = _regs(kernel_names, LAST_COMPILED)
            results.append({"config": None if cfg is None else cfg.__dict__, "ms": _bench(fn, rep_ms), **regs})
        except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory) is reported
            results.append({"config": None if cfg is None else cfg.__dict__, "error": _failure(exc)})
    return results


def run_shape(preset: str, tokens: int, ep: int, args, candidates=None) -> list[dict]:
    """The rows of one shape; candidates(op) -> the configs to time for op (default: the default config only)."""
    import megamoe.experts as X

    configs = candidates or (lambda op: [None])
    H, I, E, k = {**PRESETS, **TINY}[preset]
    E_l, R = E // ep, tokens * k
    dev = torch.device(args.device)
    sizes = _group_sizes(R, E_l, args.align, torch.Generator().manual_seed(args.seed))
    offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ends = offs[1:].contiguous()
    dgen = torch.Generator(device=dev).manual_seed(args.seed)  # the operands too: rel_err fields repeat
    x = torch.randn(R, H, device=dev, dtype=torch.bfloat16, generator=dgen)
    w13 = (torch.randn(E_l, 2 * I, H, device=dev, generator=dgen) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(E_l, H, I, device=dev, generator=dgen) / math.sqrt(I)).to(torch.bfloat16)
    s = torch.rand(R, device=dev, generator=dgen) + 0.5
    rows = []
    base = {"preset": preset, "tokens_per_gpu": tokens, "ep": ep, "R": R, "H": H, "I": I, "E_l": E_l,
            "group_min": min(sizes), "group_max": max(sizes)}
    fl1, fl2 = 2.0 * R * H * 2 * I, 2.0 * R * I * H  # GEMM1's and GEMM2's flops and minimum bytes
    by1, by2 = 2 * (R * H + E_l * 2 * I * H + R * I + R * 2 * I), 2 * (R * I + E_l * H * I + R * H)

    def add(op, dtype, flops, nbytes, key, kernels, call, vs_torch=(), check=None, **extra):
        """op's row: torch's GEMM of ``vs_torch`` (a, w) timed if given, then ``call(config)`` per ``configs(key)``."""
        torch_ms, torch_err = (_torch_time(*vs_torch, ends, args.rep, extra, dtype == "fp8", check) if vs_torch
                               else (None, None))
        ours = _time_ours(call, configs(key), kernels, args.rep)
        best = min((r for r in ours if "ms" in r), key=lambda r: r["ms"], default={})
        floor = max(flops / PEAK[dtype], nbytes / HBM) * 1e3
        rows.append(dict(base, op=op, dtype=dtype, flops=flops, bytes=nbytes, floor_ms=floor, ours_ms=best.get("ms"),
                         ours_tflops=flops / best["ms"] / 1e9 if best else None, ours_config=best.get("config"),
                         ours_kernel=best.get("kernel"), n_regs=best.get("n_regs"), n_spills=best.get("n_spills"),
                         torch_ms=torch_ms, torch_tflops=flops / torch_ms / 1e9 if torch_ms else None,
                         torch_error=torch_err, candidates=ours, **extra))

    act, h = X.gemm1_swiglu(x, w13, offs)
    add("gemm1_swiglu", "bf16", fl1, by1, "gemm1", BF16_KERNELS,
        lambda c: X.gemm1_swiglu(x, w13, offs, out=act, h_out=h, config=c), (x, w13),
        lambda h_t: {"rel_err_h_vs_torch": _rel(h, h_t)})

    out = X.gemm2(act, w2, offs, scale=s)
    add("gemm2", "bf16", fl2, by2, "gemm2", BF16_KERNELS, lambda c: X.gemm2(act, w2, offs, scale=s, out=out, config=c),
        (act, w2), lambda o_t: {"rel_err_vs_torch": _rel(out, o_t * s[:, None])})

    if not args.no_fp8:
        (xq, xs), (w13q, w13s) = X.quantize_act(x), X.quantize_weight(w13)
        (aq, as_), (w2q, w2s) = X.quantize_act(act), X.quantize_weight(w2)
        a8, h8 = X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs)
        add("gemm1_swiglu", "fp8", fl1, by1 // 2, "gemm1_fp8", FP8_KERNELS,
            lambda c: X.gemm1_swiglu_fp8(xq, xs, w13q, w13s, offs, config=c), (x, w13),
            lambda h_t: {"torch_rowwise_rel_err_h_vs_bf16": _rel(h_t, h)},
            rel_err_h_vs_bf16=_rel(h8, h), rel_err_act_vs_bf16=_rel(a8, act))
        del a8, h8
        o8 = X.gemm2_fp8(aq, as_, w2q, w2s, offs, scale=s)
        add("gemm2", "fp8", fl2, by2 // 2, "gemm2_fp8", FP8_KERNELS,
            lambda c: X.gemm2_fp8(aq, as_, w2q, w2s, offs, scale=s, config=c), (act, w2), rel_err_vs_bf16=_rel(o8, out))
        del xq, w13q, aq, w2q, o8

    if not args.no_bwd:  # the backward: ours only, no torch timing
        dy = torch.randn(R, H, device=dev, dtype=torch.bfloat16, generator=dgen)
        dh, _ = X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s)
        add("dgrad2_swiglu", "bf16", fl2, 2 * (R * H + E_l * H * I + 3 * R * 2 * I), "dgrad2", BF16_KERNELS,
            lambda c: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s, out=dh, config=c))
        dx = torch.empty_like(x)
        add("dgrad1", "bf16", fl1, 2 * (R * 2 * I + E_l * 2 * I * H + R * H), "dgrad1", DGRAD1_KERNELS,
            lambda c: X.gemm1_dgrad(dh, w13, offs, out=dx, config=c))
        add("wgrad1", "bf16", fl1, 2 * (R * 2 * I + R * H + E_l * 2 * I * H), "wgrad1", WGRAD_KERNELS,
            lambda c: X.grouped_wgrad(dh, x, offs, out_dtype=torch.bfloat16, config=c))
        add("wgrad2", "bf16", fl2, 2 * (R * H + R * I + E_l * H * I), "wgrad2", WGRAD_KERNELS,
            lambda c: X.grouped_wgrad(dy, act, offs, out_dtype=torch.bfloat16, config=c))
    return rows


#: the table's short name of the kernel that ran (the JSON keeps the full name as ours_kernel)
KERNEL_TAGS = {n: "gluon" if n.startswith("_gluon") else "triton"
               for n in (*FP8_KERNELS, *BF16_KERNELS, *WGRAD_KERNELS, "_gluon_fp8_dswiglu_kernel")}


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(rows: list[dict]) -> None:
    print(f"{'preset':14} {'tok':>5} {'op':14} {'dt':4} {'ours ms':>8} {'TF/s':>6} {'torch ms':>8} {'TF/s':>6} "
          f"{'x':>5} {'floor':>6} {'regs':>4} {'spl':>3} cfg")
    for r in rows:
        ratio = r["torch_ms"] / r["ours_ms"] if r.get("torch_ms") and r.get("ours_ms") else None
        c = r.get("ours_config") or {}
        cfg = f"{c.get('block_m')}x{c.get('block_n')}x{c.get('block_k')}s{c.get('num_stages')}w{c.get('num_warps')}" \
            f"e{c.get('epi_split')}{'f' if c.get('flatten') else ''}" if c else "default"
        kernel = KERNEL_TAGS.get(r.get("ours_kernel") or "", "")
        print(f"{r['preset']:14} {r['tokens_per_gpu']:>5} {r['op']:14} {r['dtype']:4} {_fmt(r['ours_ms'], '8.3f')} "
              f"{_fmt(r['ours_tflops'], '6.0f')} {_fmt(r['torch_ms'], '8.3f')} {_fmt(r['torch_tflops'], '6.0f')} "
              f"{_fmt(ratio, '5.2f')} {_fmt(r['floor_ms'], '6.3f')} {_fmt(r.get('n_regs'), '4d')} "
              f"{_fmt(r.get('n_spills'), '3d')} {cfg}{' ' + kernel if kernel else ''}", flush=True)


def main(argv: list[str] | None = None, candidates=None) -> int:
    """The CLI; candidates: as run_shape's (benchmarks/gemm_sweep.py times a list per op, keeping the fastest)."""
    ap = argparse.ArgumentParser(prog="megamoe bench-gemm", description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS) + list(TINY))
    ap.add_argument("--device", default="cuda", help="'cpu' runs a smoke test under TRITON_INTERPRET=1")
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384], help="tokens per GPU")
    ap.add_argument("--ep", type=int, default=4, help="expert-parallel ranks (experts per rank = E / ep)")
    ap.add_argument("--align", type=int, default=16, help="group sizes are multiples of this many rows")
    ap.add_argument("--rep", type=float, default=60.0, help="do_bench repetition time per measurement (ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse HEAD)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench-gemm needs a CUDA GPU (or --device cpu --presets tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    rows = []
    for preset, tokens in itertools.product(args.presets, args.tokens):
        new = run_shape(preset, tokens, args.ep, args, candidates)
        torch.cuda.empty_cache()
        rows.extend(new)
        print_table(new)
        if args.json:  # after every shape: a long run's partial results survive
            meta = {"commit": args.commit or git_commit(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "triton": triton.__version__,
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "ceilings": {"bf16_tflops": 790, "fp8_tflops": 1345, "hbm_tbps": 4.3}}
            write_json(args.json, {"meta": meta, "rows": rows})
    print("\n== all shapes ==")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
