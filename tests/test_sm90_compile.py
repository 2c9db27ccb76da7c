"""Kernels compiled for Hopper (sm_90a) on the CPU: what the interpreter cannot see (megamoe/sm90.py).

- the stage kernel compiles when a call has exactly one token (the launcher turns an int argument equal to 1
  into a constexpr; ``ntok.to(...)`` then failed to compile on the H200);
- the fused megakernel (forward with the pull or the push combine, backward) compiles at deepseek-v3's
  shape and moves bf16 rows through global memory at least 4 bytes at a time: no 2-byte accesses, which is
  what a pointer loaded from the heap's table without an alignment hint produced.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from megamoe.sm90 import access_widths, compile_for_hopper, ptxas_usage  # noqa: E402

FUSED_TYPES = dict(
    tab="*i64", W="i32", rank="i32", x_desc="tensordesc<bf16[128, 64]>", x_ptr="*bf16",
    w13_desc="tensordesc<bf16[1, 128, 64]>", w13_ptr="*bf16", act_desc="tensordesc<bf16[128, 64]>",
    act_ptr="*bf16", w2_desc="tensordesc<bf16[1, 256, 64]>", w2_ptr="*bf16", h_ptr="*bf16", offs_ptr="*i32",
    row_src_ptr="*i32", row_tok_ptr="*i32", row_slot_ptr="*i32", dest_rank_ptr="*i32", dest_row_ptr="*i32",
    gate_ptr="*fp32", y_ptr="*bf16", save_ptr="*bf16", rows_ptr="*bf16", slots_ptr="*bf16", ctr_ptr="*i64",
    T="i32", H="i32", I="i32", K2="i32", E_l="i32", NB_MAX="i32", NS="i32", L1="i32", L2="i32", timeout_ns="i64",
)


def test_stage_kernel_compiles_for_one_token():
    from megamoe.comm.signals import _stage_kernel

    types = dict(tab="*i64", W="i32", rank="i32", act_ptr="*bf16", n_act="i32", nrows_ptr="*i32", act_reg="i32",
                 H="i32", small_ptr="*i32", n_small="i32", small_reg="i32", small2_ptr="*i32", n_small2="i32",
                 small2_reg="i32", timeout_ns="i64")
    consts = dict(ntok=1, n_act=1, HAS_ACT=True, HAS_SMALL=True, HAS_SMALL2=False, HAS_NROWS=False, ROWS=4,
                  BLOCK_H=1024, ALIGNED=True, WP2=2)
    compile_for_hopper(_stage_kernel, types, consts, divisible=("H",), num_warps=16)


@pytest.mark.parametrize("mode", ["forward-pull", "forward-push", "backward-pull"])
def test_fused_kernel_moves_rows_in_wide_accesses(mode):
    from megamoe.kernels.fused_moe import _fused_fwd_kernel

    bwd = mode.startswith("backward")
    consts = dict(K=8, BM=128, BN1=128, BN2=256, BK=64, BLOCK_E=128, EPI_SPLIT1=2, EPI_SPLIT2=4, GB=8, ABLATE=0,
                  PULL_SPLIT=1, ROWS_P=2, BLOCK_H=2048, ROWS_C=4, BLOCK_HC=1024, USE_TMA=True, DOT_F32=False,
                  STORE_H=not bwd, SAVE=not bwd, ALIGNED=True, WP2=2, BWD=bwd, PULL_COMBINE=mode.endswith("pull"))
    k = compile_for_hopper(_fused_fwd_kernel, FUSED_TYPES, consts, divisible=("H", "I", "K2"), num_warps=8,
                           num_stages=3)
    widths = access_widths(k)
    usage = ptxas_usage(k)
    print(mode, dict(widths["st"]), dict(widths["ld"]), usage)
    narrow = {op: n for kind in ("ld", "st") for op, n in widths[kind].items() if op.endswith((".b16", ".u16"))}
    assert not narrow, f"{mode}: 2-byte global accesses {narrow} (a row pointer without an alignment hint?)"
    assert usage["registers"] > 0
