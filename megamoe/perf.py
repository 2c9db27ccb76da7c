"""Measured ceilings, flop/byte formulas and run metadata shared by the benchmarks.

Ceilings are the figures measured on the project's GPU machine (shared/MEASURED.md, 4x H200, 2026-11-29),
not datasheet numbers. A GPU without an entry gets no floor (reported as n/a).

Formulas (per rank, ``rows`` = (token, expert) pairs this rank's experts process):

* forward flops   = 6 * rows * H * I            (GEMM1 2*rows*H*2I + GEMM2 2*rows*I*H)
* forward bytes   = expert weights of the rank (3*E_l*H*I*elem) + rows * 2H * elem (rows in and out)
* forward floor   = max(flops / matmul ceiling, bytes / HBM ceiling)
* fwd+bwd floor   = 3x the forward floor's flops and bytes (dgrad + wgrad double the GEMM work; weights are
                    read again and their gradients written)
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass

import torch

from megamoe.config import MoEConfig


@dataclass(frozen=True)
class Ceilings:
    matmul_bf16: float  # FLOP/s, measured dense GEMM
    matmul_fp8: float  # FLOP/s
    hbm: float  # bytes/s, device copy counting read + write
    nvlink_pair: float  # bytes/s, one peer pair one direction
    source: str


#: substring of torch.cuda.get_device_name() -> ceilings measured on that GPU
CEILINGS = {
    "H200": Ceilings(790e12, 1438e12, 4.3e12, 394e9, "shared/MEASURED.md, 4x H200, 2026-11-29"),
}


def ceilings_for(device: torch.device) -> Ceilings | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in CEILINGS.items():
        if key in name:
            return value
    return None


def forward_flops(cfg: MoEConfig, rows: int) -> float:
    return float(cfg.flops_forward(rows))


def forward_bytes(cfg: MoEConfig, rows: int, world: int, experts: int | None = None) -> float:
    """HBM bytes of one forward on a rank: the weights of the ``experts`` it uses (default: all its local experts)
    read once, and its ``rows`` read and written once."""
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    local = cfg.local_experts(world)
    if experts is None:
        experts = local
    if not 0 <= experts <= local:
        raise ValueError(f"experts used on a rank must be in [0, {local}], got {experts}")
    weights = cfg.expert_weight_bytes(world) * experts // local
    return float(weights + rows * 2 * cfg.hidden * elem)


def floor_seconds(cfg: MoEConfig, rows: int, world: int, ceil: Ceilings | None, passes: float = 1.0,
                  experts: int | None = None) -> float | None:
    """Roofline floor of ``passes`` x the forward work on one rank (passes=3 for forward+backward) that receives
    ``rows`` rows for ``experts`` of its local experts (default all: the weights of experts no row uses need not
    be read, which matters only for small batches)."""
    if ceil is None:
        return None
    flops = passes * forward_flops(cfg, rows)
    nbytes = passes * forward_bytes(cfg, rows, world, experts)
    return max(flops / ceil.matmul_bf16, nbytes / ceil.hbm)


def layer_floor_seconds(cfg: MoEConfig, rows_per_rank: list[int], world: int, ceil: Ceilings | None,
                        passes: float = 1.0, experts_per_rank: list[int] | None = None) -> float | None:
    """The layer's floor: the largest of its ranks' floors (the ranks wait for each other in the combine). With
    every local expert used this is the busiest rank's floor."""
    if ceil is None:
        return None
    experts = experts_per_rank if experts_per_rank is not None else [None] * len(rows_per_rank)
    return max(floor_seconds(cfg, r, world, ceil, passes, e) for r, e in zip(rows_per_rank, experts, strict=True))


