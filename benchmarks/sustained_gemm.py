"""Dense bf16 GEMM throughput over a sustained run, beside the SM clock: what the board gives once its power limit
caps the clock (MEASURED.md's 678-790 TFLOP/s is a burst figure with its conditions unrecorded).

    python benchmarks/sustained_gemm.py [--seconds 40] [--n 8192] [--json out.json]

Runs back-to-back torch.matmul of n x n x n bf16 for --seconds, timing each window of --window GEMMs with CUDA
events, and samples nvidia-smi's SM clock, power and clock-event reasons every 100 ms; prints TFLOP/s per second of
the run with the clock of that second. Reads the clocks only; changes no setting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from datetime import datetime

import torch

from megamoe.apps.perf import run_metadata


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--window", type=int, default=20, help="GEMMs per timed window")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n = args.n
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    time.sleep(2.0)  # let the clock recover from the warm-up
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    t_start = time.time()
    windows = []  # (seconds since start at window end, TFLOP/s)
    flops = 2.0 * n * n * n * args.window
    while time.time() - t_start < args.seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.window):
            torch.matmul(a, b, out=c)
        e1.record()
        e1.synchronize()
        windows.append((time.time() - t_start, flops / (e0.elapsed_time(e1) * 1e-3) / 1e12))
    time.sleep(0.3)
    smi.terminate()
    samples = []
    for line in smi.stdout.read().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 4 and parts[1].isdigit():
            at = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp() - t_start  # local time, as time()
            samples.append((at, int(parts[1]), float(parts[2]), parts[3]))
    rows = []
    for sec in range(int(args.seconds) + 1):
        w = [t for (s, t) in windows if sec <= s < sec + 1]
        sm = [x for x in samples if sec <= x[0] < sec + 1]
        if not w:
            continue
        rows.append({"second": sec, "tflops": sum(w) / len(w),
                     "sm_mhz": sum(x[1] for x in sm) / len(sm) if sm else None,
                     "power_w": max(x[2] for x in sm) if sm else None,
                     "capped": any(int(x[3], 16) & 0x4 for x in sm) if sm else None})
    print(f"{n}^3 bf16 torch.matmul, {args.window} per window, {len(windows)} windows over {args.seconds:.0f} s")
    print("second  TFLOP/s  SM MHz  power W  sw power cap")
    for r in rows:
        mhz = f"{r['sm_mhz']:.0f}" if r["sm_mhz"] else "-"
        pw = f"{r['power_w']:.0f}" if r["power_w"] else "-"
        print(f"{r['second']:6d}  {r['tflops']:7.1f}  {mhz:>6}  {pw:>7}  {r['capped']}")
    ts = sorted(t for _, t in windows)
    print(f"windows: max {ts[-1]:.1f}, median {ts[len(ts) // 2]:.1f}, min {ts[0]:.1f} TFLOP/s; "
          f"first second {rows[0]['tflops']:.1f}, last {rows[-1]['tflops']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_metadata(torch.device("cuda", torch.cuda.current_device()), 1),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "n": n,
                       "window": args.window, "seconds": args.seconds, "per_second": rows,
                       "windows_tflops": [t for _, t in windows]}, f, indent=1)


if __name__ == "__main__":
    main()
