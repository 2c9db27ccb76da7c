"""Issue 6's benchmark goals, read from `megamoe bench` JSON files: a Markdown table of every goal that the files
can answer, met or not, and optionally a chart.

    python benchmarks/issue6_check.py results/*.json [--png chart.png] [--world 4]

The goals (issue 6, bf16, at the world the issue names, 4 GPUs):
- 4096 tokens per GPU, uniform routing: the fused forward within 1.25x of the floor (and at most 4.6 ms on
  deepseek-v3 and mixtral-8x7b, 0.6 ms on qwen3-30b-a3b), forward+backward within 1.35x; faster than split;
- 512 tokens per GPU: fused at least 1.3x faster than split;
- skewed routing (--skew > 0): within 1.2x of the floor of the busiest rank (the bench's floor is the largest
  rank floor);
- 1 token per GPU: the forward minus its compute under 20 us. The compute is bounded below by the bench's floor
  (the weights of the experts the rows use, read once); forward - floor is an upper bound of the overhead, so a
  pass is a pass, a miss may be the bound's slack. JSON written before experts_per_rank was recorded charged every
  expert's weights, which can exceed the forward itself: such files are not judged on this goal.

"split" is the fastest split variant in the file for each mode (forward, forward+backward), "fused" each fused
variant; like is compared with like (CUDA graph
replays with graph replays, interleaved ones first, else eager). A file at another world size is shown and marked
"not the goal's world", never counted as met.
"""

from __future__ import annotations

import argparse
import json
import sys

FWD_LIMIT_MS = {"deepseek-v3": 4.6, "mixtral-8x7b": 4.6, "qwen3-30b-a3b": 0.6}
GOAL_WORLD = 4


def _timing_rank(entry: dict) -> int:
    """Which timing to compare: interleaved graph replays, then graph replays, then eager."""
    if entry.get("timing") == "cuda-graph":
        return 0 if entry.get("interleaved") else 1
    return 2


def pick(report: dict) -> tuple[str, list[dict], list[dict]]:
    """(timing label, split entries, fused entries) of the first timing present for fused: interleaved graph replays,
    graph replays, eager."""
    results = report["results"]
    for rank in (0, 1, 2):
        same = [e for e in results if _timing_rank(e) == rank]
        splits = [e for e in same if e["backend"].split(":")[0] == "split"]
        fused = [e for e in same if e["backend"].split(":")[0] == "fused"]
        if fused:
            return ("graph, interleaved", "graph", "eager")[rank], splits, fused
    return "", [], []


def _ms(m: dict) -> float:
    return m["median_s"] * 1e3


def _goal_adder(goals: list[dict]):
    def goal(name: str, value: float | None, limit: float, lower_is_better: bool = True, unit: str = "") -> None:
        met = None if value is None else (value <= limit if lower_is_better else value >= limit)
        goals.append({"goal": name, "value": value, "limit": limit, "met": met, "unit": unit})
    return goal


