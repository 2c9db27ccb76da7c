"""benchmarks/issue6_check.py judges issue 6's goals from bench reports: only at the goal's world, like with like."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("issue6_check", os.path.join(ROOT, "benchmarks", "issue6_check.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def _entry(backend: str, fwd_ms: float, both_ms: float, floor_ms: float, timing: str = "cuda-graph", **extra) -> dict:
    def mode(ms, passes):
        return {"median_s": ms / 1e3, "floor_s": passes * floor_ms / 1e3, "x_floor": ms / (passes * floor_ms)}
    return {"backend": backend, "timing": timing, "forward": mode(fwd_ms, 1), "forward+backward": mode(both_ms, 3),
            **extra}


def _report(preset, tokens, world, entries, skew=0.0, experts=True) -> dict:
    config = {"preset": preset, "tokens_per_rank": tokens, "world": world, "skew": skew}
    if experts:
        config["experts_per_rank"] = [8] * world
    return {"meta": {"commit": "abc1234", "gpu": "NVIDIA H200"}, "config": config, "results": entries}


def _goals(rows, backend):
    (row,) = [r for r in rows if r["backend"] == backend]
    return {g["goal"]: g for g in row["goals"]}


def test_goals_at_4096_compare_like_with_like():
    rep = _report("qwen3-30b-a3b", 4096, 4, [
        _entry("split", 0.50, 1.50, 0.40, timing="eager"),  # faster eager split: not compared with graph replays
        _entry("split", 0.60, 1.60, 0.40), _entry("split:presum_combine=1", 0.55, 1.70, 0.40),
        _entry("fused", 0.48, 1.61, 0.40), _entry("fused:kernel=gluon", 0.58, 1.40, 0.40),
        _entry("fused", 0.30, 0.90, 0.40, timing="eager")])
    rows = check.judge(rep)
    assert {r["timing"] for r in rows} == {"graph"} and len(rows) == 2
    g = _goals(rows, "fused")
    assert rows[0]["split"] == "split:presum_combine=1"  # the fastest split forward
    assert g["fwd x floor"]["value"] == pytest.approx(1.2) and g["fwd x floor"]["met"]
    assert g["fwd ms"]["met"] and g["fwd ms"]["limit"] == 0.6
    assert g["fwd+bwd x floor"]["value"] == pytest.approx(1.61 / 1.2) and g["fwd+bwd x floor"]["met"]
    # each mode against its fastest split: forward presum's 0.55, forward+backward plain split's 1.60
    assert g["split/fused fwd"]["value"] == pytest.approx(0.55 / 0.48) and g["split/fused fwd"]["met"]
    assert g["split/fused fwd+bwd"]["value"] == pytest.approx(1.60 / 1.61) and not g["split/fused fwd+bwd"]["met"]
    assert rows[0]["split_both"] == "split"
    assert not _goals(rows, "fused:kernel=gluon")["fwd x floor"]["met"]
    assert "met" in check.table(rows) and "7 of 10 met" in check.summary(rows)


def test_interleaved_replays_first_and_other_worlds_not_counted():
    rep = _report("mixtral-8x7b", 512, 1, [
        _entry("split", 1.0, 3.0, 0.5), _entry("fused", 0.5, 1.5, 0.5),
        _entry("split", 1.4, 3.9, 0.5, interleaved=True), _entry("fused", 1.0, 2.0, 0.5, interleaved=True)])
    rows = check.judge(rep)
    assert [r["timing"] for r in rows] == ["graph, interleaved"]
    g = _goals(rows, "fused")
    assert g["split/fused fwd"]["value"] == pytest.approx(1.4) and g["split/fused fwd"]["met"]
    assert g["split/fused fwd+bwd"]["value"] == pytest.approx(1.95)
    assert "0 of 0 met; 2 judged at other worlds" in check.summary(rows)
    assert "at W 1, not the goal's world" in check.table(rows)


def test_one_token_and_skew():
    rows = check.judge(_report("qwen3-30b-a3b", 1, 4, [_entry("split", 0.05, 0.2, 0.02),
                                                        _entry("fused", 0.035, 0.2, 0.02)]))
    g = _goals(rows, "fused")["fwd - floor"]
    assert g["value"] == pytest.approx(15.0) and g["met"]
    # a report whose floor charged every expert's weights is not judged on the overhead
    old = check.judge(_report("qwen3-30b-a3b", 1, 4, [_entry("fused", 0.035, 0.2, 0.02)], experts=False))
    assert _goals(old, "fused")["fwd - floor"]["met"] is None
    sk = check.judge(_report("deepseek-v3", 4096, 4, [_entry("split", 9.0, 30.0, 7.0), _entry("fused", 8.0, 25, 7.0)],
                             skew=4.0))
    g = _goals(sk, "fused")
    assert set(g) == {"fwd x floor (skew)"} and g["fwd x floor (skew)"]["met"]  # 8 / 7 <= 1.2


def test_cli_reads_files_and_refuses_others(tmp_path, capsys):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(_report("qwen3-30b-a3b", 4096, 4, [_entry("split", 0.6, 1.6, 0.4),
                                                                  _entry("fused", 0.48, 1.5, 0.4)])))
    assert check.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "| qwen3-30b-a3b | 4096 | 4 |" in out and "5 of 5 met" in out
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a megamoe bench report"):
        check.main([str(bad)])


def test_reports_without_floors_or_gpu_are_shown_not_judged(tmp_path, capsys):
    # a CPU report: no measured ceilings (floor None), no GPU name
    entries = [_entry("split", 1.0, 3.0, 1.0), _entry("fused", 0.5, 1.5, 1.0)]
    for e in entries:
        for mode in ("forward", "forward+backward"):
            e[mode].update(floor_s=None, x_floor=None)
    rep = _report("qwen3-30b-a3b", 1, 4, entries)
    rep["meta"] = {"commit": "abc1234", "device": "cpu"}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(rep))
    assert check.main([str(path), "--png", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "fwd - floor n/a <= 20: n/a" in out and "0 of 0 met" in out
    assert (tmp_path / "c.png").stat().st_size > 1000
