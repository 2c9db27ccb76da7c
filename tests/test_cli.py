"""The command line: `megamoe bench` on CPU ranks writes a complete report; `megamoe info` runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megamoe.config import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "megamoe", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default; GPUs run it under torchrun")
def test_bench_cpu_default_writes_report(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = _run("bench", "--world", "2", "--iters", "2", "--warmup", "1", "--skew", "2.0", "--json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    assert "torch" in proc.stdout and "rel err" in proc.stdout
    report = json.loads(out_json.read_text())
    assert report["config"]["preset"] == "tiny" and report["config"]["world"] == 2
    assert report["config"]["skew"] == 2.0
    for key in ("commit", "date", "torch", "triton"):
        assert report["meta"][key]
    assert [e["backend"] for e in report["results"]] == ["torch", "split", "fused"]  # every backend available on CPU
    for entry in report["results"]:
        assert 0 <= entry["rel_err"] < 1e-2  # bf16 layer vs float64 reference
        for mode in ("forward", "forward+backward"):
            assert entry[mode]["median_s"] > 0 and entry[mode]["iters"] == 2
    assert sum(report["config"]["rows_per_rank"]) == 2 * 64 * 2  # ranks x tokens x top-k
    local = report["config"]["num_experts"] // 2
    assert all(1 <= e <= local for e in report["config"]["experts_per_rank"])
    # the floor's inputs per rotating input set (the timings rotate over them; the floor is the lowest set's)
    sets, esets = report["config"]["rows_per_rank_sets"], report["config"]["experts_per_rank_sets"]
    assert len(sets) == len(esets) > 1 and sets[0] == report["config"]["rows_per_rank"]
    assert all(sum(r) == 2 * 64 * 2 and len(r) == 2 for r in sets)
    assert all(1 <= e <= local for es in esets for e in es)


def test_bench_rejects_bad_world():
    proc = _run("bench", "--cpu", "--world", "3", "--iters", "1")
    assert proc.returncode == 2
    assert "divisible by the world size" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU ranks; GPUs run it under torchrun")
def test_bench_experts_replaces_the_presets(tmp_path):
    # --experts 4 on 1 rank: one rank's share of the tiny preset (8 experts) at EP 2, without the communication
    out_json = tmp_path / "bench.json"
    proc = _run("bench", "--cpu", "--world", "1", "--experts", "4", "--backends", "split", "--iters", "1",
                "--warmup", "0", "--tokens", "32", "--json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    assert "E=4 " in proc.stdout
    c = json.loads(out_json.read_text())["config"]
    assert (c["num_experts"], c["preset_num_experts"], c["world"]) == (4, 8, 1)
    assert c["rows_per_rank"] == [32 * 2] and 1 <= c["experts_per_rank"][0] <= 4
    # the expert count is checked like any MoEConfig: top_k <= E, W divides E
    for argv, text in ((("--experts", "1"), "top_k (2) must be <= num_experts (1)"),
                       (("--experts", "3", "--world", "2"), "divisible by the world size")):
        proc = _run("bench", "--cpu", "--iters", "1", *argv)
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr


def test_bench_interleave_needs_cuda_graph():
    proc = _run("bench", "--cpu", "--interleave", "--iters", "1")
    assert proc.returncode != 0 and "--interleave" in proc.stderr and "--cuda-graph" in proc.stderr


def test_bench_interleaved_replays_take_turns():
    """_replay_times replays several captured steps in turn (A B A B ...), copies each step's inputs before its
    replay, and keeps only the timed iterations after the warm-up, per step."""
    import argparse

    from megamoe.apps.bench import _replay_times

    order = []

    class Graph:
        def __init__(self, name, x):
            self.name, self.x = name, x

        def replay(self):
            order.append((self.name, float(self.x[0])))

    class Timer:
        def start(self):
            return len(order)

        def stop(self, t0):
            return float(len(order))

    xs = [torch.full((2,), float(i)) for i in range(3)]
    captured = []
    for name in "AB":
        x, dy = torch.zeros(2), torch.zeros(2)
        captured.append((Graph(name, x), None, x, dy))
    times = _replay_times(captured, xs, xs, argparse.Namespace(warmup=1, iters=3), Timer())
    assert [n for n, _ in order] == ["A", "B"] * 4
    assert [v for _, v in order] == [0, 0, 1, 1, 2, 2, 0, 0]  # inputs rotate per iteration, same for each step
    assert times == [[3.0, 5.0, 7.0], [4.0, 6.0, 8.0]]


def test_bench_graph_times_per_mode_and_maker(monkeypatch):
    """_graph_times captures each maker's step per mode (forward, then forward+backward) and returns per maker the
    stats of its own replays, in the makers' order (one maker: the non-interleaved bench; several: --interleave)."""
    import argparse

    import megamoe.apps.bench as B

    calls = []

    class Graph:
        def __init__(self, spec, mode):
            self.spec, self.mode = spec, mode

        def replay(self):
            calls.append(("replay", self.spec, self.mode))

    def capture(make, x0, dy0, device, mode):
        calls.append(("capture", make(), mode))
        return Graph(make(), mode), None, torch.zeros(2), torch.zeros(2)

    class Timer:
        def start(self):
            return None

        def stop(self, t0):  # A's replays take 1 s, B's 2 s (forward) / 10 s, 20 s (forward+backward)
            _, spec, mode = calls[-1]
            return (1.0 if spec == "A" else 2.0) * (10 if mode == "forward+backward" else 1)

    monkeypatch.setattr(B, "capture_step", capture)
    monkeypatch.setattr(B, "_max_over_ranks", lambda times, device: times)
    xs = [torch.ones(2)]
    args = argparse.Namespace(warmup=1, iters=2)
    out = B._graph_times([("a", lambda: "A"), ("b", lambda: "B")], xs, xs, args, Timer(), torch.device("cpu"), False)
    assert [c[:3] for c in calls if c[0] == "capture"] == [("capture", "A", "forward"), ("capture", "B", "forward"),
                                                           ("capture", "A", "forward+backward"),
                                                           ("capture", "B", "forward+backward")]
    assert out[0]["forward"]["median_s"] == 1.0 and out[1]["forward"]["median_s"] == 2.0
    assert out[0]["forward+backward"]["min_s"] == 10.0 and out[1]["forward+backward"]["max_s"] == 20.0
    assert all(m["iters"] == 2 for o in out for m in o.values())


