"""Launch configs of the grouped GEMM kernels: a named frozen dataclass, heuristic defaults, pinning.

A config holds only what changes code generation or the launch: block sizes, the L2 swizzle height,
pipeline depth, warps, the number of persistent programs, whether loads use TMA descriptors and which kernel runs
(``kernel``: FP8 ops "gluon_ws" = kernels/gluon_fp8_ws.py, "gluon" = kernels/gluon_fp8.py, "triton" =
kernels/grouped_gemm_fp8.py; bf16 ops "gluon_ws" = kernels/gluon_bf16_ws.py (with ``pingpong``), "gluon" =
kernels/gluon_bf16.py, "triton" = kernels/grouped_gemm.py; without a config megamoe.experts picks the warp-specialised
Gluon kernel where it can run: a CUDA device of compute capability 9.x, not under the interpreter, its shape and
config limits met; else the next one, Triton last). ``default_config(op, ...)`` picks one per shape (and kernel);
``pin_config(op, cfg)`` (a context manager) or the ``config=`` argument of every launcher in megamoe.experts
overrides it, which is how tests force each path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from megamoe import _interp

#: values of GemmConfig.kernel
KERNELS = (None, "gluon", "gluon_ws", "triton")
#: bf16 ops whose default is the warp-specialised Gluon kernel where it can run (kernels/gluon_bf16_ws.py;
#: grouped_gemm with nk weights only: dgrad1's kn launch stays on the Triton kernel, see default_config)
WS_BF16_OPS = ("gemm1_swiglu", "gemm2", "grouped_gemm", "dgrad_swiglu")


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    num_sms: int | None = None     # persistent programs; None: programs_per_sm x the device's SM count (4 on CPU)
    use_tma: bool | None = None    # None: TMA descriptors when strides/pointers are 16-byte aligned
    epi_split: int = 1             # epilogue in 1, 2 or 4 column slices (fewer live registers)
    flatten: bool = False          # bf16 kernel: tl.range(flatten=True) tile loop (on for GEMM2, measured below)
    kernel: str | None = None      # FP8 ops: "gluon_ws" (warp-specialised), "gluon", "triton", or None (the first
    #                                of those that can run); bf16 ops: "gluon_ws" = kernels/gluon_bf16_ws.py (the
    #                                default of GEMM1 + SwiGLU, GEMM2 and nk grouped_gemm where it can run),
    #                                "triton" or None = the Triton kernel, "gluon" = kernels/gluon_bf16.py (only
    #                                when asked for); a pinned Gluon kernel that cannot run (CPU, interpreter, not
    #                                sm_90, its limits) raises ValueError
    pingpong: bool = False         # bf16 ops with kernel "gluon_ws": the ping-pong schedule (consumer warpgroups on
    #                                alternate whole tiles; else cooperative: both on halves of every tile)
    programs_per_sm: int = 1       # persistent kernels, num_sms None: 2 = two CTAs share each SM, so one's epilogue
    #                                runs under the other's k-loop (the config must fit two CTAs' registers and
    #                                shared memory, else the second waits: no error, just no overlap)

    def __post_init__(self):
        if not isinstance(self.programs_per_sm, int) or isinstance(self.programs_per_sm, bool) \
                or self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be an int >= 1, got {self.programs_per_sm!r}")
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
    """Heuristic per shape (rows = buffer capacity R, n output columns, k reduction length); the pinned config
    of ``op`` if there is one. ``kernel`` (FP8 ops): the heuristic of that kernel, returned with ``kernel`` set
    (None: the Triton kernel's heuristic, kernel None).

    From two config sweeps on H200 over every preset's shapes (2026-11-29, docs/perf-notes.md): bf16 128 x 256
    output tiles for the plain GEMMs, 128 x (2 x 128) for SwiGLU (gate and up accumulators side by side) with
    the epilogue in two column slices, BLOCK_K 64, 8 warps, 3-4 stages. FP8 (Triton kernel): BLOCK_K 128 (one
    scale per k-step), 128 x 128 plain / 128 x (2 x 64) SwiGLU (wider tiles spill: the per-k-step scaled result
    and the accumulator are both live), 5 stages. FP8 (Gluon kernel, one H200, 2026-11-30): 128 x 128 tiles, 4
    stages, 8 warps was fastest on every plain-GEMM shape (3 stages and 64-row tiles slower); SwiGLU 128 x (2 x 64),
    the same registers (1.13-1.20x our bf16 GEMM1+SwiGLU, only this config timed). The bf16 defaults were revised by
    a third sweep (comment below). Under the interpreter: small tiles so the CPU tests stay fast.
    """
    if op in _PINNED:
        return _PINNED[op]
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    ws_ops = WS_BF16_OPS + ("wgrad",)
    if kernel is not None and not op.endswith("fp8") and not (kernel == "gluon_ws" and op in ws_ops):
        raise ValueError(f"{op}: default_config picks a kernel for the FP8 ops and kernel='gluon_ws' for "
                         f"{ws_ops} only, got kernel={kernel!r} (the single-stream Gluon bf16 kernel is opt-in: "
                         "pass GemmConfig(kernel='gluon', ...) as the op's config)")
    if interpreting():
        return GemmConfig(block_m=32, block_n=32, block_k=32 if "fp8" not in op else 128, group_m=2,
                          num_stages=1, num_warps=4, kernel=kernel)
    if kernel == "gluon_ws" and op == "wgrad":  # kernels/gluon_wgrad_ws.py; one H200, 2026-12-01
        # (benchmarks/gluon_wgrad_bench.py, every preset at EP 4, 4096 tokens, results/gluon-wgrad-h200-2026-12-01-
        # 16aae87-4096.json): 128 x 256 tiles, BLOCK_K 32 x 6 stages 0.96-1.20x the Triton kernel; BLOCK_K 64 x 3
        # stages 0.96-1.14x (at most 0.5% ahead of it), 2 stages and 128-column tiles slower
        return GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=6, num_warps=4, kernel="gluon_ws")
    if kernel == "gluon_ws" and op in WS_BF16_OPS:  # one H200, 2026-12-01 (benchmarks/gluon_bf16_ws_bench.py, every
        # preset at EP 4, 4096 and 16384 tokens): cooperative 128 x (128 + 128) SwiGLU tiles and 128 x 256 plain
        # tiles, 4 stages, TMA-store epilogue: 0.99-1.09x the Triton kernel on GEMM1 + SwiGLU, 1.01-1.07x on GEMM2;
        # ping-pong (128 x 64 + 64, 128 x 128) and 3 stages were slower on most shapes
        # dgrad_swiglu (the SwiGLU backward, kn weights, since 2026-12-01 on the same bench with the gate scale and
        # acts: gluon-bf16-ws-h200-2026-12-01-49f7b9d-*.json): cooperative 128 x 128 tiles, 4 stages, 1.03-1.29x the
        # Triton kernel on qwen3, deepseek and gpt-oss, 0.94-0.99x on mixtral (I = 14336); 3 stages and 64-column
        # tiles slower everywhere. dgrad1 (grouped_gemm, kn) on this kernel was 0.82-1.15x Triton, best variant
        # changing with the shape: it stays on the Triton kernel (experts._bf16_config)
        if op in ("gemm1_swiglu", "dgrad_swiglu"):
            return GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4, kernel="gluon_ws")
        return GemmConfig(block_m=128, block_n=256 if n >= 256 else 128, block_k=64, num_stages=4, num_warps=4,
                          kernel="gluon_ws")
    if kernel == "gluon_ws":  # one H200, 2026-12-01 (EP 4 shapes, gluon_fp8_ws_bench.py): 256-column plain tiles
        # (two 128-column products) 1.1-1.2x the 128-column ones on mixtral, deepseek, qwen3; SwiGLU 128 + 128 columns
        # 1.0-1.3x the 64 + 64 ones; 4 stages within noise of 3, 5 and 6
        if op == "gemm1_swiglu_fp8":
            return GemmConfig(block_m=128, block_n=128 if n % 128 == 0 else 64, block_k=128, num_stages=4,
                              num_warps=4, kernel="gluon_ws")
        return GemmConfig(block_m=128, block_n=256, block_k=128, num_stages=4, num_warps=4, kernel="gluon_ws")
    if kernel == "gluon":
        return GemmConfig(block_m=128, block_n=64 if op == "gemm1_swiglu_fp8" else 128, block_k=128, num_stages=4,
                          num_warps=8, kernel="gluon")
    # third sweep (one H200, 2026-11-30, every preset at EP = 2 and 4, 4096 tokens; bench-gemm --sweep --sweep-bwd,
    # JSON gemm-sweep-h200-2026-11-30-ep{2,4}.json): wgrad BLOCK_K 32 x 5 stages beat 64 x 4 on 14 of 16 shapes
    # (-3 to -10%; +2-3% on mixtral at EP = 4); GEMM2 4 stages + 2 epilogue slices beat 3 + 1 on all 8 (-1 to -11%);
    # GEMM1+SwiGLU 4 stages + 4 slices -3 to -13% where N is a multiple of 128 (gpt-oss, N = 2880: +15% at EP = 4)
    # wgrad, persistent since 2026-11-30 (fourth sweep, one H200, qwen3 and deepseek at EP 2 and 4): one program per
    # SM with the flattened tile loop (the tile's TMA store pipelined under the next tile's loads) beat the former
    # one-program-per-tile grid by 3-8% on 7 of 8 shapes (+1% on qwen3 dW2 at EP 4)
    if op == "wgrad":
        return GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=5, num_warps=8, flatten=True)
    if op == "gemm1_swiglu":
        if n % 128 == 0:
            return GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8, epi_split=4)
        return GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=8, epi_split=2)
    if op == "dgrad_swiglu":
        return GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8, epi_split=2)
    if op in ("gemm1_swiglu_fp8", "dgrad_swiglu_fp8"):
        return GemmConfig(block_m=128, block_n=64, block_k=128, num_stages=5, num_warps=8, kernel=kernel)
    if op.endswith("fp8"):
        return GemmConfig(block_m=128, block_n=128, block_k=128, num_stages=5, num_warps=8, kernel=kernel)
    if op == "gemm2":  # flattened tile loop: 1.16x on deepseek-v3, 1.04x on mixtral at 4096 tokens (H200, 2026-11-30);
        # it made GEMM1+SwiGLU 1.2-1.4x slower; dgrad1 (same kernel) with it, third sweep: -4-8% on qwen3 and
        # deepseek at EP = 2, +8-20% on mixtral and gpt-oss, so dgrad1 keeps the plain loop
        if n >= 256:
            return GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=4, num_warps=8, flatten=True,
                              epi_split=2)
        return GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=3, num_warps=8, flatten=True)
    return GemmConfig(block_m=128, block_n=256 if n >= 256 else 128, block_k=64, num_stages=3, num_warps=8)


#: the compiled kernel of the last launch per kernel name (for register/spill reports: .n_regs, .n_spills)
LAST_COMPILED: dict[str, object] = {}


def record(name: str, compiled: object) -> None:
    LAST_COMPILED[name] = compiled


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (whose fix-ups megamoe._interp installs once)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    _interp.apply()
    return True


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def grid_size(cfg: GemmConfig, max_tiles: int, device: torch.device) -> int:
    p = cfg.num_sms if cfg.num_sms is not None else num_sms(device) * cfg.programs_per_sm
    return max(0, min(p, max_tiles))


def gluon_device_reason(t: torch.Tensor, cfg: GemmConfig) -> str | None:
    """Why a Gluon kernel (sm_90a wgmma, TMA loads) cannot run on ``t``'s device with ``cfg``, or None: the
    interpreter, a non-CUDA device, compute capability other than 9.x, or a config pinning use_tma=False. No device
    sync: the capability comes from torch's cached device properties."""
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
    for t in tensors:
        if t.data_ptr() % 16 != 0 or t.stride(-1) != 1:
            return False
        for s in t.stride()[:-1]:
            if (s * t.element_size()) % 16 != 0:
                return False
    return True
