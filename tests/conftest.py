"""Without CUDA the tests run the Triton kernels under the interpreter. Set here, before any test module imports
megamoe or triton, so that any subset of the files runs in any order (the modules' own settings came too late
when another module had imported the kernels first, e.g. tests/test_train.py before tests/test_router.py). Spawned
CPU ranks inherit it; the sm90 report's subprocess removes it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
