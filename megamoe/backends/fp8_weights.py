"""FP8 weight copies for backend ``split`` with ``fp8=1``: w13 and w2 in both orientations (forward GEMM
and dgrad) with 128x128 block scales, requantised only when a weight changes, or kept current by the optimizer
(``MasterAdamW.maintain_fp8``). A backend mixes in :class:`Fp8WeightCache`, sets ``name`` and ``moe`` and calls
``_init_fp8_cache(fp8, device)`` in its constructor.
"""

from __future__ import annotations

import torch

from megamoe.experts import quantize_weight, quantize_weight_both
from megamoe.kernels.fp8_quant import Fp8Weight, weight_key


class Fp8WeightCache:
    """fp8_weights / fp8_copies / invalidate_fp8_weights of an FP8 backend (see the module docstring)."""

    name: str
    fp8: bool
    _fp8_copies: dict[str, Fp8Weight]
    _fp8_handed_out: bool

    def _init_fp8_cache(self, fp8: bool, device: torch.device) -> None:
        """Check ``fp8`` against the device (FP8 tensor cores on CUDA) and set up the (empty) copies."""
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"backend '{self.name}' with fp8=1 needs FP8 tensor cores (compute capability >= 8.9, "
                             f"e.g. H100/H200/L40); {torch.cuda.get_device_name(device)} has "
                             f"{torch.cuda.get_device_capability(device)}")
        self.fp8 = bool(fp8)
        self._fp8_copies = {}  # fp8_copies(): allocated on first use
        self._fp8_handed_out = False  # fp8_copies() was called: a capture no longer frees the copies

    def fp8_weight_bytes(self) -> int:
        """Device bytes of the kept copies: per weight q and q^T (1 byte per element each) and their fp32 scales."""
        return sum(2 * w.numel() + 2 * 4 * w.shape[0] * -(-w.shape[1] // 128) * -(-w.shape[2] // 128)
                   for w in (self.moe.w13, self.moe.w2))

    def fp8_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(q13, s13, q13t, s13t, q2, s2, q2t, s2t): w13 and w2 quantised in both orientations.

        The copies live in per-layer buffers (:meth:`fp8_copies`) requantised in place only when the key (version
        counter, storage pointer, shape, dtype, device) changes, so a training step quantises each weight once and
        evaluation not at all. Writes the version counter misses (``param.data``, collectives into the parameter,
        custom kernels, a graph-replayed optimizer step) need :meth:`invalidate_fp8_weights`. Under CUDA-graph
        capture the check cannot run at replay, so the graph quantises every replay (an unmanaged copy is freed)
        unless the copy is *managed* (kept by the optimizer or :meth:`pin_fp8_weights`): then it is read as it is,
        and a stale one raises at capture. Inference-mode tensors (no version counter) are quantised fresh; a fresh
        quantisation with autograd off makes only the forward orientation (the t entries None)."""
        capturing = False
        if w13.is_cuda:
            with torch.cuda.device(w13.device):  # the current stream of w13's device, not of the current device
                capturing = torch.cuda.is_current_stream_capturing()

        fresh = lambda w: quantize_weight_both(w) if torch.is_grad_enabled() else (*quantize_weight(w), None, None)
        if w13.is_inference() or w2.is_inference():
            return (*fresh(w13), *fresh(w2))
        out = []
        for name, w in (("w13", w13), ("w2", w2)):
            copy = self._fp8_copies.get(name)
            key = weight_key(w)
            if copy is not None and copy.key is not None and copy.key[1:] != key[1:]:
                # another tensor, shape or device: never overwrite buffers an earlier call may still hold for its
                # backward, nor the optimizer's copy of its own parameter
                if copy.managed:
                    out.extend(fresh(w))
                    continue
                del self._fp8_copies[name]
                copy = None
            if capturing and (copy is None or not copy.managed):
                # every replay quantises the weight as it is then; the unmanaged copy, which the graph never reads, is
                # freed unless fp8_copies() handed it out
                if not self._fp8_handed_out:
                    self._fp8_copies.pop(name, None)
                out.extend(fresh(w))
                continue
            if copy is None:
                copy = self._fp8_copies[name] = Fp8Weight.empty_like(w)
            if capturing:  # a managed copy, read by every replay as the optimizer keeps it
                if copy.key != key:
                    raise RuntimeError(
                        f"{self.name} backend: the optimizer-kept FP8 copy of {name} is stale at CUDA-graph capture "
                        "(the weight was written outside the optimizer since its last step, e.g. by load_state_dict or "
                        "through .data); call opt.refresh_fp8() or moe.backend.invalidate_fp8_weights() first")
            elif copy.key != key:  # in place: autograd refuses a pending backward that saved the changed weight
                quantize_weight_both(w.detach(), out=copy)
                copy.key = key
            out.extend(copy.tensors())
        return tuple(out)

    def fp8_copies(self) -> list[tuple[torch.nn.Parameter, Fp8Weight]]:
        """[(w13, its Fp8Weight), (w2, its Fp8Weight)], allocated on first use and never moved (``fp8`` only). Hand
        them to the optimizer (``for p, c in moe.backend.fp8_copies(): opt.maintain_fp8(p, c)``) and the layer never
        quantises its weights itself, in a CUDA graph either."""
        if not self.fp8:
            raise ValueError("fp8_copies: the layer keeps FP8 weight copies only with fp8=1")
        self._fp8_handed_out = True  # from now on a capture keeps them (their holder may hand them to an optimizer)
        for name in ("w13", "w2"):
            if name not in self._fp8_copies:
                self._fp8_copies[name] = Fp8Weight.empty_like(getattr(self.moe, name))
        return [(self.moe.w13, self._fp8_copies["w13"]), (self.moe.w2, self._fp8_copies["w2"])]

    def pin_fp8_weights(self) -> None:
        """Quantise the weights into the FP8 copies now and mark them managed without an optimizer, so graph replays
        read them as they are (inference, benchmarks on fixed weights). Eager calls still requantise a changed weight;
        before replaying after a change call :meth:`invalidate_fp8_weights`. Outside capture; ``fp8`` only."""
        for _, copy in self.fp8_copies():
            copy.managed = True
        self.invalidate_fp8_weights()  # which requantises the managed copies now

    def invalidate_fp8_weights(self) -> None:
        """After writes the version counter misses: mark unmanaged copies stale (the next eager call requantises)
        and requantise managed ones now. Outside CUDA-graph capture."""
        for name, copy in self._fp8_copies.items():
            if copy.managed:
                w = getattr(self.moe, name)
                quantize_weight_both(w.detach(), out=copy)
                copy.key = weight_key(w)
            else:
                copy.key = None
