"""Every Hopper default kernel against its Triton twin, at the shapes of every preset (one H100/H200).

On Hopper (sm_90) megamoe.experts runs Gluon kernels by default (megamoe.experts.choose_config): the warp-specialised
bf16 GEMM (kernels/gluon/bf16.py: GEMM1 + SwiGLU, GEMM2, grouped_gemm with nk weights, the SwiGLU backward), the
warp-specialised weight gradient (gluon/wgrad.py), the warp-specialised FP8 GEMM (gluon/fp8.py: plain and SwiGLU)
and the FP8 SwiGLU backward (gluon/fp8_dswiglu.py); backend fused runs its forward's items in Gluon where they can
run (gluon/fused.py). Everywhere else, and on the CPU under the interpreter, the Triton kernels run: they are the
Gluon kernels' references, and CI never executes a Gluon kernel. Each test here runs one op with its Gluon kernel's
default config (``GemmConfig(kernel="gluon")``, megamoe.experts.default_config), checks that the op's default launch
(no config) is that launch (the same kernel, bitwise the same outputs), and runs the same op with the Triton
kernel's default config (``kernel="triton"``) on the same inputs; both against float64.

Shapes: every preset but tiny at its expert-parallel-4 rank share (E/4 local experts, H, I) with TOKENS * top_k
received rows (what a rank receives on average at EP 4), spread log-normally unevenly over the local experts in
groups of any size (not aligned to the 128-row tiles, nor to 16 rows), with an empty expert and a one-row expert inside
the schedule (where E/4 > 2; mixtral's two local experts both hold rows), then PAD padding rows. Every input's padding
rows hold NaN (a kernel reading them as data makes its output non-finite) and every row output is pre-filled with
SENTINEL (rows past offs[E_l] must keep it; the gate gradient ds, which the op zero-fills, must stay 0 there; a weight
gradient of an expert without rows must be exactly 0).

Checks per output (relative error ||a - ref|| / ||ref|| in float64, over the rows of the groups or the experts' tiles):
  * both kernels within REF_BOUND of the float64 twin, as a whole and per expert (one wrong small group vanishes in the
    global norm); no NaN or inf anywhere (a non-finite value fails every check);
  * the Gluon error at most max(SLACK_RATIO x Triton's, Triton's + SLACK_ABS): the two kernels round the same fp32
    sums of the same products (same k-steps, same scale products), so their errors against float64 are the common
    bf16 rounding of the outputs and differ only where a different accumulation order inside a k-step flips a
    rounding; 1.25x absorbs that where the errors are bf16-sized (~2e-3), + 1e-4 where Triton's error is tiny (the
    fp32 gate gradient ds, ~1e-6: a ratio would demand that the summation order never matters). A lost or misplaced
    tile, k-step or scale moves the error by 1e-2 to 1, far outside either;
  * the two outputs' mutual difference ||gluon - triton|| / ||triton|| below TWIN_BOUND, the bound each kernel's own GPU
    test asserts for the same pair (tests/test_gpu_gemm.py: bf16 ops 1e-3, FP8 ops 3e-4, fp32 outputs 1e-5), or bitwise
    equality where the docs claim it: the fused forward (backends/fused.py: "the same items, order, waits and results as
    the Triton kernel") and the weight gradient (docs/performance.md: "bitwise on the bench shapes"), the latter on
    groups of multiples of 16 rows (the shapes it was measured on). On other group sizes the twins split an expert's
    last partial 32-row chunk differently between the k-step's two k16 wgmmas (Triton: the chunk from its first row, the
    valid rows first; Gluon: the window ending at the expert's end, the valid rows last), with an fp32 rounding in
    between: where more than 16 rows remain they may differ in the last bits, so the realistic groups get the closeness
    bound, and the table says whether they were equal.
A default that is the Triton kernel on a preset's shape (a Gluon limit fails) is skipped with the limit's reason;
the default must then indeed launch Triton and kernel="gluon" raise with that reason, and the default must launch the
Gluon kernel wherever no limit fails.

Every test adds its outputs' rows (op, output, preset, kernel, gluon err, triton err, diff, bitwise) to a table that
is printed at the end of the session (and written as JSON to $MEGAMOE_TWINS_JSON when set):

    pytest -q -m gpu tests/test_gpu_twins.py
    MEGAMOE_TWINS_JSON=twins.json pytest -q -m gpu tests/test_gpu_twins.py

(The table and the JSON hold one pytest process's rows: split across processes, give each its own
$MEGAMOE_TWINS_JSON.)

Runtime on one H200: the GEMMs are ~30 TFLOP in all (the largest, deepseek-v3's and mixtral's GEMM1, 0.5 TFLOP: ~1
ms) and the float64 references ~18 GEMM2-sized products per preset (deepseek-v3: 4.3 TFLOP, ~0.1 s on the FP64 tensor
cores), so the time is compilation: ~25 GEMM specialisations per distinct local expert count (a constexpr of every
grouped GEMM: 32, 64 and 2 experts; qwen3 and gpt-oss share theirs), ~2 s each, and up to 14 megakernels (~10-25 s
each) in one spawned rank (its start, CUDA init and symmetric heap ~20 s). Expected 5-8 minutes with a cold Triton
cache, 1-2 with a warm one.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import megamoe.experts as X
from megamoe.config import PRESETS
from megamoe.kernels.gemm_config import EPI_DSWIGLU, EPI_NONE, EPI_SWIGLU, LAST_COMPILED, GemmConfig

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a CUDA device of compute capability 9.x (the Gluon "
                                                     "kernels are sm_90a code: wgmma, TMA, warp specialisation)")

PRESET_NAMES = [name for name in PRESETS if name != "tiny"]
EP = 4            # the expert-parallel degree whose rank share each preset is checked at
TOKENS = 1024     # tokens per rank; TOKENS * top_k received rows
PAD = 77          # padding rows after the last group: a partial tile of them; R is never a multiple of 16
SENTINEL = 4352.0  # poison of the outputs: finite and exact in bf16, so a missed or an extra write both show
REF_BOUND = 1e-2  # either kernel vs float64 (bf16 outputs: ~2e-3 of rounding; the kernels' own tests' bound)
SLACK_RATIO, SLACK_ABS = 1.25, 1e-4  # Gluon's error <= max(1.25 x Triton's, Triton's + 1e-4): module docstring
TWIN_BOUND = {"bf16": 1e-3, "fp8": 3e-4, "fp32": 1e-5}  # ||gluon - triton|| / ||triton||: module docstring
FUSED_TIMEOUT_S = 1800

#: kernel launched -> its label in the table (gemm_config.LAST_COMPILED records each launch by kernel name)
KERNELS = {"_gluon_bf16_ws_kernel": "gluon/bf16", "_gluon_fp8_ws_kernel": "gluon/fp8",
           "_gluon_fp8_dswiglu_kernel": "gluon/fp8_dswiglu", "_gluon_wgrad_ws_kernel": "gluon/wgrad",
           "_grouped_gemm_kernel": "triton", "_grouped_gemm_fp8_kernel": "triton", "_grouped_wgrad_kernel": "triton"}
#: the Triton twin of each op family
TRITON = {"bf16": "_grouped_gemm_kernel", "fp8": "_grouped_gemm_fp8_kernel", "wgrad": "_grouped_wgrad_kernel"}
FUSED_KERNELS = ("_gluon_fused_fwd_kernel", "_fused_fwd_kernel")


# ------------------------------------------------------------------------------------------------- the problem
def _group_sizes(E_l: int, rows: int) -> list[int]:
    """``rows`` over E_l experts, log-normally uneven (sigma 0.8: the largest group several times the median, as
    routing skew gives); with E_l > 2 expert E_l // 3 gets no rows and (E_l > 3) expert 2 E_l // 3 a single row, both
    inside the schedule, where their neighbours' tiles and the tile counts around them are exercised."""
    gen = torch.Generator().manual_seed(E_l)
    w = torch.empty(E_l, dtype=torch.float64).log_normal_(0.0, 0.8, generator=gen)
    if E_l > 2:
        w[E_l // 3] = 0.0
    sizes = (w / w.sum() * rows).floor().long()
    if E_l > 3:
        sizes[2 * E_l // 3] = 1
    sizes[int(sizes.argmax())] += rows - int(sizes.sum())
    return sizes.tolist()


def _aligned16(sizes: list[int]) -> list[int]:
    """The same rows in groups of multiples of 16 (each rounded down, the rest to the largest group): the groups of
    the benchmarks (torch._grouped_mm's alignment), where the wgrad twins' last partial chunks line up (module
    docstring)."""
    out = [n - n % 16 for n in sizes]
    out[sizes.index(max(sizes))] += sum(sizes) - sum(out)
    return out


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    o = [0]
    for n in sizes:
        o.append(o[-1] + n)
    return list(zip(o[:-1], o[1:], strict=True))


def _offs(sizes: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=device)


@dataclass
class Problem:
    """One preset's rank share: bf16 operands of every op (padding rows NaN), the FP8 ones and the float64 references
    made on first use and kept for the preset's other ops (``memo``)."""

    preset: str
    E_l: int
    H: int
    I: int
    sizes: list[int]
    used: int            # rows holding data: offs[E_l]
    R: int               # buffer rows: used + PAD
    offs: torch.Tensor   # int32 [E_l + 1]
    offs16: torch.Tensor  # the same rows in groups of multiples of 16 (_aligned16): the wgrad's bitwise check
    x: torch.Tensor      # [R, H]  GEMM1's input (the received rows)
    w13: torch.Tensor    # [E_l, 2I, H]
    w2: torch.Tensor     # [E_l, H, I]
    act: torch.Tensor    # [R, I]  GEMM2's input
    dy: torch.Tensor     # [R, H]  the output gradient
    h: torch.Tensor      # [R, 2I] GEMM1's pre-activation, as the SwiGLU backward reads it
    dh: torch.Tensor     # [R, 2I] GEMM1's output gradient (dgrad1's and dW13's operand)
    s: torch.Tensor      # [R] fp32 per-row gate scale in [0.5, 1.5)
    memo: dict = field(default_factory=dict)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return _bounds(self.sizes)

    @property
    def bounds16(self) -> list[tuple[int, int]]:
        return _bounds(_aligned16(self.sizes))

    def once(self, key: str, make: Callable):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def q(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """quantize_act of operand ``name`` (1x128 scales; NaN rows stay NaN)."""
        return self.once("q:" + name, lambda: X.quantize_act(getattr(self, name)))

    def qw(self, name: str) -> tuple[torch.Tensor, ...]:
        """quantize_weight_both of weight ``name``: (q, s) for the forward, (qt, st) of its transpose for the dgrad."""
        return self.once("qw:" + name, lambda: X.quantize_weight_both(getattr(self, name)))


@functools.lru_cache(maxsize=1)  # the cases run preset by preset: one preset's tensors (up to ~15 GB) alive at a time
def _problem(name: str, device: str = "cuda") -> Problem:
    cfg = PRESETS[name]
    E_l, H, I = cfg.num_experts // EP, cfg.hidden, cfg.intermediate
    sizes = _group_sizes(E_l, TOKENS * cfg.top_k)
    used = sum(sizes)
    R = used + PAD
    gen = torch.Generator(device=device).manual_seed(1234)

    def rows(n: int) -> torch.Tensor:
        t = torch.randn(R, n, device=device, generator=gen).to(torch.bfloat16)
        t[used:] = float("nan")
        return t

    def weights(n: int, k: int) -> torch.Tensor:  # an expert at a time: no fp32 copy of deepseek's 3.8 GB w13
        w = torch.empty(E_l, n, k, device=device, dtype=torch.bfloat16)
        for e in range(E_l):
            w[e] = torch.randn(n, k, device=device, generator=gen) * k**-0.5
        return w

    s = torch.rand(R, device=device, generator=gen) + 0.5
    s[used:] = float("nan")
    return Problem(name, E_l, H, I, sizes, used, R, _offs(sizes, device), _offs(_aligned16(sizes), device),
                   x=rows(H), w13=weights(2 * I, H), w2=weights(H, I), act=rows(I), dy=rows(H), h=rows(2 * I),
                   dh=rows(2 * I), s=s)


def _poisoned(P: Problem, n: int) -> torch.Tensor:
    return torch.full((P.R, n), SENTINEL, device=P.offs.device, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------- float64 twins
def _rows_ref(P: Problem, a64: torch.Tensor, weight: Callable[[int], torch.Tensor], n: int) -> torch.Tensor:
    """float64 [R, n]: rows of group e times weight(e)^T ([n, K], float64; built an expert at a time, so no float64
    copy of a whole weight); rows outside the groups 0."""
    out = torch.zeros(P.R, n, dtype=torch.float64, device=P.offs.device)
    for e, (lo, hi) in enumerate(P.bounds):
        if hi > lo:
            out[lo:hi] = a64[lo:hi] @ weight(e).T
    return out


def _h_ref(P: Problem) -> torch.Tensor:  # x @ w13[e]^T: GEMM1's h, and the nk grouped_gemm's output
    return P.once("ref:h", lambda: _rows_ref(P, P.x.double(), lambda e: P.w13[e].double(), 2 * P.I))


def _y_ref(P: Problem) -> torch.Tensor:  # act @ w2[e]^T: GEMM2 without the scale
    return P.once("ref:y", lambda: _rows_ref(P, P.act.double(), lambda e: P.w2[e].double(), P.H))


def _dact_ref(P: Problem) -> torch.Tensor:  # dy @ w2[e]: the SwiGLU backward's GEMM (w2 read as kn weights)
    return P.once("ref:dact", lambda: _rows_ref(P, P.dy.double(), lambda e: P.w2[e].double().T, P.I))


def _fp8_ref(P: Problem, a: str, w: str, transposed: bool) -> torch.Tensor:
    """float64 product of the dequantised operands: quantize_act(a) @ q(w)^T per group (transposed: q(w^T), the
    dgrads' weights)."""
    def make():
        q, s, qt, st = P.qw(w)
        wq, ws = (qt, st) if transposed else (q, s)
        weight = lambda e: X.dequantize_weight_ref(wq[e:e + 1], ws[e:e + 1])[0]  # noqa: E731
        return _rows_ref(P, X.dequantize_act_ref(*P.q(a)), weight, wq.shape[1])

    return P.once(f"ref8:{a}@{w}{'^T' if transposed else ''}", make)


def _swiglu(h: torch.Tensor, I: int) -> torch.Tensor:
    return F.silu(h[:, :I]) * h[:, I:]


def _dswiglu(dact: torch.Tensor, P: Problem) -> dict[str, torch.Tensor]:
    """The SwiGLU backward's outputs from dact = dy @ w2 and h (megamoe.experts.gemm2_dgrad_swiglu's contract): dh =
    [s dact u silu'(g) | s dact silu(g)], ds = <dact, silu(g) u>, acts = s silu(g) u."""
    h, s = P.h.double(), P.s.double()[:, None]
    g, u = h[:, :P.I], h[:, P.I:]
    sig = torch.sigmoid(g)
    silu = g * sig
    da = dact * s
    return {"dh": torch.cat([da * u * sig * (1 + g * (1 - sig)), da * silu], 1), "ds": (dact * silu * u).sum(1),
            "acts": silu * u * s}


# ------------------------------------------------------------------------------------------------- the ops
@dataclass
class Launch:
    """One launch of a megamoe.experts op: ``call(config)`` runs it into fresh (poisoned) outputs and returns them by
    name; config None is the default. The operands and the epilogue decide which kernel the default picks."""

    family: str                     # "bf16", "fp8" or "wgrad": the Triton twin and the twin-difference bound
    config_op: str                  # its gemm_config op name
    a: torch.Tensor                 # A operand [R, K] (FP8: e4m3; wgrad: x [R, M])
    w: torch.Tensor                 # weights (wgrad: y [R, N])
    n: int                          # output columns (wgrad: N)
    call: Callable[[GemmConfig | None], dict[str, torch.Tensor]]
    epilogue: int = EPI_NONE
    w_kn: bool = False
    h: torch.Tensor | None = None   # the SwiGLU backward's h (its TMA loads are part of the bf16 kernel's limits)
    n_up: int = 0
    out_dtype: torch.dtype = torch.bfloat16  # wgrad


@dataclass(frozen=True)
class Op:
    launch: Callable[[Problem], Launch]
    ref: Callable[[Problem], dict]  # output -> float64 [R, ...] (rows); wgrad: (its groups' bounds, e -> [M, N])
    bitwise: tuple[str, ...] = ()   # outputs documented bitwise equal to the Triton twin's


def _gluon_config(L: Launch) -> GemmConfig:
    """The Gluon kernel's default config for the launch (kernel="gluon"; the one the op picks when no config is
    given and the kernel's limits hold)."""
    R, K = L.a.shape
    return X.default_config(L.config_op, R, L.n, K, kernel="gluon")


def _why_not_gluon(L: Launch) -> str | None:
    """Why the default of this launch is the Triton kernel (None: its Gluon kernel), by megamoe.experts.gluon_reason:
    the Gluon kernel's device, TMA and shape limits at its default config."""
    return X.gluon_reason(L.config_op, _gluon_config(L), L.a, L.w, n=L.n, epilogue=L.epilogue, n_up=L.n_up,
                          w_kn=L.w_kn, h=L.h, out_dtype=L.out_dtype)


def _gluon_kernel(L: Launch) -> str:
    """The Gluon kernel of the launch's op, by the name it records."""
    if L.family == "fp8":
        return "_gluon_fp8_dswiglu_kernel" if L.epilogue == EPI_DSWIGLU else "_gluon_fp8_ws_kernel"
    return "_gluon_wgrad_ws_kernel" if L.family == "wgrad" else "_gluon_bf16_ws_kernel"


def _twin_config(L: Launch) -> GemmConfig:
    """The Triton kernel's default config for the launch, naming kernel="triton"."""
    R, K = L.a.shape
    return X.default_config(L.config_op, R, L.n, K, kernel="triton").with_(kernel="triton")


def _gemm1_swiglu(store_h: bool) -> Op:
    def launch(P: Problem) -> Launch:
        def call(cfg):
            act, h = _poisoned(P, P.I), (_poisoned(P, 2 * P.I) if store_h else None)
            X.gemm1_swiglu(P.x, P.w13, P.offs, store_h=store_h, out=act, h_out=h, config=cfg)
            return {"act": act, "h": h} if store_h else {"act": act}

        return Launch("bf16", "gemm1_swiglu", P.x, P.w13, P.I, call, epilogue=EPI_SWIGLU, n_up=P.I)

    def ref(P: Problem) -> dict:
        h = _h_ref(P)
        return {"act": _swiglu(h, P.I), "h": h} if store_h else {"act": _swiglu(h, P.I)}

    return Op(launch, ref)


def _gemm2(scaled: bool) -> Op:
    def launch(P: Problem) -> Launch:
        def call(cfg):
            out = _poisoned(P, P.H)
            X.gemm2(P.act, P.w2, P.offs, scale=P.s if scaled else None, out=out, config=cfg)
            return {"out": out}

        return Launch("bf16", "gemm2", P.act, P.w2, P.H, call)

    return Op(launch, lambda P: {"out": _y_ref(P) * P.s.double()[:, None] if scaled else _y_ref(P)})


def _grouped_gemm(P: Problem) -> Launch:  # the generic op with nk weights: x @ w13[e]^T, no epilogue
    def call(cfg):
        out = _poisoned(P, 2 * P.I)
        X.grouped_gemm(P.x, P.w13, P.offs, w_layout="nk", out=out, config=cfg)
        return {"out": out}

    return Launch("bf16", "grouped_gemm", P.x, P.w13, 2 * P.I, call)


def _dgrad_swiglu(P: Problem) -> Launch:  # with the gate scale (ds) and acts_out: the split backward's launch
    def call(cfg):
        dh, acts = _poisoned(P, 2 * P.I), _poisoned(P, P.I)
        dh, ds = X.gemm2_dgrad_swiglu(P.dy, P.w2, P.h, P.offs, scale=P.s, out=dh, acts_out=acts, config=cfg)
        return {"dh": dh, "ds": ds, "acts": acts}

    return Launch("bf16", "dgrad_swiglu", P.dy, P.w2, P.I, call, epilogue=EPI_DSWIGLU, w_kn=True, h=P.h)


def _wgrad(x_name: str, y_name: str, label: str, out_dtype: torch.dtype) -> Op:
    """c[e] = x[rows_e]^T @ y[rows_e] (dW13 = dh^T x, dW2 = dy^T act; bf16 as the layer stores it, float32 the op's
    default), on the problem's groups (``label``) and on the same rows in groups of multiples of 16 (``label@16``,
    where the docs' bitwise claim is asserted: module docstring)."""
    def launch(P: Problem) -> Launch:
        x, y = getattr(P, x_name), getattr(P, y_name)

        def call(cfg):
            return {label: X.grouped_wgrad(x, y, P.offs, out_dtype=out_dtype, config=cfg),
                    label + "@16": X.grouped_wgrad(x, y, P.offs16, out_dtype=out_dtype, config=cfg)}

        return Launch("wgrad", "wgrad", x, y, y.shape[1], call, out_dtype=out_dtype)

    def ref(P: Problem) -> dict:
        x, y = getattr(P, x_name), getattr(P, y_name)

        def per_expert(bounds):
            return bounds, lambda e: x[bounds[e][0]:bounds[e][1]].double().T @ y[bounds[e][0]:bounds[e][1]].double()

        return {label: per_expert(P.bounds), label + "@16": per_expert(P.bounds16)}

    return Op(launch, ref, bitwise=(label + "@16",))


def _gemm1_swiglu_fp8(P: Problem) -> Launch:
    xq, xs = P.q("x")
    wq, ws, _, _ = P.qw("w13")

    def call(cfg):
        act, h = _poisoned(P, P.I), _poisoned(P, 2 * P.I)
        X.gemm1_swiglu_fp8(xq, xs, wq, ws, P.offs, store_h=True, out=act, h_out=h, config=cfg)
        return {"act": act, "h": h}

    return Launch("fp8", "gemm1_swiglu_fp8", xq, wq, P.I, call, epilogue=EPI_SWIGLU, n_up=P.I)


def _gemm2_fp8(op: str, scaled: bool) -> Op:
    """GEMM2's operands on the plain FP8 op: gemm2_fp8 as the split FP8 layer launches it (no scale), grouped_gemm_fp8
    with the per-row scale."""
    def launch(P: Problem) -> Launch:
        aq, a_s = P.q("act")
        wq, ws, _, _ = P.qw("w2")
        fn = X.gemm2_fp8 if op == "gemm2_fp8" else X.grouped_gemm_fp8

        def call(cfg):
            out = _poisoned(P, P.H)
            fn(aq, a_s, wq, ws, P.offs, scale=P.s if scaled else None, out=out, config=cfg)
            return {"out": out}

        return Launch("fp8", op, aq, wq, P.H, call)

    def ref(P: Problem) -> dict:
        y = _fp8_ref(P, "act", "w2", False)
        return {"out": y * P.s.double()[:, None] if scaled else y}

    return Op(launch, ref)


def _gemm1_dgrad_fp8(P: Problem) -> Launch:  # dx = dh @ w13[e] on q(w13^T) [E_l, H, 2I]
    dhq, dh_s = P.q("dh")
    _, _, wtq, wts = P.qw("w13")

    def call(cfg):
        out = _poisoned(P, P.H)
        X.gemm1_dgrad_fp8(dhq, dh_s, wtq, wts, P.offs, out=out, config=cfg)
        return {"out": out}

    return Launch("fp8", "dgrad1_fp8", dhq, wtq, P.H, call)


def _dgrad_swiglu_fp8(P: Problem) -> Launch:  # on q(w2^T) [E_l, I, H], with the gate scale and acts_out
    dyq, dy_s = P.q("dy")
    _, _, wtq, wts = P.qw("w2")

    def call(cfg):
        dh, acts = _poisoned(P, 2 * P.I), _poisoned(P, P.I)
        dh, ds = X.gemm2_dgrad_swiglu_fp8(dyq, dy_s, wtq, wts, P.h, P.offs, scale=P.s, out=dh, acts_out=acts,
                                          config=cfg)
        return {"dh": dh, "ds": ds, "acts": acts}

    return Launch("fp8", "dgrad_swiglu_fp8", dyq, wtq, P.I, call, epilogue=EPI_DSWIGLU)


#: op -> its launch and its float64 twin
OPS: dict[str, Op] = {
    "gemm1_swiglu+h": _gemm1_swiglu(store_h=True),
    "gemm1_swiglu": _gemm1_swiglu(store_h=False),
    "gemm2": _gemm2(scaled=False),
    "gemm2+scale": _gemm2(scaled=True),
    "grouped_gemm:nk": Op(_grouped_gemm, lambda P: {"out": _h_ref(P)}),
    "gemm2_dgrad_swiglu+scale+acts": Op(_dgrad_swiglu, lambda P: _dswiglu(_dact_ref(P), P)),
    "grouped_wgrad:dW13": _wgrad("dh", "x", "dW13", torch.bfloat16),
    "grouped_wgrad:dW2": _wgrad("dy", "act", "dW2", torch.bfloat16),
    "grouped_wgrad:dW2:fp32": _wgrad("dy", "act", "dW2", torch.float32),
    "gemm1_swiglu_fp8+h": Op(_gemm1_swiglu_fp8, lambda P: {"act": _swiglu(_fp8_ref(P, "x", "w13", False), P.I),
                                                           "h": _fp8_ref(P, "x", "w13", False)}),
    "gemm2_fp8": _gemm2_fp8("gemm2_fp8", scaled=False),
    "grouped_gemm_fp8+scale": _gemm2_fp8("grouped_gemm_fp8", scaled=True),
    "gemm1_dgrad_fp8": Op(_gemm1_dgrad_fp8, lambda P: {"out": _fp8_ref(P, "dh", "w13", True)}),
    "gemm2_dgrad_swiglu_fp8+scale+acts": Op(_dgrad_swiglu_fp8, lambda P: _dswiglu(_fp8_ref(P, "dy", "w2", True), P)),
}
CASES = [(preset, op) for preset in PRESET_NAMES for op in OPS]  # preset-major: one Problem alive at a time


# ------------------------------------------------------------------------------------------------- comparison
def _ratio(num2: float, den2: float) -> float:
    """sqrt(num2 / den2), inf where either is not finite (NaN never passes a bound)."""
    if not (math.isfinite(num2) and math.isfinite(den2)):
        return math.inf
    if den2 == 0.0:
        return 0.0 if num2 == 0.0 else math.inf
    return math.sqrt(num2 / den2)


class _Tally:
    """Float64 sums over the chunks of one output (its groups of rows, or its experts): ||gluon - ref||^2,
    ||triton - ref||^2, ||gluon - triton||^2, ||ref||^2, ||triton||^2; the non-finite values; bitwise equality."""

    def __init__(self) -> None:
        self.sums = [0.0] * 5
        self.nonfinite = 0
        self.bitwise = True

    def add(self, g: torch.Tensor, t: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
        """Add a chunk; returns its (gluon, triton) relative errors against ref."""
        g64, t64 = g.double(), t.double()
        bad = (~torch.isfinite(g64)).sum() + (~torch.isfinite(t64)).sum()
        v = torch.stack([(g64 - ref).square().sum(), (t64 - ref).square().sum(), (g64 - t64).square().sum(),
                         ref.square().sum(), t64.square().sum(), bad.double()]).tolist()
        self.sums = [a + b for a, b in zip(self.sums, v[:5], strict=True)]
        self.nonfinite += int(v[5])
        self.bitwise = self.bitwise and torch.equal(g, t)
        return _ratio(v[0], v[3]), _ratio(v[1], v[3])

    def errors(self) -> tuple[float, float, float]:
        """(gluon vs float64, triton vs float64, gluon vs triton), relative; inf if anything was non-finite."""
        ge, te, gt, rr, tt = self.sums
        if self.nonfinite:
            return math.inf, math.inf, math.inf
        return _ratio(ge, rr), _ratio(te, rr), _ratio(gt, tt)


def _judge(gerr: float, terr: float, diff: float, *, nonfinite: int, bitwise_equal: bool, ref_bound: float,
           twin_bound: float | None) -> list[str]:
    """The checks common to every output (module docstring) on its figures: errors of the Gluon kernel and of its
    Triton twin against float64, their mutual difference; twin_bound None: bitwise equality required. Failures as
    messages."""
    bad = []
    if nonfinite:
        bad.append(f"{nonfinite} non-finite values (a NaN padding row read as data, or an overflow)")
    if not terr < ref_bound:
        bad.append(f"Triton twin vs float64: {terr:.3g} (bound {ref_bound:g})")
    if not gerr < ref_bound:
        bad.append(f"Gluon vs float64: {gerr:.3g} (bound {ref_bound:g})")
    if not gerr <= max(SLACK_RATIO * terr, terr + SLACK_ABS):
        bad.append(f"Gluon's error {gerr:.3g} exceeds max({SLACK_RATIO} x Triton's {terr:.3g}, Triton's + "
                   f"{SLACK_ABS:g})")
    if twin_bound is None and not bitwise_equal:
        bad.append(f"documented bitwise equal to the Triton twin, differs (rel. {diff:.3g})")
    if twin_bound is not None and not diff <= twin_bound:
        bad.append(f"Gluon vs Triton: {diff:.3g} (bound {twin_bound:g})")
    return bad


def _compare(P: Problem, name: str, g: torch.Tensor, t: torch.Tensor, ref, family: str, bitwise: bool
             ) -> tuple[_Tally, list[str]]:
    """Tally one output over its chunks, with the per-chunk and the padding checks; then _judge."""
    tally, bad = _Tally(), []
    if family == "wgrad":  # [E_l, M, N]: per expert; no rows -> exact zeros
        bounds, ref = ref
        for e, (lo, hi) in enumerate(bounds):
            if hi == lo:
                if not (bool((g[e] == 0).all()) and bool((t[e] == 0).all())):
                    bad.append(f"expert {e} has no rows, but its gradient is not 0")
                continue
            ge, te = tally.add(g[e], t[e], ref(e))
            if not (ge < REF_BOUND and te < REF_BOUND):
                bad.append(f"expert {e} ({hi - lo} rows) vs float64: gluon {ge:.3g}, triton {te:.3g}")
    else:
        row_sums = g.dim() == 1  # ds: fp32 row sums, zero-filled by the op
        poison = 0.0 if row_sums else SENTINEL
        for who, out in (("Gluon", g), ("Triton", t)):
            if not bool((out[P.used:] == poison).all()):
                bad.append(f"{who} wrote padding rows (past offs[E_l] = {P.used})")
        for e, (lo, hi) in enumerate(P.bounds):
            if hi > lo:
                ge, te = tally.add(g[lo:hi], t[lo:hi], ref[lo:hi])
                # (no per-group check of ds: a one-row group's sum can cancel to ~0, its relative error is noise)
                if not row_sums and not (ge < REF_BOUND and te < REF_BOUND):
                    bad.append(f"expert {e} (rows {lo}:{hi}) vs float64: gluon {ge:.3g}, triton {te:.3g}")
    twin = None if bitwise else TWIN_BOUND["fp32" if g.dtype == torch.float32 else "fp8" if family == "fp8" else "bf16"]
    return tally, bad + _judge(*tally.errors(), nonfinite=tally.nonfinite, bitwise_equal=tally.bitwise,
                               ref_bound=REF_BOUND, twin_bound=twin)


def _launched(call: Callable, cfg: GemmConfig | None) -> tuple[dict, list[str]]:
    """Run ``call(cfg)``; returns its outputs and the grouped-GEMM kernels it launched."""
    for name in KERNELS:
        LAST_COMPILED.pop(name, None)
    out = call(cfg)
    torch.cuda.synchronize()
    return out, [name for name in KERNELS if name in LAST_COMPILED]


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


# ------------------------------------------------------------------------------------------------- the summary
def _table(rows: list[dict]) -> list[str]:
    fmt = "{:<34} {:<8} {:<14} {:<18} {:>10} {:>10} {:>10} {:>7}"
    out = [fmt.format("op", "output", "preset", "kernel", "gluon err", "triton err", "diff", "bitwise")]
    for r in rows:
        nums = [f"{r[k]:.3e}" if r.get(k) is not None else "-" for k in ("gluon_err", "triton_err", "diff")]
        bit = "-" if r.get("bitwise") is None else ("yes" if r["bitwise"] else "no")
        out.append(fmt.format(r["op"], r["output"], r["preset"], r["kernel"], *nums, bit))
        if r.get("note"):
            out.append(f"    ({r['note']})")
    return out


class _TwinsSummary:
    """A pytest plugin that the twins_table fixture registers: prints the rows at the end of the session (outside the
    output capture) and writes them to $MEGAMOE_TWINS_JSON when set (from a pytest-xdist worker: with .<worker id>
    appended)."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.rows:
            return
        terminalreporter.write_sep("-", f"Gluon defaults vs their Triton twins: relative error vs float64, EP {EP} "
                                        f"rank shares, {TOKENS} tokens x top_k rows")
        for line in _table(self.rows):
            terminalreporter.write_line(line)
        path = os.environ.get("MEGAMOE_TWINS_JSON")
        if path:
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            with open(f"{path}.{worker}" if worker else path, "w") as f:
                json.dump(self.rows, f, indent=1)
            terminalreporter.write_line(f"(rows written to {path})")


@pytest.fixture(scope="session")
def twins_table(request) -> list[dict]:
    """The summary rows; each test appends its outputs' rows (also those of failing checks: the numbers are what a
    failure needs)."""
    rows: list[dict] = []
    request.config.pluginmanager.register(_TwinsSummary(rows), "megamoe-twins-summary")
    return rows


# ------------------------------------------------------------------------------------------------- op tests
@needs_hopper
@pytest.mark.parametrize("preset,op", CASES, ids=[f"{op}-{preset}" for preset, op in CASES])
def test_twin(preset: str, op: str, twins_table: list[dict]) -> None:
    P = _problem(preset)
    spec = OPS[op]
    L = spec.launch(P)
    why = _why_not_gluon(L)
    if why is not None:  # a Gluon limit fails at this shape: the default must be the Triton kernel, nothing to compare
        _, ran = _launched(L.call, None)
        assert ran == [TRITON[L.family]], f"{op} on {preset}: Gluon cannot run ({why}), yet the default launched {ran}"
        with pytest.raises(ValueError, match=re.escape(why)):
            L.call(_gluon_config(L))
        twins_table.append(dict(op=op, output="", preset=preset, kernel="triton (default)", gluon_err=None,
                                triton_err=None, diff=None, bitwise=None, note=why))
        pytest.skip(f"{op} on {preset}: the default is the Triton kernel here ({why})")
    got, ran = _launched(L.call, _gluon_config(L))
    assert ran == [_gluon_kernel(L)], f"{op} on {preset}: kernel='gluon' launched {ran}"
    kernel = KERNELS[ran[0]]
    failures = []
    default, ran_d = _launched(L.call, None)  # no config: the same launch
    assert ran_d == ran, f"{op} on {preset}: no Gluon limit fails, yet the default launched {ran_d}"
    failures += [f"{op} on {preset}, {name}: the default launch differs from kernel='gluon' with its default config"
                 for name in got if not torch.equal(got[name], default[name])]
    del default
    tri, ran_t = _launched(L.call, _twin_config(L))
    assert ran_t == [TRITON[L.family]], f"{op} on {preset}: the pinned Triton config launched {ran_t}"
    refs = spec.ref(P)
    assert set(got) == set(tri) == set(refs), (set(got), set(tri), set(refs))
    for name in got:
        tally, bad = _compare(P, name, got[name], tri[name], refs[name], L.family, name in spec.bitwise)
        gerr, terr, diff = tally.errors()
        twins_table.append(dict(op=op, output=name, preset=preset, kernel=kernel, gluon_err=_num(gerr),
                                triton_err=_num(terr), diff=_num(diff), bitwise=tally.bitwise))
        failures += [f"{op} on {preset}, {name} ({kernel}): {b}" for b in bad]
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------------- fused forward


def _fused_case(name: str) -> dict:
    """On a one-rank group: a layer of the preset's rank share (E/4 experts, all local) with backend fused, whose
    megakernel runs the Gluon items (the backend's choice on Hopper), then the same layer with its FusedConfig
    replaced by kernel="triton" (as kernels/fused_moe.FusedConfig lets tests force a path), on TOKENS tokens, forward
    only (the Gluon items are the forward's; the backward is the same code either way); routing skewed by logit
    offsets (two favoured experts, one starved where E/4 > top_k). Both outputs against float64 of the same routing
    (experts_ref on the layer's own top-k, so a near-tie of the router cannot move a token between the reference and
    the layer). Where the Gluon items cannot run, the backend must have chosen the Triton kernel."""
    from megamoe.config import preset
    from megamoe.dist import rank_device
    from megamoe.kernels.fused_moe import default_fused_config
    from megamoe.kernels.gluon.fused import gluon_fused_reason
    from megamoe.layer import MoE
    from megamoe.reference import experts_ref, shared_ref

    dev = rank_device()
    # the preset's shapes with SwiGLU experts (the megakernel's form; gpt-oss's own runs on torch and split)
    cfg = preset(name, num_experts=PRESETS[name].num_experts // EP, max_tokens_per_rank=TOKENS, expert_kind="swiglu",
                 router_bias=False)
    why = gluon_fused_reason(default_fused_config(dev), H=cfg.hidden, I=cfg.intermediate, device=dev)
    moe = MoE(cfg, backend="fused", device=dev, seed=0)
    chosen = moe.backend.config.kernel
    if why is not None:
        return {"skip": why, "chosen": chosen}
    E = cfg.num_experts
    gen = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn(TOKENS, cfg.hidden, device=dev, generator=gen).to(torch.bfloat16)
    offset = torch.zeros(E, device=dev)
    offset[0], offset[1] = 1.5, 0.75
    if E > cfg.top_k:
        offset[E // 3] = -1e4
    moe.router.set_logit_offset(offset)
    ys, ran = {}, {}
    for kernel in ("gluon", "triton"):
        for k in FUSED_KERNELS:
            LAST_COMPILED.pop(k, None)
        if kernel == "triton":
            moe.backend.config = moe.backend.config.with_(kernel="triton")
        with torch.no_grad():
            ys[kernel] = moe(x).out
        ran[kernel] = [k for k in FUSED_KERNELS if k in LAST_COMPILED]
    with torch.no_grad():
        r = moe.router(x)
        ref = experts_ref(x.double(), r.topk_idx, r.topk_w, moe.w13, moe.w2)
        if moe.shared_w13 is not None:  # the layer adds its shared expert to the experts' sum
            ref = ref + shared_ref(x.double(), moe.shared_w13, moe.shared_w2, moe.shared_gate)
    tally = _Tally()
    tally.add(ys["gluon"], ys["triton"], ref)
    gerr, terr, diff = tally.errors()
    return {"gluon_err": gerr, "triton_err": terr, "diff": diff, "bitwise": tally.bitwise,
            "nonfinite": tally.nonfinite, "ran": ran, "chosen": chosen, "counts": r.tokens_per_expert.tolist()}


def _fused_rank(rank: int, world: int, names: list[str]) -> dict:
    """Every preset of ``names`` on this rank; a case that raises is reported, the others still run."""
    out = {}
    for name in names:
        try:
            out[name] = _fused_case(name)
        except Exception as exc:  # noqa: BLE001 - reported by that case's test
            out[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def fused_results(request) -> dict:
    """The fused cases of the presets selected in this session, from one spawned rank (backend fused needs a process
    group: a one-rank group on the GPU, as tests/test_gpu_fused.py runs it)."""
    from megamoe.dist import spawn

    wanted = {item.callspec.params["preset"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_fused_twin" and hasattr(item, "callspec")}
    _problem.cache_clear()  # the op tests' last problem: give its memory to the rank
    torch.cuda.empty_cache()
    return spawn(_fused_rank, 1, [p for p in PRESET_NAMES if p in wanted], device="cuda",
                 timeout_s=FUSED_TIMEOUT_S)[0]


@needs_hopper
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_fused_twin(preset: str, fused_results: dict, twins_table: list[dict]) -> None:
    # backend fused with its Gluon items against its FusedConfig forced to kernel="triton": documented bitwise equal;
    # against float64 within the layer bounds of megamoe.testing
    from megamoe.testing import BOUNDS

    op = "MoE fused forward"
    r = fused_results[preset]
    if "error" in r:
        pytest.fail(f"{op} on {preset} raised on the rank:\n{r['error']}")
    if "skip" in r:
        twins_table.append(dict(op=op, output="", preset=preset, kernel="(gluon cannot run)", gluon_err=None,
                                triton_err=None, diff=None, bitwise=None, note=r["skip"]))
        assert r["chosen"] == "triton", f"{op} on {preset}: Gluon cannot run ({r['skip']}), the backend chose it"
        pytest.skip(f"{op} on {preset}: kernel='gluon' cannot run ({r['skip']})")
    twins_table.append(dict(op=op, output="y", preset=preset, kernel="gluon_fused", gluon_err=_num(r["gluon_err"]),
                            triton_err=_num(r["triton_err"]), diff=_num(r["diff"]), bitwise=r["bitwise"]))
    assert r["chosen"] == "gluon", f"{op} on {preset}: the backend chose {r['chosen']!r}, its Gluon items can run"
    assert r["ran"] == {"gluon": ["_gluon_fused_fwd_kernel"], "triton": ["_fused_fwd_kernel"]}, r["ran"]
    bad = _judge(r["gluon_err"], r["triton_err"], r["diff"], nonfinite=r["nonfinite"], bitwise_equal=r["bitwise"],
                 ref_bound=BOUNDS["fused.bf16.cuda"]["out"], twin_bound=None)
    assert not bad, f"{op} on {preset} (tokens per expert {r['counts']}):\n" + "\n".join(bad)
