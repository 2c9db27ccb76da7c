"""AdamW with float32 master weights in one fused pass per parameter (what `megamoe train` steps with).

torch's recipe (upcast bf16 grads, fused AdamW on float32 masters, copy down) moves ~46 bytes per parameter
through HBM; one Triton kernel per parameter reads grad, master and moments and writes master, moments and the
bf16 parameter: 28 bytes, ~1.9x faster (benchmarks/adamw_bench.py, docs/performance.md).

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, ``eps`` outside the root) plus
an optional per-set gradient multiplier, a device scalar (clip coefficient, 1/W for experts) applied as the grad is
read, so clipping needs no extra pass and no host sync. float32 parameters are their own masters; weight decay
applies to parameters of 2+ dims. CPU tensors use torch ops (``impl="torch"``) or the kernel under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from megamoe.kernels import interpreter
from megamoe.kernels.fp8_quant import Fp8Weight, quantize_weight_both, quantize_weight_ref, weight_key

interpreter.apply()  # under TRITON_INTERPRET=1: bf16 stores round to nearest, as on the GPU

__all__ = ["MasterAdamW"]

FORMAT = "megamoe.optim.MasterAdamW/1"
_BLOCK = 1024  # with 4 warps: 4.19 TB/s on an H200, a little faster than 4096 with 8 warps
_WARPS = 4


@triton.jit
def _bf16_stochastic(x, r):
    """float32 -> bfloat16, rounded up in magnitude with probability (dropped low 16 bits) / 2^16 (r: uint32
    random bits): unbiased, so increments far below a bf16 ulp survive on average. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (r & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)


