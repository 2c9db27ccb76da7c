"""Launch configs of the grouped GEMM kernels (only what changes code generation or the launch), heuristic defaults,
pinning, and the device facts the kernel choice reads. ``kernel``: "gluon" (the Hopper kernel in kernels/gluon/),
"triton" (runs everywhere) or None (megamoe.experts picks Gluon where it can run). ``default_config(op, ...)`` picks
one per shape; ``pin_config(op, cfg)`` or a launcher's ``config=`` overrides it, which is how tests force each path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from megamoe.kernels import interpreter

#: epilogues of the grouped GEMM kernels (kernels/grouped_gemm.py has the table of what each writes)
EPI_NONE, EPI_SWIGLU, EPI_DSWIGLU = 0, 1, 2
#: values of GemmConfig.kernel
KERNELS = (None, "gluon", "triton")
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    num_sms: int | None = None     # persistent programs; None: the device's SM count (4 on CPU)
    use_tma: bool | None = None    # None: TMA descriptors when strides/pointers are 16-byte aligned
    epi_split: int = 1             # epilogue in 1, 2 or 4 column slices (fewer live registers)
    flatten: bool = False          # Triton kernel: tl.range(flatten=True) tile loop (the TMA store pipelined)
    kernel: str | None = None      # module docstring; a pinned Gluon kernel that cannot run raises ValueError

    def __post_init__(self):
        if self.epi_split not in (1, 2, 4) or self.block_n % (8 * self.epi_split):
            raise ValueError(f"epi_split must be 1, 2 or 4 and divide block_n into >= 8 columns, got "
                             f"epi_split={self.epi_split}, block_n={self.block_n}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")

    def with_(self, **kw) -> GemmConfig:
        return replace(self, **kw)


#: op names used by default_config / pin_config
OPS = ("gemm1_swiglu", "gemm2", "dgrad_swiglu", "dgrad1", "wgrad", "gemm1_swiglu_fp8", "gemm2_fp8",
       "dgrad_swiglu_fp8", "dgrad1_fp8", "grouped_gemm", "grouped_gemm_fp8")
#: ops with a Gluon kernel on Hopper (every other op runs the Triton kernel there too)
GLUON_OPS = ("gemm1_swiglu", "gemm2", "grouped_gemm", "dgrad_swiglu", "wgrad", "gemm1_swiglu_fp8", "gemm2_fp8",
             "dgrad_swiglu_fp8", "dgrad1_fp8", "grouped_gemm_fp8")

_PINNED: dict[str, GemmConfig] = {}


@contextlib.contextmanager
def pin_config(op: str, cfg: GemmConfig) -> Iterator[None]:
    """Force ``cfg`` for every launch of ``op`` inside the block (ops: see OPS)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")
    old = _PINNED.get(op)
    _PINNED[op] = cfg
    try:
        yield
    finally:
        if old is None:
            _PINNED.pop(op, None)
        else:
            _PINNED[op] = old


def pinned_config(op: str) -> GemmConfig | None:
    """The config pinned for ``op`` by an enclosing pin_config block, else None."""
    return _PINNED.get(op)


