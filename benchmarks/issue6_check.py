"""Issue 6's benchmark goals, read from `megamoe bench` JSON files: a Markdown table of every goal that the files
can answer, met, not met or n/a, and optionally a chart.

    python benchmarks/issue6_check.py results/*.json [--png chart.png] [--world 4]

The goals (issue 6: bf16, 4x H200, one GPU per rank):
- 4096 tokens per GPU, uniform routing: the fused forward within 1.25x of the floor (and at most 4.6 ms on
  deepseek-v3 and mixtral-8x7b, 0.6 ms on qwen3-30b-a3b), forward+backward within 1.35x; faster than split (strictly);
- 512 tokens per GPU: fused at least 1.3x faster than split;
- skewed routing (--skew other than 0): within 1.2x of the floor. The bench's floor is the largest rank floor,
  each rank charged its rows and the experts they use; with every expert in use (any 4096-token skew run) that is
  the busiest rank's floor, which the issue names;
- 1 token per GPU: the forward minus its compute under 20 us (strictly). The compute is bounded below by the bench's
  floor (the weights of the experts the rows use, read once, the lowest over the bench's input sets), so forward -
  floor is an upper bound of the overhead: a pass is a pass, a miss may be the bound's slack. JSON from before
  the floor was taken per input set (no ``rows_per_rank_sets``) is not judged on this goal: its floor came from one
  input set, or charged every expert's weights.

"split" is the fastest bf16 split variant in the file for each mode (forward, forward+backward), "fused" each bf16
fused variant; FP8 variants (``fp8=1``) are left out (the goals are bf16). Like is compared with like: the first
timing the fused entries have (interleaved CUDA-graph replays, then graph replays, then eager), and split in the
same timing; without one, the split goals read n/a. A file whose setup is not the goals' (another world, fewer GPUs
than ranks, another GPU, another dtype) is shown with the reason and never counted.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys

from megamoe.backends import parse_backend

FWD_LIMIT_MS = {"deepseek-v3": 4.6, "mixtral-8x7b": 4.6, "qwen3-30b-a3b": 0.6}
GOAL_WORLD = 4
GOAL_GPU = "H200"
TIMINGS = ("graph, interleaved", "graph", "eager")


def _timing_rank(entry: dict) -> int:
    """Which timing to compare: interleaved graph replays, then graph replays, then eager."""
    if entry.get("timing") == "cuda-graph":
        return 0 if entry.get("interleaved") else 1
    return 2


def _kind(backend: str) -> tuple[str, bool]:
    """(backend name, whether it runs FP8) of a spec such as ``split:presum_combine=1:fp8=1``."""
    name, options = parse_backend(backend)
    return name, bool(options.get("fp8", False))


def pick(report: dict) -> tuple[str, list[dict], list[dict]]:
    """(timing label, bf16 split entries, bf16 fused entries) of the first timing present for fused."""
    bf16 = [e for e in report["results"] if not _kind(e["backend"])[1]]
    for rank, label in enumerate(TIMINGS):
        same = [e for e in bf16 if _timing_rank(e) == rank]
        fused = [e for e in same if _kind(e["backend"])[0] == "fused"]
        if fused:
            return label, [e for e in same if _kind(e["backend"])[0] == "split"], fused
    return "", [], []


def setup_problem(report: dict, world: int = GOAL_WORLD) -> str | None:
    """None when the report ran the goals' setup, else why not."""
    c, m = report["config"], report["meta"]
    if c["world"] != world:
        return f"W {c['world']}"
    if m.get("gpu_count") is None or m["gpu_count"] < world:
        return f"{world} ranks on {m.get('gpu_count', '?')} GPU(s)"
    if GOAL_GPU not in (m.get("gpu") or ""):
        return f"on {m.get('gpu') or m.get('device', '?')}"
    if c.get("dtype") != "bfloat16":
        return f"dtype {c.get('dtype')}"
    if c.get("num_experts") != c.get("preset_num_experts", c.get("num_experts")):
        return f"E {c['num_experts']} (the preset has {c['preset_num_experts']}: bench --experts)"
    return None


def _ms(m: dict) -> float:
    return m["median_s"] * 1e3


OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


def _goal(name: str, value: float | None, limit: float, sign: str, unit: str) -> dict:
    """One goal: ``value sign limit`` met (True / False), or None when the value is unknown."""
    met = None if value is None else OPS[sign](value, limit)
    return {"goal": name, "value": value, "limit": limit, "sign": sign, "met": met, "unit": unit}


