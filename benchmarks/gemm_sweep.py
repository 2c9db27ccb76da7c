"""Tile sweep of the expert GEMMs: `megamoe bench-gemm` timing every candidate config per op, keeping the fastest.

``PYTHONPATH=. python3 benchmarks/gemm_sweep.py --tokens 4096 --json sweep.json`` (every bench-gemm option applies);
on a CPU: ``--device cpu --presets tiny --tokens 16`` under TRITON_INTERPRET=1. Each row's ``candidates`` lists every
config's time (or why it could not run); ``ours_config`` is the fastest. gemm_config.default_config's tables come
from such sweeps.
"""

from __future__ import annotations

import sys

from megamoe.apps import bench_gemm


def candidates(op: str):
    """The configs timed for ``op``: the Triton kernel's (kernel="triton") and, for the ops with a Gluon kernel
    (gemm_config.GLUON_OPS; not GEMM1's dgrad), the Gluon kernel's (kernel="gluon": each within that kernel's limits
    where the shape allows, see megamoe.experts.gluon_reason; a config that cannot run is reported as an error)."""
    from megamoe.kernels.gemm_config import GemmConfig

    def T(bm, bn, bk, st, wp, sp=1, fl=False):  # noqa: N802 - the Triton kernel
        return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_stages=st, num_warps=wp, epi_split=sp,
                          flatten=fl, kernel="triton")

    def G(bn, bk, st, bm=128, wp=4):  # noqa: N802 - the Gluon kernel (warp-specialised: 128-row tiles on 4 warps)
        return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_stages=st, num_warps=wp, kernel="gluon")

    table = {
        "gemm1": [T(128, 128, 64, 3, 8, 2), T(128, 128, 64, 4, 8, 4), T(128, 128, 64, 3, 8, 2, True),
                  T(128, 128, 64, 4, 8, 4, True), T(128, 64, 64, 4, 8), T(64, 128, 64, 4, 4, 2),
                  T(128, 128, 64, 5, 8, 4),
                  G(128, 64, 4), G(128, 64, 3), G(64, 64, 6), G(64, 64, 4)],  # gate (= up) columns per tile
        "dgrad2": [T(128, 128, 64, 3, 8, 4), T(128, 128, 64, 4, 8, 2), T(128, 128, 64, 4, 8, 4), T(128, 64, 64, 4, 8),
                   T(128, 256, 64, 3, 8, 4), T(128, 128, 64, 5, 8, 2), T(128, 128, 64, 4, 8, 2, True),
                   G(128, 64, 4), G(128, 64, 3), G(64, 64, 6), G(64, 64, 4)],
        "gemm2": [T(128, 256, 64, 3, 8), T(128, 256, 64, 3, 8, 2), T(128, 256, 64, 3, 8, 1, True),
                  T(128, 256, 64, 3, 8, 2, True), T(128, 128, 64, 4, 8, 1, True), T(128, 256, 64, 4, 8, 2, True),
                  G(256, 64, 4), G(256, 64, 3), G(128, 64, 6), G(128, 64, 4)],
        "dgrad1": [T(128, 256, 64, 3, 8), T(128, 256, 64, 3, 8, 2), T(128, 256, 64, 3, 8, 1, True),
                   T(128, 256, 64, 3, 8, 2, True), T(128, 128, 64, 4, 8, 1, True), T(128, 256, 64, 4, 8, 2, True)],
        # FP8 on the Triton kernel: 8 warps (the scaled product and the accumulator live); on the Gluon kernel: two
        # 64-row consumer warpgroups, SwiGLU tiles of 64 or 128 gate columns, plain tiles up to 256 columns
        "gemm1_fp8": [T(128, 64, 128, 5, 8), T(128, 64, 128, 4, 8), T(128, 128, 128, 4, 8, 4),
                      G(128, 128, 4), G(128, 128, 3), G(64, 128, 6), G(64, 128, 4)],
        "gemm2_fp8": [T(128, 128, 128, 5, 8), T(128, 128, 128, 4, 8), T(128, 256, 128, 3, 8, 4),
                      G(256, 128, 4), G(256, 128, 3), G(128, 128, 6), G(128, 128, 4)],
        # wgrad: flatten=True pipelines the TMA store of a tile under the next tile's loads (a separate store buffer)
        "wgrad1": [T(128, 256, 32, 5, 8), T(128, 256, 32, 5, 8, fl=True), T(128, 256, 32, 4, 8, fl=True),
                   T(256, 128, 32, 5, 8, fl=True), T(128, 256, 64, 3, 8, fl=True), T(128, 128, 32, 4, 8, fl=True),
                   G(256, 32, 6), G(256, 32, 5), G(256, 64, 3), G(128, 64, 6), G(128, 32, 6)],
    }
    table["wgrad2"] = table["wgrad1"]
    return table[op]


def main(argv: list[str] | None = None) -> int:
    return bench_gemm.main(argv, candidates=candidates)


if __name__ == "__main__":
    sys.exit(main())
