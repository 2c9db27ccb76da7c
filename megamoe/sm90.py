"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU, and read what the compiler made.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy and sees neither the compiler's argument
specialisation nor its code generation, so it misses two classes of defects that only show on the device:

- compile errors under specialisation: an int argument equal to 1 arrives as a Python constexpr, so
  ``n.to(tl.int64)`` fails to compile when a call has exactly one token (found on the H200, 2026-11-30);
- slow memory access: a pointer loaded from memory (the symmetric heap's peer table) has no alignment the
  compiler can see, and without ``tl.multiple_of`` or passing it as an argument every element is its own
  2-byte access (the fused megakernel's GEMM2 epilogue store cost ~1.9 ms of 7.4 that way, same day).

``compile_only`` stands in for the CUDA driver: every launch compiles its kernel for sm_90a (the real cubin,
with Triton's bundled ptxas) with the launch's own argument specialisation, and launches nothing.
``access_widths`` counts global loads/stores by width in the PTX and ``ptxas_usage`` reports registers, spills
and shared memory. ``python -m megamoe.sm90`` runs the split and fused layers (forward + backward, the
variants in LAYERS, 64 and 1 tokens per rank, 1 and 2 ranks, full hidden sizes) on gloo ranks under ``compile_only`` and
prints a JSON report per compiled kernel (plus the Gluon FP8 GEMM's variants, GLUON_VARIANTS: the layers on CPU
tensors take the Triton FP8 kernel, and the Gluon bf16 GEMM's, BF16_VARIANTS); tests/test_sm90_compile.py asserts
on it. It must run where
TRITON_INTERPRET is unset (under the interpreter @triton.jit yields functions the compiler cannot take), so
the test starts it as a subprocess.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from triton.backends.compiler import GPUTarget

HOPPER = GPUTarget("cuda", 90, 32)


def access_widths(compiled) -> dict[str, Counter]:
    """Global loads and stores in the PTX, by instruction (e.g. 'st.global.v4.b32': 60, 'st.global.b16': 16)."""
    ptx = compiled.asm["ptx"]
    pat = r"\b({kind}(?:\.[A-Za-z0-9_:]+)*\.global(?:\.[A-Za-z0-9_:]+)*)"
    return {kind: Counter(re.findall(pat.format(kind=kind), ptx)) for kind in ("ld", "st")}


def ffma_under_wgmma(sass: str) -> int:
    """FFMA instructions that the SASS issues while the warp still has a wgmma in flight: after a
    ``WARPGROUP.DEPBAR.LE gsb0, N`` with N > 0 (wgmma.wait_group N) and before the next wait for 0. ptxas moves a
    wait above any independent instruction of its basic block, so PTX order alone does not show the overlap of an
    FP8 kernel's promotions with the tensor cores (the Gluon FP8 kernel's plain loop: wait_group 1 in the PTX,
    0 FFMAs under a wgmma in the SASS)."""
    count, open_ = 0, False
    for m in re.finditer(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)|\bFFMA\b", sass):
        if m.group(1) is not None:
            open_ = int(m.group(1), 16) > 0
        elif open_:
            count += 1
    return count


#: kernels whose SASS is always disassembled (for ffma_under_wgmma); any other kernel's only where ptxas reports spills
#: (for spills_by_regs): cuobjdump of every kernel was a third of the report's time on 2 CPU cores (2026-12-03)
SASS_KERNELS = ("_gluon_fp8_grouped_kernel",)


def ptxas_usage(compiled, sass_always: bool = False) -> dict[str, int]:
    """Registers per thread, spill bytes, shared memory and wgmma-serialisation warnings of the kernel, from the
    bundled ptxas -v; and from its SASS (bundled cuobjdump; where the kernel spills, or sass_always) the FFMAs issued
    under an in-flight wgmma and the spills of each setmaxnreg region. Without the SASS: ``ffma_under_wgmma`` None
    (not looked at) and, with no spills, ``spill_store_bytes_by_regs`` {} (nothing to attribute)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas

    text = _PTXAS_LOGS.get(compiled.hash)
    with tempfile.TemporaryDirectory() as tmp:
        if text is None:  # (from the cache: ptxas again)
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            res = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                                 capture_output=True, text=True, check=True)
            text = res.stdout + res.stderr
        else:
            (Path(tmp) / "k.o").write_bytes(compiled.asm["cubin"])
        spill_st = re.search(r"(\d+) bytes spill stores", text)
        spill_st = int(spill_st.group(1)) if spill_st else 0
        overlapped, by_regs = None, {}
        if sass_always or spill_st:
            try:
                sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(Path(tmp) / "k.o")],
                                      capture_output=True, text=True, check=True).stdout
                overlapped = ffma_under_wgmma(sass)
                by_regs = {str(r): n for r, n in sorted(spills_by_regs(sass).items())}
            except Exception:  # noqa: BLE001 - a triton install without its bundled cuobjdump
                overlapped, by_regs = -1, None
    regs = re.search(r"Used (\d+) registers", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else -1,
            # ptxas C7510-C7519: "wgmma.mma_async instructions are serialized due to ..." (it then waits after every
            # wgmma, whatever wait_group the PTX asks for)
            "wgmma_serialized": sorted(set(re.findall(r"\((C751\d)\)", text))),
            "spill_store_bytes": spill_st,
            "spill_load_bytes": int(spill_ld.group(1)) if spill_ld else 0,
            "shared_bytes": int(compiled.metadata.shared),
            "ffma_under_wgmma": overlapped,
            # spill-store bytes by the registers per thread where they are (spills_by_regs; None: no cuobjdump)
            "spill_store_bytes_by_regs": by_regs}


def spills_by_regs(sass: str) -> dict[int, int]:
    """Spill-store bytes of the SASS by the register count in effect where they are: the last ``setmaxnreg`` before
    them in layout order (``USETMAXREG ... 0xd0``: 208; 0: before any), which tells the partitions of a
    warp-specialised kernel apart (ptxas -v only gives the kernel's total): each partition's code is laid out after
    its own ``setmaxnreg``. -1: after the kernel's last EXIT, the out-of-line blocks (e.g. the paths a warp takes
    when it is diverged at a collective), which this cannot attribute."""
    last_exit = max((m.start() for m in re.finditer(r"\bEXIT\b", sass)), default=len(sass))
    out: dict[int, int] = {}
    regs = 0
    for m in re.finditer(r"USETMAXREG\.\S+\s+(?:\w+\s*,\s*)?0x([0-9a-f]+)|\bSTL(\.(?:64|128))?\b", sass):
        if m.group(1) is not None:
            regs = int(m.group(1), 16)
        else:
            key = -1 if m.start() > last_exit else regs
            out[key] = out.get(key, 0) + {".64": 8, ".128": 16}.get(m.group(2) or "", 4)
    return out


class _HopperTarget:
    """Stands in for Triton's CUDA driver where there is no GPU: the current target is sm_90a."""

    def get_current_target(self):
        return HOPPER

    def get_current_device(self):
        # its own key in every JITFunction's per-device cache: sm_90a kernels compiled here are never handed to
        # a real launch on device 0 afterwards, nor real kernels of device 0 reported as sm_90a
        return "sm90a"

    def get_current_stream(self, device=None):
        return 0


#: the ptxas -v output of each kernel compiled under :func:`compile_only` in this process, by its hash: ptxas_usage
#: reads it (and disassembles the kernel's cubin) instead of running ptxas on the PTX again
_PTXAS_LOGS: dict[str, str] = {}
#: seconds each kernel compiled under compile_only took (hash -> s; absent: taken from the cache)
_COMPILE_S: dict[str, float] = {}


@contextlib.contextmanager
def _launches_to(run):
    """Inside the block every Triton launch calls ``run(self, *args, grid=, warmup=, **kwargs)`` instead, with the
    Hopper stand-in as the driver's target (compile_only, launch_nothing)."""
    from triton.runtime import driver as drv
    from triton.runtime.jit import JITFunction

    orig_run = JITFunction.run
    prev = drv._active
    drv.set_active(_HopperTarget())
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = orig_run
        drv._active = prev


@contextlib.contextmanager
def compile_only(compiled: dict[str, dict[str, object]]):
    """Inside the block every Triton launch compiles its kernel for sm_90a with the launch's real argument
    specialisation (ints equal to 1 as constexprs, 16-byte alignment of each pointer) and launches nothing;
    ``compiled[kernel name][cache key]`` collects the kernels. Outputs are left unwritten, so only code whose
    host side never reads device results (megamoe's sync-free backends) runs through unchanged."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    orig_run = JITFunction.run
    env = os.environ.get("TRITON_DUMP_PTXAS_LOG")

    def run(self, *args, grid, warmup, **kwargs):
        log = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(log):  # (a compile prints its ptxas -v output: kept for ptxas_usage)
            k = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        if "registers" in log.getvalue():  # compiled now (not from the cache)
            _PTXAS_LOGS[k.hash] = log.getvalue()
            _COMPILE_S[k.hash] = time.perf_counter() - t0
        compiled.setdefault(self.fn.__name__, {})[k.hash] = k
        return k

    knobs.nvidia.dump_ptxas_log = True
    try:
        with _launches_to(run):
            yield compiled
    finally:
        del knobs.nvidia.dump_ptxas_log  # (and its environment variable as it was: setting the knob exports it)
        if env is None:
            os.environ.pop("TRITON_DUMP_PTXAS_LOG", None)
        else:
            os.environ["TRITON_DUMP_PTXAS_LOG"] = env


#: the layers whose kernels :func:`layer_report` compiles:
#: (world, preset, experts, tokens per rank, backend, options). An int argument equal to 1 (one rank, one local
#: expert, one token) becomes a constexpr, hence the W = 1, E_l = 1 (mixtral dims with 2 experts on 2 ranks)
#: and 1-token entries. The communication kernels take ``rank`` unspecialised (``do_not_specialize``, since
#: 2026-12-03: rank 1 used to arrive as a constexpr, rank 0 as a multiple of 16, so every rank compiled its own
#: copies, ~20% of this report's compile time): on a two-rank entry rank 0 compiles first while rank 1 runs the
#: layer with its launches skipped, then (after a barrier) rank 1 runs every entry under compile_only, which finds
#: rank 0's kernels in Triton's cache wherever its launches specialise alike; a kernel it compiles anew is its own
#: (the report keeps it; tests/test_sm90_compile.py asserts there is none).
LAYERS = [
    (2, "qwen3-30b-a3b", 8, 64, "split", {}),
    (2, "qwen3-30b-a3b", 8, 64, "split", {"presum_combine": True, "overlap_backward": False}),
    (2, "qwen3-30b-a3b", 8, 64, "split", {"fp8": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"combine": "pull", "fused_backward": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"fused_backward": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"ring_blocks": 8}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"prologue": True, "pull_prefetch": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"pull_prefetch": True, "fused_backward": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"fp8": True}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"fp8": True, "ring_blocks": 8}),
    (2, "qwen3-30b-a3b", 8, 1, "split", {}),
    (2, "qwen3-30b-a3b", 8, 1, "fused", {}),
    (2, "qwen3-30b-a3b", 8, 1, "fused", {"combine": "pull"}),
    (2, "deepseek-v3", 8, 64, "split", {}),
    (2, "mixtral-8x7b", 2, 64, "split", {}),
    (2, "mixtral-8x7b", 2, 64, "fused", {}),
    (1, "qwen3-30b-a3b", 8, 64, "split", {}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {"kernel": "gluon"}),
    (2, "qwen3-30b-a3b", 8, 64, "fused", {"kernel": "gluon", "ring_blocks": 8, "combine": "pull"}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {"kernel": "gluon", "fp8": True}),
]


def _summary(k) -> dict:
    widths = access_widths(k)
    waits = Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", k.asm["ptx"]))
    tma_st = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", k.asm["ptx"]))
    return {"ld": dict(widths["ld"]), "st": dict(widths["st"]), "tma_stores": tma_st, "wgmma_wait_groups": dict(waits),
            **ptxas_usage(k, sass_always=k.metadata.name in SASS_KERNELS),
            "compile_s": round(_COMPILE_S.get(k.hash, 0.0), 2)}  # (0: taken from Triton's cache)


#: the Gluon FP8 kernel's variants that :func:`_gluon_fp8` compiles: (label, epilogue, (block_m, block_n, stages,
#: warps), flag = scale (EPI_NONE, EPI_DSWIGLU) or store_h (EPI_SWIGLU), edge = one row and one expert (R = 1 and
#: E_l = 1 arrive as constexprs)); "acts" in a label: the SwiGLU backward also writes the gated activation. The
#: configs are the ones tests/test_gpu_gluon_fp8.py runs; the first of each epilogue is its default
#: (gemm_config.default_config(..., kernel="gluon")).
GLUON_VARIANTS = [
    ("none/bm128/s4", 0, (128, 128, 4, 8), True, False),
    ("none/bm128/s3", 0, (128, 128, 3, 8), True, False),
    ("none/bm64/s4", 0, (64, 128, 4, 8), True, False),
    ("swiglu/bm128", 1, (128, 64, 4, 8), False, False),
    ("swiglu/bm128/h", 1, (128, 64, 4, 8), True, False),
    ("swiglu/bm64w4/h", 1, (64, 64, 3, 4), True, False),
    ("swiglu/bm128/h/1row", 1, (128, 64, 4, 8), True, True),
    ("dswiglu/bm128", 2, (128, 128, 4, 8), False, False),
    ("dswiglu/bm128/scale", 2, (128, 128, 4, 8), True, False),
    ("dswiglu/bm64/scale", 2, (64, 128, 4, 8), True, False),
    ("dswiglu/bm64w4/scale", 2, (64, 64, 3, 4), True, False),
    ("dswiglu/bm128/scale/1row", 2, (128, 128, 4, 8), True, True),
    ("dswiglu/bm128/scale/acts", 2, (128, 128, 4, 8), True, False),  # the split FP8 backward's launch
]


#: the warp-specialised FP8 kernel's variants that :func:`_gluon_fp8_ws` compiles: (label, epilogue, block_n,
#: stages, experts, rows): the defaults at deepseek-v3's shapes (plain 256 columns, SwiGLU 128 + 128) with 8 and 64
#: local experts (the loader's schedule vectors grow with them; 240 consumer registers at <= 8), the SwiGLU 64 + 64
#: tile (the default where I % 128 != 0), one row and one expert
WS_VARIANTS = [
    ("none/bn256/E8", 0, 256, 4, 8, 1024),
    ("none/bn256/E64", 0, 256, 4, 64, 4096),
    ("swiglu/bn128/E64", 1, 128, 4, 64, 4096),
    ("swiglu/bn64/E64", 1, 64, 4, 64, 4096),
    ("swiglu/bn128/1row", 1, 128, 4, 1, 1),
]


def _gluon_fp8_ws(compiled: dict, where: dict) -> None:
    """Compile the warp-specialised Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8_ws.py) for every entry of
    WS_VARIANTS (plain: K = I = 2048, N = H = 7168; SwiGLU: K = H, I = 2048) with the launcher's default registers."""
    import torch

    from megamoe.kernels.gemm_config import GemmConfig
    from megamoe.kernels.gluon_fp8_ws import launch_gluon_fp8_ws

    H, I = 7168, 2048
    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    for label, epi, bn, stages, E, R in WS_VARIANTS:
        N, K, N_w = (H, I, H) if epi == 0 else (I, H, 2 * I)
        aq, wq = torch.empty(R, K, dtype=f8), torch.empty(E, N_w, K, dtype=f8)  # (never read: compiled only)
        a_s, w_s = torch.ones(R, K // 128), torch.ones(E, N_w // 128, K // 128)
        offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
        cfg = GemmConfig(block_m=128, block_n=bn, block_k=128, num_stages=stages, num_warps=4, num_sms=132,
                         kernel="gluon_ws")
        out = torch.empty(R, N, dtype=bf)
        h = torch.empty(R, 2 * I, dtype=bf) if epi == 1 else None
        before = set(compiled.get("_gluon_fp8_ws_kernel", {}))
        with compile_only(compiled):
            launch_gluon_fp8_ws(aq, a_s, wq, w_s, offs, out, cfg, n=N, epilogue=epi, h=h, store_h=epi == 1,
                                n_up=I if epi == 1 else 0, scale=torch.ones(R) if epi == 0 else None)
        for key in set(compiled.get("_gluon_fp8_ws_kernel", {})) - before:
            where[f"_gluon_fp8_ws_kernel#{key[:8]}"] = f"gluon-fp8-ws/{label}"


#: the warp-specialised bf16 kernel's variants that :func:`_gluon_bf16_ws` compiles: (label, epilogue, ping-pong,
#: block_n, stages, experts, rows, TMA-able output, kn weights): the defaults at deepseek-v3's shapes (cooperative
#: SwiGLU 128 + 128 with h, plain 256 columns with the gate scale) on 8 and 64 experts, the ping-pong tiles, an output
#: TMA cannot store (N = 7164: masked stores only), one row and one expert, GEMM1's dgrad (kn, opt-in) and the SwiGLU
#: backward (kn w2, h by TMA, with the gate scale's partial sums and the gated activation; the default on Hopper)
WS_BF16_VARIANTS = [
    ("coop/swiglu/bn128/s4/h/E64", 1, False, 128, 4, 64, 4096, True, False),
    ("coop/none/bn256/s4/scale/E8", 0, False, 256, 4, 8, 1024, True, False),
    ("coop/none/bn256/s4/scale/E64", 0, False, 256, 4, 64, 4096, True, False),
    ("coop/none/bn256/s4/masked", 0, False, 256, 4, 8, 1024, False, False),
    ("pp/none/bn128/s5/scale/E64", 0, True, 128, 5, 64, 4096, True, False),
    ("pp/swiglu/bn64/s5/h/E64", 1, True, 64, 5, 64, 4096, True, False),
    ("coop/swiglu/bn128/s4/h/1row", 1, False, 128, 4, 1, 1, True, False),
    ("coop/kn/bn256/s4/E64", 0, False, 256, 4, 64, 4096, True, True),
    ("pp/kn/bn128/s5/E64", 0, True, 128, 5, 64, 4096, True, True),
    ("coop/dswiglu/bn128/s4/scale/acts/E64", 2, False, 128, 4, 64, 4096, True, True),
    ("coop/dswiglu/bn128/s3/E64", 2, False, 128, 3, 64, 4096, True, True),
    ("coop/dswiglu/bn64/s4/scale/E8", 2, False, 64, 4, 8, 1024, True, True),
    ("coop/dswiglu/bn128/s4/scale/acts/1row", 2, False, 128, 4, 1, 1, True, True),
]


def _gluon_bf16_ws(compiled: dict, where: dict) -> None:
    """Compile the warp-specialised Gluon bf16 grouped GEMM (megamoe/kernels/gluon_bf16_ws.py) for every entry of
    WS_BF16_VARIANTS (plain: GEMM2, K = I = 2048, N = H = 7168; SwiGLU: GEMM1, K = H, I = 2048; kn: GEMM1's dgrad,
    K = 2I, N = H)."""
    import torch

    from megamoe.kernels.gemm_config import GemmConfig
    from megamoe.kernels.gluon_bf16_ws import launch_gluon_bf16_ws

    H, I = 7168, 2048
    bf = torch.bfloat16
    for label, epi, pp, bn, stages, E, R, aligned, kn in WS_BF16_VARIANTS:
        N, K, N_w = (H if aligned else H - 4, I, H if aligned else H - 4) if epi == 0 else (I, H, 2 * I)
        if kn:  # GEMM1's dgrad (K = 2I, N = H) or the SwiGLU backward (w2 as [E, H, I]: K = H, N = I)
            N, K, N_w = (I, H, I) if epi == 2 else (H, 2 * I, H)
        a = torch.empty(R, K, dtype=bf)  # (the operands are never read: compiled only; zero-filling the GBs of
        # weights took ~1 s per variant on 2 CPU cores)
        w = torch.empty(E, K, N_w, dtype=bf) if kn else torch.empty(E, N_w, K, dtype=bf)
        offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
        cfg = GemmConfig(block_m=128, block_n=bn, block_k=64, num_stages=stages, num_warps=4, num_sms=132,
                         kernel="gluon_ws", pingpong=pp)
        out = torch.empty(R, 2 * N if epi == 2 else N, dtype=bf)
        h = torch.empty(R, 2 * I, dtype=bf) if epi else None
        scale = torch.ones(R) if (epi == 0 and not kn) or "scale" in label else None
        dsp = torch.zeros((N + bn - 1) // bn, R) if epi == 2 and scale is not None else None
        acts = torch.empty(R, N, dtype=bf) if "acts" in label else None
        before = set(compiled.get("_gluon_bf16_ws_kernel", {}))
        with compile_only(compiled):
            launch_gluon_bf16_ws(a, w, offs, out, cfg, n=N, epilogue=epi, h=h, store_h=epi == 1, w_kn=kn,
                                 n_up=I if epi == 1 else 0, scale=scale, dsp=dsp, acts=acts)
        for key in set(compiled.get("_gluon_bf16_ws_kernel", {})) - before:
            where[f"_gluon_bf16_ws_kernel#{key[:8]}"] = f"gluon-bf16-ws/{label}"


def _gluon_fp8(compiled: dict, where: dict) -> None:
    """Compile the Gluon FP8 grouped GEMM (megamoe/kernels/gluon_fp8.py) for every entry of GLUON_VARIANTS at
    deepseek-v3's shapes on 8 experts (plain: GEMM2, K = I = 2048, N = H = 7168; SwiGLU: GEMM1, K = H, I = 2048;
    SwiGLU backward: K = H, N = I), the edge entries with one row and one expert."""
    import torch

    from megamoe.kernels.gemm_config import GemmConfig
    from megamoe.kernels.gluon_fp8 import launch_gluon_fp8

    H, I = 7168, 2048
    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    for label, epi, (bm, bn, stages, warps), flag, edge in GLUON_VARIANTS:
        E, R = (1, 1) if edge else (8, 1024)
        N, K, N_w = {0: (H, I, H), 1: (I, H, 2 * I), 2: (I, H, I)}[epi]
        aq, wq = torch.empty(R, K, dtype=f8), torch.empty(E, N_w, K, dtype=f8)  # (never read: compiled only)
        a_s, w_s = torch.ones(R, K // 128), torch.ones(E, N_w // 128, K // 128)
        offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
        cfg = GemmConfig(block_m=bm, block_n=bn, block_k=128, num_stages=stages, num_warps=warps, num_sms=132,
                         kernel="gluon")
        out = torch.empty(R, 2 * N if epi == 2 else N, dtype=bf)
        h = torch.empty(R, 2 * I, dtype=bf) if (epi == 2 or (epi == 1 and flag)) else None
        scale = torch.ones(R) if flag and epi != 1 else None
        dsp = torch.zeros(N // bn, R) if scale is not None and epi == 2 else None
        acts = torch.empty(R, N, dtype=bf) if "acts" in label.split("/") else None
        before = set(compiled.get("_gluon_fp8_grouped_kernel", {}))
        with compile_only(compiled):
            launch_gluon_fp8(aq, a_s, wq, w_s, offs, out, cfg, n=N, epilogue=epi, h=h, scale=scale, dsp=dsp,
                             store_h=epi == 1 and flag, n_up=I if epi == 1 else 0, acts=acts)
        for key in set(compiled.get("_gluon_fp8_grouped_kernel", {})) - before:
            where[f"_gluon_fp8_grouped_kernel#{key[:8]}"] = f"gluon-fp8/{label}"


#: the Gluon bf16 kernel's variants that :func:`_gluon_bf16` compiles: (label, epilogue, (block_m, block_n, block_k,
#: stages, warps), flag = scale (EPI_NONE, EPI_DSWIGLU) or store_h (EPI_SWIGLU), w_kn, edge = one row and one expert).
#: The configs are the ones tests/test_gpu_gluon_bf16.py and benchmarks/gluon_bf16_bench.py run.
BF16_VARIANTS = [
    ("none/nk/bm128n128/s4/scale", 0, (128, 128, 64, 4, 8), True, False, False),
    ("none/nk/bm128n256/s3/scale", 0, (128, 256, 64, 3, 8), True, False, False),
    ("none/nk/bm128n256/s4", 0, (128, 256, 64, 4, 8), False, False, False),
    ("none/nk/bm64w4/s4", 0, (64, 128, 64, 4, 4), True, False, False),
    ("none/kn/bm128n128/s4", 0, (128, 128, 64, 4, 8), False, True, False),
    ("none/kn/bm128n256/s3", 0, (128, 256, 64, 3, 8), False, True, False),
    ("none/kn/bm128n256/s3/1row", 0, (128, 256, 64, 3, 8), False, True, True),
    ("none/nk/bm128n128/bk128/s3/scale", 0, (128, 128, 128, 3, 8), True, False, False),
    ("swiglu/bm128n128/s4/h", 1, (128, 128, 64, 4, 8), True, False, False),
    ("swiglu/bm128n128/s3", 1, (128, 128, 64, 3, 8), False, False, False),
    ("swiglu/bm128n64/s4/h", 1, (128, 64, 64, 4, 8), True, False, False),
    ("swiglu/bm64w4/s4/h", 1, (64, 64, 64, 4, 4), True, False, False),
    ("swiglu/bm128n128/s4/h/1row", 1, (128, 128, 64, 4, 8), True, False, True),
    ("dswiglu/kn/bm128n128/s4/scale", 2, (128, 128, 64, 4, 8), True, True, False),
    ("dswiglu/kn/bm128n128/s4", 2, (128, 128, 64, 4, 8), False, True, False),
    ("dswiglu/kn/bm128n128/s3/scale", 2, (128, 128, 64, 3, 8), True, True, False),
    ("dswiglu/kn/bm128n64/s4/scale", 2, (128, 64, 64, 4, 8), True, True, False),
    ("dswiglu/kn/bm64w4/s4/scale", 2, (64, 64, 64, 4, 4), True, True, False),
    ("dswiglu/kn/bm128n128/s4/scale/1row", 2, (128, 128, 64, 4, 8), True, True, True),
]


def _gluon_bf16(compiled: dict, where: dict) -> None:
    """Compile the Gluon bf16 grouped GEMM (megamoe/kernels/gluon_bf16.py) for every entry of BF16_VARIANTS at
    deepseek-v3's shapes on 8 experts (plain nk: GEMM2, K = I = 2048, N = H = 7168; plain kn: dgrad1, K = 2I,
    N = H; SwiGLU: GEMM1, K = H, I = 2048; SwiGLU backward kn: dgrad2, K = H, N = I), the edge entries with one row
    and one expert."""
    import torch

    from megamoe.kernels.gemm_config import GemmConfig
    from megamoe.kernels.gluon_bf16 import launch_gluon_bf16

    H, I = 7168, 2048
    bf = torch.bfloat16
    for label, epi, (bm, bn, bk, stages, warps), flag, kn, edge in BF16_VARIANTS:
        E, R = (1, 1) if edge else (8, 1024)
        if epi == 0:
            N, K = (H, 2 * I) if kn else (H, I)
        else:
            N, K = I, H
        if epi == 1:
            w = torch.empty(E, 2 * I, H, dtype=bf)  # (never read: compiled only)
        else:
            w = torch.empty(E, K, N, dtype=bf) if kn else torch.empty(E, N, K, dtype=bf)
        a = torch.empty(R, K, dtype=bf)
        offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
        cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps, num_sms=132,
                         kernel="gluon")
        out = torch.empty(R, 2 * N if epi == 2 else N, dtype=bf)
        h = torch.empty(R, 2 * I, dtype=bf) if (epi == 2 or (epi == 1 and flag)) else None
        scale = torch.ones(R) if flag and epi != 1 else None
        dsp = torch.zeros((N + bn - 1) // bn, R) if scale is not None and epi == 2 else None
        before = set(compiled.get("_gluon_bf16_grouped_kernel", {}))
        with compile_only(compiled):
            launch_gluon_bf16(a, w, offs, out, cfg, n=N, w_kn=kn, epilogue=epi, h=h, scale=scale, dsp=dsp,
                              store_h=epi == 1 and flag, n_up=I if epi == 1 else 0)
        for key in set(compiled.get("_gluon_bf16_grouped_kernel", {})) - before:
            where[f"_gluon_bf16_grouped_kernel#{key[:8]}"] = f"gluon-bf16/{label}"


def _wgrad_outputs(compiled: dict, where: dict) -> None:
    """The public grouped_wgrad with its default config and both output dtypes (bf16: what the layers use; float32:
    the op's default), at deepseek-v3's dW13 width: the float32 output's TMA staging tile once overflowed shared
    memory, which a launch on the GPU reports and compile_only does not (the report's shared bytes show it)."""
    import torch

    from megamoe.experts import grouped_wgrad

    x = torch.zeros(512, 4096, dtype=torch.bfloat16)
    y = torch.zeros(512, 7168, dtype=torch.bfloat16)
    offs = torch.tensor([0, 200, 512], dtype=torch.int32)
    for dt in (torch.bfloat16, torch.float32):
        before = set(compiled.get("_grouped_wgrad_kernel", {}))
        with compile_only(compiled):
            grouped_wgrad(x, y, offs, out_dtype=dt)
        for key in set(compiled.get("_grouped_wgrad_kernel", {})) - before:
            where[f"_grouped_wgrad_kernel#{key[:8]}"] = f"wgrad/default/{str(dt).replace('torch.', '')}"


#: the warp-specialised wgrad kernel's variants that :func:`_gluon_wgrad_ws` compiles: (label, M, N, experts, rows,
#: output dtype, BLOCK_K, stages): its default config (gemm_config.default_config("wgrad", ..., kernel="gluon_ws"))
#: at deepseek-v3's dW13 (M = 2I, N = H) on 64 experts, the float32 output, BLOCK_K 64 x 3 stages (the config timed
#: in the layer at 16aae87). Shapes and counts are runtime values (rows live in the TMA descriptors), so dW2's shape
#: or one row compiles the same kernel as these
WGRAD_WS_VARIANTS = [
    ("dw13/bf16/E64", 4096, 7168, 64, 4096, "bfloat16", None, None),
    ("dw13/fp32/E8", 4096, 7168, 8, 1024, "float32", None, None),
    ("dw13/bf16/bk64s3/E8", 4096, 7168, 8, 1024, "bfloat16", 64, 3),
]


def _gluon_wgrad_ws(compiled: dict, where: dict) -> None:
    """Compile the warp-specialised Gluon wgrad (megamoe/kernels/gluon_wgrad_ws.py) for every WGRAD_WS_VARIANTS
    entry: out [E, M, N] = per expert x^T y, x [R, M], y [R, N] bf16."""
    import dataclasses

    import torch

    from megamoe.kernels.gemm_config import default_config
    from megamoe.kernels.gluon_wgrad_ws import launch_gluon_wgrad_ws

    for label, M, N, E, R, dt, bk, stages in WGRAD_WS_VARIANTS:
        x, y = torch.empty(R, M, dtype=torch.bfloat16), torch.empty(R, N, dtype=torch.bfloat16)  # (compiled only)
        out = torch.empty(E, M, N, dtype=getattr(torch, dt))
        offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
        cfg = dataclasses.replace(default_config("wgrad", R, N, M, kernel="gluon_ws"), num_sms=132)
        if bk is not None:
            cfg = dataclasses.replace(cfg, block_k=bk, num_stages=stages)
        before = set(compiled.get("_gluon_wgrad_ws_kernel", {}))
        with compile_only(compiled):
            launch_gluon_wgrad_ws(x, y, offs, out, cfg)
        for key in set(compiled.get("_gluon_wgrad_ws_kernel", {})) - before:
            where[f"_gluon_wgrad_ws_kernel#{key[:8]}"] = f"gluon-wgrad-ws/{label}"


#: the router kernels' cases (megamoe/kernels/router_topk.py) that :func:`_router` compiles: (label, E, k, sigmoid,
#: with a bias, tokens); the layers run on CPU tensors and so take the torch router. One token: T = 1 arrives as a
#: constexpr.
ROUTER_CASES = [
    ("qwen3", 128, 8, False, False, 4096),
    ("deepseek", 256, 8, True, True, 4096),
    ("mixtral", 8, 2, False, False, 4096),
    ("gpt-oss/1tok", 128, 4, False, False, 1),
]


def _router(compiled: dict, where: dict) -> None:
    """The router's forward and backward kernels at every preset's (E, k, router) (the first Triton router spilled at
    255 registers and took 28 us on qwen3 against 15 now, one H200, 2026-11-30)."""
    import torch

    from megamoe.kernels.router_topk import RouteTopk

    for label, E, k, sigmoid, bias, T in ROUTER_CASES:
        names = ("_route_fwd_kernel", "_route_finish_kernel", "_route_bwd_kernel")
        before = {n: set(compiled.get(n, {})) for n in names}
        with compile_only(compiled):
            logits = torch.zeros(T, E, requires_grad=True)
            idx, gates, aux, counts = RouteTopk.apply(logits, torch.zeros(E) if bias else None, k, sigmoid, True,
                                                      2.5 if sigmoid else 1.0, 0.01)
            (gates.sum() + aux).backward()
        for n, keys in before.items():
            for key in set(compiled.get(n, {})) - keys:
                where[f"{n}#{key[:8]}"] = f"router/{label}"


def launch_nothing():
    """A context in which every Triton launch is skipped (nothing compiled, nothing run; the launch returns None), as
    under compile_only a rank whose kernels are not wanted."""
    return _launches_to(lambda self, *args, grid, warmup, **kwargs: None)


@contextlib.contextmanager
def _experts_uninitialised(moe_cls):
    """MoE layers built inside the block leave their expert weights uninitialised (torch.empty) and initialise only
    the router: under compile_only no kernel reads the weights, and drawing them (up to 176 M values per layer here)
    was ~6% of the report's CPU time (py-spy, 2026-12-03)."""
    import torch

    orig = moe_cls.reset_parameters

    def router_only(self, seed: int = 0) -> None:
        self.router.reset_parameters(torch.Generator().manual_seed(seed))

    moe_cls.reset_parameters = router_only
    try:
        yield
    finally:
        moe_cls.reset_parameters = orig


def _layer_rank(rank: int, world: int, standalone: bool = False) -> dict:
    """The LAYERS entries of this world size on this rank, compiled under compile_only; standalone: also the
    standalone kernels' variants (the Gluon GEMMs, the wgrad outputs, the router cases)."""
    import torch
    import torch.distributed as dist

    from megamoe.config import preset
    from megamoe.layer import MoE

    compiled: dict[str, dict[str, object]] = {}
    where: dict[str, str] = {}
    entries = [e for e in LAYERS if e[0] == world]
    # pass 0: rank 0 compiles, the other ranks skip their launches; pass 1 (two or more ranks): the reverse, every
    # kernel rank 0 already compiled with the same specialisation comes from Triton's cache
    for compiling in range(min(world, 2)):
        if compiling:  # (else rank 1, whose launch_nothing layers run ahead, would compile rank 0's last entries too)
            dist.barrier()
        for w, name, experts, tokens, backend, opts in entries:
            cfg = preset(name, num_experts=experts, max_tokens_per_rank=max(tokens, 1))
            label = f"W{w}/{name}/{tokens}tok/{backend}" + "".join(f":{k}={v}" for k, v in opts.items())
            before = {n: set(v) for n, v in compiled.items()}
            ctx = compile_only(compiled) if (rank > 0) == (compiling == 1) else launch_nothing()
            with ctx, _experts_uninitialised(MoE):
                moe = MoE(cfg, backend=backend, device=torch.device("cpu"), seed=0, **opts)
                x = torch.zeros(tokens, cfg.hidden, dtype=cfg.dtype).requires_grad_()
                out = moe(x).out
                out.backward(torch.zeros_like(out))
            for n, keys in compiled.items():
                for key in set(keys) - before.get(n, set()):
                    where.setdefault(f"{n}#{key[:8]}", label)
            del moe
    if standalone:
        for fn in (_gluon_fp8, _gluon_fp8_ws, _gluon_wgrad_ws, _wgrad_outputs, _router, _gluon_bf16, _gluon_bf16_ws):
            fn(compiled, where)
    # every rank reports what it compiled: a rank's own specialisations (an argument that differs from rank 0's in
    # value class) are checked too. The report is the union: a kernel a lower rank compiled as well is summarised
    # there only
    mine = {f"{n}#{key[:8]}": k for n, ks in compiled.items() for key, k in ks.items()}
    if world > 1:
        keys = [None] * world
        dist.all_gather_object(keys, sorted(mine))
        lower = set().union(*keys[:rank])
        mine = {name: k for name, k in mine.items() if name not in lower}
    return {name: {"layer": where.get(name, ""), "rank": rank, **_summary(k)} for name, k in mine.items()}


def layer_report() -> dict[str, dict]:
    """Every Triton kernel that the split and fused layers (forward + backward, the LAYERS variants) launch on
    their gloo ranks, compiled for sm_90a with its real specialisation: access widths, registers, spills; and the
    standalone kernels' variants. The world sizes' groups run at once (the standalone kernels on the one-rank group,
    which has the least else to do): tests/test_sm90_compile.py on 2 CPU cores with a cold Triton cache took 331 s,
    against 499 s with the groups one after the other and every kernel's SASS disassembled (back to back,
    2026-12-03)."""
    from concurrent.futures import ThreadPoolExecutor

    from megamoe.dist import spawn

    worlds = sorted({entry[0] for entry in LAYERS}, reverse=True)
    if 1 not in worlds:
        worlds.append(1)
    out: dict[str, dict] = {}
    with ThreadPoolExecutor(len(worlds)) as pool:
        futs = [pool.submit(spawn, _layer_rank, w, w == 1, timeout_s=1500) for w in worlds]
        for f in futs:  # (largest world first: a one-rank entry of the same kernel overwrites it, as before)
            for rank_out in f.result():
                out.update(rank_out)
    return out


def run_report_subprocess(timeout_s: float = 1500.0) -> dict[str, dict]:
    """:func:`layer_report` in a fresh interpreter without TRITON_INTERPRET (usable from an interpreted
    process, e.g. the CPU test suite)."""
    import signal

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parent.parent)  # the source tree, whether installed or not
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "megamoe.sm90"]
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
