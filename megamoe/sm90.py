"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU, and read what the compiler made.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy and sees neither the compiler's argument
specialisation nor its code generation, so it misses two classes of defects that only show on the device:

- compile errors under specialisation: an int argument equal to 1 arrives as a Python constexpr, so
  ``n.to(tl.int64)`` fails to compile when a call has exactly one token (found on the H200, 2026-11-30);
- slow memory access: a pointer loaded from memory (the symmetric heap's peer table) has no alignment the
  compiler can see, and without ``tl.multiple_of`` or passing it as an argument every element is its own
  2-byte access (the fused megakernel's GEMM2 epilogue store cost ~1.9 ms of 7.4 that way, same day).

``compile_for_hopper`` builds the real cubin with Triton's bundled ptxas (no driver needed);
``access_widths`` counts global loads/stores by width in its PTX and ``ptxas_usage`` reports registers,
spills and shared memory. ``python -m megamoe.sm90`` compiles the kernels whose defects these were (the stage
kernel with one token; the fused megakernel at deepseek-v3's shape, forward with either combine and backward)
and prints a JSON report; tests/test_sm90_compile.py asserts on it. It must run in a process where
TRITON_INTERPRET is unset (under the interpreter @triton.jit yields functions the compiler cannot take), so
the test starts it as a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(fn, types: dict[str, str], constexprs: dict[str, object], divisible: tuple[str, ...] = (),
                       num_warps: int = 4, num_stages: int = 3):
    """Compile ``fn`` (a @triton.jit function) for sm_90a.

    types: Triton type string per runtime argument ("*bf16", "i32", "tensordesc<bf16[128, 64]>", ...);
    constexprs: value per constexpr argument (an int argument the launcher would specialise, e.g. one equal
    to 1, goes here too); divisible: int arguments known to be multiples of 16 (the launcher's specialisation).
    Every pointer argument is taken as 16-byte aligned, as the launcher does for torch tensors.
    """
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
            continue
        if name not in types:
            raise ValueError(f"no type for argument {name!r} of {fn.__name__}")
        sig[name] = types[name]
        if types[name].startswith("*") or name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


def access_widths(compiled) -> dict[str, Counter]:
    """Global loads and stores in the PTX, by instruction (e.g. 'st.global.v4.b32': 60, 'st.global.b16': 16)."""
    ptx = compiled.asm["ptx"]
    return {kind: Counter(re.findall(rf"\b{kind}\.global(?:\.[a-z0-9]+)*", ptx)) for kind in ("ld", "st")}


def ptxas_usage(compiled) -> dict[str, int]:
    """Registers per thread, spill bytes and shared memory of the kernel, from the bundled ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        res = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill_st = re.search(r"(\d+) bytes spill stores", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_store_bytes": int(spill_st.group(1)) if spill_st else 0,
            "spill_load_bytes": int(spill_ld.group(1)) if spill_ld else 0,
            "shared_bytes": int(compiled.metadata.shared)}


#: runtime argument types of the fused megakernel as megamoe.kernels.fused_moe._launch passes them on a GPU
FUSED_TYPES = dict(
    tab="*i64", W="i32", rank="i32", x_desc="tensordesc<bf16[128, 64]>", x_ptr="*bf16",
    w13_desc="tensordesc<bf16[1, 128, 64]>", w13_ptr="*bf16", act_desc="tensordesc<bf16[128, 64]>",
    act_ptr="*bf16", w2_desc="tensordesc<bf16[1, 256, 64]>", w2_ptr="*bf16", h_ptr="*bf16", offs_ptr="*i32",
    row_src_ptr="*i32", row_tok_ptr="*i32", row_slot_ptr="*i32", dest_rank_ptr="*i32", dest_row_ptr="*i32",
    gate_ptr="*fp32", y_ptr="*bf16", save_ptr="*bf16", rows_ptr="*bf16", slots_ptr="*bf16", ctr_ptr="*i64",
    T="i32", H="i32", I="i32", K2="i32", E_l="i32", NB_MAX="i32", NS="i32", L1="i32", L2="i32", timeout_ns="i64",
)


def fused_constexprs(mode: str, ablate: int = 0) -> dict[str, object]:
    """The fused megakernel's constexprs at deepseek-v3's shape (H 7168, E_l 128, k 8) with the GPU config;
    mode: 'forward-push', 'forward-pull', 'backward-push' or 'backward-pull'."""
    bwd = mode.startswith("backward")
    return dict(K=8, BM=128, BN1=128, BN2=256, BK=64, BLOCK_E=128, EPI_SPLIT1=2, EPI_SPLIT2=4, GB=8, ABLATE=ablate,
                PULL_SPLIT=1, ROWS_P=2, BLOCK_H=2048, ROWS_C=4, BLOCK_HC=1024, USE_TMA=True, DOT_F32=False,
                STORE_H=not bwd, SAVE=not bwd, ALIGNED=True, WP2=2, BWD=bwd, PULL_COMBINE=mode.endswith("pull"))


def report() -> dict[str, dict]:
    """Compile the checked kernels for sm_90a; per kernel: 'error' (compile failure) or access widths + usage."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("run with TRITON_INTERPRET unset (python -m megamoe.sm90 in a fresh process)")
    from megamoe.comm.signals import _stage_kernel
    from megamoe.kernels.fused_moe import _fused_fwd_kernel

    jobs = {"stage-one-token": (_stage_kernel, dict(
        tab="*i64", W="i32", rank="i32", act_ptr="*bf16", nrows_ptr="*i32", act_reg="i32", H="i32",
        small_ptr="*i32", n_small="i32", small_reg="i32", small2_ptr="*i32", n_small2="i32", small2_reg="i32",
        timeout_ns="i64"), dict(ntok=1, n_act=1, HAS_ACT=True, HAS_SMALL=True, HAS_SMALL2=False, HAS_NROWS=False,
                                ROWS=4, BLOCK_H=1024, ALIGNED=True, WP2=2), ("H",), 16)}
    for mode in ("forward-push", "forward-pull", "backward-push", "backward-pull"):
        jobs[f"fused-{mode}"] = (_fused_fwd_kernel, FUSED_TYPES, fused_constexprs(mode), ("H", "I", "K2"), 8)
    out = {}
    for name, (fn, types, consts, div, warps) in jobs.items():
        try:
            k = compile_for_hopper(fn, types, consts, divisible=div, num_warps=warps)
        except Exception as exc:  # noqa: BLE001 - reported, the caller decides
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
            continue
        widths = access_widths(k)
        out[name] = {"ld": dict(widths["ld"]), "st": dict(widths["st"]), **ptxas_usage(k)}
    return out


def run_report_subprocess(timeout_s: float = 600.0) -> dict[str, dict]:
    """:func:`report` in a fresh interpreter without TRITON_INTERPRET (usable from an interpreted process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "megamoe.sm90"], capture_output=True, text=True, env=env,
                         timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"python -m megamoe.sm90 failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(report()))
