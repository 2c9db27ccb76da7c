"""The FP8 weight copies of a layer whose GEMMs run on e4m3 operands (backends ``split`` and ``fused`` with
``fp8=1``): both orientations of w13 and w2 (forward GEMM and dgrad) with their 128x128 block scales, kept across
calls and requantised only when a weight changes, or kept current by the optimizer (``MasterAdamW.maintain_fp8``).

A backend mixes in :class:`Fp8WeightCache`, sets ``name`` and ``moe`` (the layer: ``moe.w13``, ``moe.w2``) and
calls ``_init_fp8_cache(fp8, fp8_weight_cache, device)`` in its constructor (it checks them).
"""

from __future__ import annotations

import torch

from megamoe.experts import quantize_weight, quantize_weight_both
from megamoe.kernels.fp8_quant import Fp8Weight, weight_key


def _capturing_on(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (checked on that device, which need not
    be the current one)."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


class Fp8WeightCache:
    """fp8_weights / fp8_copies / invalidate_fp8_weights of an FP8 backend (see the module docstring)."""

    name: str
    fp8: bool
    fp8_weight_cache: bool
    _fp8_copies: dict[str, Fp8Weight]
    _fp8_handed_out: bool

    def _init_fp8_cache(self, fp8: bool, fp8_weight_cache: bool, device: torch.device) -> None:
        """Check the options ``fp8`` and ``fp8_weight_cache`` (flags; FP8 tensor cores on a CUDA ``device``) and set up
        the (empty) copies."""
        for name, flag in (("fp8", fp8), ("fp8_weight_cache", fp8_weight_cache)):
            if flag not in (True, False, 0, 1):
                raise ValueError(f"backend '{self.name}': {name} must be a flag (True/False or 1/0), got {flag!r}")
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"backend '{self.name}' with fp8=1 needs FP8 tensor cores (compute capability >= 8.9, "
                             f"e.g. H100/H200/L40); {torch.cuda.get_device_name(device)} has "
                             f"{torch.cuda.get_device_capability(device)}")
        self.fp8 = bool(fp8)
        self.fp8_weight_cache = bool(fp8_weight_cache)
        self._fp8_copies = {}  # fp8_copies(): allocated on first use
        self._fp8_handed_out = False  # fp8_copies() was called: a capture no longer frees the copies

    def fp8_weight_bytes(self) -> int:
        """Device bytes of the kept copies: per weight q and q^T (1 byte per element each) and their fp32 scales."""
        return sum(2 * w.numel() + 2 * 4 * w.shape[0] * -(-w.shape[1] // 128) * -(-w.shape[2] // 128)
                   for w in (self.moe.w13, self.moe.w2))

    def fp8_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(q13, s13, q13t, s13t, q2, s2, q2t, s2t): w13 and w2 quantised in both orientations (forward GEMM and
        dgrad), one pass per weight (experts.quantize_weight_both).

        With ``fp8_weight_cache`` they live in buffers allocated once per layer (:meth:`fp8_copies`, 2 bytes per
        weight element with the scales) and are requantised in place only when a parameter changes: the key is
        (version counter, storage pointer, shape, dtype, device), and in-place torch ops bump the version (torch's
        optimizers, ``copy_``/``load_state_dict``, megamoe.optim.MasterAdamW), so a training step quantises each
        weight once, and evaluation or repeated calls not at all. Writes the version counter does not see leave
        the copies stale: through ``param.data``, collectives writing into the parameter (``dist.broadcast``,
        ``all_reduce``), custom kernels that do not bump it, an optimizer step replayed from a CUDA graph; after
        those call :meth:`invalidate_fp8_weights`. While a CUDA graph is being captured the host-side check cannot
        run at replay, so a weight is quantised inside the graph (one pass per weight per replay; its unmanaged
        copy is freed then, as the graph never reads it) unless its copy is *managed*: kept current by the
        optimizer (``MasterAdamW.maintain_fp8`` with the pairs of :meth:`fp8_copies`, which refreshes it in its
        step right after updating the weight); a managed copy is read as it is, in a graph and out of one (a
        graphed layer then quantises nothing: with gradient accumulation or evaluation replays, once per update
        instead of once per replay; a managed copy whose key no longer matches its weight at capture raises, since
        every replay would read it). Quantised fresh, without the copies: with
        ``fp8_weight_cache=False`` and for inference-mode tensors (no version counter); then with autograd off
        (torch.no_grad or inference mode) only the forward orientation is made (q13t, s13t, q2t, s2t None)."""
        capturing = w13.is_cuda and _capturing_on(w13.device)

        def fresh(w):
            if torch.is_grad_enabled():
                return quantize_weight_both(w)
            return (*quantize_weight(w), None, None)

        if not self.fp8_weight_cache or w13.is_inference() or w2.is_inference():
            return (*fresh(w13), *fresh(w2))
        out = []
        for name, w in (("w13", w13), ("w2", w2)):
            copy = self._fp8_copies.get(name)
            key = weight_key(w)
            if copy is not None and copy.key is not None and copy.key[1:] != key[1:]:
                # other weights than the copy holds (another tensor, shape or device): never overwrite buffers an
                # earlier call may still hold for its backward, nor the optimizer's copy of its own parameter
                if copy.managed:
                    out.extend(fresh(w))
                    continue
                del self._fp8_copies[name]
                copy = None
            if capturing and (copy is None or not copy.managed):
                # in the graph every replay quantises the weight as it is then; an unmanaged copy, which the graph
                # never reads, is freed (an eager call after the capture allocates it again), unless fp8_copies()
                # has handed it out
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
            elif copy.key != key:  # in place: a pending backward of an earlier call holding these buffers is
                # refused by autograd anyway once this weight changed (w13 / w2 are saved tensors)
                quantize_weight_both(w.detach(), out=copy)
                copy.key = key
            out.extend(copy.tensors())
        return tuple(out)

    def fp8_copies(self) -> list[tuple[torch.nn.Parameter, Fp8Weight]]:
        """[(w13, its Fp8Weight), (w2, its Fp8Weight)]: the layer's FP8 weight buffers (``fp8`` with
        ``fp8_weight_cache``), allocated on first use and never moved. Hand them to the optimizer to keep them
        current in its update pass: ``for p, c in moe.backend.fp8_copies(): opt.maintain_fp8(p, c)``
        (megamoe.optim.MasterAdamW); the layer then never quantises its weights itself, in a CUDA graph either."""
        if not (self.fp8 and self.fp8_weight_cache):
            raise ValueError("fp8_copies: the layer keeps FP8 weight copies only with fp8=1 and fp8_weight_cache=1")
        self._fp8_handed_out = True  # from now on a capture keeps them (their holder may hand them to an optimizer)
        for name in ("w13", "w2"):
            if name not in self._fp8_copies:
                self._fp8_copies[name] = Fp8Weight.empty_like(getattr(self.moe, name))
        return [(self.moe.w13, self._fp8_copies["w13"]), (self.moe.w2, self._fp8_copies["w2"])]

    def pin_fp8_weights(self) -> None:
        """Quantise the layer's weights into its FP8 copies now and mark the copies managed, with no optimizer: the
        layer then reads them as they are, in CUDA-graph replays too (no quantisation per replay), which suits
        inference, evaluation and benchmarks on fixed weights. An eager call still requantises a copy whose weight
        changed (its version counter moved); graph replays cannot check, so after changing the weights call
        :meth:`invalidate_fp8_weights` (which requantises managed copies) before replaying, or capture again (a
        capture with a stale managed copy raises). Outside CUDA-graph capture; ``fp8`` with ``fp8_weight_cache``."""
        for w, copy in self.fp8_copies():
            quantize_weight_both(w.detach(), out=copy)
            copy.key = weight_key(w)
            copy.managed = True

    def invalidate_fp8_weights(self) -> None:
        """After writes the version counter does not see (e.g. through ``param.data``): the layer's own FP8 copies
        are marked stale (the next call outside graph capture requantises into them), the optimizer-kept ones are
        requantised now (graph replays read them as they are). Call it outside CUDA-graph capture."""
        for name, copy in self._fp8_copies.items():
            if copy.managed:
                w = getattr(self.moe, name)
                quantize_weight_both(w.detach(), out=copy)
                copy.key = weight_key(w)
            else:
                copy.key = None
