"""The ``megamoe`` command (``python -m megamoe`` under ``torchrun -m``): ``bench``, ``bench-comm``, ``bench-gemm``,
``info``, ``train``."""

from __future__ import annotations

import importlib
import sys

#: command -> (module with a main(argv) function, one-line help)
COMMANDS = {
    "bench": ("megamoe.apps.bench", "time the MoE layer forward and forward+backward, backends side by side"),
    "bench-comm": ("megamoe.apps.bench_comm", "time dispatch and combine alone next to NCCL all_to_all_single"),
    "bench-gemm": ("megamoe.apps.bench_gemm", "time the expert grouped GEMMs next to torch._grouped_mm"),
    "train": ("megamoe.apps.train", "train a small MoE language model with expert parallelism; tokens/s/GPU"),
    "info": ("megamoe.apps.info", "versions, GPUs, peer access, whether symmetric memory works"),
}


def usage() -> str:
    lines = ["usage: megamoe <command> [options]   (megamoe <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"megamoe: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[cmd][0])
    try:
        return int(mod.main(rest) or 0)
    except ValueError as exc:  # configuration errors: say what is wrong, no traceback
        print(f"megamoe {cmd}: {exc}", file=sys.stderr)
        return 2