def event_median_s(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` calls, each between two CUDA events, after ``warmup`` calls."""
    if iters < 1:
        raise ValueError(f"event_median_s: iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in evs)[iters // 2] * 1e-3


def git_commit() -> str:
    """``MEGAMOE_COMMIT`` if set (a copy of the tree without .git, e.g. on a remote GPU machine, is told its
    commit by whoever copied it), else ``git rev-parse HEAD`` of the source tree (+ "-dirty"), else "unknown"."""
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def source_digest(root: str | None = None) -> str:
    """sha1 over the package's Python sources (each ``megamoe/**/*.py`` path relative to the package, then its bytes,
    in path order): names the code a result ran, whatever git says on the machine that ran it (a copied tree's HEAD
    can be stale; 2026-12-02). ``git archive <commit> megamoe`` unpacked elsewhere gives the same digest."""
    import hashlib

    root = root or os.path.dirname(os.path.abspath(__file__))
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
    h = hashlib.sha1()
    for p in sorted(paths, key=lambda q: os.path.relpath(q, root).replace(os.sep, "/")):
        h.update(os.path.relpath(p, root).replace(os.sep, "/").encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()


def run_metadata(device: torch.device, world: int) -> dict:
    import triton

    meta = {
        "commit": git_commit(),
        "source_sha1": source_digest(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "world": world,
        "device": device.type,
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
        meta["gpu_count"] = torch.cuda.device_count()
        ceil = ceilings_for(device)
        meta["ceilings"] = asdict(ceil) if ceil else None
    else:
        meta["gpu"] = None
        meta["cpu"] = platform.processor() or platform.machine()
    return meta


def write_results(path: str | None, device: torch.device, what: str, rows: list) -> None:
    """A one-GPU benchmark script's JSON: {"meta": run_metadata, "what": its first docstring line, "results"}
    (nothing when path is None)."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"meta": run_metadata(device, 1), "what": what.strip().split("\n")[0], "results": rows}, f,
                      indent=1)


def print_kernel_rows(spec: str, op: str, rows: list[dict], base_ms: float, *, base: str = "", diff_key: str = "",
                      diff_label: str = "diff", op_w: int = 13, kernel_w: int = 22) -> None:
    """One line per timed kernel of a one-GPU GEMM benchmark script (gluon_*_bench.py): ms, TFLOP/s, the speed-up
    over ``base_ms`` (labelled ``base``), and rows[diff_key] when present; rows without "ms" print their "error"."""
    for r in rows:
        if "ms" in r:
            txt = f"{r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s {base_ms / r['ms']:5.2f}x{' ' + base if base else ''}"
            if diff_key in r:
                txt += f"  {diff_label} {r[diff_key]:.1e}"
        else:
            txt = r["error"]
        print(f"{spec:18} {op:{op_w}} {r['kernel']:{kernel_w}} {txt}", flush=True)


def report_kernel_rows(spec: str, op: str, flops: float, base_ms: float, new: list[dict], rows: list, *, base: str,
                       diff_key: str) -> None:
    """TFLOP/s into every timed row of ``new``, print them (print_kernel_rows), append them to ``rows`` (the
    warp-specialised GEMM scripts)."""
    for r in new:
        if "ms" in r:
            r["tflops"] = flops / r["ms"] / 1e9
    print_kernel_rows(spec, op, new, base_ms, base=base, diff_key=diff_key, op_w=12)
    rows.extend(new)


def expert_offsets(rows: int, experts: int, align: int = 16, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    """offs int32 [experts + 1] of a uniform multinomial draw of rows // align units over the experts, each
    group a multiple of align rows (torch._grouped_mm's alignment); the same draw for the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.multinomial(torch.full((experts,), 1.0 / experts), rows // align, replacement=True,
                              generator=gen).bincount(minlength=experts) * align
    return torch.tensor([0] + sizes.cumsum(0).tolist(), dtype=torch.int32, device=device)


def run_shapes(run_shape, default_shapes: str) -> None:
    """The command line of the per-shape GEMM benchmark scripts (benchmarks/gemm_tail.py, gluon_fp8_bench.py):
    ``--shapes preset:ep,...``, ``--tokens``, ``--json``; calls ``run_shape(preset, ep, tokens, rows)`` for each shape
    on one GPU and rewrites the JSON after every shape, so a crash keeps what was measured."""
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=default_shapes)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict] = []
    for spec in args.shapes.split(","):
        name, ep = spec.split(":")
        run_shape(name, int(ep), args.tokens, rows)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": run_metadata(torch.device("cuda"), 1), "tokens": args.tokens, "rows": rows}, f,
                          indent=1)


def safe_name(spec: str) -> str:
    """A backend spec as a file-name part: "split:presum_combine=1" -> "split_presum_combine_1"."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", spec)


def kernel_table(prof, iters: int, top: int = 25) -> str:
    """The GPU kernels of a finished torch.profiler run, by device time per iteration (``iters`` iterations
    profiled), longest first, with their sum: where a step's device time goes."""
    from torch.autograd import DeviceType

    # kernels and copies only: not the ops, nor user annotations on the GPU timeline (DDP's forward range and
    # nccl:all_reduce would count their kernels twice)
    rows = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and not e.key.startswith(("nccl:", "DistributedData"))]
    rows.sort(key=lambda e: -e.device_time_total)
    lines = [f"{'kernel':<60} {'calls/iter':>10} {'ms/iter':>9}"]
    total = 0.0
    for e in rows[:top]:
        ms = e.device_time_total / 1e3 / iters
        total += ms
        lines.append(f"{e.key[:60]:<60} {e.count / iters:10.1f} {ms:9.3f}")
    rest = sum(e.device_time_total for e in rows[top:]) / 1e3 / iters
    lines.append(f"{f'the other {max(0, len(rows) - top)} kernels':<60} {'':>10} {rest:9.3f}")
    lines.append(f"{'sum of all kernels':<60} {'':>10} {total + rest:9.3f}")
    return "\n".join(lines)