def test_cli_usage_and_info():
    proc = _run("--help")
    assert proc.returncode == 0 and "bench" in proc.stdout
    assert _run("nonsense").returncode == 2
    info = _run("info")
    assert info.returncode == 0, info.stderr
    assert "torch" in info.stdout and "backends:" in info.stdout


def test_backend_spec_parsing():
    from megamoe.apps.bench import parse_backend

    assert parse_backend("torch") == ("torch", {})
    spec = parse_backend("split:comm_sms=24:presum_combine=1")
    assert spec == ("split", {"comm_sms": 24, "presum_combine": True})
    with pytest.raises(ValueError, match="key=value"):
        parse_backend("split:fast")


def test_floor_counts_the_experts_a_rank_uses():
    from megamoe.apps.perf import CEILINGS, floor_seconds, forward_bytes, layer_floor_seconds

    cfg, ceil = preset("qwen3-30b-a3b"), CEILINGS["H200"]
    w = cfg.expert_weight_bytes(4)  # 32 local experts at EP 4
    assert forward_bytes(cfg, 10, 4) == forward_bytes(cfg, 10, 4, 32) == w + 10 * 2 * cfg.hidden * 2
    assert forward_bytes(cfg, 10, 4, 8) == w // 4 + 10 * 2 * cfg.hidden * 2
    # one token per GPU: 8 experts' weights, not 32; the bytes bound the floor
    assert floor_seconds(cfg, 8, 4, ceil, experts=8) == pytest.approx(forward_bytes(cfg, 8, 4, 8) / ceil.hbm)
    assert floor_seconds(cfg, 8, 4, ceil, experts=8) < floor_seconds(cfg, 8, 4, ceil) / 3.9
    # every expert used: the busiest rank's floor, as before
    rows = [30000, 32768, 35000, 33000]
    assert layer_floor_seconds(cfg, rows, 4, ceil, 3.0) == floor_seconds(cfg, 35000, 4, ceil, 3.0)
    assert layer_floor_seconds(cfg, rows, 4, ceil, 3.0, [32] * 4) == floor_seconds(cfg, 35000, 4, ceil, 3.0)
    # a rank with fewer rows but more experts can set the floor of a small batch
    assert layer_floor_seconds(cfg, [9, 6], 4, ceil, 1.0, [3, 6]) == floor_seconds(cfg, 6, 4, ceil, experts=6)
    assert layer_floor_seconds(cfg, rows, 4, None) is None
    with pytest.raises(ValueError, match="experts used"):
        forward_bytes(cfg, 10, 4, 33)


def _bench_reference_error_rank(rank: int, world: int) -> list[float]:
    from megamoe.apps.bench import _reference_error
    from megamoe.layer import MoE

    errs = []
    for cfg in (preset("tiny", shared_intermediate=32, shared_gate=True, dtype=torch.float32),  # gated shared expert
                preset("gpt-oss-20b", hidden=64, intermediate=32, num_experts=8, dtype=torch.float32)):  # gpt-oss
        moe = MoE(cfg, backend="torch", device="cpu", seed=1, group=torch.distributed.group.WORLD)
        x = torch.randn(23, cfg.hidden, generator=torch.Generator().manual_seed(rank)) * 4
        with torch.no_grad():
            errs.append(_reference_error(moe, x, moe(x).out))
    return errs


def test_bench_reference_check_covers_the_layers_form():
    # the bench's float64 check is the layer's whole function: gpt-oss's biases and clamped activation, the shared
    # expert and its gate (a plain SwiGLU reference reads 1e-1 or worse there)
    from megamoe.dist import spawn

    for errs in spawn(_bench_reference_error_rank, 2, timeout_s=300):
        assert max(errs) < 1e-5, errs  # float32 layers against float64
