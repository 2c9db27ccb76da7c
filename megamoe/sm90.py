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
spills and shared memory. Used by tests/test_sm90_compile.py and handy before spending device time.
"""

from __future__ import annotations

import re
import subprocess
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
