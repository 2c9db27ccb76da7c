"""Process-group helpers: run a function on W ranks, on CPUs (gloo) or GPUs (NCCL).

Under ``torchrun`` :func:`init_from_env` joins the group it describes; otherwise :func:`spawn` starts ``world``
processes over a free local port (tests, ``megamoe bench`` on CPU). Every process turns NVLink multicast off
(:data:`NO_MULTICAST`) before torch touches a GPU.

``MEGAMOE_SHARE_GPUS=1`` (correctness runs only): rank r uses GPU r mod the GPUs visible, on gloo (NCCL refuses two
ranks on one device). The kernels still spin-wait across processes as the GPU time-slices the contexts, so the
multi-rank GPU tests run on fewer GPUs; same-device peers share one L2, so this is weaker evidence of the memory
ordering than real peers, and none of NVLink speed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: NVLink multicast must stay off on the shared machines (NCCL NVLS, symmetric-memory multicast, NVSHMEM NVLS).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def share_gpus() -> bool:
    """True when ``MEGAMOE_SHARE_GPUS=1``: more ranks than GPUs allowed (see the module docstring)."""
    return os.environ.get("MEGAMOE_SHARE_GPUS", "0") == "1"


_GPU_RANKS_ON_GLOO = False


def gpu_ranks_on_gloo() -> bool:
    """True when :func:`init_from_env` put this process's GPU rank on a gloo group (ranks sharing GPUs)."""
    return _GPU_RANKS_ON_GLOO


def gpu_world(most: int = 4, least: int = 1) -> int:
    """Ranks for a GPU run here: one per GPU up to ``most``; if that is below ``least``, ``least`` ranks sharing
    GPUs when MEGAMOE_SHARE_GPUS=1, else 0 (cannot run)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if min(n, most) >= least:
        return min(n, most)
    return least if n > 0 and share_gpus() else 0


def gpu_ranks_possible(world: int) -> bool:
    """Whether ``world`` GPU ranks can run here: one GPU each, or any number sharing GPUs (MEGAMOE_SHARE_GPUS=1)."""
    return gpu_world(world, world) > 0


def rank_device():
    """This GPU rank's device as :func:`init_from_env` set it (local rank, mod the GPUs visible when shared)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def group_world_rank(group=None) -> tuple:
    """(group, W, rank): ``group`` (None: the default one), its size and this process's rank; without
    torch.distributed (None, 1, 0): one process, where a group given raises."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        group = group or dist.group.WORLD
        return group, dist.get_world_size(group), dist.get_rank(group)
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    return None, 1, 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(device: str | None = None, timeout_s: float = 300.0):
    """Join the group torchrun's environment describes; ``device`` "cuda", "cpu" or None (CUDA when available).
    Returns this rank's torch.device."""
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)  # also for the children this process starts
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend, dev = "gloo", torch.device("cpu")
    if device == "cuda":
        ngpu = torch.cuda.device_count()
        if ngpu == 0:
            raise RuntimeError("device 'cuda' asked for, but no CUDA GPU is visible")
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        crowded = local_world is not None and int(local_world) > ngpu  # more ranks on this host than GPUs
        if share_gpus():
            if local_world is None:
                raise RuntimeError("MEGAMOE_SHARE_GPUS=1 needs LOCAL_WORLD_SIZE (the ranks on this host; torchrun and "
                                   "megamoe.dist.spawn set it) so that every rank picks the same process group")
        elif local_rank >= ngpu or crowded:
            # without LOCAL_WORLD_SIZE (srun / mpirun wrappers) a rank only knows its own index
            raise RuntimeError(f"local rank {local_rank} of {local_world or '?'} on this host, but this process sees "
                               f"{ngpu} GPU(s) (CUDA_VISIBLE_DEVICES?): one GPU per rank expected, GPU <local rank>; "
                               "MEGAMOE_SHARE_GPUS=1 lets more ranks than GPUs share them, on gloo, for correctness "
                               "runs only")
        dev = torch.device("cuda", local_rank % ngpu)
        torch.cuda.set_device(dev.index)
        backend = "gloo" if crowded else "nccl"  # NCCL refuses two ranks on one device
        global _GPU_RANKS_ON_GLOO
        _GPU_RANKS_ON_GLOO = crowded
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return dev


def _child(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple, queue) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    if device == "cpu":  # W ranks share the machine's cores: no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_from_env(device)
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a failed peer can leave the group unusable
                dist.destroy_process_group()


def wire_dtype(dtype, group=None):
    """dtype a tensor crosses a collective in: gloo has no bfloat16 collectives, so bf16 goes as float32."""
    import torch
    import torch.distributed as dist

    return torch.float32 if dtype == torch.bfloat16 and dist.get_backend(group) == "gloo" else dtype


class RankError(RuntimeError):
    """One or more spawned ranks raised; the message holds each failing rank's traceback."""


def spawn(fn: Callable[..., Any], world: int, *args: Any, device: str = "cpu", timeout_s: float = 900.0) -> list:
    """Run ``fn(rank, world, *args)`` (importable, picklable arguments and result) on ``world`` new processes;
    return the results in rank order. Raises :class:`RankError` naming every failed rank, ``TimeoutError``
    after ``timeout_s`` (the processes are killed)."""
    import multiprocessing as mp
    import queue as queue_mod

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    os.environ.update(NO_MULTICAST)  # also for the children this process starts
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, device, fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, failures = {}, {}  # rank -> fn's result, rank -> traceback
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"spawned ranks not done after {timeout_s:.0f} s; finished: {sorted(results)}, "
                                   f"failed: {sorted(failures)}")
            try:
                rank, ok, payload = q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results | failures]
                if not dead:
                    continue
                try:  # give a dying rank a moment to flush its report through the queue
                    rank, ok, payload = q.get(timeout=2.0)
                except queue_mod.Empty:
                    failures.update({r: f"process exited with code {procs[r].exitcode} without a report" for r in dead})
                    continue
            (results if ok else failures)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 1.0)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankError(f"{len(failures)} of {world} ranks failed:\n{text}")
    return [results[r] for r in range(world)]
