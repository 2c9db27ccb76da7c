"""Measured ceilings, flop/byte formulas, run metadata and the rank launcher shared by the benchmarks and train.

Ceilings are measured, not datasheet figures (docs/performance.md, section 1); a GPU without an entry gets no floor.
Per rank, ``rows`` = (token, expert) pairs its experts process:

* forward flops   = 6 * rows * H * I            (GEMM1 2*rows*H*2I + GEMM2 2*rows*I*H)
* forward bytes   = expert weights of the rank (3*E_l*H*I*elem) + rows * 2H * elem (rows in and out)
* forward floor   = max(flops / matmul ceiling, bytes / HBM ceiling); fwd+bwd: 3x flops and bytes
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megamoe.config import MoEConfig
from megamoe.dist import init_from_env, rank_device, spawn, under_torchrun


@dataclass(frozen=True)
class Ceilings:
    matmul_bf16: float  # FLOP/s, measured dense GEMM
    matmul_fp8: float  # FLOP/s
    hbm: float  # bytes/s, device copy counting read + write
    nvlink_pair: float  # bytes/s, one peer pair one direction
    source: str


#: substring of torch.cuda.get_device_name() -> ceilings measured on that GPU
CEILINGS = {"H200": Ceilings(790e12, 1438e12, 4.3e12, 394e9, "measured on 4x H200 (docs/performance.md)")}


def ceilings_for(device: torch.device) -> Ceilings | None:
    if device.type != "cuda":
        return None
    return next((ceil for key, ceil in CEILINGS.items() if key in torch.cuda.get_device_name(device)), None)


def forward_bytes(cfg: MoEConfig, rows: int, world: int, experts: int | None = None) -> float:
    """HBM bytes of one forward on a rank: the weights of the ``experts`` it uses (default: all its local experts)
    read once, and its ``rows`` read and written once."""
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    local = cfg.local_experts(world)
    experts = local if experts is None else experts
    if not 0 <= experts <= local:
        raise ValueError(f"experts used on a rank must be in [0, {local}], got {experts}")
    return float(cfg.expert_weight_bytes(world) * experts // local + rows * 2 * cfg.hidden * elem)


def floor_seconds(cfg: MoEConfig, rows: int, world: int, ceil: Ceilings | None, passes: float = 1.0,
                  experts: int | None = None) -> float | None:
    """Roofline floor of ``passes`` x (3 for fwd+bwd) the forward work of a rank receiving ``rows`` rows for
    ``experts`` of its local experts (default all; unused experts' weights need not be read)."""
    if ceil is None:
        return None
    return max(passes * float(cfg.flops_forward(rows)) / ceil.matmul_bf16,
               passes * forward_bytes(cfg, rows, world, experts) / ceil.hbm)


def layer_floor_seconds(cfg: MoEConfig, rows_per_rank: list[int], world: int, ceil: Ceilings | None,
                        passes: float = 1.0, experts_per_rank: list[int] | None = None) -> float | None:
    """The largest of the ranks' floors (the ranks wait for each other in the combine)."""
    experts = experts_per_rank if experts_per_rank is not None else [None] * len(rows_per_rank)
    return None if ceil is None else max(floor_seconds(cfg, r, world, ceil, passes, e)
                                         for r, e in zip(rows_per_rank, experts, strict=True))


class Marks:
    """Time points from construction on: CUDA events (read once the last is done) or host clocks (the CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.points = []
        self.mark()

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append(ev)
        else:
            self.points.append(time.perf_counter())

    def elapsed(self) -> list[float]:
        if self.cuda:
            self.points[-1].synchronize()
            return [a.elapsed_time(b) * 1e-3 for a, b in zip(self.points, self.points[1:], strict=False)]
        return [b - a for a, b in zip(self.points, self.points[1:], strict=False)]


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
    """``MEGAMOE_COMMIT`` (a copied tree without .git), else ``git rev-parse HEAD`` (+ "-dirty"), else "unknown"."""
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"]
    git = lambda *a: subprocess.run(["git", *a], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                                    text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def source_digest(root: str | None = None) -> str:
    """sha1 over each ``megamoe/**/*.py`` relative path and bytes, in path order: names the code a result ran even
    where a copied tree's HEAD is stale (``git archive <commit> megamoe`` gives the same digest)."""
    import hashlib

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, above apps/
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        paths += [os.path.join(d, f) for f in files if f.endswith(".py")]
    h, rel = hashlib.sha1(), lambda p: os.path.relpath(p, root).replace(os.sep, "/")
    for p in sorted(paths, key=rel):
        h.update(rel(p).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()


def run_metadata(device: torch.device, world: int) -> dict:
    import triton

    meta = {"commit": git_commit(), "source_sha1": source_digest(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "host": platform.node(),
            "world": world, "device": device.type}
    if device.type == "cuda":
        ceil = ceilings_for(device)
        meta.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    gpu_count=torch.cuda.device_count(), ceilings=asdict(ceil) if ceil else None)
    else:
        meta.update(gpu=None, cpu=platform.processor() or platform.machine())
    return meta


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_results(path: str | None, device: torch.device, what: str, rows: list) -> None:
    """A one-GPU benchmark's JSON {"meta", "what": its docstring's first line, "results"}; nothing when path is None."""
    if path:
        write_json(path, {"meta": run_metadata(device, 1), "what": what.strip().split("\n")[0], "results": rows})


def _spawned_rank(rank: int, world: int, run_rank, args, on_gpu: bool):
    return run_rank(args, rank_device() if on_gpu else torch.device("cpu"))


def run_ranks(run_rank, args, on_gpu: bool, check_world, timeout_s: float):
    """Rank 0's ``run_rank(args, device)`` (other ranks return None): under torchrun in its group; otherwise on
    ``args.world`` spawned ranks (default: one per GPU, or 2 gloo CPU ranks running the Triton kernels interpreted),
    ``check_world(world)`` raising first where that world size cannot run."""
    if under_torchrun():
        report = run_rank(args, init_from_env("cuda" if on_gpu else "cpu"))
        dist.destroy_process_group()
        return report
    world = args.world or (torch.cuda.device_count() if on_gpu else 2)
    check_world(world)
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return spawn(_spawned_rank, world, run_rank, args, on_gpu, device="cuda" if on_gpu else "cpu",
                 timeout_s=timeout_s)[0]
