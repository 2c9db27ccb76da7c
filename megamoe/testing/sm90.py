"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU, and read what the compiler made.

The interpreter runs kernels as numpy and misses two classes of device-only defects: compile errors under
argument specialisation (an int argument equal to 1 becomes a constexpr, so ``n.to(tl.int64)`` fails on a
one-token call), and slow memory access (a pointer loaded from memory, such as the heap's peer table, has no
alignment the compiler can see; without ``tl.multiple_of`` every element is its own 2-byte access).

``compile_only`` stands in for the CUDA driver: every launch compiles its kernel for sm_90a with the launch's own
specialisation (Triton's bundled ptxas) and launches nothing. ``python -m megamoe.testing.sm90`` runs the LAYERS
variants (forward + backward on gloo ranks) and the Gluon GEMM and router variants under ``compile_only`` and prints
a JSON report per kernel (global access widths, ptxas usage, ...) for tests/test_sm90_compile.py. It needs
TRITON_INTERPRET unset (interpreted @triton.jit functions cannot be compiled), so the test runs it as a subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime import driver as drv
from triton.runtime.jit import JITFunction


def unfenced_publishes(ptx: str) -> int:
    """Publishing atomics (``atom.global.sys.release.exch``) whose nearest preceding global store is predicated for
    other threads (a single thread's store, the lanes' atomics) with no CTA barrier between: PTX release is cumulative
    only over what its own thread observed, so such a store may be seen after the flag (comm/signals.publish)."""
    bad, last_store, barrier = 0, None, False
    for line in ptx.splitlines():
        line = line.strip()
        if re.match(r"(bar|barrier)\.sync\b", line):
            barrier = True
        elif m := re.match(r"(@!?%p\d+\s+)?st\.global\b", line):
            last_store, barrier = (m.group(1) or "").strip(), False
        elif m := re.match(r"(@!?%p\d+\s+)?atom\.global\.sys\.release\.exch\b", line):
            if last_store is not None and last_store != (m.group(1) or "").strip() and not barrier:
                bad += 1
    return bad


def ffma_under_wgmma(sass: str) -> int:
    """FFMAs the SASS issues while a wgmma is in flight (after ``WARPGROUP.DEPBAR.LE gsb0, N`` with N > 0, before
    the next wait for 0). ptxas hoists waits above independent instructions, so the PTX's wait_group does not show
    whether an FP8 kernel's promotions overlap the tensor cores."""
    count, open_ = 0, False
    for m in re.finditer(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)|\bFFMA\b", sass):
        if m.group(1) is not None:
            open_ = int(m.group(1), 16) > 0
        elif open_:
            count += 1
    return count


#: kernels whose SASS is always disassembled (ffma_under_wgmma); others only where ptxas reports spills, since
#: cuobjdump of every kernel costs about a third of the report's time
SASS_KERNELS = ("_gluon_fp8_dswiglu_kernel",)


def ptxas_usage(compiled, sass_always: bool = False) -> dict[str, int]:
    """Registers, spill bytes, shared memory and wgmma-serialisation warnings from ptxas -v; from the SASS (where the
    kernel spills, or sass_always) ffma_under_wgmma and spills_by_regs, else None and {}."""
    text = _PTXAS_LOGS.get(compiled.hash)
    with tempfile.TemporaryDirectory() as tmp:
        if text is None:  # taken from the cache: run ptxas again
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            res = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                                 capture_output=True, text=True, check=True)
            text = res.stdout + res.stderr
        else:
            (Path(tmp) / "k.o").write_bytes(compiled.asm["cubin"])
        spill_st = _count(r"(\d+) bytes spill stores", text)
        overlapped, by_regs = None, {}
        if sass_always or spill_st:
            try:
                sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(Path(tmp) / "k.o")],
                                      capture_output=True, text=True, check=True).stdout
                overlapped = ffma_under_wgmma(sass)
                by_regs = {str(r): n for r, n in sorted(spills_by_regs(sass).items())}
            except Exception:  # noqa: BLE001 - a triton install without its bundled cuobjdump
                overlapped, by_regs = -1, None
    return {"registers": _count(r"Used (\d+) registers", text, -1),
            # ptxas C7510-C7519: "wgmma.mma_async instructions are serialized" (a wait after every wgmma)
            "wgmma_serialized": sorted(set(re.findall(r"\((C751\d)\)", text))),
            "spill_store_bytes": spill_st, "spill_load_bytes": _count(r"(\d+) bytes spill loads", text),
            "shared_bytes": int(compiled.metadata.shared), "ffma_under_wgmma": overlapped,
            # spill-store bytes by the registers per thread where they are (spills_by_regs; None: no cuobjdump)
            "spill_store_bytes_by_regs": by_regs}


