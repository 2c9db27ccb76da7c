"""Measure the errors the numeric tests' bounds are set from: run test files over several seed sets and report the
worst relative error per checked quantity, with the bound that adds the margin (30% by default).

    python tools/measure_bounds.py [--seeds 3] [--margin 1.3] [pytest args ...]

The tests record each error through megamoe.testing.note_error (file named by MEGAMOE_ERRLOG) and shift their
seeds by MEGAMOE_SEED_OFFSET; with no pytest args the layer, communication and router tests run. Compare the
suggested bounds with megamoe.testing.BOUNDS and tests/comm_cases.py, and update them (with the figures in their
comments) when a kernel's arithmetic changes on purpose.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

DEFAULT_TESTS = ["tests/test_comm.py", "tests/test_torch_backend.py", "tests/test_split_backend.py",
                 "tests/test_fused_backend.py", "-k", "not absent and not timeline and not rejects"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="seed sets to run (offsets 0 .. N-1)")
    ap.add_argument("--margin", type=float, default=1.3, help="bound = worst error x this")
    ap.add_argument("pytest_args", nargs="*", help="what to run (default: the layer and communication tests)")
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    worst: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "errors.jsonl")
        for offset in range(args.seeds):
            env = dict(os.environ, MEGAMOE_ERRLOG=log, MEGAMOE_SEED_OFFSET=str(offset))
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + (args.pytest_args or DEFAULT_TESTS)
            print(f"seed set {offset}: {' '.join(cmd[3:])}", flush=True)
            rc = subprocess.call(cmd, cwd=root, env=env)
            if rc not in (0, 1):
                print(f"pytest exited with {rc}", file=sys.stderr)
                return rc
        with open(log) as f:
            for line in f:
                rec = json.loads(line)
                worst[rec["key"]] = max(worst[rec["key"]], float(rec["err"]))
    print(f"\n{'quantity':<40} {'worst':>10} {'bound':>10}")
    for key in sorted(worst):
        print(f"{key:<40} {worst[key]:>10.3g} {worst[key] * args.margin:>10.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
