"""Every candidate's time per shape and op from `megamoe bench-gemm --sweep` JSON files, default config first.

    python benchmarks/sweep_table.py results.json [more.json ...]

One block per (preset, tokens, ep, op): every timed candidate's ms, TFLOP/s and config (BMxBNxBK, stages,
warps, epilogue slices, f = flattened tile loop, programs per SM); the fastest is marked with *.
"""

from __future__ import annotations

import json
import sys


def short(c: dict) -> str:
    return (f"{c['block_m']}x{c['block_n']}x{c['block_k']}s{c['num_stages']}w{c['num_warps']}e{c.get('epi_split', 1)}"
            f"{'f' if c.get('flatten') else ''}p{c.get('programs_per_sm', 1)}")


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        print(f"== {path} (commit {data['meta'].get('commit')}, {data['meta'].get('gpu')})")
        for r in data["rows"]:
            ok = [c for c in r.get("candidates", []) if "ms" in c and c.get("config")]
            if not ok:
                continue
            best = min(c["ms"] for c in ok)
            cells = []
            for c in ok:
                mark = "*" if c["ms"] == best else " "
                cells.append(f"{mark}{short(c['config'])} {c['ms']:.3f} ({r['flops'] / c['ms'] / 1e9:.0f})")
            errs = sum(1 for c in r.get("candidates", []) if "error" in c)
            print(f"{r['preset'][:10]:10} {r['tokens_per_gpu']:5} ep{r['ep']} {r['op']:13} floor {r['floor_ms']:.3f}"
                  f"{f' errors {errs}' if errs else ''}")
            for i in range(0, len(cells), 3):
                print("    " + " | ".join(cells[i:i + 3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