def _count(pattern: str, text: str, missing: int = 0) -> int:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else missing


def spills_by_regs(sass: str) -> dict[int, int]:
    """Spill-store bytes by the register count of the last ``setmaxnreg`` before them (0: before any), telling a
    warp-specialised kernel's partitions apart where ptxas -v gives only the total. -1: out-of-line blocks after
    the last EXIT, which cannot be attributed."""
    last_exit = max((m.start() for m in re.finditer(r"\bEXIT\b", sass)), default=len(sass))
    out, regs = Counter(), 0
    for m in re.finditer(r"USETMAXREG\.\S+\s+(?:\w+\s*,\s*)?0x([0-9a-f]+)|\bSTL(\.(?:64|128))?\b", sass):
        if m.group(1) is not None:
            regs = int(m.group(1), 16)
        else:
            out[-1 if m.start() > last_exit else regs] += {".64": 8, ".128": 16}.get(m.group(2) or "", 4)
    return dict(out)


#: stands in for Triton's CUDA driver where there is no GPU: the current target is sm_90a; the device "sm90a" is its
#: own key in JITFunction's per-device cache, so sm_90a kernels never mix with real device-0 kernels
_HOPPER_DRIVER = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32),
                                       get_current_device=lambda: "sm90a", get_current_stream=lambda device=None: 0)

#: ptxas -v output of each kernel compiled under :func:`compile_only`, by hash, so ptxas_usage need not rerun ptxas
_PTXAS_LOGS: dict[str, str] = {}
#: seconds each kernel compiled under compile_only took (hash -> s; absent: taken from the cache)
_COMPILE_S: dict[str, float] = {}


@contextlib.contextmanager
def _launches_to(run):
    """Inside the block every Triton launch calls ``run(self, *args, grid=, warmup=, **kwargs)``, on the Hopper
    stand-in target."""
    with mock.patch.object(drv, "_active", _HOPPER_DRIVER), mock.patch.object(JITFunction, "run", run):
        yield


@contextlib.contextmanager
def compile_only(compiled: dict[str, dict[str, object]]):
    """Inside the block every Triton launch compiles for sm_90a with its real specialisation and launches nothing;
    ``compiled[kernel name][cache key]`` collects the kernels. Outputs stay unwritten, so only code that never reads
    device results on the host (the sync-free backends) runs unchanged."""
    orig_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        log, t0 = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stdout(log):  # a compile prints its ptxas -v output: kept for ptxas_usage
            k = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        if "registers" in log.getvalue():  # compiled now (not from the cache)
            _PTXAS_LOGS[k.hash] = log.getvalue()
            _COMPILE_S[k.hash] = time.perf_counter() - t0
        compiled.setdefault(self.fn.__name__, {})[k.hash] = k
        return k

    with knobs.nvidia.scope(), _launches_to(run):  # scope restores the knob and the environment variable
        knobs.nvidia.dump_ptxas_log = True
        yield compiled


