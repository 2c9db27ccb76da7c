"""Communication path on CPU ranks: host heap + gloo + TRITON_INTERPRET=1 (the same Triton kernels as on GPUs).

Each spawn runs several cases (the interpreter is slow, so shapes are small); every rank checks its share
against megamoe.comm.reference on the global batch.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from comm_cases import assert_no_failures, rank_absent, rank_cases, rank_peer_buffer  # noqa: E402

from megamoe.dist import spawn  # noqa: E402

CASES_W2 = [
    # random routing, uneven T per rank, k = 2
    dict(name="w2-basic", T=[9, 5], H=48, k=2, E=4, seed=1),
    # rank 0 has no tokens; H = 100 is not a power of two (and rows are not 16-byte aligned)
    dict(name="w2-empty-rank-H100", T=[0, 7], H=100, k=2, E=4, seed=2),
    # k = 1; expert 0 receives every token; T not a multiple of the schedule chunk
    dict(name="w2-k1-hot", T=[17, 3], H=32, k=1, E=4, routing="hot", seed=3),
    # only rank 0's experts are used: rank 1's experts receive nothing, rank 1 receives no rows
    dict(name="w2-narrow", T=[6, 6], H=40, k=2, E=8, routing="narrow", seed=4),
    # tiles forced small: BLOCK_H = 16 < H = 40, so every kernel walks a row in 3 chunks (last one masked),
    # 2 rows per step; the pipelined pull then carries a row's chunks across its two units per iteration
    dict(name="w2-chunked-rows", T=[7, 4], H=40, k=3, E=4, seed=7, tiles=(32, 4, 16, 2)),
    # the schedule's four kernels (these small cases otherwise take its one-program kernel)
    dict(name="w2-four-launches", T=[9, 5], H=48, k=2, E=4, seed=11, four_launches=True),
    # 3 schedule chunks of 16 tokens (k = 8): W * NCH = 6 pairs, past the one-program kernel's 4
    dict(name="w2-chunks", T=[40, 21], H=32, k=8, E=16, seed=12),
    # heap sized for 11 tokens, calls with 5 and 3: the pull stops its walk at max T_s = 5 (and 2 rows per
    # step make the pipelined pull run several steps per program, an odd number of units on some)
    dict(name="w2-spare-capacity", T=[5, 3], H=32, k=2, E=4, seed=8, max_tokens=11, tiles=(64, 4, 32, 2)),
    # rank 1 stages late (dispatch's rows, the backward's dy): a rank that pulled without waiting for its READY would
    # read stale rows (dispatch's schedule waits for READY too; the backward's pull is the only wait there)
    dict(name="w2-late-stager", T=[6, 5], H=32, k=2, E=4, seed=9, late=(1, "stage")),
    # rank 1 reads late, and rank 0 dispatches twice in a row: restaging before rank 1's DONE overwrites rows
    # rank 1 has still to read
    dict(name="w2-late-reader", T=[6, 5], H=32, k=2, E=4, seed=10, late=(1, "pull"), back_to_back=True,
         backward=False),
]

CASES_W4 = [
    # k = 3 (not a power of two), 4 ranks, one rank without tokens
    dict(name="w4-k3", T=[6, 0, 5, 3], H=40, k=3, E=8, seed=5),
    # expert 0 in every token's list (receives everything); k = 4 > E_l = 2
    dict(name="w4-hot-k4", T=[4, 5, 3, 6], H=24, k=4, E=8, routing="hot", seed=6),
    # the one-program schedule over 4 ranks and 2 chunks of 16 tokens each (ONE_LAUNCH_ITEMS raised to 8)
    dict(name="w4-one-program-chunks", T=[17, 32, 2, 20], H=24, k=8, E=16, seed=13, one_launch_items=8),
]


def _run(world, cases):
    assert_no_failures(spawn(rank_cases, world, cases, timeout_s=600))


CASES_W1 = [
    # heap sized for 200 tokens (13 schedule chunks at k 8), calls of 5 and 40 tokens: the one-program schedule over
    # the call's 1 and 3 chunks; 100 tokens: the four kernels over its 7
    dict(name="w1-one-chunk", T=[5], H=32, k=8, E=8, seed=14, max_tokens=200),
    dict(name="w1-three-chunks", T=[40], H=32, k=8, E=8, seed=15, max_tokens=200),
    dict(name="w1-seven-chunks", T=[100], H=32, k=8, E=8, seed=16, max_tokens=200),
]


def test_dispatch_combine_one_rank():
    _run(1, CASES_W1)


def test_dispatch_combine_two_ranks():
    _run(2, CASES_W2)


def test_dispatch_combine_four_ranks():
    _run(4, CASES_W4)


@pytest.mark.parametrize("world,absent", [(2, 1), (4, 2)])
def test_absent_rank_times_out_naming_it(world, absent):
    timeout_s = 1.5
    t0 = time.monotonic()
    res = spawn(rank_absent, world, absent, timeout_s, timeout_s=120)
    wall = time.monotonic() - t0
    for r, (msg, took) in enumerate(res):
        if r == absent:
            continue
        assert f"peer rank {absent} never signalled" in msg, msg
        assert f"on rank {r}" in msg, msg
        assert took < timeout_s + 10, took
    assert wall < 90


def test_peer_buffer_two_ranks():
    # each rank's view of every rank's tok region (the Gluon items' TMA pull builds its descriptors on these)
    assert_no_failures(spawn(rank_peer_buffer, 2, timeout_s=120))


def test_heap_bytes_known_before_allocation():
    from megamoe.comm import CommShape, heap_bytes, workspace_bytes

    s = CommShape(world=4, max_tokens=4096, hidden=7168, topk=8, num_experts=256)
    assert s.rows_cap == 4 * 4096 * 8
    b = heap_bytes(s)
    assert b >= s.rows_cap * 7168 * 2 + 4096 * 7168 * 2
    assert workspace_bytes(s) >= s.rows_cap * 7168 * 2
    with pytest.raises(ValueError, match="multiple of world"):
        CommShape(world=3, max_tokens=8, hidden=8, topk=2, num_experts=8)
    with pytest.raises(ValueError, match="topk"):
        CommShape(world=2, max_tokens=8, hidden=8, topk=9, num_experts=8)

