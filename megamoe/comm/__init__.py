"""Communication path: symmetric heap, signals, device-side schedule, pull dispatch and combine.

Public API (each module's docstring has the details):
    CommShape, SymmetricHeap, heap_bytes, workspace_bytes, CommTimeoutError   (heap.py)
    dispatch, dispatch_fp8, dispatch_backward, DispatchHandle                 (dispatch.py)
    combine, combine_backward                                                 (combine.py)
    barrier                                                                   (signals.py)
    Schedule                                                                  (schedule.py)

Importing this package imports triton; under TRITON_INTERPRET=1 (set before the import) the kernels run
on the CPU against the ``host`` heap backend.
"""

from megamoe import _interp

_interp.apply()  # before any kernel runs: round-to-nearest bf16 conversions under the interpreter

from .combine import combine, combine_backward  # noqa: E402
from .dispatch import DispatchHandle, dispatch, dispatch_backward, dispatch_fp8  # noqa: E402
from .heap import CommShape, CommTimeoutError, SymmetricHeap, heap_bytes, workspace_bytes  # noqa: E402
from .schedule import Schedule  # noqa: E402
from .signals import barrier  # noqa: E402

__all__ = [
    "CommShape",
    "CommTimeoutError",
    "DispatchHandle",
    "Schedule",
    "SymmetricHeap",
    "barrier",
    "combine",
    "combine_backward",
    "dispatch",
    "dispatch_backward",
    "dispatch_fp8",
    "heap_bytes",
    "workspace_bytes",
]