def judge(report: dict, world: int = GOAL_WORLD, file: str = "") -> list[dict]:
    """One row per fused entry: the goals this report answers, each with its value, limit and verdict."""
    c = report["config"]
    label, splits, fused = pick(report)
    sf = min(splits, key=lambda e: e["forward"]["median_s"]) if splits else None
    sb = min(splits, key=lambda e: e["forward+backward"]["median_s"]) if splits else None
    rows = []
    for e in fused:
        f, b = e["forward"], e["forward+backward"]
        goals = []
        goal = _goal_adder(goals)
        tokens, skew = c["tokens_per_rank"], c.get("skew", 0.0) or 0.0
        if tokens == 4096 and skew == 0:
            goal("fwd x floor", f["x_floor"], 1.25, unit="x")
            if c["preset"] in FWD_LIMIT_MS:
                goal("fwd ms", _ms(f), FWD_LIMIT_MS[c["preset"]], unit="ms")
            goal("fwd+bwd x floor", b["x_floor"], 1.35, unit="x")
            if splits:
                goal("split/fused fwd", sf["forward"]["median_s"] / f["median_s"], 1.0, False, "x")
                goal("split/fused fwd+bwd", sb["forward+backward"]["median_s"] / b["median_s"], 1.0, False, "x")
        if tokens == 512 and skew == 0 and splits:
            goal("split/fused fwd", sf["forward"]["median_s"] / f["median_s"], 1.3, False, "x")
            goal("split/fused fwd+bwd", sb["forward+backward"]["median_s"] / b["median_s"], 1.3, False, "x")
        if skew > 0:
            goal("fwd x floor (skew)", f["x_floor"], 1.2, unit="x")
        if tokens == 1 and skew == 0:
            ok = "experts_per_rank" in c and f["floor_s"] is not None
            goal("fwd - floor", (f["median_s"] - f["floor_s"]) * 1e6 if ok else None, 20.0, unit="us")
        rows.append({"preset": c["preset"], "tokens": tokens, "world": c["world"], "skew": skew, "timing": label,
                     "backend": e["backend"], "fwd_ms": _ms(f), "fwd_x": f["x_floor"], "both_ms": _ms(b),
                     "both_x": b["x_floor"], "split": sf["backend"] if sf else None,
                     "split_both": sb["backend"] if sb else None,
                     "split_fwd_ms": _ms(sf["forward"]) if sf else None,
                     "split_both_ms": _ms(sb["forward+backward"]) if sb else None,
                     "goals": goals, "goal_world": c["world"] == world, "commit": report["meta"].get("commit", "?"),
                     "gpu": report["meta"].get("gpu") or report["meta"].get("device", "?"), "file": file})
    return rows


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    return {"ms": f"{v:.3f} ms", "x": f"{v:.3f}x", "us": f"{v:.1f} us"}.get(unit, f"{v:.3g}")


def table(rows: list[dict]) -> str:
    out = ["| preset | tok/GPU | W | skew | timing | fused | fwd ms (x floor) | fwd+bwd ms (x floor) "
           "| best split fwd / fwd+bwd ms | goals |", "|" + "---|" * 10]
    for r in rows:
        marks = []
        for g in r["goals"]:
            verdict = "n/a" if g["met"] is None else ("met" if g["met"] else "**not met**")
            if g["met"] is not None and not r["goal_world"]:
                verdict = f"{'met' if g['met'] else 'not met'} at W {r['world']}, not the goal's world"
            sign = "<=" if "split/fused" not in g["goal"] else ">="
            marks.append(f"{g['goal']} {_num(g['value'], g['unit'])} "
                         f"{sign} {g['limit']:g}: {verdict}")
        names = r["split"] if r["split"] == r["split_both"] else f"{r['split']} / {r['split_both']}"
        split = "-" if r["split"] is None else f"{r['split_fwd_ms']:.3f} / {r['split_both_ms']:.3f} ({names})"
        fx = "n/a" if r["fwd_x"] is None else f"{r['fwd_x']:.2f}"
        bx = "n/a" if r["both_x"] is None else f"{r['both_x']:.2f}"
        out.append(f"| {r['preset']} | {r['tokens']} | {r['world']} | {r['skew']:g} | {r['timing']} | {r['backend']} | "
                   f"{r['fwd_ms']:.3f} ({fx}) | {r['both_ms']:.3f} ({bx}) | {split} | "
                   f"{'; '.join(marks) or '(no goal at this size)'} |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    judged = [(r, g) for r in rows for g in r["goals"] if g["met"] is not None]
    at_world = [(r, g) for r, g in judged if r["goal_world"]]
    met = sum(1 for _, g in at_world if g["met"])
    others = len(judged) - len(at_world)
    text = f"goals judged at the goal's world: {met} of {len(at_world)} met"
    if others:
        text += f"; {others} judged at other worlds (shown, not counted)"
    return text


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
        draw(rows, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
