"""The A/B table of benchmarks/gpu.sh's ``bench`` scenario: per preset, backend, timing and mode, the median over the
runs of ``bench-<preset>-new*.json`` and of ``bench-<preset>-base*.json`` (each run's own median over its iterations),
and their ratio (new / base: above 1.03 is a slowdown beyond the noise we accept).

    python benchmarks/ab_table.py OUT_DIR
"""

from __future__ import annotations

import glob
import json
import statistics
import sys


def medians(files: list[str]) -> dict[tuple[str, str, str], float]:
    got: dict[tuple[str, str, str], list[float]] = {}
    for f in files:
        for e in json.load(open(f))["results"]:
            for mode in ("forward", "forward+backward"):
                got.setdefault((e["backend"], e["timing"], mode), []).append(e[mode]["median_s"] * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def main(out: str) -> None:
    print(f"{'bench ms':<14} {'backend':<8} {'timing':<10} {'mode':<16} {'new':>8} {'base':>8} {'new/base':>8}")
    for stem in sorted({f.rsplit("-new", 1)[0] for f in glob.glob(f"{out}/bench-*-new*.json")}):
        preset = stem.rsplit("/bench-", 1)[1]
        new, base = medians(glob.glob(f"{stem}-new*.json")), medians(glob.glob(f"{stem}-base*.json"))
        for k in sorted(new):
            b = base.get(k)
            ratio = f"{new[k] / b:8.3f}" if b else f"{'n/a':>8}"
            print(f"{preset:<14} {k[0]:<8} {k[1]:<10} {k[2]:<16} {new[k]:8.3f} {b or float('nan'):8.3f} {ratio}")


if __name__ == "__main__":
    main(sys.argv[1])