@triton.jit(do_not_specialize=["seed"])  # a new seed every step: no recompile when it happens to be 1 or 16k
def _adamw_kernel(p_ptr, g_ptr, x_ptr, m_ptr, v_ptr, mult_ptr, n,
                  decay, beta1, beta2, step_size, inv_sqrt_bc2, eps, seed,
                  HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, MOM_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(n, BLOCK),): one BLOCK of the flat parameter. x = master (HAS_MASTER) or the float32 parameter;
    g = grad (* mult); x *= decay (1 - lr * wd); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    x -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps); stores m, v, master and parameter (x rounded to its dtype).
    MOM_BF16: m, v stochastically rounded with Philox bits of (seed, offset)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_MULT:
        g = g * tl.load(mult_ptr)
    if HAS_MASTER:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        x = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = x * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    x = x - step_size * m / (tl.sqrt(v) * inv_sqrt_bc2 + eps)
    if MOM_BF16:
        r_m, r_v, _, _ = tl.randint4x(seed, offs)
        tl.store(m_ptr + offs, _bf16_stochastic(m, r_m), mask=mask)
        tl.store(v_ptr + offs, _bf16_stochastic(v, r_v), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    pv = x.to(p_ptr.dtype.element_ty)
    if HAS_MASTER:
        tl.store(x_ptr + offs, x, mask=mask)
    tl.store(p_ptr + offs, pv, mask=mask)


def _bf16_stochastic_torch(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The torch-ops twin of _bf16_stochastic (its own random bits: same distribution, not the same values)."""
    r = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32, device=gen.device)
    bits = x.contiguous().view(torch.int32)
    # magnitude rounding in the int32 view: only a NaN payload could carry into the sign bit (NaN is kept below)
    rounded = ((bits + r) & ~0xFFFF).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


@dataclass
class _Slot:
    param: torch.nn.Parameter
    master: torch.Tensor        # the parameter itself when it is float32
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    weight_decay: float
    index: int                  # position among all parameters: with the step, the seed of its stochastic rounding
    step: int = 0               # per parameter, as torch's AdamW (a parameter without grad does not advance)
    fp8: Fp8Weight | None = None  # FP8 copies refreshed with every update (maintain_fp8)


class MasterAdamW:
    """AdamW over sets of parameters, each set with its own gradient multiplier per step.

    ``param_sets``: lists of contiguous float32 / bfloat16 / float16 parameters; lower-precision ones get float32
    masters. ``impl``: None (Triton for CUDA tensors, else torch ops), "triton" or "torch". ``lr`` is read every
    step. ``moments_dtype`` torch.bfloat16 (DeepSeek-V3's recipe) moves 20 instead of 28 bytes per step and keeps
    4 fewer bytes of state; the moments are rounded stochastically, since with beta2 = 0.999 v's per-step change is
    below half a bf16 ulp and round-to-nearest would freeze it. The random bits depend on (parameter, step) only,
    so resumed runs are bitwise reproducible (the kernel and torch ops draw different bits).
    """

    def __init__(self, param_sets: list[list[torch.Tensor]], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, impl: str | None = None,
                 moments_dtype: torch.dtype = torch.float32):
        if impl not in (None, "triton", "torch"):
            raise ValueError(f"MasterAdamW: impl must be None, 'triton' or 'torch', got {impl!r}")
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"MasterAdamW: moments_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{moments_dtype!r}")
        self.moments_dtype = moments_dtype
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0) or eps <= 0 or lr < 0 or weight_decay < 0:
            raise ValueError(f"MasterAdamW: need 0 <= betas < 1, eps > 0, lr >= 0, weight_decay >= 0; got "
                             f"betas={betas}, eps={eps}, lr={lr}, weight_decay={weight_decay}")
        self.lr, self.betas, self.eps, self.impl = lr, betas, eps, impl
        self.block, self.num_warps = _BLOCK, _WARPS  # the kernel's elements per program and warps (tuning)
        seen: set[int] = set()
        self.sets: list[list[_Slot]] = []
        for params in param_sets:
            slots = []
            for p in params:
                if id(p) in seen:
                    raise ValueError("MasterAdamW: a parameter appears twice in param_sets")
                seen.add(id(p))
                if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"MasterAdamW: parameters must be float32, bfloat16 or float16, got {p.dtype}")
                if not p.is_contiguous():
                    raise ValueError(f"MasterAdamW: parameters must be contiguous, got shape {tuple(p.shape)} with "
                                     f"strides {p.stride()}")
                with torch.no_grad():
                    master = p if p.dtype == torch.float32 else p.detach().float().clone()
                slots.append(_Slot(p, master, torch.zeros_like(master, dtype=moments_dtype),
                                   torch.zeros_like(master, dtype=moments_dtype),
                                   weight_decay if p.dim() >= 2 else 0.0, index=len(seen) - 1))
            self.sets.append(slots)

    def masters(self) -> list[torch.Tensor]:
        return [s.master for slots in self.sets for s in slots]

    @torch.no_grad()
    def step(self, multipliers: list[torch.Tensor | None] | None = None) -> None:
        """One update of every parameter that has a grad; ``multipliers[i]`` (a float32 scalar tensor on the
        parameters' device, or None) multiplies set i's grads as they are read. Grads are left as they were."""
        mults = multipliers if multipliers is not None else [None] * len(self.sets)
        if len(mults) != len(self.sets):
            raise ValueError(f"MasterAdamW.step: {len(mults)} multipliers for {len(self.sets)} parameter sets")
        b1, b2 = self.betas
        for slots, mult in zip(self.sets, mults, strict=True):
            for s in slots:
                g = s.param.grad
                if g is None:
                    continue
                if g.shape != s.param.shape:
                    raise ValueError(f"MasterAdamW.step: grad shape {tuple(g.shape)} != parameter shape "
                                     f"{tuple(s.param.shape)}")
                s.step += 1
                bc1 = 1.0 - b1 ** s.step
                bc2 = 1.0 - b2 ** s.step
                decay = 1.0 - self.lr * s.weight_decay
                step_size = self.lr / bc1
                if self._use_kernel(s):
                    n = s.param.numel()
                    if n == 0:
                        continue
                    has_master = s.master is not s.param
                    args = (s.param, g.contiguous(), s.master if has_master else s.param, s.exp_avg, s.exp_avg_sq,
                            mult if mult is not None else s.exp_avg)
                    hyper = (decay, b1, b2, step_size, 1.0 / math.sqrt(bc2), self.eps, self._seed(s))
                    flags = dict(HAS_MASTER=has_master, HAS_MULT=mult is not None,
                                 MOM_BF16=self.moments_dtype == torch.bfloat16)
                    _adamw_kernel[(triton.cdiv(n, self.block),)](*args, n, *hyper, **flags, BLOCK=self.block,
                                                                 num_warps=self.num_warps)
                    # the kernel wrote the parameter behind autograd's back: bump its version as an in-place op
                    # would, so saved-tensor checks and version-keyed caches see the change
                    increment_version(s.param)
                else:
                    gf = g.float() if mult is None else g.float() * mult
                    s.master.mul_(decay)
                    m = s.exp_avg.float().mul_(b1).add_(gf, alpha=1.0 - b1)
                    v = s.exp_avg_sq.float().mul_(b2).addcmul_(gf, gf, value=1.0 - b2)
                    denom = v.sqrt().mul_(1.0 / math.sqrt(bc2)).add_(self.eps)
                    s.master.addcdiv_(m, denom, value=-step_size)
                    if self.moments_dtype == torch.bfloat16:
                        gen = torch.Generator(device=m.device).manual_seed(self._seed(s))
                        m, v = _bf16_stochastic_torch(m, gen), _bf16_stochastic_torch(v, gen)
                    s.exp_avg.copy_(m)
                    s.exp_avg_sq.copy_(v)
                    if s.master is not s.param:
                        s.param.copy_(s.master)
                if s.fp8 is not None:  # both orientations from the new parameter
                    self._refresh_fp8(s)

    def maintain_fp8(self, param: torch.Tensor, fp8: Fp8Weight) -> None:
        """Keep ``fp8`` (an Fp8Weight of ``param`` [E_l, N, K], both orientations) current: filled now and after
        every step that updates ``param``, and marked ``managed``, so an FP8 backend (``backend.fp8_copies()``)
        reads it without quantising, which a CUDA graph would otherwise redo every replay.
        Writes that bypass the optimizer (``copy_``, ``param.data``, loading the model) leave it stale for graph
        replays until the next step, load_state_dict or :meth:`refresh_fp8` (eager calls requantise).
        Managed copies must keep being maintained by whatever optimizer steps ``param``."""
        slot = next((x for slots in self.sets for x in slots if x.param is param), None)
        if slot is None:
            raise ValueError("MasterAdamW.maintain_fp8: the parameter is not one of this optimizer's")
        if param.dim() != 3:
            raise ValueError(f"MasterAdamW.maintain_fp8: the parameter must be a 3-D expert weight [E_l, N, K], got "
                             f"{tuple(param.shape)}")
        if not isinstance(fp8, Fp8Weight):
            raise TypeError(f"MasterAdamW.maintain_fp8: fp8 must be a megamoe Fp8Weight, got {type(fp8).__name__}")
        fp8.check(param, "MasterAdamW.maintain_fp8")
        if fp8.pow2_scale not in (True, False):
            raise ValueError(f"MasterAdamW.maintain_fp8: fp8.pow2_scale must be a bool, got {fp8.pow2_scale!r}")
        slot.fp8 = fp8
        try:  # filled before it is marked managed: a failure leaves neither attached nor trusted
            self._refresh_fp8(slot)
        except Exception:
            slot.fp8 = None
            raise
        fp8.managed = True

    @torch.no_grad()
    def reload_masters(self, params: list[torch.Tensor]) -> None:
        """Reset the masters of ``params`` from their current values after something rewrote them (DDP's broadcast
        when DDP is built after the optimizer). Moments and steps are kept."""
        slots = {id(x.param): x for sl in self.sets for x in sl}
        for p in params:
            s = slots.get(id(p))
            if s is None:
                raise ValueError("MasterAdamW.reload_masters: a parameter is not one of this optimizer's")
            if s.master is not s.param:
                s.master.copy_(s.param)
            if s.fp8 is not None:
                self._refresh_fp8(s)

    @torch.no_grad()
    def refresh_fp8(self) -> None:
        """Requantise every maintained FP8 copy from its parameter (after writes that bypassed the optimizer)."""
        for slots in self.sets:
            for s in slots:
                if s.fp8 is not None:
                    self._refresh_fp8(s)

    def _use_kernel(self, s: _Slot) -> bool:
        return self.impl == "triton" or (self.impl is None and s.param.is_cuda)

    @torch.no_grad()
    def _refresh_fp8(self, s: _Slot) -> None:
        p, c = s.param.detach(), s.fp8
        if self._use_kernel(s):
            quantize_weight_both(p, pow2_scale=c.pow2_scale, out=c)
        else:  # the torch twins (bitwise the kernels' values)
            q, sc = quantize_weight_ref(p, pow2_scale=c.pow2_scale)
            qt, sct = quantize_weight_ref(p.transpose(1, 2).contiguous(), pow2_scale=c.pow2_scale)
            for dst, src in zip(c.tensors(), (q, sc, qt, sct), strict=True):
                dst.copy_(src)
        c.key = weight_key(s.param)

    @staticmethod
    def _seed(s: _Slot) -> int:
        """The stochastic rounding's seed of parameter s at its current step (distinct per parameter and step)."""
        return (s.index * 1_000_003 + s.step) % (1 << 62)

    def zero_grad(self) -> None:
        for slots in self.sets:
            for s in slots:
                s.param.grad = None

    def state_dict(self) -> dict:
        """References to the live masters and moments (no device copy, as torch's optimizers): save it before
        the next step."""
        return {"format": FORMAT, "lr": self.lr, "betas": self.betas, "eps": self.eps,
                "sets": [[{"step": s.step, "master": s.master.detach(), "exp_avg": s.exp_avg,
                           "exp_avg_sq": s.exp_avg_sq, "weight_decay": s.weight_decay} for s in slots]
                         for slots in self.sets]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore steps, masters and moments (the parameters are set from the masters)."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"optimizer state is not {FORMAT} (written by an older megamoe train, or by another "
                             "optimizer): start the run afresh")
        sets = state["sets"]
        if [len(x) for x in sets] != [len(x) for x in self.sets]:
            raise ValueError(f"optimizer state has parameter sets of sizes {[len(x) for x in sets]}, this optimizer "
                             f"{[len(x) for x in self.sets]}")
        pairs = [(s, d) for sl, ds in zip(self.sets, sets, strict=True) for s, d in zip(sl, ds, strict=True)]
        for s, d in pairs:  # every shape checked before anything is overwritten
            if tuple(d["master"].shape) != tuple(s.master.shape):
                raise ValueError(f"optimizer state: a parameter of shape {tuple(d['master'].shape)} where this "
                                 f"model has {tuple(s.master.shape)}")
        for s, d in pairs:
            s.step = int(d["step"])
            s.weight_decay = float(d["weight_decay"])
            s.exp_avg.copy_(d["exp_avg"])
            s.exp_avg_sq.copy_(d["exp_avg_sq"])
            s.master.copy_(d["master"])
            if s.master is not s.param:
                s.param.copy_(s.master)
            if s.fp8 is not None:
                self._refresh_fp8(s)
        self.lr, self.betas, self.eps = state["lr"], tuple(state["betas"]), state["eps"]