def judge(report: dict, world: int = GOAL_WORLD, file: str = "") -> list[dict]:
    """One row per bf16 fused entry: the goals this report answers, each with its value, limit and verdict."""
    c = report["config"]
    label, splits, fused = pick(report)
    sf = min(splits, key=lambda e: e["forward"]["median_s"]) if splits else None
    sb = min(splits, key=lambda e: e["forward+backward"]["median_s"]) if splits else None
    problem = setup_problem(report, world)
    tokens, skew = c["tokens_per_rank"], c.get("skew", 0.0) or 0.0
    fp8_left_out = sum(1 for x in report["results"] if _kind(x["backend"])[1])
    rows = []
    for e in fused:
        f, b = e["forward"], e["forward+backward"]
        ratio_f = sf["forward"]["median_s"] / f["median_s"] if sf else None  # split time / fused time
        ratio_b = sb["forward+backward"]["median_s"] / b["median_s"] if sb else None
        goals = []
        if tokens == 4096 and skew == 0:
            goals.append(_goal("fwd x floor", f["x_floor"], 1.25, "<=", "x"))
            if c["preset"] in FWD_LIMIT_MS:
                goals.append(_goal("fwd ms", _ms(f), FWD_LIMIT_MS[c["preset"]], "<=", "ms"))
            goals.append(_goal("fwd+bwd x floor", b["x_floor"], 1.35, "<=", "x"))
            goals += [_goal("split/fused fwd", ratio_f, 1.0, ">", "x"),
                      _goal("split/fused fwd+bwd", ratio_b, 1.0, ">", "x")]
        if tokens == 512 and skew == 0:
            goals += [_goal("split/fused fwd", ratio_f, 1.3, ">=", "x"),
                      _goal("split/fused fwd+bwd", ratio_b, 1.3, ">=", "x")]
        if skew != 0:
            goals.append(_goal("fwd x floor (skew)", f["x_floor"], 1.2, "<=", "x"))
        if tokens == 1 and skew == 0:
            ok = "rows_per_rank_sets" in c and f["floor_s"] is not None
            goals.append(_goal("fwd - floor", (f["median_s"] - f["floor_s"]) * 1e6 if ok else None, 20.0, "<", "us"))
        rows.append({"preset": c["preset"], "tokens": tokens, "world": c["world"], "skew": skew, "timing": label,
                     "backend": e["backend"], "fwd_ms": _ms(f), "fwd_x": f["x_floor"], "both_ms": _ms(b),
                     "both_x": b["x_floor"], "split": sf["backend"] if sf else None,
                     "split_both": sb["backend"] if sb else None,
                     "split_fwd_ms": _ms(sf["forward"]) if sf else None,
                     "split_both_ms": _ms(sb["forward+backward"]) if sb else None,
                     "goals": goals, "problem": problem, "commit": report["meta"].get("commit", "?"),
                     "gpu": report["meta"].get("gpu") or report["meta"].get("device", "?"), "file": file,
                     "fp8_left_out": fp8_left_out})
    return rows


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    return {"ms": f"{v:.4f} ms", "x": f"{v:.4f}x", "us": f"{v:.1f} us"}.get(unit, f"{v:.4g}")


