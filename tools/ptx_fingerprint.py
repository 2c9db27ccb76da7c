"""The sm_90a code of every kernel a default layer or op launches on an H100/H200, compiled on a machine without a GPU,
as normalised PTX: two trees whose fingerprints agree run the same GPU code (same behaviour, same speed).

    python tools/ptx_fingerprint.py OUT_DIR          # one .ptx file per (kernel, specialisation) + index.json
    python tools/ptx_fingerprint.py --diff A B       # compare two such directories

Under megamoe.testing.sm90's compile_only every launch compiles for sm_90a with its real argument specialisation and
launches nothing. CPU tensors stand in for the device's: the device checks that pick a kernel (compute capability 9,
not under the interpreter) are told they run on a Hopper GPU, so the default choices are the H200's. Normalised:
debug line directives (.loc / .file: paths and line numbers move with the code), comments, and the kernel's own
name (renaming a kernel is no change). Entries are keyed by a label of what launched them and the kernel's
compiled signature.

Run it where TRITON_INTERPRET is unset.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def normalise(ptx: str, name: str) -> str:
    out = []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and ".debug" in s:  # DWARF sections to the end: file names, line tables
            break
        if s.startswith((".loc", ".file", "//", "$L__")) or not s:
            continue
        out.append(re.sub(r"//.*$", "", line.replace(name, "KERNEL")).rstrip())
    return _renumber("\n".join(out) + "\n")


def _renumber(text: str) -> str:
    """Virtual registers (%r12, %rd3, %p7, ...) renumbered per class in order of first use, and the register counts
    of their declarations dropped: one register more or less early in a kernel renumbers every later one."""
    text = re.sub(r"(\.reg \.\w+\s+%\w+)<\d+>", r"\1<N>", text)
    seen: dict[str, dict[str, int]] = {}

    def sub(m):
        cls, num = m.group(1), m.group(2)
        per = seen.setdefault(cls, {})
        return f"%{cls}{per.setdefault(num, len(per))}"

    text = re.sub(r"%([a-z]+)(\d+)\b", sub, text)
    # kernel parameters: an unused argument removed renumbers the later ones; compare uses, not the declarations
    text = "\n".join(line for line in text.split("\n") if not re.match(r"\s*\.param\s", line))
    params: dict[str, int] = {}
    return re.sub(r"KERNEL_param_(\d+)", lambda m: f"P{params.setdefault(m.group(1), len(params))}", text)


def _pretend_hopper() -> None:
    """Every device check that chooses a kernel answers as on an H200 (see the module docstring)."""
    import torch

    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    for mod in [m for name, m in sys.modules.items() if name.startswith("megamoe") and m is not None]:
        for attr in ("gluon_device_reason", "gluon_fused_reason"):
            if hasattr(mod, attr):
                real = getattr(mod, attr)
                if attr == "gluon_device_reason":
                    setattr(mod, attr, lambda t, cfg, _real=real: None if cfg.use_tma is not False else
                            _real(t, cfg))
                else:
                    setattr(mod, attr, lambda cfg, _real=real, **kw: _real(cfg, **{**kw, "device": None}))
        if hasattr(mod, "num_sms") and callable(mod.num_sms):
            mod.num_sms = lambda device: 132


def _sm90():
    try:
        import megamoe.testing.sm90 as sm90
    except ImportError:  # a tree from before the package's testing/ folder
        import megamoe.sm90 as sm90
    return sm90


def _import_everything() -> None:
    import pkgutil

    import megamoe

    for info in pkgutil.walk_packages(megamoe.__path__, "megamoe."):
        if any(part in info.name for part in (".apps", "bench", ".cli", ".train", ".testing", "sm90", ".info",
                                              "__main__")):
            continue
        __import__(info.name)


LAYERS = [  # (world, preset, local experts, tokens per rank, backend, options); options must exist in both trees
    (1, "qwen3-30b-a3b", 8, 64, "split", {}),
    (1, "qwen3-30b-a3b", 8, 64, "split", {"fp8": True}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {}),
    (1, "qwen3-30b-a3b", 8, 64, "fused", {"ring_blocks": 8}),
    (1, "qwen3-30b-a3b", 8, 1, "split", {}),
    (1, "qwen3-30b-a3b", 8, 1, "fused", {}),
    (1, "deepseek-v3", 8, 64, "split", {}),
    (1, "mixtral-8x7b", 2, 64, "split", {}),
    (1, "mixtral-8x7b", 2, 64, "fused", {}),
]


def _layers(compiled: dict, where: dict, layer_opts) -> None:
    import torch

    from megamoe.config import preset
    from megamoe.layer import MoE

    sm90 = _sm90()
    for w, name, experts, tokens, backend, opts in LAYERS:
        cfg = preset(name, num_experts=experts * w, max_tokens_per_rank=max(tokens, 1))
        opts = layer_opts(backend, opts)
        label = f"W{w}/{name}/{tokens}tok/{backend}" + "".join(f":{k}={v}" for k, v in sorted(opts.items()))
        before = {n: set(v) for n, v in compiled.items()}
        with sm90.compile_only(compiled):
            moe = MoE(cfg, backend=backend, device=torch.device("cpu"), seed=0, **opts)
            x = torch.zeros(tokens, cfg.hidden, dtype=cfg.dtype).requires_grad_()
            out = moe(x).out
            out.backward(torch.zeros_like(out))
        for n, keys in compiled.items():
            for key in set(keys) - before.get(n, set()):
                where.setdefault((n, key), label)


def _ops(compiled: dict, where: dict) -> None:
    """Every op of megamoe.experts with its default config at deepseek-v3's EP-4 expert shapes, and the router."""
    import torch

    import megamoe.experts as X

    H, I, E, R = 7168, 2048, 8, 1024
    bf = torch.bfloat16
    offs = torch.arange(0, E + 1, dtype=torch.int32) * (R // E)
    x, w13, w2 = torch.zeros(R, H, dtype=bf), torch.zeros(E, 2 * I, H, dtype=bf), torch.zeros(E, H, I, dtype=bf)
    act, h, dy = torch.zeros(R, I, dtype=bf), torch.zeros(R, 2 * I, dtype=bf), torch.zeros(R, H, dtype=bf)
    s = torch.ones(R)
    calls = {
        "gemm1_swiglu": lambda: X.gemm1_swiglu(x, w13, offs),
        "gemm2+scale": lambda: X.gemm2(act, w2, offs, scale=s),
        "gemm2": lambda: X.gemm2(act, w2, offs),
        "dgrad_swiglu+scale+acts": lambda: X.gemm2_dgrad_swiglu(dy, w2, h, offs, scale=s,
                                                                acts_out=torch.empty_like(act)),
        "dgrad1": lambda: X.gemm1_dgrad(h, w13, offs),
        "wgrad:bf16": lambda: X.grouped_wgrad(h, x, offs, out_dtype=bf),
        "wgrad:fp32": lambda: X.grouped_wgrad(dy, act, offs),
    }
    xq, xs = torch.zeros(R, H, dtype=torch.float8_e4m3fn), torch.ones(R, H // 128)
    aq, a_s = torch.zeros(R, I, dtype=torch.float8_e4m3fn), torch.ones(R, I // 128)
    dhq, dhs = torch.zeros(R, 2 * I, dtype=torch.float8_e4m3fn), torch.ones(R, 2 * I // 128)
    q13, s13 = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn), torch.ones(E, 2 * I // 128, H // 128)
    q2, s2 = torch.zeros(E, H, I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, I // 128)
    q2t, s2t = torch.zeros(E, I, H, dtype=torch.float8_e4m3fn), torch.ones(E, I // 128, H // 128)
    q13t, s13t = torch.zeros(E, H, 2 * I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, 2 * I // 128)
    calls.update({
        "fp8:gemm1_swiglu": lambda: X.gemm1_swiglu_fp8(xq, xs, q13, s13, offs),
        "fp8:gemm2": lambda: X.gemm2_fp8(aq, a_s, q2, s2, offs),
        "fp8:dgrad_swiglu+scale+acts": lambda: X.gemm2_dgrad_swiglu_fp8(xq, xs, q2t, s2t, h, offs, scale=s,
                                                                        acts_out=torch.empty_like(act)),
        "fp8:dgrad1": lambda: X.gemm1_dgrad_fp8(dhq, dhs, q13t, s13t, offs),
        "quantize_act": lambda: X.quantize_act(x),
        "quantize_weight_both": lambda: X.quantize_weight_both(w2),
    })
    sm90 = _sm90()
    for label, fn in calls.items():
        before = {n: set(v) for n, v in compiled.items()}
        with sm90.compile_only(compiled):
            fn()
        for n, keys in compiled.items():
            for key in set(keys) - before.get(n, set()):
                where.setdefault((n, key), f"op/{label}")


def _rank(rank: int, world: int, out_dir: str, layer_opts_src: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    _import_everything()
    _pretend_hopper()
    compiled: dict = {}
    where: dict = {}
    layer_opts = eval(layer_opts_src)  # noqa: S307 - our own lambda source from the command line
    _layers(compiled, where, layer_opts)
    _ops(compiled, where)
    index = {}
    for (name, key), label in where.items():
        k = compiled[name][key]
        text = normalise(k.asm["ptx"], k.metadata.name)
        digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        entry = f"{label}|{k.metadata.name.split('_kernel')[0]}"
        fname = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", entry) + f"-{digest}.ptx"
        Path(out_dir, fname).write_text(text)
        index.setdefault(label, []).append({"kernel": k.metadata.name, "sha1": digest, "file": fname,
                                            "shared": k.metadata.shared, "warps": k.metadata.num_warps})
    Path(out_dir, "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    return len(where)


def _label(label: str) -> str:
    """Labels across trees whose option names differ: options that became the default are dropped."""
    for opt in (":kernel=gluon", ":fp8_dispatch=True"):
        label = label.replace(opt, "")
    return label


def _digest(d: str, entry: dict) -> str:
    """The entry's normalised PTX digest, normalised again (files written by an older normalise compare alike)."""
    text = normalise(Path(d, entry["file"]).read_text(), entry["kernel"])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def diff(a: str, b: str) -> int:
    ia, ib = ({_label(k): v for k, v in json.loads(Path(d, "index.json").read_text()).items()} for d in (a, b))
    bad = 0
    for label in sorted(set(ia) | set(ib)):
        ka = sorted(ia.get(label, []), key=lambda e: e["kernel"])
        kb = sorted(ib.get(label, []), key=lambda e: e["kernel"])
        sa = sorted(_digest(a, e) for e in ka)
        sb = sorted(_digest(b, e) for e in kb)
        if sa == sb:
            print(f"same  {label}: {len(sa)} kernels")
            continue
        bad += 1
        print(f"DIFF  {label}: {[e['kernel'] for e in ka]} -> {[e['kernel'] for e in kb]}")
        only_a = [e for e in ka if _digest(a, e) not in sb]
        only_b = [e for e in kb if _digest(b, e) not in sa]
        for ea, eb in zip(only_a, only_b, strict=False):
            ta = normalise(Path(a, ea["file"]).read_text(), ea["kernel"]).splitlines()
            tb = normalise(Path(b, eb["file"]).read_text(), eb["kernel"]).splitlines()
            d = list(difflib.unified_diff(ta, tb, lineterm="", n=1))
            print(f"      {ea['kernel']} vs {eb['kernel']}: {len(d)} diff lines")
            for line in d[:40]:
                print("      " + line)
    print(f"{bad} labels differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"))
    ap.add_argument("--layer-opts", default="lambda backend, opts: opts",
                    help="python lambda (backend, opts) -> the options to pass (to map option names across trees)")
    args = ap.parse_args()
    if args.diff:
        return diff(*args.diff)
    os.makedirs(args.out, exist_ok=True)
    from megamoe.dist import spawn

    n = spawn(_rank, 1, args.out, args.layer_opts, timeout_s=3000)[0]
    print(f"{n} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
