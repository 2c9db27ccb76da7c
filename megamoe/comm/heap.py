"""Symmetric heap: every cross-rank buffer of the communication path, allocated once per process group.

Shape legend: W world size, T_max max tokens per rank, H hidden, k top-k, E experts, E_l = E / W local
experts, R_cap = W * T_max * min(k, E_l) worst-case rows received by one rank.

Its size is known before anything is allocated (:func:`heap_bytes`), logged, allocated once, torn down by
:meth:`close`. Regions (the same layout on each rank; ``tab[reg, p]`` is this process's address of rank p's copy):

| region | shape, dtype | written by | read by |
|---|---|---|---|
| flags | [3, W] int64 | rank s writes column s (READY, DONE, DW_DONE call numbers) | owner polls |
| ctrl  | [8] int64 | owner (call counter, arrival counters) | owner |
| meta  | [8] int64 | owner (meta[0] = tokens this call) | peers |
| idx   | [T_max, k] int32 | owner (top-k expert ids) | peers (schedule) |
| w     | [T_max, k] fp32 | owner (gates) | peers |
| dw    | [T_max, k] fp32 | the expert rank of each slot (d gates) | owner |
| tok   | [T_max, H] dtype | owner (x for dispatch, dy for pull_grad) | peers (pull) |
| rows  | [R_cap, H] dtype | owner (expert outputs / their grads) | peers (pull by the token owner) |
| err   | [16] int64 | owner's kernels (timeout record) | owner's host (host backend only) |
| slots | [T_max, k, H] dtype (``CommShape.slots`` only) | expert rank of (t, j): out_j(t) | owner (fused) |

Backends:
* ``cuda``: ``torch.distributed._symmetric_memory``: one uint8 allocation, ``rendezvous`` once, peer addresses from
  ``handle.buffer_ptrs``. The error record is pinned host memory that a watchdog thread polls (docs/design.md,
  "Fail-stop"). Ranks sharing a GPU (``MEGAMOE_SHARE_GPUS=1``, which torch's symmetric memory refuses) map
  ordinary allocations through CUDA IPC instead.
* ``host``: one POSIX shared-memory file per rank in /dev/shm, mapped by every CPU rank (unlinked once all have
  mapped them, so a crash leaks nothing); the same Triton kernels run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import math
import mmap
import os
import struct
import threading
import uuid
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from megamoe.dist import gpu_ranks_on_gloo, group_world_rank, share_gpus

from . import signals as S
from .schedule import chunk_tokens
from .signals import CommTimeoutError

log = logging.getLogger("megamoe.comm")

_ALIGN = 256
#: seconds the watchdog leaves the main thread to raise a recorded timeout before it stops the process, and its code
STOP_GRACE_S = 2.0
STOP_EXIT_CODE = 75


@dataclass(frozen=True)
class CommShape:
    """Sizes the heap is built for. ``max_tokens`` bounds T on every rank (T may differ per rank, or be 0)."""

    world: int
    max_tokens: int
    hidden: int
    topk: int
    num_experts: int
    dtype: torch.dtype = torch.bfloat16
    slots: bool = False  # also a [T_max, k, H] per-slot buffer that expert ranks push into (backend fused)

    def __post_init__(self):
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if self.num_experts % self.world:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of world ({self.world})")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"topk must be in [1, num_experts={self.num_experts}], got {self.topk}")
        if self.max_tokens < 1 or self.hidden < 1:
            raise ValueError(f"max_tokens and hidden must be >= 1, got {self.max_tokens}, {self.hidden}")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bf16, fp16 or fp32, got {self.dtype}")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def rows_cap(self) -> int:
        """R_cap: worst-case rows one rank receives (every token of every rank, min(k, E_l) copies)."""
        return self.world * self.max_tokens * min(self.topk, self.local_experts)

    def rows_for(self, tokens: int | None) -> int:
        """Rows the per-call buffers of a call with ``tokens`` here hold: one rank sizes them by the call (every row
        is one of its T * k slots; at least 1); with peers (their T is unknown without a sync) or None, R_cap."""
        if tokens is None or self.world > 1:
            return self.rows_cap
        return max(1, tokens * min(self.topk, self.local_experts))


#: region name -> its row of the pointer table, the kernels' signals.REG_* constants
_REG_INDEX = {name: i for i, name in enumerate(S.REGIONS)}


def _layout(shape: CommShape) -> tuple[dict[str, tuple[int, tuple[int, ...], torch.dtype]], int]:
    """({region: (byte offset, dims, dtype)}, total bytes) of the module docstring's table."""
    W, T, H, k, dt = shape.world, shape.max_tokens, shape.hidden, shape.topk, shape.dtype
    i64, f32 = torch.int64, torch.float32
    regions = [("flags", (3, W), i64), ("ctrl", (8,), i64), ("meta", (8,), i64), ("idx", (T, k), torch.int32),
               ("w", (T, k), f32), ("dw", (T, k), f32), ("tok", (T, H), dt), ("rows", (shape.rows_cap, H), dt),
               ("err", (S.ERR_SLOTS,), i64), ("slots", (T, k, H) if shape.slots else (0,), dt)]
    out, off = {}, 0
    for name, dims, dtype in regions:
        out[name] = (off, dims, dtype)
        off += (math.prod(dims) * dtype.itemsize + _ALIGN - 1) // _ALIGN * _ALIGN
    return out, off