def table(rows: list[dict]) -> str:
    out = ["| preset | tok/GPU | W | skew | timing | fused | fwd ms (x floor) | fwd+bwd ms (x floor) "
           "| best split fwd / fwd+bwd ms | goals |", "|" + "---|" * 10]
    for r in rows:
        marks = []
        for g in r["goals"]:
            verdict = "n/a" if g["met"] is None else ("met" if g["met"] else "**not met**")
            if g["met"] is not None and r["problem"]:
                verdict = f"{'met' if g['met'] else 'not met'}, not counted ({r['problem']})"
            marks.append(f"{g['goal']} {_num(g['value'], g['unit'])} {g['sign']} {g['limit']:g}: {verdict}")
        names = r["split"] if r["split"] == r["split_both"] else f"{r['split']} / {r['split_both']}"
        split = "-" if r["split"] is None else f"{r['split_fwd_ms']:.3f} / {r['split_both_ms']:.3f} ({names})"
        fx = "n/a" if r["fwd_x"] is None else f"{r['fwd_x']:.2f}"
        bx = "n/a" if r["both_x"] is None else f"{r['both_x']:.2f}"
        out.append(f"| {r['preset']} | {r['tokens']} | {r['world']} | {r['skew']:g} | {r['timing']} | {r['backend']} | "
                   f"{r['fwd_ms']:.3f} ({fx}) | {r['both_ms']:.3f} ({bx}) | {split} | "
                   f"{'; '.join(marks) or '(no goal at this size)'} |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    counted = [r for r in rows if not r["problem"]]
    goals = [g for r in counted for g in r["goals"]]
    met = sum(1 for g in goals if g["met"])
    na = sum(1 for g in goals if g["met"] is None)
    lines = [f"goals at the goals' setup (bf16, {GOAL_WORLD}x {GOAL_GPU}): {met} of {len(goals)} met, "
             f"{len(goals) - met - na} not met, {na} n/a"]
    for r in counted:
        if r["goals"]:
            ok = sum(1 for g in r["goals"] if g["met"])
            whole = "every goal met" if ok == len(r["goals"]) else f"{ok} of {len(r['goals'])} met"
            lines.append(f"  {r['preset']} {r['tokens']} tok skew {r['skew']:g} {r['backend']}: {whole}")
    others = [r for r in rows if r["problem"]]
    if others:
        reasons = sorted({r["problem"] for r in others})
        lines.append(f"{len(others)} fused rows not counted ({'; '.join(reasons)})")
    fp8 = sum(r["fp8_left_out"] for r in {r["file"]: r for r in rows}.values())
    if fp8:
        lines.append(f"{fp8} FP8 entries left out (the goals are bf16)")
    return "\n".join(lines)


def draw(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def case(r: dict) -> tuple:
        return r["file"], r["preset"], r["tokens"], r["world"], r["skew"]

    cases = []
    for r in rows:
        if case(r) not in cases:
            cases.append(case(r))
    ncol = min(4, len(cases))
    nrow = -(-len(cases) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol, 3.4 * nrow), squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, cases, strict=False):
        mine = [r for r in rows if case(r) == key]
        names = (["best split"] if mine[0]["split"] else []) + \
            [r["backend"].replace(":", "\n") for r in mine]
        fwd = ([mine[0]["split_fwd_ms"]] if mine[0]["split"] else []) + [r["fwd_ms"] for r in mine]
        both = ([mine[0]["split_both_ms"]] if mine[0]["split"] else []) + [r["both_ms"] for r in mine]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], fwd, 0.4, label="forward")
        ax.bar([i + 0.2 for i in x], both, 0.4, label="fwd+bwd")
        r0 = mine[0]
        if r0["fwd_x"]:
            ax.axhline(r0["fwd_ms"] / r0["fwd_x"], color="k", ls="--", lw=1, label="fwd floor")
            ax.axhline(r0["both_ms"] / r0["both_x"], color="gray", ls=":", lw=1, label="fwd+bwd floor")
        ax.set_xticks(list(x), names, fontsize=6)
        ax.set_title(f"{key[1]}, {r0['commit'][:7]}\n{key[2]} tok/GPU x {key[3]}, skew {key[4]:g} ({r0['timing']})",
                     fontsize=7)
        ax.set_ylabel("ms", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    axes[0][0].legend(fontsize=6)
    gpus = ", ".join(sorted({r["gpu"] for r in rows}))
    fig.suptitle(f"megamoe fused vs the best split variant (ms, median; max over ranks), {gpus}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="megamoe bench --json files")
    p.add_argument("--png", default=None, help="draw the cases side by side here (needs matplotlib)")
    p.add_argument("--world", type=int, default=GOAL_WORLD, help="the world size the goals are judged at")
    args = p.parse_args(argv)
    rows = []
    for path in args.json:
        with open(path) as f:
            report = json.load(f)
        if "results" not in report or "config" not in report or "tokens_per_rank" not in report["config"]:
            raise SystemExit(f"{path}: not a megamoe bench report")
        rows += judge(report, args.world, path)
    if not rows:
        raise SystemExit("no fused entries in these files")
    print(table(rows))
    print(summary(rows))
    if args.png:
        try:
            draw(rows, args.png)
            print(f"wrote {args.png}")
        except ImportError:  # e.g. the GPU machine: draw it here later from the same JSON
            print("no chart: matplotlib is not installed (run again with --png where it is)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
