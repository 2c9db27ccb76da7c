"""Triton and Gluon (sm_90a) kernels (one op per module). Under TRITON_INTERPRET=1 the interpreter's bf16 rounding
is fixed first (see megamoe._interp)."""

from megamoe import _interp

_interp.apply()