#: the layers :func:`layer_report` compiles: (world, preset, experts, tokens per rank, backend, options). An int
#: argument equal to 1 becomes a constexpr, hence the W = 1, E_l = 1 (mixtral, 2 experts on 2 ranks) and 1-token
#: entries. On CPU tensors fused picks its Triton items; the pseudo-option ``items="gluon"`` (not a layer option)
#: compiles the Gluon items. On two ranks rank 0 compiles first, then rank 1, which finds rank 0's kernels in
#: Triton's cache wherever it specialises alike (communication kernels leave ``rank`` unspecialised); a kernel
#: rank 1 compiles anew is reported (tests/test_sm90_compile.py asserts there is none).
LAYERS = [
    (2, "qwen3-30b-a3b", 8, 64, "split", {}),
    (2, "qwen3-30b-a3b", 8, 64, "split", {"presum_combine": True}),
    (2, "qwen3-30b-a3b", 8, 64, "split", {"fp8": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"ring_blocks": 8}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"items": "gluon", "ring_blocks": 8}),
    (2, "qwen3-30b-a3b", 8, 1, "split", {}),
    (2, "qwen3-30b-a3b", 8, 1, "fused", {}),
    (2, "qwen3-30b-a3b", 8, 1, "fused", {"items": "gluon"}),
    (2, "deepseek-v3", 8, 64, "split", {}),
    (2, "mixtral-8x7b", 2, 64, "split", {}),
    (2, "mixtral-8x7b", 2, 64, "fused", {}),
    (1, "qwen3-30b-a3b", 8, 64, "split", {}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {"items": "gluon"}),
]


@contextlib.contextmanager
def _fused_items(items: str | None):
    """``items="gluon"``: the Gluon items' checks pass with the device left out (compiled, never run); None: the
    device check as it is (Triton on CPU)."""
    import megamoe.backends.fused as backend
    import megamoe.kernels.fused_moe as fm

    orig = backend.gluon_fused_reason
    no_device = lambda cfg, **kw: orig(cfg, **{**kw, "device": None})
    with contextlib.ExitStack() as stack:
        for mod in (backend, fm) if items is not None else ():
            stack.enter_context(mock.patch.object(mod, "gluon_fused_reason", no_device))
        yield


def _summary(k) -> dict:
    ptx = k.asm["ptx"]
    # "ld" / "st": global loads and stores by instruction (e.g. 'st.global.v4.b32': 60, 'st.global.b16': 16)
    widths = {kind: dict(Counter(re.findall(rf"\b({kind}(?:\.[A-Za-z0-9_:]+)*\.global(?:\.[A-Za-z0-9_:]+)*)", ptx)))
              for kind in ("ld", "st")}
    waits = Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))
    tma_st = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx))
    return {**widths, "tma_stores": tma_st, "wgmma_wait_groups": dict(waits), "bounded_waits": "%globaltimer" in ptx,
            "traps": len(re.findall(r"\btrap;", ptx)), "unfenced_publishes": unfenced_publishes(ptx),
            **ptxas_usage(k, sass_always=k.metadata.name in SASS_KERNELS),
            "compile_s": round(_COMPILE_S.get(k.hash, 0.0), 2)}  # 0: taken from Triton's cache


@contextlib.contextmanager
def _compiling(compiled: dict, where: dict, label: str, *kernels: str):
    """:func:`compile_only`, labelling ``label`` in ``where`` each kernel that the block compiles (of these names;
    none named: any)."""
    before = {n: set(v) for n, v in compiled.items()}
    with compile_only(compiled):
        yield
    for n in kernels or list(compiled):
        for key in set(compiled.get(n, {})) - before.get(n, set()):
            where.setdefault(f"{n}#{key[:8]}", label)


