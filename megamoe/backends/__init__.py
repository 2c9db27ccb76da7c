"""Layer backends: one interface, selected by name; never a silent fallback.

    backend(x [T, H], topk_idx [T, k] int64, topk_w [T, k] float32, w13 [E_l, 2I, H], w2 [E_l, H, I]) -> y [T, H]

differentiable w.r.t. x, topk_w, w13 and w2 (gpt_oss experts: also ``b13=`` [E_l, 2I], ``b2=`` [E_l, H]); built
once per :class:`megamoe.MoE` (``make_backend``), so it may own workspaces for the module's lifetime. What ``torch``,
``split`` and ``fused`` are: docs/design.md, "Backends, one interface"; their options: README's table.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megamoe.layer import MoE

# name -> (module, class). A backend whose module is missing is "not built" and selecting it raises.
_REGISTRY = {"torch": ("megamoe.backends.torch_a2a", "TorchBackend"),
             "split": ("megamoe.backends.split", "SplitBackend"), "fused": ("megamoe.backends.fused", "FusedBackend")}


def parse_backend(spec: str) -> tuple[str, dict]:
    """``"split:comm_sms=24:presum_combine=1"`` -> ("split", {"comm_sms": 24, "presum_combine": 1}); values
    parse as true/false, int, float or string (a flag given as 1 / 0 acts as True / False)."""
    name, *opts = spec.split(":")
    options = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise ValueError(f"backend option {opt!r} in {spec!r} is not key=value")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
            continue
        for parse in (int, float, str):  # the first that takes the value
            with contextlib.suppress(ValueError):
                options[key] = parse(value)
                break
    return name, options


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here; the message says why. megamoe never falls back silently."""


def _load(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise BackendUnavailable(f"backend {name!r} is not built in this version of megamoe") from None
        raise
    return getattr(mod, cls)


def why_unavailable(name: str, device) -> str | None:
    """None if backend ``name`` can run on ``device``, else the reason."""
    try:
        cls = _load(name)
    except BackendUnavailable as exc:
        return str(exc)
    return cls.why_unavailable(device)


def available_backends(device="cpu") -> list[str]:
    """Names of the backends that can run on ``device``."""
    return [name for name in _REGISTRY if why_unavailable(name, device) is None]


def make_backend(name: str, moe: MoE, **options):
    """Build backend ``name`` for ``moe``; raises :class:`BackendUnavailable` (never falls back)."""
    cls = _load(name)
    if (reason := cls.why_unavailable(moe.device)) is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run on {moe.device}: {reason}")
    known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "moe")]
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"backend {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(known) or 'none'}")
    return cls(moe, **options)
