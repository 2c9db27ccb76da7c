"""Without CUDA the tests run the Triton kernels under the interpreter, and the tests marked ``gpu`` are deselected
(not skipped: the summary counts what ran). TRITON_INTERPRET is set here, before any test module imports megamoe or
triton, so that any subset of the files runs in any order (a module's own setting comes too late when another module
imported the kernels first). Spawned CPU ranks inherit it; the sm90 report's subprocess removes it."""

from __future__ import annotations

import os

import torch

HAVE_CUDA = torch.cuda.is_available()

if not HAVE_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    gpu = [it for it in items if it.get_closest_marker("gpu") is not None]
    if gpu:
        items[:] = [it for it in items if it.get_closest_marker("gpu") is None]
        config.hook.pytest_deselected(items=gpu)
