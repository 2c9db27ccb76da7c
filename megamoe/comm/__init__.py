"""Communication path: symmetric heap (heap.py), signals (signals.py), device-side schedule (schedule.py), pull
dispatch (dispatch.py) and combine (combine.py, presum.py). Under TRITON_INTERPRET=1 (set before the import) the
kernels run on the CPU against the ``host`` heap backend.
"""

from megamoe.kernels import interpreter

interpreter.apply()  # before any kernel runs: round-to-nearest bf16 conversions under the interpreter

from .combine import combine, dispatch_backward, pull_grad, send_gate_grad  # noqa: E402
from .dispatch import DispatchHandle, dispatch, dispatch_fp8  # noqa: E402
from .heap import (  # noqa: E402
    CommShape,
    CommTimeoutError,
    SymmetricHeap,
    close_heaps,
    get_heap,
    heap_bytes,
    release_heap,
    workspace_bytes,
)
from .schedule import Schedule  # noqa: E402

__all__ = [
    "CommShape", "CommTimeoutError", "DispatchHandle", "Schedule", "SymmetricHeap", "close_heaps", "get_heap",
    "release_heap", "combine", "pull_grad", "send_gate_grad", "dispatch", "dispatch_backward", "dispatch_fp8",
    "heap_bytes", "workspace_bytes",
]
