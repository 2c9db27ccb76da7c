"""megamoe: an expert-parallel Mixture-of-Experts layer for NVLink-connected GPUs.

Importing the package does no work beyond checking the installed torch and triton versions; the layer,
its config and the reference are loaded on first use (``megamoe.MoE``, ``megamoe.MoEConfig``, ...).
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata

__version__ = "0.1.0"

_MIN_VERSIONS = {"torch": (2, 11), "triton": (3, 6)}


def _check_versions() -> None:
    for name, minimum in _MIN_VERSIONS.items():
        need = f"megamoe needs {name} >= {'.'.join(map(str, minimum))}"
        try:
            found = _metadata.version(name)
        except _metadata.PackageNotFoundError:
            # torch from a source build or a container may carry no metadata; fall back to the module
            try:
                found = importlib.import_module(name).__version__
            except ImportError as exc:
                raise ImportError(f"{need}, and {name} is not installed") from exc
        if tuple(int("".join(filter(str.isdigit, p)) or 0) for p in found.split("+")[0].split(".")[:2]) < minimum:
            raise ImportError(f"{need}, found {name} {found}; upgrade it (on a CPU machine: pip install "
                              "torch==2.13.0 triton==3.6.0)")


_check_versions()

_LAZY = {
    "MoEConfig": "megamoe.config", "PRESETS": "megamoe.config", "preset": "megamoe.config",
    "MoE": "megamoe.layer", "MoEOutput": "megamoe.layer", "capture_moe_layers": "megamoe.layer",
    "Router": "megamoe.router", "RouterOutput": "megamoe.router",
    "available_backends": "megamoe.backends",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if (module := _LAZY.get(name)) is None:
        raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