def default_config(op: str, rows: int, n: int, k: int, *, kernel: str | None = None) -> GemmConfig:
    """The pinned config of ``op``, else a heuristic per shape (rows = buffer capacity R, n output columns, k
    reduction length) for the Triton (``kernel`` None / "triton") or Gluon kernel, from config sweeps on an H200
    over every preset's EP-4 shapes (docs/performance.md); small tiles under the interpreter keep CPU tests fast."""
    if op in _PINNED:
        return _PINNED[op]
    if kernel == "gluon" and op not in GLUON_OPS:  # (an unknown kernel: GemmConfig raises)
        raise ValueError(f"{op}: no Gluon kernel (it runs the Triton kernel on Hopper too); Gluon ops: {GLUON_OPS}")
    if interpreting():
        return GemmConfig(block_m=32, block_n=32, block_k=32 if "fp8" not in op else 128, group_m=2,
                          num_stages=1, num_warps=4, kernel=kernel)
    # block_m 128 throughout; unnamed fields keep GemmConfig's defaults (block_k 64, 3 stages, 8 warps)
    if kernel == "gluon":
        if op == "wgrad":  # 128 x 256 tiles, BLOCK_K 32 x 6 stages: ahead of BLOCK_K 64 x 3 and of 2 stages
            return GemmConfig(block_n=256, block_k=32, num_stages=6, num_warps=4, kernel="gluon")
        if op in ("gemm1_swiglu", "dgrad_swiglu"):  # 128 x (128 + 128) SwiGLU tiles, 128 x 128 for its backward
            return GemmConfig(num_stages=4, num_warps=4, kernel="gluon")
        if op in ("gemm2", "grouped_gemm"):  # 128 x 256 plain tiles, 4 stages
            return GemmConfig(block_n=256 if n >= 256 else 128, num_stages=4, num_warps=4, kernel="gluon")
        if op == "dgrad_swiglu_fp8":  # the single-stream kernel: 128 x 128 tiles on 8 warps
            return GemmConfig(block_k=128, num_stages=4, kernel="gluon")
        if op == "gemm1_swiglu_fp8":  # 128 + 128 columns (64 + 64 where I % 128 != 0)
            return GemmConfig(block_n=128 if n % 128 == 0 else 64, block_k=128, num_stages=4, num_warps=4,
                              kernel="gluon")
        # plain FP8: 256-column tiles (two 128-column products) beat 128-column ones by 1.1-1.2x
        return GemmConfig(block_n=256, block_k=128, num_stages=4, num_warps=4, kernel="gluon")
    if op == "wgrad":  # persistent, flattened tile loop (the TMA store pipelined under the next tile's loads)
        return GemmConfig(block_n=256, block_k=32, num_stages=5, flatten=True, kernel=kernel)
    if op == "gemm1_swiglu":  # 4 slices where N is a multiple of 128 (gpt-oss's N = 2880: slower with them)
        if n % 128 == 0:
            return GemmConfig(num_stages=4, epi_split=4, kernel=kernel)
        return GemmConfig(epi_split=2, kernel=kernel)
    if op == "dgrad_swiglu":
        return GemmConfig(num_stages=4, epi_split=2, kernel=kernel)
    if op in ("gemm1_swiglu_fp8", "dgrad_swiglu_fp8"):  # wider FP8 tiles spill (scaled product + accumulator live)
        return GemmConfig(block_n=64, block_k=128, num_stages=5, kernel=kernel)
    if op.endswith("fp8"):
        return GemmConfig(block_k=128, num_stages=5, kernel=kernel)
    if op == "gemm2":  # the flattened tile loop pays here (not for GEMM1 + SwiGLU, nor for dgrad1 on every preset)
        if n >= 256:
            return GemmConfig(block_n=256, num_stages=4, flatten=True, epi_split=2, kernel=kernel)
        return GemmConfig(flatten=True, kernel=kernel)
    return GemmConfig(block_n=256 if n >= 256 else 128, kernel=kernel)


#: the compiled kernel of the last launch per kernel name (for register/spill reports: .n_regs, .n_spills)
LAST_COMPILED: dict[str, object] = {}


def record(name: str, compiled: object) -> None:
    LAST_COMPILED[name] = compiled


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (whose fix-ups kernels/interpreter.py installs once)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    interpreter.apply()
    return True


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def grid_size(cfg: GemmConfig, max_tiles: int, device: torch.device) -> int:
    p = cfg.num_sms if cfg.num_sms is not None else num_sms(device)
    return max(0, min(p, max_tiles))


def gluon_device_reason(t: torch.Tensor, cfg: GemmConfig) -> str | None:
    """Why a Gluon kernel (sm_90a wgmma, TMA loads) cannot run on ``t``'s device with ``cfg``, or None (no sync)."""
    if interpreting():
        return "the interpreter (TRITON_INTERPRET=1) cannot run Gluon kernels"
    if t.device.type != "cuda":
        return f"the operands are on {t.device}, not a CUDA device (Gluon kernels need an sm_90a GPU)"
    cc = torch.cuda.get_device_capability(t.device)
    if cc[0] != 9:
        return f"it needs compute capability 9.x (sm_90a wgmma), {t.device} has {cc[0]}.{cc[1]}"
    if cfg.use_tma is False:
        return "it loads through TMA and the config pins use_tma=False"
    return None


def tma_ok(tensors: list[torch.Tensor]) -> bool:
    """TMA descriptors need a 16-byte aligned base, unit inner stride and 16-byte aligned outer strides."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def resolve_tma(cfg: GemmConfig, tensors: list[torch.Tensor], name: str) -> bool:
    """Whether a Triton launch loads ``tensors`` through TMA: cfg.use_tma where pinned (True: ValueError unless
    tma_ok), else where tma_ok."""
    ok = tma_ok(tensors)
    if cfg.use_tma is None:
        return ok
    if cfg.use_tma and not ok:
        raise ValueError(f"{name}: config pins use_tma=True, but TMA needs 16-byte aligned base pointers and "
                         f"row strides (bf16: the inner dims must be multiples of 8, fp8: of 16); shapes "
                         f"{[tuple(t.shape) for t in tensors]}")
    return bool(cfg.use_tma)