#: :func:`_gluon_fp8_ws`'s variants (label, epilogue, block_n, stages, experts, rows): the defaults at deepseek-v3's
#: shapes with 8 and 64 experts (the loader's schedule vectors grow with them), the SwiGLU 64 + 64 tile (default
#: where I % 128 != 0), one row and one expert
WS_VARIANTS = [
    ("none/bn256/E8", 0, 256, 4, 8, 1024),
    ("none/bn256/E64", 0, 256, 4, 64, 4096),
    ("swiglu/bn128/E64", 1, 128, 4, 64, 4096),
    ("swiglu/bn64/E64", 1, 64, 4, 64, 4096),
    ("swiglu/bn128/1row", 1, 128, 4, 1, 1),
]


#: deepseek-v3's hidden and intermediate widths, the Gluon GEMM variants' shapes
H, I = 7168, 2048


def _grouped(E: int, R: int, **cfg):
    """(offsets of R rows split evenly over E experts, a Gluon GemmConfig on 132 SMs)."""
    from megamoe.kernels.gemm_config import GemmConfig

    return torch.arange(0, E + 1, dtype=torch.int32) * (R // E), GemmConfig(num_sms=132, kernel="gluon", **cfg)


def _gluon_fp8_ws(compiled: dict, where: dict) -> None:
    """Compile megamoe/kernels/gluon/fp8.py's kernel for WS_VARIANTS at deepseek-v3's H and I (plain: K = I)."""
    from megamoe.kernels.gluon.fp8 import launch_gluon_fp8_ws

    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    for label, epi, bn, stages, E, R in WS_VARIANTS:
        N, K, N_w = (H, I, H) if epi == 0 else (I, H, 2 * I)
        aq, wq = torch.empty(R, K, dtype=f8), torch.empty(E, N_w, K, dtype=f8)  # never read: compiled only
        a_s, w_s = torch.ones(R, K // 128), torch.ones(E, N_w // 128, K // 128)
        offs, cfg = _grouped(E, R, block_m=128, block_n=bn, block_k=128, num_stages=stages, num_warps=4)
        out = torch.empty(R, N, dtype=bf)
        h = torch.empty(R, 2 * I, dtype=bf) if epi == 1 else None
        with _compiling(compiled, where, f"gluon-fp8-ws/{label}", "_gluon_fp8_ws_kernel"):
            launch_gluon_fp8_ws(aq, a_s, wq, w_s, offs, out, cfg, n=N, epilogue=epi, h=h, store_h=epi == 1,
                                n_up=I if epi == 1 else 0, scale=torch.ones(R) if epi == 0 else None)


#: :func:`_gluon_fp8_dswiglu`'s variants (label, (block_m, block_n, stages, warps), gate scale, one row and one
#: expert); "acts" also writes the gated activation (split's FP8 backward). The first is the default config.
DSWIGLU_VARIANTS = [
    ("bm128/scale/acts", (128, 128, 4, 8), True, False),
    ("bm128", (128, 128, 4, 8), False, False),
    ("bm128/scale", (128, 128, 4, 8), True, False),
    ("bm64/scale", (64, 128, 4, 8), True, False),
    ("bm64w4/scale", (64, 64, 3, 4), True, False),
    ("bm128/scale/1row", (128, 128, 4, 8), True, True),
]


def _gluon_fp8_dswiglu(compiled: dict, where: dict) -> None:
    """Compile megamoe/kernels/gluon/fp8_dswiglu.py's kernel for DSWIGLU_VARIANTS (K = H = 7168, N = I = 2048)."""
    from megamoe.kernels.gluon.fp8_dswiglu import launch_gluon_fp8_dswiglu

    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    for label, (bm, bn, stages, warps), scaled, edge in DSWIGLU_VARIANTS:
        E, R = (1, 1) if edge else (8, 1024)
        aq, wq = torch.empty(R, H, dtype=f8), torch.empty(E, I, H, dtype=f8)  # never read: compiled only
        a_s, w_s = torch.ones(R, H // 128), torch.ones(E, I // 128, H // 128)
        offs, cfg = _grouped(E, R, block_m=bm, block_n=bn, block_k=128, num_stages=stages, num_warps=warps)
        out, h = torch.empty(R, 2 * I, dtype=bf), torch.empty(R, 2 * I, dtype=bf)
        scale = torch.ones(R) if scaled else None
        dsp = torch.zeros(I // bn, R) if scaled else None
        acts = torch.empty(R, I, dtype=bf) if "acts" in label.split("/") else None
        with _compiling(compiled, where, f"gluon-fp8-dswiglu/{label}", "_gluon_fp8_dswiglu_kernel"):
            launch_gluon_fp8_dswiglu(aq, a_s, wq, w_s, offs, out, cfg, n=I, h=h, scale=scale, dsp=dsp, acts=acts)


#: :func:`_gluon_bf16_ws`'s variants (label, epilogue, block_n, stages, experts, rows, TMA-able output): the defaults
#: at deepseek-v3's shapes (GEMM1 + SwiGLU, GEMM2 with gate scale, the SwiGLU backward) on 8 and 64 experts, an
#: output TMA cannot store (N = 7164: masked stores), one row and one expert
WS_BF16_VARIANTS = [
    ("swiglu/bn128/s4/h/E64", 1, 128, 4, 64, 4096, True),
    ("none/bn256/s4/scale/E8", 0, 256, 4, 8, 1024, True),
    ("none/bn256/s4/scale/E64", 0, 256, 4, 64, 4096, True),
    ("none/bn256/s4/masked", 0, 256, 4, 8, 1024, False),
    ("swiglu/bn128/s4/h/1row", 1, 128, 4, 1, 1, True),
    ("dswiglu/bn128/s4/scale/acts/E64", 2, 128, 4, 64, 4096, True),
    ("dswiglu/bn128/s3/E64", 2, 128, 3, 64, 4096, True),
    ("dswiglu/bn64/s4/scale/E8", 2, 64, 4, 8, 1024, True),
    ("dswiglu/bn128/s4/scale/acts/1row", 2, 128, 4, 1, 1, True),
]


def _gluon_bf16_ws(compiled: dict, where: dict) -> None:
    """Compile megamoe/kernels/gluon/bf16.py's kernel for WS_BF16_VARIANTS at deepseek-v3's H and I (dswiglu: kn w2)."""
    from megamoe.kernels.gluon.bf16 import launch_gluon_bf16_ws

    bf = torch.bfloat16
    for label, epi, bn, stages, E, R, aligned in WS_BF16_VARIANTS:
        kn = epi == 2
        N, K, N_w = {0: (H if aligned else H - 4, I, H if aligned else H - 4), 1: (I, H, 2 * I), 2: (I, H, I)}[epi]
        a = torch.empty(R, K, dtype=bf)  # never read: zero-filling GBs of weights would cost ~1 s per variant
        w = torch.empty(E, K, N_w, dtype=bf) if kn else torch.empty(E, N_w, K, dtype=bf)
        offs, cfg = _grouped(E, R, block_m=128, block_n=bn, block_k=64, num_stages=stages, num_warps=4)
        out = torch.empty(R, 2 * N if epi == 2 else N, dtype=bf)
        h = torch.empty(R, 2 * I, dtype=bf) if epi else None
        scale = torch.ones(R) if epi == 0 or "scale" in label else None
        dsp = torch.zeros((N + bn - 1) // bn, R) if epi == 2 and scale is not None else None
        acts = torch.empty(R, N, dtype=bf) if "acts" in label else None
        with _compiling(compiled, where, f"gluon-bf16-ws/{label}", "_gluon_bf16_ws_kernel"):
            launch_gluon_bf16_ws(a, w, offs, out, cfg, n=N, epilogue=epi, h=h, store_h=epi == 1, w_kn=kn,
                                 n_up=I if epi == 1 else 0, scale=scale, dsp=dsp, acts=acts)


def _wgrad_outputs(compiled: dict, where: dict) -> None:
    """grouped_wgrad with its default config and both output dtypes (bf16 as the layers use, float32 the default)
    at deepseek-v3's dW13 width: the float32 output's TMA staging tile can overflow shared memory, which only the
    report's shared bytes show without a GPU."""
    from megamoe.experts import grouped_wgrad

    x, y = torch.zeros(512, 4096, dtype=torch.bfloat16), torch.zeros(512, 7168, dtype=torch.bfloat16)
    offs = torch.tensor([0, 200, 512], dtype=torch.int32)
    for dt in (torch.bfloat16, torch.float32):
        with _compiling(compiled, where, f"wgrad/default/{str(dt).replace('torch.', '')}", "_grouped_wgrad_kernel"):
            grouped_wgrad(x, y, offs, out_dtype=dt)


#: :func:`_gluon_wgrad_ws`'s variants (label, M, N, experts, rows, output dtype, BLOCK_K, stages): the default
#: config at deepseek-v3's dW13, float32 output, BLOCK_K 64 x 3 stages. Shapes are runtime values (in the TMA
#: descriptors), so dW2's shape or one row compiles the same kernel
WGRAD_WS_VARIANTS = [
    ("dw13/bf16/E64", 4096, 7168, 64, 4096, "bfloat16", None, None),
    ("dw13/fp32/E8", 4096, 7168, 8, 1024, "float32", None, None),
    ("dw13/bf16/bk64s3/E8", 4096, 7168, 8, 1024, "bfloat16", 64, 3),
]


def _gluon_wgrad_ws(compiled: dict, where: dict) -> None:
    """Compile megamoe/kernels/gluon/wgrad.py's kernel for WGRAD_WS_VARIANTS (out [E, M, N] = x^T y per expert)."""
    from megamoe.kernels.gemm_config import default_config
    from megamoe.kernels.gluon.wgrad import launch_gluon_wgrad_ws

    for label, M, N, E, R, dt, bk, stages in WGRAD_WS_VARIANTS:
        x, y = torch.empty(R, M, dtype=torch.bfloat16), torch.empty(R, N, dtype=torch.bfloat16)  # compiled only
        out = torch.empty(E, M, N, dtype=getattr(torch, dt))
        offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
        cfg = dataclasses.replace(default_config("wgrad", R, N, M, kernel="gluon"), num_sms=132)
        if bk is not None:
            cfg = dataclasses.replace(cfg, block_k=bk, num_stages=stages)
        with _compiling(compiled, where, f"gluon-wgrad-ws/{label}", "_gluon_wgrad_ws_kernel"):
            launch_gluon_wgrad_ws(x, y, offs, out, cfg)


#: :func:`_router`'s cases of megamoe/kernels/router_topk.py (label, E, k, sigmoid, bias, tokens, n_group,
#: topk_group; T = 1 arrives as a constexpr); the layers on CPU tensors take the torch router.
ROUTER_CASES = [
    ("qwen3", 128, 8, False, False, 4096, 1, 1),
    ("deepseek", 256, 8, True, True, 4096, 1, 1),
    ("deepseek/groups", 256, 8, True, True, 4096, 8, 4),
    ("mixtral", 8, 2, False, False, 4096, 1, 1),
    ("gpt-oss/1tok", 128, 4, False, False, 1, 1, 1),
]


def _router(compiled: dict, where: dict) -> None:
    """The router's forward and backward kernels at every preset's (E, k, router): a spill there nearly doubles
    their time."""
    from megamoe.kernels.router_topk import RouteTopk

    for label, E, k, sigmoid, bias, T, n_group, topk_group in ROUTER_CASES:
        names = ("_route_fwd_kernel", "_route_finish_kernel", "_route_bwd_kernel")
        with _compiling(compiled, where, f"router/{label}", *names):
            logits = torch.zeros(T, E, requires_grad=True)
            idx, gates, aux, counts = RouteTopk.apply(logits, torch.zeros(E) if bias else None, k, sigmoid, True,
                                                      2.5 if sigmoid else 1.0, 0.01, n_group, topk_group)
            (gates.sum() + aux).backward()


def _layer_rank(rank: int, world: int, standalone: bool = False) -> dict:
    """This rank's LAYERS entries of this world size under compile_only; ``standalone``: also the Gluon GEMM,
    wgrad and router variants."""
    from megamoe.config import preset
    from megamoe.layer import MoE

    compiled: dict[str, dict[str, object]] = {}
    where: dict[str, str] = {}

    # the layers initialise only the router: no kernel reads the expert weights, and drawing them costs ~6% of the
    # report's time
    router_only = lambda self, seed=0: self.router.reset_parameters(torch.Generator().manual_seed(seed))

    # pass 0: rank 0 compiles, the others skip their launches; pass 1: the reverse, rank 0's kernels from the cache
    for compiling in range(min(world, 2)):
        if compiling:  # else rank 1, running ahead, would compile rank 0's last entries too
            dist.barrier()
        for w, name, experts, tokens, backend, opts in [e for e in LAYERS if e[0] == world]:
            cfg = preset(name, num_experts=experts, max_tokens_per_rank=max(tokens, 1))
            label = f"W{w}/{name}/{tokens}tok/{backend}" + "".join(f":{k}={v}" for k, v in opts.items())
            skip = _launches_to(lambda self, *args, grid, warmup, **kwargs: None)  # kernels not wanted on this rank
            ctx = _compiling(compiled, where, label) if (rank > 0) == (compiling == 1) else skip
            layer_opts = {k: v for k, v in opts.items() if k != "items"}
            with ctx, mock.patch.object(MoE, "reset_parameters", router_only), _fused_items(opts.get("items")):
                moe = MoE(cfg, backend=backend, device=torch.device("cpu"), seed=0, **layer_opts)
                out = moe(torch.zeros(tokens, cfg.hidden, dtype=cfg.dtype).requires_grad_()).out
                out.backward(torch.zeros_like(out))
            del moe
    if standalone:
        for fn in (_gluon_fp8_dswiglu, _gluon_fp8_ws, _gluon_wgrad_ws, _wgrad_outputs, _router, _gluon_bf16_ws):
            fn(compiled, where)
    # every rank reports what it compiled (its own specialisations are checked too); a kernel a lower rank also
    # compiled is summarised there only
    mine = {f"{n}#{key[:8]}": k for n, ks in compiled.items() for key, k in ks.items()}
    if world > 1:
        keys = [None] * world
        dist.all_gather_object(keys, sorted(mine))
        lower = set().union(*keys[:rank])
        mine = {name: k for name, k in mine.items() if name not in lower}
    return {name: {"layer": where.get(name, ""), "rank": rank, **_summary(k)} for name, k in mine.items()}


def layer_report() -> dict[str, dict]:
    """{kernel: summary} of every Triton kernel the LAYERS variants launch on their gloo ranks and of the standalone
    variants, compiled for sm_90a. The world sizes' groups run at once (the standalone kernels on the one-rank group,
    which has least else to do), ~1.5x faster than one after the other."""
    from megamoe.dist import spawn

    worlds = sorted({entry[0] for entry in LAYERS} | {1}, reverse=True)
    out: dict[str, dict] = {}
    with ThreadPoolExecutor(len(worlds)) as pool:
        futs = [pool.submit(spawn, _layer_rank, w, w == 1, timeout_s=1500) for w in worlds]
        for f in futs:  # largest world first: a one-rank entry of the same kernel overwrites it
            for rank_out in f.result():
                out.update(rank_out)
    return out


def run_report_subprocess(timeout_s: float = 1500.0) -> dict[str, dict]:
    """:func:`layer_report` in a fresh interpreter without TRITON_INTERPRET (for interpreted processes)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])  # the source tree, whether installed or not
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "megamoe.testing.sm90"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
                            start_new_session=True)  # its own process group: a timeout kills the ranks too
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(layer_report()))