def _region_view(buf: torch.Tensor, off: int, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return buf[off : off + math.prod(dims) * dtype.itemsize].view(dtype).view(dims)


def heap_bytes(shape: CommShape) -> int:
    """Bytes of symmetric memory each rank allocates for ``shape`` (nothing is allocated)."""
    return _layout(shape)[1]


def workspace_bytes(shape: CommShape) -> int:
    """Bytes of ordinary device memory one dispatch call allocates at most (receive buffer + schedule tables
    for R_cap rows; one rank sizes them by the call, CommShape.rows_for)."""
    W, T, H, k, E = shape.world, shape.max_tokens, shape.hidden, shape.topk, shape.num_experts
    recv = shape.rows_cap * H * shape.dtype.itemsize
    chunks = triton.cdiv(T, chunk_tokens(k))
    tables = 4 * (W * chunks * E + 2 * W * E + W * T * k + 2 * T * k + 3 * shape.rows_cap + shape.local_experts + 1 + W)
    return recv + tables


class SymmetricHeap:
    """Cross-rank buffers for one process group (module docstring). ``timeout_s`` bounds every device-side wait;
    ``num_sms``: the communication kernels' default programs. :meth:`buffer`: this rank's views; ``tab`` (int64
    [NUM_REGIONS, W] on ``device``): the peer-pointer table the kernels take."""

    def __init__(self, shape: CommShape, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, timeout_s: float = 60.0, num_sms: int = 32):
        # without torch.distributed: one process, a heap of one rank, no collective ever runs
        self.group, self.world, self.rank = group_world_rank(group)
        if self.world != shape.world:
            raise ValueError(f"shape.world={shape.world} but the process group has {self.world} ranks")
        if device is not None:  # the backend by the device; else by the group (nccl, or GPU ranks on gloo)
            backend = "cuda" if torch.device(device).type == "cuda" else "host"
        else:
            gpu_group = self.group is not None and (dist.get_backend(self.group) == "nccl" or gpu_ranks_on_gloo())
            backend = "cuda" if torch.cuda.is_available() and gpu_group else "host"
        self.shape, self.backend = shape, backend
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.num_sms = int(num_sms)
        self.wp2 = triton.next_power_of_2(self.world)
        self.layout, self.nbytes = _layout(shape)
        self._closed = False
        self._error: str | None = None
        #: the ``rows`` rule (docs/design.md, after the flag table): while peers may still read this rank's ``rows`` (a
        #: gather of them enqueued, no stage kernel since) only a stage kernel writes them. Set by the gather launchers,
        #: cleared by the stage launchers in enqueue order (no sync, graph-safe); read by backends/common.heap_rows etc.
        self.rows_busy = False
        self._maps: list = []
        self._watchdog = None
        self.users = 0  # layers holding it through get_heap; release_heap closes it at zero
        if backend == "cuda":
            dev = torch.device(device) if device is not None else torch.device("cuda")
            self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
            bases = self._alloc_cuda()
        else:
            self.device = torch.device("cpu")
            bases = self._alloc_host()
        own = self._buf if backend == "cuda" else torch.frombuffer(self._maps[self.rank], dtype=torch.uint8)
        self._views = {name: _region_view(own, *spec) for name, spec in self.layout.items()}
        addrs = [[b + self.layout[name][0] for b in bases] for name in S.REGIONS]
        addrs[_REG_INDEX["err"]] = [self._err_addr] * self.world  # this process's own record
        self.tab = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        row_mib = shape.hidden * shape.dtype.itemsize / 2**20
        log.info("megamoe symmetric heap (%s, W=%d, rank %d): %.1f MiB symmetric per rank (rows %.1f MiB, tok %.1f "
                 "MiB), %.1f MiB workspace per dispatch call", backend, self.world, self.rank, self.nbytes / 2**20,
                 shape.rows_cap * row_mib, shape.max_tokens * row_mib, workspace_bytes(shape) / 2**20)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(self.group)

    def _alloc_cuda(self) -> list[int]:
        self._handle = self._peers = None  # symmetric memory's handle, or the CUDA IPC path's peer tensors
        if self.group is None:  # no peers: an ordinary allocation
            self._buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
            bases = [int(self._buf.data_ptr())]
        elif self._ranks_share_a_gpu():
            bases = self._alloc_cuda_ipc()
        else:
            bases = self._alloc_symm_mem()
        self._err_host = torch.zeros(S.ERR_SLOTS, dtype=torch.int64, pin_memory=True)
        self._err_addr = self._err_host.data_ptr()
        torch.cuda.synchronize(self.device)
        self._barrier()
        self._watchdog_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="megamoe-comm-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self._report_at_exit)
        return bases

    def _ranks_share_a_gpu(self) -> bool:
        """Whether two ranks of the group run on one GPU (asked only under MEGAMOE_SHARE_GPUS=1: one collective)."""
        if self.world == 1 or not share_gpus():
            return False
        mine = str(torch.cuda.get_device_properties(self.device).uuid)
        uuids: list = [None] * self.world
        dist.all_gather_object(uuids, mine, group=self.group)
        return len(set(uuids)) < self.world

    def _alloc_cuda_ipc(self) -> list[int]:
        """Ranks sharing a GPU: an ordinary buffer each, which the peers map through torch's CUDA IPC."""
        from torch.multiprocessing.reductions import reduce_tensor

        self._buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        # one reduction per peer: each carries its own reference counter (one sent to W - 1 peers would be
        # released W - 1 times, freeing the buffer while a peer still maps it)
        mine = [None if r == self.rank else reduce_tensor(self._buf) for r in range(self.world)]
        handles: list = [None] * self.world
        dist.all_gather_object(handles, mine, group=self.group)
        self._peers = [self._buf if r == self.rank else handles[r][self.rank][0](*handles[r][self.rank][1])
                       for r in range(self.world)]
        return [int(t.data_ptr()) for t in self._peers]

    def _alloc_symm_mem(self) -> list[int]:
        import torch.distributed._symmetric_memory as symm_mem

        with contextlib.suppress(Exception):  # already set, or an older torch without set_backend
            symm_mem.set_backend("CUDA")
        with contextlib.suppress(Exception), warnings.catch_warnings():  # needed before torch 2.11 only
            warnings.simplefilter("ignore")  # deprecated on torch 2.11, where it is a no-op
            symm_mem.enable_symm_mem_for_group(self.group.group_name)
        self._buf = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._buf.zero_()
        self._handle = symm_mem.rendezvous(self._buf, self.group)
        return [int(p) for p in self._handle.buffer_ptrs]

    def _alloc_host(self) -> list[int]:
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        if self.group is not None:
            dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0), group=self.group)
        root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        paths = [os.path.join(root, f"megamoe-{token[0]}-{r}") for r in range(self.world)]
        with os.fdopen(os.open(paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), "r+b") as f:
            f.truncate(self.nbytes)
        self._barrier()  # every file exists, zero-filled
        bases = []
        for r in range(self.world):
            with open(paths[r], "r+b") as f:
                mm = mmap.mmap(f.fileno(), self.nbytes)
            self._maps.append(mm)
            bases.append(ctypes.addressof(ctypes.c_char.from_buffer(mm)))
        self._barrier()  # every rank mapped every file: unlink now, nothing leaks on a crash
        self._paths = paths
        self._unlink_own()
        self._err_addr = bases[self.rank] + self.layout["err"][0]
        return bases

    def _unlink_own(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._paths[self.rank])

    def buffer(self, name: str) -> torch.Tensor:
        """This rank's view of region ``name`` (see the module docstring)."""
        if self._closed:
            raise RuntimeError(f"SymmetricHeap is closed: no region {name!r} to use (build a new heap or layer)")
        return self._views[name]

    def tokens_buffer(self) -> torch.Tensor:
        """[T_max, H] symmetric buffer: write x[:T] here and dispatch skips its staging copy. Peers read it until
        they finish the op that pulled from it (dispatch, pull_grad): write it only after a later op of this heap
        has been enqueued (e.g. the combine after a dispatch), whose stage kernel waits until they are done."""
        return self.buffer("tok")

    def rows_buffer(self) -> torch.Tensor:
        """[R_cap, H] symmetric buffer: let the expert GEMM write here and combine skips its staging copy. Peers
        read it during combine / dispatch_backward; a write from any kernel that is no stage kernel is safe once
        ``rows_busy`` is False (a stage kernel enqueued since: docs/design.md, after the flag table)."""
        return self.buffer("rows")

    def peer_ptrs(self, name: str) -> torch.Tensor:
        """int64 [W]: this process's addresses of every rank's copy of region ``name``."""
        return self.tab[_REG_INDEX[name]]

    def peer_buffer(self, name: str, rank: int) -> torch.Tensor:
        """Rank ``rank``'s copy of region ``name`` as a tensor of this process (its own: :meth:`buffer`), e.g. for
        the TMA descriptors of the peers' ``tok`` regions. Read it only as the region's protocol allows."""
        if name not in self.layout:
            raise KeyError(f"no heap region {name!r}; regions: {', '.join(self.layout)}")
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for a heap of {self.world} ranks")
        if rank == self.rank:
            return self.buffer(name)
        off, dims, dtype = self.layout[name]
        if self.backend == "cuda" and self._peers is None:
            return self._handle.get_buffer(rank, tuple(dims), dtype, off // dtype.itemsize)
        buf = self._peers[rank] if self.backend == "cuda" else torch.frombuffer(self._maps[rank], dtype=torch.uint8)
        return _region_view(buf, off, dims, dtype)

    def _read_error(self) -> str | None:
        if self.backend == "cuda":  # pinned host memory: a host read, no device sync
            rec = self._err_host.tolist()
        else:  # not through a torch op, which megamoe.testing.sync_guard would count as a sync
            rec = struct.unpack_from(f"={S.ERR_SLOTS}q", self._maps[self.rank], self.layout["err"][0])
        if rec[S.ERR_FLAG.value] == 0:
            return None
        op = S.OPS.get(rec[S.ERR_OP.value], str(rec[S.ERR_OP.value]))
        purpose = S.PURPOSES.get(rec[S.ERR_PURPOSE.value], str(rec[S.ERR_PURPOSE.value]))
        return (f"megamoe comm timeout in {op} (call {rec[S.ERR_CALL.value]}) on rank {rec[S.ERR_RANK.value]}: "
                f"peer rank {rec[S.ERR_PEER.value]} never signalled {purpose} (expected >= "
                f"{rec[S.ERR_EXPECTED.value]}, saw {rec[S.ERR_SEEN.value]}) within {self.timeout_s:g} s")

    def _watch(self) -> None:
        """CUDA: the kernel that recorded a timeout trapped (signals.fail_stop), so the context is lost and the main
        thread may be blocked (a graph replay, a collective with the dead peer). Like NCCL's watchdog, stop the
        process with the record's message, after STOP_GRACE_S in which the main thread may raise it itself."""
        while not self._watchdog_stop.wait(0.05):
            msg = self._read_error()
            if msg is not None:
                self._error = msg
                log.error("%s", msg)
                if not self._watchdog_stop.wait(STOP_GRACE_S):
                    os.write(2, f"megamoe: stopping the process: {msg}\n".encode())
                    os._exit(STOP_EXIT_CODE)
                return

    def _report_at_exit(self) -> None:
        """The main thread may end first, on the CUDA error the trap left (not naming anything): name the timeout."""
        msg = None if self._closed else self._error or self._read_error()
        if msg is not None:
            os.write(2, f"megamoe: {msg}\n".encode())

    def check(self) -> None:
        """Raise :class:`CommTimeoutError` if a device-side wait of this rank timed out (no device sync)."""
        if self._closed:
            raise RuntimeError("SymmetricHeap is closed")
        msg = self._error or self._read_error()
        if msg is not None:
            self._error = msg
            raise CommTimeoutError(msg)

    def after_launch(self) -> None:
        """Host backend: kernels ran synchronously, so report a timeout now. CUDA: the watchdog does."""
        if self.backend == "host":
            self.check()

    def close(self) -> None:
        """Free the heap (the host backend unmaps its segments; files were unlinked at construction)."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            if self._error is None and self._read_error() is None:  # a recorded timeout stops the process anyway
                self._watchdog_stop.set()
                self._watchdog.join(timeout=1.0)
            atexit.unregister(self._report_at_exit)
        self._views = {}
        if self.backend == "cuda":
            self._handle = self._peers = self._buf = None
        else:
            self._unlink_own()
            for mm in self._maps:
                with contextlib.suppress(BufferError):  # a view handed out earlier is alive; the mapping goes with it
                    mm.close()
            self._maps = []


#: one heap per (process group, shape, device, timeout, programs), shared by the layers of a model
_HEAPS: dict[tuple, SymmetricHeap] = {}


def get_heap(shape: CommShape, group, device, timeout_s: float, num_sms: int) -> SymmetricHeap:
    """The heap of this process group for ``shape`` (built on first use; layers of one shape share it); without
    torch.distributed (one process, ``shape.world`` 1) of one rank. Each call counts a user (:func:`release_heap`)."""
    group = group_world_rank(group)[0]
    name = None if group is None else group.group_name  # names are unique, ids can be reused
    key = (name, shape, str(device), timeout_s, num_sms)
    heap = _HEAPS.get(key)
    if heap is None or heap._closed:
        heap = _HEAPS[key] = SymmetricHeap(shape, group=group, device=device, timeout_s=timeout_s, num_sms=num_sms)
    heap.users += 1
    return heap


def release_heap(heap: SymmetricHeap) -> None:
    """One user of ``heap`` is done with it; the last one closes it and frees its memory. Peers may still read this
    rank's buffers until they finish their last call: release on every rank after the last call's results are used
    (a CUDA heap first waits for this device's work)."""
    heap.users -= 1
    if heap.users > 0 or heap._closed:
        return
    for key in [key for key, h in _HEAPS.items() if h is heap]:
        del _HEAPS[key]
    if heap.backend == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(heap.device)
    heap.close()


def hold_heap(owner, heap: SymmetricHeap):
    """The function that gives ``owner``'s use of ``heap`` (counted by get_heap) back, once. Of a one-rank heap it
    runs also when ``owner`` is garbage collected, so the autograd contexts that keep a backend alive keep its heap;
    with peers only when called on every rank (ranks collect garbage at different times; a new heap is collective)."""
    if heap.world == 1:
        return weakref.finalize(owner, release_heap, heap)
    return functools.cache(lambda: release_heap(heap))  # (cached: a second call does nothing)


def close_heaps() -> None:
    """Tear down every heap :func:`get_heap` built (call before destroying their process groups)."""
    for heap in _HEAPS.values():
        heap.close()
    _HEAPS.clear()
