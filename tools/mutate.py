"""Mutation check: plant realistic bugs one at a time in a copy of the repository and see which the CPU tests catch.

    python tools/mutate.py                 # baseline, then every mutation against its own test selection
    python tools/mutate.py --list          # the mutations, their files and selections
    python tools/mutate.py --only combine-gate-slot,swiglu-halves
    python tools/mutate.py --full          # every mutation against the whole CPU suite (slow)

The tracked files of the repository (``git ls-files``, read from the working tree) are copied once into a temporary
directory; each mutation replaces one exact snippet in one file there, runs

    <python> -m pytest -x -q -p no:cacheprovider -rfE <selection>

in that directory with PYTHONPATH pointing at it, and restores the file. Results:

    caught   pytest exit 1 (a test failed)
    missed   pytest exit 0 (everything selected passed)
    error    anything else: the mutated file does not parse, collection / usage error (exit 2-5), timeout, killed;
             reported apart and never counted as caught

Before the mutations, a baseline run of the union of the selections (``--full``: the whole suite) on the unmutated
copy must pass: a failing baseline would make every mutation look caught.

Every snippet must occur exactly once in its file, checked for all mutations before anything runs: a site that
moved or changed stops the script (exit 2) instead of being skipped.

Exit status: 0 when every mutation run was caught; 1 when any was missed or errored; 2 on a harness error
(snippet not found or not unique, failing baseline, bad option).

Not part of CI. It is for maintainers changing the tests: a mutation reported missed names a real bug class that
the selection does not pin. A new test file must be tracked by git (``git add``) to be copied.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE"]  # -rfE: the FAILED/ERROR lines parsed below

COMM = ("tests/test_comm.py",)
#: the layer tests (their routing and aux loss come from megamoe.reference, written apart from the router)
LAYER = ("tests/test_torch_backend.py::test_torch_backend_matches_reference[1]",)
GEMM = ("tests/test_grouped_gemm.py", "-k", "test_bf16_ops_interpreter")
FUSED_W1 = ("tests/test_fused_backend.py::test_fused_matches_reference_cpu[1]",)
SYNC = ("tests/test_sync_free_cpu.py", "-k", "reads_nothing and split")
FAILSTOP = ("tests/test_failstop.py", "-k", "survivor_raises")
HF = ("tests/test_hf.py", "-k", "test_model_loss_and_gradients")
ROUTER_KERNEL = ("tests/test_router.py", "-k", "matches_torch")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # the real bug it models, one line
    path: str  # repo-relative
    old: str  # exact snippet, must occur once in the file
    new: str
    selection: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions


MUTATIONS = [
    Mutation(
        "combine-gate-slot",
        "combine weights slot j's row with the gate of slot K-1-j (gates applied to the wrong rows)",
        "megamoe/comm/combine.py",
        "wj = tl.sum(tl.where(jj[None, :] == j, wv, 0.0), axis=1)",
        "wj = tl.sum(tl.where(jj[None, :] == K - 1 - j, wv, 0.0), axis=1)",
        COMM,
    ),
    Mutation(
        "combine-gate-bf16",
        "combine rounds the gates to bf16 before weighting (precision loss in the fp32 sum)",
        "megamoe/comm/combine.py",
        "wv = tl.load(w_ptr + toff, mask=mk, other=0.0).to(tl.float32)",
        "wv = tl.load(w_ptr + toff, mask=mk, other=0.0).to(tl.bfloat16).to(tl.float32)",
        COMM,
    ),
    Mutation(
        "router-no-renorm",
        "torch router path drops the top-k renormalisation under norm_topk (gates no longer sum to 1)",
        "megamoe/router.py",
        "gates = gates / gates.sum(-1, keepdim=True)",
        "gates = gates",
        LAYER,
    ),
    Mutation(
        "swiglu-halves",
        "GEMM1 epilogue swaps gate and up: silu(u) * g instead of silu(g) * u",
        "megamoe/kernels/tiles.py",
        "act = g / (1.0 + tl.exp(-g)) * u",
        "act = u / (1.0 + tl.exp(-u)) * g",
        GEMM,
    ),
    Mutation(
        "gemm-row-mask",
        "grouped GEMM epilogue writes one row past its expert's group (off-by-one row mask)",
        "megamoe/kernels/tiles.py",
        "mmask = rm < row_end",
        "mmask = rm <= row_end",
        GEMM,
    ),
    Mutation(
        "schedule-token-mask",
        "the schedule's histogram counts token t == T_s of a peer (one past its token count)",
        "megamoe/comm/schedule.py",
        "m = (t[:, None] < T_s) & (jj[None, :] < K)",
        "m = (t[:, None] <= T_s) & (jj[None, :] < K)",
        COMM,
    ),
    Mutation(
        "schedule-one-program-first-rank",
        "the one-program schedule places the entries of rank 0 only (its placement loop stops after one rank)",
        "megamoe/comm/schedule.py",
        "            c += 1\n        s += 1\n\n\n#: at most",
        "            c += 1\n        s += W\n\n\n#: at most",
        COMM,
    ),
    Mutation(
        "schedule-call-chunks",
        "one rank alone schedules one chunk fewer than its call holds (the last chunk's entries never placed)",
        "megamoe/comm/schedule.py",
        "NCH = max(1, min(NCH, triton.cdiv(T, CH)))",
        "NCH = max(1, min(NCH, triton.cdiv(T, CH) - 1))",
        COMM,
    ),
    # The wait removals are races: tests/test_comm.py's late-stager and late-reader cases make one rank late on
    # purpose (before its staging; before its pull, with back-to-back dispatches), so the suite catches them always.
    Mutation(
        "pull-no-ready-wait",
        "pull kernel reads peers' buffers without waiting for their READY (reads before the peer staged)",
        "megamoe/comm/dispatch.py",
        "ok = wait_flags(tab, W, rank, READY, 0, W, call, OP_PULL, timeout_ns, WP2)",
        "ok = call >= 0",  # a runtime boolean like wait_flags' result, always true
        COMM,
    ),
    Mutation(
        "stage-no-done-wait",
        "stage overwrites this rank's source buffers without waiting for the peers' DONE of the previous call",
        "megamoe/comm/signals.py",
        "ok = wait_flags(tab, W, rank, DONE, 0, W, prev, OP_STAGE, timeout_ns, WP2)",
        "ok = prev >= 0",
        COMM,
    ),
    Mutation(
        "aux-loss-fraction",
        "torch router path divides the expert load fraction by T instead of T*k (aux loss k times too large)",
        "megamoe/router.py",
        "frac = counts.to(cdt) / (T * k)",
        "frac = counts.to(cdt) / T",
        LAYER,
    ),
    Mutation(
        "fused-tail-gate-slot",
        "fused megakernel's token sum weights slot j's row with the gate of slot K-1-j",
        "megamoe/kernels/fused_moe.py",
        "wj = tl.load(gate_ptr + t * K + jk, mask=mt, other=0.0)",
        "wj = tl.load(gate_ptr + t * K + (K - 1 - jk), mask=mt, other=0.0)",
        FUSED_W1,
    ),
    Mutation(
        "fused-tail-gate-bf16",
        "fused megakernel's token sum rounds the gates to bf16 before weighting",
        "megamoe/kernels/fused_moe.py",
        "acc += wj[:, None] * v.to(tl.float32)",
        "acc += wj.to(tl.bfloat16).to(tl.float32)[:, None] * v.to(tl.float32)",
        FUSED_W1,
    ),
    Mutation(
        "split-host-check",
        "split and fused backends validate the expert ids on the host (a device -> host sync in every forward)",
        "megamoe/backends/common.py",
        "        if x.shape[0] > self.shape.max_tokens:",
        "        if x.shape[0] > self.shape.max_tokens or bool((topk_idx >= self.moe.config.num_experts).any()):",
        SYNC,
    ),
    Mutation(
        "router-group-top1",
        "group-limited routing scores a group by its best expert instead of the sum of its two best (DeepSeek-V3)",
        "megamoe/router.py",
        "group_score = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)",
        "group_score = choice.view(T, G, E // G).topk(1, dim=-1).values.sum(-1)",
        LAYER,
    ),
    Mutation(
        "router-kernel-group-top1",
        "the Triton router scores a group by twice its best expert instead of the sum of its two best",
        "megamoe/kernels/router_topk.py",
        "gsc = tl.where(gcols[None, :] == g, (m1 + m2)[:, None], gsc)",
        "gsc = tl.where(gcols[None, :] == g, (m1 + m1)[:, None], gsc)",
        ROUTER_KERNEL,
    ),
    Mutation(
        "shared-gate-no-sigmoid",
        "Qwen2-MoE's shared-expert gate applied without its sigmoid",
        "megamoe/layer.py",
        "s = s * torch.sigmoid(F.linear(x.to(cdt), self.shared_gate.to(cdt)))",
        "s = s * F.linear(x.to(cdt), self.shared_gate.to(cdt))",
        LAYER,
    ),
    Mutation(
        "timeout-unreported",
        "a timed-out CPU launch is not reported: the caller gets outputs computed from unfinished inputs",
        "megamoe/comm/heap.py",
        "        if self.backend == \"host\":\n            self.check()",
        "        if self.backend == \"host\":\n            pass",
        FAILSTOP,
    ),
    Mutation(
        "hf-logits-dropped",
        "the patched router returns its gates where transformers expects the router logits (HF's aux loss breaks)",
        "megamoe/hf.py",
        "    return r.logits, r.topk_w, r.topk_idx",
        "    return r.topk_w, r.topk_w, r.topk_idx",
        HF,
    ),
    Mutation(
        "send-dw-slot",
        "the backward stores each row's gate gradient into the mirrored slot K-1-j of its token (d topk_w permuted)",
        "megamoe/comm/combine.py",
        "tl.store(dwp + tok * K + slot, tl.load(ds_ptr + r, mask=m, other=0.0), mask=m)",
        "tl.store(dwp + tok * K + (K - 1 - slot), tl.load(ds_ptr + r, mask=m, other=0.0), mask=m)",
        COMM,
    ),
    Mutation(
        "dispatch-backward-bf16-acc",
        "dispatch's backward sums a token's k gradient rows in bf16 instead of fp32",
        "megamoe/comm/combine.py",
        "                        acc += v\n",
        "                        acc = (acc + v).to(tl.bfloat16).to(tl.float32)\n",
        COMM,
    ),
    Mutation(
        "presum-no-gate",
        "the pre-summing combine adds an expert rank's rows without their gates",
        "megamoe/comm/presum.py",
        "acc += gj[:, None] * v",
        "acc += v",
        COMM,
    ),
    Mutation(
        "wgrad-tail-row",
        "the weight gradient's last partial chunk reads one row past its expert's group",
        "megamoe/kernels/wgrad.py",
        "valid = rk < end",
        "valid = rk <= end",
        ("tests/test_grouped_gemm.py",),
    ),
    Mutation(
        "fp8-pow2-round-down",
        "power-of-two FP8 scales round down instead of up (values above 448 * s clamp)",
        "megamoe/kernels/fp8_quant.py",
        "ex = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)",
        "ex = bits >> 23",
        ("tests/test_grouped_gemm.py", "tests/test_optim.py", "-k", "quantize or pow2"),
    ),
    Mutation(
        "fp8-act-scale-column",
        "activation quantisation stores every 128-column block's scale into column 0",
        "megamoe/kernels/fp8_quant.py",
        "tl.store(s_ptr + rr64 * stride_s + kb, s, mask=rr < R)",
        "tl.store(s_ptr + rr64 * stride_s, s, mask=rr < R)",
        ("tests/test_grouped_gemm.py", "-k", "quantize"),
    ),
    Mutation(
        "fp8-both-scale-layout",
        "quantize_weight_both writes the transposed orientation's scales in the plain layout",
        "megamoe/kernels/fp8_quant.py",
        "            tl.store(st_ptr + (e * n_kb + kb) * n_nb + nb, s)",
        "            tl.store(st_ptr + (e * n_nb + nb) * n_kb + kb, s)",
        ("tests/test_grouped_gemm.py", "-k", "quantize"),
    ),
    Mutation(
        "fp8-cache-ignores-version",
        "the FP8 weight cache keys on the storage only: an in-place update keeps the stale FP8 copy",
        "megamoe/kernels/fp8_quant.py",
        "return (w._version, w.data_ptr(), tuple(w.shape), w.dtype, w.device)",
        "return (w.data_ptr(), tuple(w.shape), w.dtype, w.device)",
        ("tests/test_split_backend.py", "-k", "fp8_weight_cache"),
    ),
    Mutation(
        "adamw-no-version-bump",
        "MasterAdamW's kernel updates a parameter without bumping its version (version-keyed caches go stale)",
        "megamoe/optim.py",
        "                    increment_version(s.param)\n",
        "                    pass\n",
        ("tests/test_optim.py", "tests/test_split_backend.py", "-k", "fp8"),
    ),
    Mutation(
        "adamw-decay-on-vectors",
        "MasterAdamW applies weight decay to 1-D parameters (norms, biases) too",
        "megamoe/optim.py",
        "weight_decay if p.dim() >= 2 else 0.0",
        "weight_decay",
        ("tests/test_optim.py",),
    ),
    Mutation(
        "hf-gpt-oss-bias-interleave",
        "converting gpt-oss's experts keeps the gate/up bias interleaved (weights de-interleaved, bias not)",
        "megamoe/hf.py",
        "gate_up_bias.view(E, I2 // 2, 2).transpose(1, 2).reshape(E, I2)",
        "gate_up_bias.reshape(E, I2)",
        ("tests/test_hf.py", "-k", "gpt_oss"),
    ),
    Mutation(
        "db2-no-gate",
        "the output bias's gradient sums dy's rows without their gates",
        "megamoe/backends/common.py",
        "segment_sum(dy_rows, offs, scale=gate, out_dtype=b2.dtype)",
        "segment_sum(dy_rows, offs, out_dtype=b2.dtype)",
        ("tests/test_gpt_oss.py", "-k", "bf16_backend_matches_reference"),
    ),
    Mutation(
        "backward-frees-retained-h",
        "the backward frees h even when the graph is retained (a second backward reads freed memory)",
        "megamoe/backends/common.py",
        "    if not retained():",
        "    if True:",
        ("tests/test_layer_features.py", "-k", "frees_h"),
    ),
    Mutation(
        "router-kernel-tie-high",
        "the Triton router breaks ties between equal logits toward the higher expert id",
        "megamoe/kernels/router_topk.py",
        "key = (mono.to(tl.int64) << 32) + (BLOCK_E - 1 - cols)[None, :].to(tl.int64)",
        "key = (mono.to(tl.int64) << 32) + cols[None, :].to(tl.int64)",
        ("tests/test_router.py",),
    ),
    Mutation(
        "fused-b2-expert0",
        "the Triton megakernel adds expert 0's output bias to every expert's rows",
        "megamoe/kernels/fused_moe.py",
        "b2v = tl.load(b2_ptr + e.to(tl.int64) * H + rn, mask=rn < H, other=0.0)",
        "b2v = tl.load(b2_ptr + rn, mask=rn < H, other=0.0)",
        ("tests/test_gpt_oss.py", "-k", "bf16_backend_matches_reference and fused"),
    ),
    Mutation(
        "segment-sum-row-past",
        "the bias gradient's per-expert row sum includes the next expert's first row",
        "megamoe/kernels/bias_grad.py",
        "rmask = rr < end",
        "rmask = rr <= end",
        ("tests/test_gpt_oss.py", "-k", "ops_match_float64_twins"),
    ),
    Mutation(
        "presum-dgrad-into-rows",
        "with presum_combine the backward writes d_recv into the heap's rows region, which presum's stage overwrites",
        "megamoe/backends/common.py",
        "None if presum else handle.heap)",
        "handle.heap)",
        ("tests/test_split_backend.py::test_split_matches_reference_cpu[2]",),
    ),
    Mutation(
        "rows-busy-ignored",
        "GEMM2 writes into the heap's rows region while peers may still read it (heap.rows_busy ignored)",
        "megamoe/backends/common.py",
        "return rb[:shape[0]] if fits and not heap.rows_busy else None",
        "return rb[:shape[0]] if fits else None",
        ("tests/test_failstop.py", "-k", "rows_written"),
    ),
]


class HarnessError(Exception):
    pass


@dataclasses.dataclass
class Outcome:
    status: str  # caught / missed / error / pass / fail (baseline)
    seconds: float
    first_failure: str
    exit_code: int | None
    output: str


def check_sites(root: Path, mutations: list[Mutation]) -> dict[str, str]:
    """Original text of every mutated file; raises HarnessError listing every snippet not found exactly once."""
    texts, problems = {}, []
    for m in mutations:
        if m.path not in texts:
            f = root / m.path
            if not f.is_file():
                problems.append(f"{m.name}: {m.path} does not exist")
                continue
            texts[m.path] = f.read_text()
        n = texts[m.path].count(m.old)
        if n != 1:
            problems.append(f"{m.name}: snippet occurs {n} times in {m.path} (must be exactly once): {m.old!r}")
        if m.old == m.new:
            problems.append(f"{m.name}: replacement equals the snippet")
    if problems:
        raise HarnessError("mutation sites changed; update MUTATIONS in tools/mutate.py:\n  " + "\n  ".join(problems))
    return texts


def copy_tracked(root: Path, dest: Path) -> int:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    n = 0
    for rel in out.decode().split("\0"):
        if not rel or rel.startswith((".venv/", ".git/")):
            continue
        src = root / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        n += 1
    return n


_FIRST = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def run_pytest(python: str, cwd: Path, args: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, output, seconds). The run gets its own process group, so a timeout also
    ends the ranks it spawned."""
    env = dict(os.environ, PYTHONPATH=str(cwd))
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.monotonic()
    proc = subprocess.Popen([python, *PYTEST, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        out += f"\n[mutate.py: timed out after {timeout:.0f} s, process group killed]\n"
        code = None
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return code, out, time.monotonic() - t0


def classify(code: int | None) -> str:
    if code == 1:
        return "caught"
    if code == 0:
        return "missed"
    return "error"  # 2 interrupted, 3 internal error, 4 usage error, 5 nothing collected, <0 killed, None timeout


def first_failure(out: str) -> str:
    m = _FIRST.search(out)
    return m.group(1) if m else ""


def collect(python: str, cwd: Path, selection: tuple[str, ...], timeout: float) -> list[str]:
    """Node ids a selection runs (so that the baseline covers the union of selections with different -k)."""
    env = dict(os.environ, PYTHONPATH=str(cwd))
    env.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *selection],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise HarnessError(f"collecting {' '.join(selection)} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}")
    return [line for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def baseline_args(python: str, cwd: Path, mutations: list[Mutation], full: bool, timeout: float) -> list[str]:
    if full:
        return []
    ids: list[str] = []
    for sel in dict.fromkeys(m.selection for m in mutations):
        for node in collect(python, cwd, sel, timeout):
            if node not in ids:
                ids.append(node)
    if not ids:
        raise HarnessError("the selections collect no tests")
    return ids


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def print_table(rows: list[tuple[str, Outcome]]) -> None:
    w = max([len("mutation")] + [len(n) for n, _ in rows])
    print(f"\n{'mutation':<{w}}  {'result':<7} {'seconds':>8}  first failing test")
    print(f"{'-' * w}  {'-' * 7} {'-' * 8}  {'-' * 18}")
    for name, o in rows:
        extra = o.first_failure
        if o.status == "error" and not extra:
            extra = "timeout" if o.exit_code is None else f"exit {o.exit_code}"
        print(f"{name:<{w}}  {o.status:<7} {o.seconds:8.1f}  {extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", metavar="NAME[,NAME]", help="run only these mutations")
    ap.add_argument("--full", action="store_true", help="run the whole CPU suite (pytest -q) for every mutation")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest (default: this one)")
    ap.add_argument("--timeout", type=float,
                    help="seconds per pytest run (default 1800; with --full 3600: the whole suite took 14 min on 2 "
                         "busy cores)")
    ap.add_argument("--log-dir", type=Path, help="write each run's pytest output to DIR/<name>.log")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the baseline run (only when it was just checked: a failing baseline fakes catches)")
    args = ap.parse_args(argv)
    if args.timeout is None:
        args.timeout = 3600.0 if args.full else 1800.0

    mutations = MUTATIONS
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {m.name for m in MUTATIONS}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"unknown mutation(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}", file=sys.stderr)
            return 2
        mutations = [m for m in MUTATIONS if m.name in names]

    if args.list:
        for m in mutations:
            print(f"{m.name}\n    bug:       {m.bug}\n    file:      {m.path}\n"
                  f"    selection: {' '.join(m.selection)}\n    replace:   {m.old}\n    with:      {m.new}")
        return 0

    try:
        originals = check_sites(REPO, mutations)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    tmp_parent = Path(tempfile.mkdtemp(prefix="megamoe-mutate-"))
    work = tmp_parent / "repo"  # a fixed name: the rootdir's name is among the words -k matches
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, Outcome]] = []
    try:
        n = copy_tracked(REPO, work)
        originals = check_sites(work, mutations)  # the copy is what runs (tracked files only)
        print(f"copied {n} tracked files to {work}; python {args.python}", flush=True)

        if not args.no_baseline:
            base = baseline_args(args.python, work, mutations, args.full, args.timeout)
            what = "the whole suite" if args.full else f"{len(base)} tests (union of the selections)"
            print(f"baseline: {what} on the unmutated copy ...", flush=True)
            code, out, secs = run_pytest(args.python, work, base, args.timeout)
            if args.log_dir:
                (args.log_dir / "baseline.log").write_text(out)
            if code != 0:
                print(tail(out), file=sys.stderr)
                print(f"error: the baseline does not pass (exit {code}, {secs:.0f} s); every mutation would look "
                      "caught. Fix the tests first.", file=sys.stderr)
                return 2
            print(f"baseline passed in {secs:.1f} s", flush=True)

        for i, m in enumerate(mutations, 1):
            f = work / m.path
            original = originals[m.path]
            mutated = original.replace(m.old, m.new, 1)
            print(f"[{i}/{len(mutations)}] {m.name}: {m.bug}", flush=True)
            try:
                f.write_text(mutated)
                try:
                    compile(mutated, str(f), "exec")
                except SyntaxError as e:
                    o = Outcome("error", 0.0, f"mutated file does not parse: {e}", None, "")
                else:
                    sel = [] if args.full else list(m.selection)
                    code, out, secs = run_pytest(args.python, work, sel, args.timeout)
                    o = Outcome(classify(code), secs, first_failure(out), code, out)
            finally:
                f.write_text(original)
            if args.log_dir:
                (args.log_dir / f"{m.name}.log").write_text(o.output)
            print(f"    {o.status} in {o.seconds:.1f} s {o.first_failure}", flush=True)
            if o.status == "error":
                print(tail(o.output, 20), flush=True)
            rows.append((m.name, o))
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"kept the copy at {work}")
        else:
            shutil.rmtree(tmp_parent, ignore_errors=True)

    print_table(rows)
    caught = sum(o.status == "caught" for _, o in rows)
    errors = sum(o.status == "error" for _, o in rows)
    note = f" ({errors} error{'s' if errors != 1 else ''}, not counted)" if errors else ""
    print(f"{caught}/{len(rows)} caught{note}")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
