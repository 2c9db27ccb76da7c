"""Kernels compiled for Hopper (sm_90a) on the CPU: what the interpreter cannot see (megamoe/sm90.py).

- the stage kernel compiles when a call has exactly one token (the launcher turns an int argument equal to 1
  into a constexpr; ``ntok.to(...)`` then failed to compile on the H200);
- the fused megakernel (forward and backward, push and pull combine) compiles at deepseek-v3's shape and
  moves bf16 rows through global memory at least 4 bytes at a time: no 2-byte accesses, which is what a
  pointer loaded from the heap's table without an alignment hint produced.
The compiles run in one subprocess without TRITON_INTERPRET (about 30 s).
"""

from __future__ import annotations

import pytest

from megamoe.sm90 import run_report_subprocess


@pytest.fixture(scope="module")
def rep():
    return run_report_subprocess()


def test_stage_kernel_compiles_for_one_token(rep):
    assert "error" not in rep["stage-one-token"], rep["stage-one-token"]


@pytest.mark.parametrize("mode", ["forward-push", "forward-pull", "backward-push", "backward-pull"])
def test_fused_kernel_moves_rows_in_wide_accesses(rep, mode):
    r = rep[f"fused-{mode}"]
    assert "error" not in r, r
    narrow = {op: n for kind in ("ld", "st") for op, n in r[kind].items() if op.endswith((".b16", ".u16"))}
    assert not narrow, f"{mode}: 2-byte global accesses {narrow} (a row pointer without an alignment hint?)"
    assert r["registers"] > 0
