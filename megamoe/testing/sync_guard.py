"""A CPU check of the split and fused backends' promise: no host-device synchronisation in forward or backward.

On a GPU ``torch.cuda.set_sync_debug_mode("error")`` catches a sync; CPU ranks never wait, so inside
:func:`no_host_reads` a torch call by megamoe code that reads tensor *data* on the host raises :class:`HostSyncError`
naming the op and source line (CPU tensors count as device tensors): a Python value from tensor data (``item``,
``tolist``, ``__bool__``, ``equal``, printing, ...: :data:`_ALWAYS`); ``Tensor.cpu`` and ``Tensor.to`` a CPU device
(not ``to(other_tensor)``, which on CPU cannot tell a move from a cast; host -> device copies do not count);
data-dependent output sizes (``nonzero``, one-argument ``torch.where``, ``repeat_interleave`` with tensor repeats and
no ``output_size``, boolean-mask indexing, ...: :func:`_host_read`).

A call counts when its nearest caller outside torch is megamoe code (by module namespace or package file), except
:data:`EXCLUDED` (kernels/interpreter.py emulates the device); a torch function megamoe calls is charged to megamoe
whatever it does inside (a read in DDP's forward counts). A ``TorchFunctionMode`` is off while its own handler runs,
so the backwards ``Tensor.backward`` starts would go unseen: while a guard is active, ``BackwardCFunction.apply``
(the engine's entry into custom backwards) re-pushes the innermost guard's mode. ``Tensor.register_hook`` hooks are
not covered (megamoe has none); one thread at a time. Use after a warm-up call outside the guard::

    with no_host_reads():
        out = moe(x)
        out.out.backward(dy)
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys

import torch
from torch.overrides import TorchFunctionMode


class HostSyncError(RuntimeError):
    """megamoe code read tensor data on the host inside :func:`no_host_reads`."""


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # megamoe/, above testing/
#: megamoe modules whose calls do not count (see the module docstring)
EXCLUDED = frozenset({__name__, "megamoe.kernels.interpreter"})
_EXCLUDED_FILES = frozenset(os.path.join(_PKG_DIR, *m.split(".")[1:]) + ".py" for m in EXCLUDED)


def _in(frame, pkg: str, pkg_dir: str) -> bool:
    """Whether ``frame`` runs code of ``pkg``: by its globals' module (a function planted into a megamoe module
    counts as that module's) or by its file (a module run as __main__)."""
    name = frame.f_globals.get("__name__") or ""
    return name == pkg or name.startswith(pkg + ".") or frame.f_code.co_filename.startswith(pkg_dir)


def _megamoe_caller(frame):
    """The nearest frame outside torch (and this module): returned if it is megamoe code that counts, else None."""
    while frame is not None and (_in(frame, "torch", _TORCH_DIR) or frame.f_globals.get("__name__") == __name__):
        frame = frame.f_back
    if frame is None or not _in(frame, "megamoe", _PKG_DIR):
        return None
    excluded = frame.f_globals.get("__name__") in EXCLUDED or frame.f_code.co_filename in _EXCLUDED_FILES
    return None if excluded else frame


#: torch callables that always read tensor data on the host -> the name reported (str(t) reaches torch as __repr__)
_ALWAYS = {getattr(torch.Tensor, n): f"Tensor.{n}" for n in (
    "item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__complex__", "__index__", "cpu",
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount", "equal", "allclose",
    "is_nonzero", "__repr__", "__format__")}
_ALWAYS |= {getattr(torch, n): f"torch.{n}" for n in (
    "nonzero", "argwhere", "unique", "unique_consecutive", "_unique", "_unique2", "masked_select", "bincount", "equal",
    "allclose", "is_nonzero")}


def _is_mask(i) -> bool:
    if isinstance(i, torch.Tensor):
        return i.dtype in (torch.bool, torch.uint8)
    return isinstance(i, (tuple, list)) and any(_is_mask(j) for j in i)


def _host_read(func, args, kwargs) -> str | None:
    """The name of the host read ``func(*args, **kwargs)`` would make, or None."""
    if (name := _ALWAYS.get(func)) is not None:
        return name
    if func is torch.Tensor.to:
        devs = [kwargs.get("device")] + [a for a in args[1:] if isinstance(a, (str, torch.device))]
        return "Tensor.to(cpu)" if any(d is not None and torch.device(d).type == "cpu" for d in devs) else None
    if func is torch.Tensor.__getitem__ or func is torch.Tensor.__setitem__:
        return f"Tensor.{func.__name__} with a boolean mask" if len(args) > 1 and _is_mask(args[1]) else None
    if func is torch.where:
        return "torch.where(condition)" if len(args) + len(kwargs) == 1 else None
    if func is torch.repeat_interleave or func is torch.Tensor.repeat_interleave:
        if kwargs.get("output_size") is not None or len(args) > 3:  # (output_size given: no read)
            return None
        alone = args[0] if func is torch.repeat_interleave and len(args) == 1 else None  # (repeats alone)
        if isinstance(kwargs.get("repeats", args[1] if len(args) > 1 else alone), torch.Tensor):
            return f"{'torch' if func is torch.repeat_interleave else 'Tensor'}.repeat_interleave without output_size"
    return None


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _host_read(func, args, kwargs)
        if op is not None and (frame := _megamoe_caller(sys._getframe(1))) is not None:
            path, line = frame.f_code.co_filename, frame.f_lineno
            where = f"{os.path.relpath(path, os.path.dirname(_PKG_DIR.rstrip(os.sep)))}:{line}"
            if not path.startswith(_PKG_DIR):  # (code run in a megamoe module's namespace from elsewhere)
                where += f" (module {frame.f_globals.get('__name__')})"
            raise HostSyncError(f"{op} reads tensor data on the host (a host-device sync on a GPU) at {where} "
                                f"in {frame.f_code.co_name}: {linecache.getline(path, line).strip()}")
        return func(*args, **kwargs)


_active: list[_Mode] = []  # the guards entered and not yet left, innermost last


def _install_backward_wrapper() -> None:
    """Wrap ``BackwardCFunction.apply`` / ``apply_boxed`` once (see the module docstring)."""
    from torch.autograd.function import BackwardCFunction

    for name in ("apply", "apply_boxed"):
        if (orig := getattr(BackwardCFunction, name, None)) is None or getattr(orig, "_megamoe_guarded", False):
            continue

        def wrapped(self, *args, _orig=orig):
            mode = _active[-1] if _active else None
            skip = mode is None or any(m is mode for m in torch.overrides._get_current_function_mode_stack())
            with contextlib.nullcontext() if skip else mode:  # skip: no guard, or its mode is on the stack already
                return _orig(self, *args)

        wrapped._megamoe_guarded = True
        wrapped.__doc__ = orig.__doc__
        setattr(BackwardCFunction, name, wrapped)


@contextlib.contextmanager
def no_host_reads():
    """Raise :class:`HostSyncError` at any host read of tensor data by megamoe code inside the block."""
    _install_backward_wrapper()
    mode = _Mode()
    _active.append(mode)
    try:
        with mode:
            yield
    finally:
        _active.remove(mode)
