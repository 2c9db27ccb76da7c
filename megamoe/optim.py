"""AdamW with float32 master weights in one fused pass per parameter (what `megamoe train` steps with).

Mixed-precision training keeps bf16 parameters for the forward/backward and float32 copies ("master weights")
plus float32 Adam moments for the update. Done with torch's own pieces (upcast the bf16 grads into fp32 grads of
the masters, fused AdamW on the masters, which with ``grad_scale`` also writes the scaled grads back, then copy the
masters down into the bf16 parameters) an update moves ~46 bytes per parameter through HBM; on the GPU one Triton
kernel per parameter reads the bf16 grad, master, exp_avg and exp_avg_sq and writes master, exp_avg, exp_avg_sq
and the bf16 parameter: 28 bytes. Measured (2026-11-30, H200): 8.08 ms for the 1.21 G expert parameters per GPU
of `megamoe train`'s model at EP = 2 (4.19 TB/s; torch's recipe 15.6 ms, benchmarks/adamw_bench.py), and the
training step's optimizer phase 18.1 -> 10.1 ms (docs/perf-notes.md).

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, ``eps`` outside the square
root), with two additions: an optional gradient multiplier per parameter set, a device scalar (the clip
coefficient, and for expert-parallel experts also 1/W), applied to the grad as it is read so clipping needs no
pass of its own and no host sync; and float32 masters only for parameters stored in lower precision (a float32
parameter is its own master). Weight decay applies to parameters of 2 or more dims. On CPU tensors the same
update runs as torch ops (``impl="torch"``); the Triton kernel also runs there under TRITON_INTERPRET=1.

``moments_dtype=torch.bfloat16`` keeps both moments in bf16 (DeepSeek-V3's recipe), stochastically rounded: 20
bytes per bf16 parameter per step instead of 28, and 4 bytes less optimizer state per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from megamoe import _interp

_interp.apply()  # under TRITON_INTERPRET=1: bf16 stores round to nearest, as on the GPU

__all__ = ["MasterAdamW"]

FORMAT = "megamoe.optim.MasterAdamW/1"
_BLOCK = 1024  # with 4 warps: 8.08 ms for 1.21 G bf16 parameters on one H200 (4.19 TB/s), 4096 / 8 warps 8.24 ms
_WARPS = 4


@triton.jit
def _bf16_stochastic(x, r):
    """float32 -> bfloat16 rounded up in magnitude with probability (dropped low 16 bits) / 2^16: unbiased, so
    increments far below a bf16 ulp (v's (1 - beta2) g^2 against v) survive on average instead of being rounded
    away; r: uint32 random bits. NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + (r & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)


@triton.jit(do_not_specialize=["seed"])  # a new seed every step: no recompile when it happens to be 1 or 16k
def _adamw_kernel(p_ptr, g_ptr, x_ptr, m_ptr, v_ptr, mult_ptr, n,
                  decay, beta1, beta2, step_size, inv_sqrt_bc2, eps, seed,
                  HAS_MASTER: tl.constexpr, HAS_MULT: tl.constexpr, MOM_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK of elements: x = master (HAS_MASTER) or the float32 parameter itself; g = grad (* mult);
    x *= decay (1 - lr * wd); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    x -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps); the parameter gets x rounded to its dtype.
    MOM_BF16: m and v are stored as bfloat16, stochastically rounded with Philox bits keyed on (seed, element)."""
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
    if HAS_MASTER:
        tl.store(x_ptr + offs, x, mask=mask)
        tl.store(p_ptr + offs, x.to(p_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr + offs, x, mask=mask)


def _bf16_stochastic_torch(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The torch-ops twin of _bf16_stochastic (its own random bits: same distribution, not the same values)."""
    r = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32, device=gen.device)
    bits = x.contiguous().view(torch.int32)
    # magnitude rounding in the int32 view: the sign bit is untouched unless the carry overflows it, which
    # only a NaN payload could do (NaN is kept below)
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


class MasterAdamW:
    """AdamW over sets of parameters, each set with its own gradient multiplier per step.

    ``param_sets``: lists of contiguous floating-point parameters (float32, bfloat16 or float16); the lower-precision
    ones get float32 masters, initialised from their values. ``impl``: None (the Triton kernel for CUDA tensors,
    torch ops elsewhere), "triton" or "torch". ``lr`` is read at every step (set ``opt.lr`` for a schedule).
    ``moments_dtype``: torch.float32 (default) or torch.bfloat16, the DeepSeek-V3 recipe: both Adam moments kept
    in bf16, 20 instead of 28 bytes per bf16 parameter moved per step and 4 fewer bytes of state. They are rounded
    stochastically (unbiased: with beta2 = 0.999, v's per-step change of 0.1% is below half a bf16 ulp, and round-
    to-nearest would freeze it), with random bits fixed by (parameter, step), so runs and resumed runs are
    bitwise reproducible; the Triton kernel and the torch-ops path draw different bits.
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
                use_kernel = self.impl == "triton" or (self.impl is None and s.param.is_cuda)
                if use_kernel:
                    n = s.param.numel()
                    if n == 0:
                        continue
                    has_master = s.master is not s.param
                    _adamw_kernel[(triton.cdiv(n, self.block),)](
                        s.param, g.contiguous(), s.master if has_master else s.param, s.exp_avg, s.exp_avg_sq,
                        mult if mult is not None else s.exp_avg, n,
                        decay, b1, b2, step_size, 1.0 / math.sqrt(bc2), self.eps, self._seed(s),
                        HAS_MASTER=has_master, HAS_MULT=mult is not None,
                        MOM_BF16=self.moments_dtype == torch.bfloat16, BLOCK=self.block, num_warps=self.num_warps)
                    # the kernel wrote the parameter in place behind autograd's back: bump its version as an
                    # in-place torch op would, so autograd refuses a graph that saved the old value and caches
                    # keyed on versions see the change
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

    @staticmethod
    def _seed(s: _Slot) -> int:
        """The stochastic rounding's seed of parameter s at its current step (distinct per parameter and step)."""
        return (s.index * 1_000_003 + s.step) % (1 << 62)

    def zero_grad(self) -> None:
        for slots in self.sets:
            for s in slots:
                s.param.grad = None

    def state_dict(self) -> dict:
        """References to the live masters and moments, as torch's optimizers return (no copy of ~12 bytes per
        parameter on the device): save it before the next step."""
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
        for slots, saved in zip(self.sets, sets, strict=True):
            for s, d in zip(slots, saved, strict=True):
                if tuple(d["master"].shape) != tuple(s.master.shape):
                    raise ValueError(f"optimizer state: a parameter of shape {tuple(d['master'].shape)} where this "
                                     f"model has {tuple(s.master.shape)}")
        for slots, saved in zip(self.sets, sets, strict=True):
            for s, d in zip(slots, saved, strict=True):
                s.step = int(d["step"])
                s.weight_decay = float(d["weight_decay"])
                s.exp_avg.copy_(d["exp_avg"])
                s.exp_avg_sq.copy_(d["exp_avg_sq"])
                s.master.copy_(d["master"])
                if s.master is not s.param:
                    s.param.copy_(s.master)
        self.lr, self.betas, self.eps = state["lr"], tuple(state["betas"]), state["eps"]
