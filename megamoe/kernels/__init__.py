"""Triton kernels (one op per module; they run everywhere, the CPU interpreter included, and are the references) and,
in ``megamoe.kernels.gluon``, the Hopper (sm_90a) warp-specialised kernels that megamoe.experts runs there by default.
Under TRITON_INTERPRET=1 the interpreter's fix-ups (kernels/interpreter.py) are installed first."""

from megamoe.kernels import interpreter

interpreter.apply()
