"""Triton interpreter fix-ups, applied only when TRITON_INTERPRET=1 (the CPU emulation).

Correctness (triton 3.6): the interpreter converts float32 -> bfloat16 by truncation (also in ``.to`` and stores),
where the GPU rounds to nearest even; the doubled error pushes chained bf16 results past the CPU tests' tolerance,
so the converter rounds to nearest even. bf16 -> fp32 is the exact shift (upstream drops a bit of subnormals).
With numpy >= 2.3 ``int(np.array([3]))`` raises, which breaks ``range(n)`` with a runtime n: ``tensor.__index__``
reads the single element.

Speed, results unchanged: skip re-patching ``triton.language`` on every jit-helper call inside a launch that has
patched it (~30% of the interpreter's time); no int64 overflow check (``sanitize_overflow``) for a device_assert the
interpreter drops (~30% of the rest); per-op frontend types computed lazily (``_lazy_frontend_types``, ~15%); the
``_get_np_dtype`` table built once (``_np_dtype_table``, ~8%). tests/test_grouped_gemm.py compares each patch with
the function it replaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types

import numpy as np
import torch

_applied = False


def row_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer of rows that kernels write only in part (received rows, grouped rows: the rows past offs[E_l]):
    uninitialised on a GPU, where tiles loaded past the written rows only feed outputs that the masked stores drop;
    zeroed on the CPU, where the interpreter computes those tiles in numpy, which warns (overflow, invalid value) on
    the garbage of uninitialised memory."""
    device = torch.device(device)
    return (torch.zeros if device.type == "cpu" else torch.empty)(shape, dtype=dtype, device=device)


def _f32_to_bf16_rne(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.ascontiguousarray(data, dtype=np.float32))
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)  # stay a quiet NaN
    return out


class _Lazy:
    """A non-data descriptor: the attribute ``name`` is computed by ``make(obj)`` on its first read and then kept in
    the instance's ``__dict__`` (which also takes any later assignment, as a plain attribute would)."""

    def __init__(self, name: str, make) -> None:
        self.name, self.make = name, make

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        try:
            v = self.make(obj)
        except AttributeError as exc:  # (as TypeError: an AttributeError would fall into tl.tuple.__getattr__)
            raise TypeError(f"{type(obj).__name__}.{self.name}: {exc}") from exc
        obj.__dict__[self.name] = v
        return v


def _lazy_frontend_types(core) -> None:
    """Every interpreted op eagerly builds a ``block_type``, its shape's ``tl.tuple`` / ``tuple_type`` and their
    ``name`` strings, almost never read. Each is computed on its first read from the values it was built with
    (copied where a caller could mutate them), so reads give what the eager code gave (a tuple of values without a
    type now fails at its first ``type`` read, as a TypeError, instead of at construction)."""
    tup, tup_type, block_type = core.tuple, core.tuple_type, core.block_type
    type_for = core._type_for_tuple_values

    def tuple_init(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, tup_type):
            self.type = type
        elif type is not None:  # make_template in ASTFunction.deserialize may pass a list / tuple
            self.type = tup_type(type)
        else:  # (computed from the values as they were: a copy, since _setitem and callers may change the list)
            self.__dict__["_type_src"] = list(self.values)

    def tuple_type_of(self):
        return type_for(self.__dict__["_type_src"])

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)
        self.__dict__["_name_src"] = (list(self.fields), list(self.types))

    def tuple_type_name(self):
        fields, types = self.__dict__.pop("_name_src")
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(fields, types, strict=False)]) + "]"

    block_init = block_type.__init__

    def block_type_init(self, element_ty, shape):
        # (the upstream body, the name left to its first read: shape and element_ty are not reassigned after init)
        self.element_ty = element_ty
        assert isinstance(shape, (list, tup))
        self.shape = tup(core._unwrap_shape(shape))
        if not self.shape:
            raise TypeError("0d block_type is forbidden")
        self.numel = core.validate_block_shape(self.shape)

    def block_type_name(self):
        return f"<{self.shape}, {self.element_ty}>"

    if getattr(block_init, "__code__", None) is None or "name" not in block_init.__code__.co_names:
        return  # (a triton whose block_type does not look like 3.6's: left as it is)
    tup.__init__ = tuple_init
    tup.type = _Lazy("type", tuple_type_of)
    tup_type.__init__ = tuple_type_init
    tup_type.name = _Lazy("name", tuple_type_name)
    block_type.__init__ = block_type_init
    block_type.name = _Lazy("name", block_type_name)


def _np_dtype_table(interpreter, tl) -> None:
    """``_get_np_dtype`` (most interpreted ops) builds its triton -> numpy dict on every call. Build it once from the
    original's own answers, keyed by dtype name; pointers, blocks and unknown types behave as before."""
    orig = interpreter._get_np_dtype
    table = {}
    for v in vars(tl).values():
        if isinstance(v, tl.dtype) and not isinstance(v, (tl.pointer_type, tl.block_type)):
            with contextlib.suppress(KeyError):
                table[v.name] = orig(v)
    u64 = np.dtype(np.uint64)
    ptr, blk = tl.pointer_type, tl.block_type

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, blk):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, ptr):
            return u64
        np_dtype = table.get(getattr(tt_dtype, "name", None))
        return np_dtype if np_dtype is not None else orig(tt_dtype)  # (orig raises for what it does not know)

    get_np_dtype.upstream = orig  # (tests compare the two)
    interpreter._get_np_dtype = get_np_dtype


def apply() -> None:
    """Patch the interpreter once (no-op unless TRITON_INTERPRET=1)."""
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _f32_to_bf16_rne(np.asarray(input).reshape(-1)).reshape(np.shape(input))
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:  # exact: bf16 is f32's upper half
            return np.asarray(input).astype(np.uint32) << np.uint32(16)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert.upstream = original  # (tests compare the two)
    interpreter._convert_float = convert

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_with_index

    patch_lang = interpreter._patch_lang
    active: list[frozenset] = []  # the modules the running launch has patched (empty: no launch running)
    kept = types.SimpleNamespace(restore=lambda: None)  # a helper call's scope: upstream never restores those either
    seen: dict = {}  # fn -> the language modules its globals hold (the interpreter's _patch_lang test)

    def patch_lang_once(fn):
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if active and langs <= active[0]:  # a helper inside a launch whose patch covers its modules
            return kept
        scope = patch_lang(fn)
        if active:  # a helper that sees another module: patched as upstream does (kept until the launch ends)
            active[0] = active[0] | langs
            return scope
        active.append(langs)  # a launch (GridExecutor): its restore() ends the window
        restore = scope.restore

        def restore_and_close() -> None:
            active.clear()
            restore()

        scope.restore = restore_and_close
        return scope

    interpreter._patch_lang = patch_lang_once
    _lazy_frontend_types(tl.core)
    _np_dtype_table(interpreter, tl)
    # (speed only: skipped where a later triton has no such options)
    b = getattr(interpreter, "interpreter_builder", None)
    opts = getattr(b, "options", None)
    if dataclasses.is_dataclass(opts) and hasattr(opts, "sanitize_overflow") and not getattr(opts, "debug", True):
        b.options = dataclasses.replace(opts, sanitize_overflow=False)  # (device_assert returns at once without debug)
    _applied = True
