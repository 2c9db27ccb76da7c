"""FP8 (e4m3) block quantisation: 1x128 for activations, 128x128 for weights (the DeepSeek-V3 recipe).

Shape legend: R rows, K reduction columns, E_l experts, N weight rows.
    activations  x [R, K]       -> q [R, K] float8_e4m3fn, s [R, cdiv(K, 128)] fp32      x[r, k] ~ q * s[r, k // 128]
    weights      w [E_l, N, K]  -> q float8_e4m3fn, s [E_l, cdiv(N, 128), cdiv(K, 128)] fp32
Scale = amax(|block|) / 448 (448 = largest e4m3 value), floored at 1e-12 so zero blocks quantise to 0; with
``pow2_scale`` the scale is rounded up to a power of two (exact rescaling, as some recipes want).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megamoe.kernels.gemm_config import interpreting
from megamoe.kernels.interpreter import row_buffer

FP8_MAX = 448.0
QBLOCK = 128


@triton.jit
def scale_of(amax, POW2: tl.constexpr):
    s = tl.div_rn(tl.maximum(amax, 1e-12), 448.0)
    if POW2:  # round up to a power of two on the bits (exact; log2 on the GPU is approximate)
        bits = s.to(tl.int32, bitcast=True)
        ex = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (ex << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def to_e4m3(v, RNE_IN_FP32: tl.constexpr):
    """Cast |v| <= 448 to e4m3. The interpreter's fp8 cast rounds wrongly (124.3 -> 64, ties away from even) but
    converts representable values exactly, so there (RNE_IN_FP32) we round to the e4m3 grid in fp32 first."""
    if RNE_IN_FP32:
        a = tl.abs(v)
        ex = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)
        ulp = tl.exp2(ex - 3.0)
        t = a / ulp
        f = tl.floor(t)
        d = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        up = (d > 0.5) | ((d == 0.5) & odd)
        r = tl.where(up, f + 1.0, f) * ulp
        neg = v.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 and negatives rounding to zero give -0, as on GPUs
        q = tl.where(neg, -r, r).to(tl.float8e4nv)
        # the interpreter's cast drops the sign of -0.0: set it on the bits
        return (q.to(tl.uint8, bitcast=True) | tl.where(neg & (r == 0.0), 0x80, 0).to(tl.uint8)).to(
            tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _act_block(R, K, nrows_ptr, BLOCK_R: tl.constexpr, HAS_NROWS: tl.constexpr):
    """Program (pid_r, kb)'s 1x128 blocks of an [R, K] activation: (kb, rows, columns, the rows bound (R, or *nrows
    when HAS_NROWS and smaller), mask, rows as int64)."""
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    if HAS_NROWS:
        R = tl.minimum(R, tl.load(nrows_ptr))
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rk = kb * 128 + tl.arange(0, 128)
    return kb, rr, rk, R, (rr < R)[:, None] & (rk < K)[None, :], rr.to(tl.int64)


@triton.jit
def _quant_act_kernel(
    x_ptr,   # x_RK [R, K] bf16/fp32, row stride stride_x
    q_ptr,   # q_RK [R, K] fp8 e4m3, row stride stride_q
    s_ptr,   # s [R, n_kb] fp32, row stride stride_s
    nrows_ptr,  # int32 [1] (HAS_NROWS): rows that hold data, read on the device; rows >= it are skipped
    R, K, stride_x, n_kb, stride_q, stride_s,
    BLOCK_R: tl.constexpr, POW2: tl.constexpr, RNE_IN_FP32: tl.constexpr, HAS_NROWS: tl.constexpr,
):
    """Grid: (cdiv(R, BLOCK_R), n_kb). s[r, kb] = amax(x[r, kb*128 : +128]) / 448; q = x / s."""
    kb, rr, rk, R, mask, rr64 = _act_block(R, K, nrows_ptr, BLOCK_R, HAS_NROWS)
    x = tl.load(x_ptr + rr64[:, None] * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    s = scale_of(tl.max(tl.abs(x), axis=1), POW2)
    q = tl.clamp(tl.div_rn(x, s[:, None]), -448.0, 448.0)  # IEEE division: bitwise equal to torch
    tl.store(q_ptr + rr64[:, None] * stride_q + rk[None, :], to_e4m3(q, RNE_IN_FP32), mask=mask)
    tl.store(s_ptr + rr64 * stride_s + kb, s, mask=rr < R)


@triton.jit
def quantise_slice(ptrs, mask, s, RNE_IN_FP32: tl.constexpr):
    """e4m3(*ptrs / s) for one slice of a weight block (the block's scale s), read as float32."""
    w = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return to_e4m3(tl.clamp(tl.div_rn(w, s), -448.0, 448.0), RNE_IN_FP32)


@triton.jit
def _quant_weight_kernel(
    w_ptr,   # w [E_l, N, K] bf16/fp32 contiguous
    q_ptr,   # q [E_l, N, K] fp8 e4m3 (TRANSPOSE: [E_l, K, N])
    s_ptr,   # s [E_l, n_nb, n_kb] fp32 (TRANSPOSE: [E_l, n_kb, n_nb])
    qt_ptr,  # BOTH: q of the transpose [E_l, K, N] fp8 e4m3
    st_ptr,  # BOTH: its scales [E_l, n_kb, n_nb] fp32
    N, K, n_nb, n_kb,
    CHUNK: tl.constexpr, POW2: tl.constexpr, RNE_IN_FP32: tl.constexpr, TRANSPOSE: tl.constexpr,
    BOTH: tl.constexpr, COLS_T: tl.constexpr = False,
):
    """Grid: (E_l, n_nb, n_kb). One 128x128 block: s = amax / 448, q = w / s. TRANSPOSE: q [E_l, K, N], s
    [E_l, n_kb, n_nb], the quantisation of w.transpose(1, 2) without a transposed copy (a block of the transpose
    is the transpose of a block, same amax). BOTH: plain into q, s and transposed into qt, st from one read.
    CHUNK < 128: the block in CHUNK-row slices, one loop for the amax and one that reloads each slice (L1 / L2) to
    quantise it, so a thread holds fewer values (more programs per SM in flight); same values either way.
    COLS_T: the transposed orientation from its own loop over CHUNK-column slices, so each transposed row gets
    128 bytes per store instead of CHUNK; one more read of the block."""
    e = tl.program_id(0)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    rk = kb * 128 + tl.arange(0, 128)
    kmask = rk < K
    base = e.to(tl.int64) * N * K
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, 128, CHUNK):
        rn = nb * 128 + c + tl.arange(0, CHUNK)
        mask = (rn < N)[:, None] & kmask[None, :]
        w = tl.load(w_ptr + base + rn.to(tl.int64)[:, None] * K + rk[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(w.to(tl.float32)), axis=1))
    s = scale_of(tl.max(amax, axis=0), POW2)
    if not (TRANSPOSE and COLS_T):
        for c in range(0, 128, CHUNK):
            rn = nb * 128 + c + tl.arange(0, CHUNK)
            mask = (rn < N)[:, None] & kmask[None, :]
            off = base + rn.to(tl.int64)[:, None] * K + rk[None, :]
            q = quantise_slice(w_ptr + off, mask, s, RNE_IN_FP32)
            off_t = base + rk.to(tl.int64)[None, :] * N + rn[:, None]
            tl.store(q_ptr + (off_t if TRANSPOSE else off), q, mask=mask)
            if BOTH and not (COLS_T or TRANSPOSE):
                tl.store(qt_ptr + off_t, q, mask=mask)
    if COLS_T and (TRANSPOSE or BOTH):
        rn = nb * 128 + tl.arange(0, 128)
        nmask = rn < N
        for c in range(0, 128, CHUNK):
            rc = kb * 128 + c + tl.arange(0, CHUNK)
            mask = nmask[:, None] & (rc < K)[None, :]
            q = quantise_slice(w_ptr + base + rn.to(tl.int64)[:, None] * K + rc[None, :], mask, s, RNE_IN_FP32)
            off_t = base + rc.to(tl.int64)[None, :] * N + rn[:, None]
            tl.store((q_ptr if TRANSPOSE else qt_ptr) + off_t, q, mask=mask)
    if TRANSPOSE:
        tl.store(s_ptr + (e * n_kb + kb) * n_nb + nb, s)
    else:
        tl.store(s_ptr + (e * n_nb + nb) * n_kb + kb, s)
        if BOTH:
            tl.store(st_ptr + (e * n_kb + kb) * n_nb + nb, s)


#: (CHUNK, num_warps, COLS_T) per mode: "one" (quantize_weight), "both" (quantize_weight_both); benchmarks/
#: quant_bench.py may override them. Fastest on an H200 for qwen3 / deepseek-v3 / mixtral expert weights: 32-row
#: slices beat whole blocks by 1.1-1.5x; COLS_T helps "both" (3-4%) and slows "one" (3-6%). See docs/performance.md.
WEIGHT_QUANT_CONFIG = {"one": (32, 8, False), "both": (32, 16, True)}
#: under the interpreter take whole weight blocks (CHUNK 128) and 128 activation rows per program: fewer, larger
#: interpreted programs (each op has a fixed Python cost, ~2x faster), same values. Tests of the tilings turn it off.
INTERPRETER_TILES = True


def _act_rows() -> int:
    return 128 if INTERPRETER_TILES and interpreting() else 32


def _quant_weight(w: torch.Tensor, q, s, qt, st, *, pow2_scale: bool, transpose: bool, both: bool) -> None:
    """One _quant_weight_kernel launch over the blocks of w [E_l, N, K] (contiguous, non-empty), with
    WEIGHT_QUANT_CONFIG's "both" or "one" tiling."""
    E_l, N, K = w.shape
    n_nb, n_kb = triton.cdiv(N, QBLOCK), triton.cdiv(K, QBLOCK)
    chunk, warps, cols_t = WEIGHT_QUANT_CONFIG["both" if both else "one"]
    chunk = 128 if INTERPRETER_TILES and interpreting() else chunk
    _quant_weight_kernel[(E_l, n_nb, n_kb)](w, q, s, qt, st, N, K, n_nb, n_kb, CHUNK=chunk, POW2=pow2_scale,
                                            RNE_IN_FP32=interpreting(), TRANSPOSE=transpose, BOTH=both,
                                            COLS_T=cols_t and (transpose or both), num_warps=warps)


def quantize_act(x: torch.Tensor, *, pow2_scale: bool = False, nrows: torch.Tensor | None = None,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (bf16/fp32, unit inner stride) -> (q [R, K] float8_e4m3fn, s [R, cdiv(K, 128)] fp32). nrows: int32
    tensor on x's device whose first element counts the rows holding data (e.g. a schedule's ``offs[E_l:]``); later
    rows are neither read nor written, with no host sync. out: (q, s) to fill, unit inner strides (row-strided ok)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_act: x must be 2-D [R, K] with unit inner stride, got {tuple(x.shape)}")
    if nrows is not None and (nrows.dtype != torch.int32 or nrows.numel() < 1 or nrows.device != x.device):
        raise ValueError(f"quantize_act: nrows must be an int32 tensor with >= 1 element on {x.device}, got "
                         f"{nrows.dtype} [{nrows.numel()}] on {nrows.device}")
    R, K = x.shape
    n_kb = triton.cdiv(K, QBLOCK)
    if out is None:
        q = row_buffer((R, K), torch.float8_e4m3fn, x.device)
        s = row_buffer((R, n_kb), torch.float32, x.device)
    else:
        q, s = out
        if (q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (R, K) or q.stride(-1) != 1 or s.dtype != torch.float32
                or tuple(s.shape) != (R, n_kb) or s.stride(-1) != 1):
            raise ValueError(f"quantize_act: out must be (float8_e4m3fn [R, K] = {(R, K)}, float32 [R, cdiv(K, 128)] "
                             f"= {(R, n_kb)}) with unit inner strides, got {q.dtype} {tuple(q.shape)}, {s.dtype} "
                             f"{tuple(s.shape)}")
    if R and K:
        block_r = _act_rows()
        _quant_act_kernel[(triton.cdiv(R, block_r), n_kb)](
            x, q, s, nrows if nrows is not None else s, R, K, x.stride(0), n_kb, q.stride(0), s.stride(0),
            BLOCK_R=block_r, POW2=pow2_scale,
            RNE_IN_FP32=interpreting(), HAS_NROWS=nrows is not None, num_warps=4)
    return q, s


@triton.jit
def _dequant_act_kernel(
    q_ptr,   # q [R, K] fp8 e4m3, row stride stride_q
    s_ptr,   # s [R, n_kb] fp32, row stride stride_s
    x_ptr,   # x [R, K] out (bf16), contiguous
    nrows_ptr,  # int32 [1] (HAS_NROWS): rows that hold data; rows >= it are left unwritten
    R, K, stride_q, stride_s,
    BLOCK_R: tl.constexpr, HAS_NROWS: tl.constexpr,
):
    """Grid: (cdiv(R, BLOCK_R), n_kb). x[r, kb*128 : +128] = q * s[r, kb] (fp32 product, rounded to x's dtype)."""
    kb, rr, rk, R, mask, rr64 = _act_block(R, K, nrows_ptr, BLOCK_R, HAS_NROWS)
    q = tl.load(q_ptr + rr64[:, None] * stride_q + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(s_ptr + rr64 * stride_s + kb, mask=rr < R, other=0.0)
    tl.store(x_ptr + rr64[:, None] * K + rk[None, :], (q * sc[:, None]).to(x_ptr.dtype.element_ty), mask=mask)


def dequantize_act(q: torch.Tensor, s: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16,
                   nrows: torch.Tensor | None = None) -> torch.Tensor:
    """(q [R, K] float8_e4m3fn, s [R, cdiv(K, 128)] fp32), unit inner strides (row-strided views allowed) -> x [R, K]
    ``dtype`` = q * s per 1x128 block (quantize_act's inverse up to its rounding). nrows: as quantize_act's."""
    if q.dim() != 2 or q.stride(-1) != 1 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_act: q must be float8_e4m3fn [R, K] with unit inner stride, got {q.dtype} "
                         f"{tuple(q.shape)}")
    R, K = q.shape
    n_kb = triton.cdiv(K, QBLOCK)
    if s.dtype != torch.float32 or tuple(s.shape) != (R, n_kb) or s.stride(-1) != 1:
        raise ValueError(f"dequantize_act: s must be float32 [R, cdiv(K, 128)] = {(R, n_kb)} with unit inner "
                         f"stride, got {s.dtype} {tuple(s.shape)}")
    x = torch.empty((R, K), device=q.device, dtype=dtype)
    if R and K:
        block_r = _act_rows()
        _dequant_act_kernel[(triton.cdiv(R, block_r), n_kb)](
            q, s, x, nrows if nrows is not None else s, R, K, q.stride(0), s.stride(0), BLOCK_R=block_r,
            HAS_NROWS=nrows is not None, num_warps=4)
    return x


def quantize_weight(w: torch.Tensor, *, pow2_scale: bool = False,
                    transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E_l, N, K] -> (q float8_e4m3fn [E_l, N, K], s [E_l, cdiv(N, 128), cdiv(K, 128)] fp32). transpose: quantise
    w.transpose(1, 2) (q [E_l, K, N], s [E_l, cdiv(K, 128), cdiv(N, 128)]) read from w as it is (a transposed bf16
    copy for the dgrad was the FP8 layer's largest cost); a transposed view is quantised through its base."""
    if w.dim() != 3:
        raise ValueError(f"quantize_weight: w must be 3-D [E_l, N, K], got {tuple(w.shape)}")
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():  # a transposed view: quantise its base
        w, transpose = w.transpose(1, 2), not transpose
    w = w.contiguous()
    specs = Fp8Weight.specs(w)  # one orientation's pair of the layouts quantize_weight_both fills
    names = ("qt", "st") if transpose else ("q", "s")
    q, s = (torch.empty(specs[n][0], device=w.device, dtype=specs[n][1]) for n in names)
    if w.numel():
        _quant_weight(w, q, s, q, s, pow2_scale=pow2_scale, transpose=transpose, both=False)
    return q, s


def weight_key(w: torch.Tensor) -> tuple:
    """Identifies a weight's current values for a quantisation cache; in-place ops (and MasterAdamW) bump _version."""
    return (w._version, w.data_ptr(), tuple(w.shape), w.dtype, w.device)


@dataclass(eq=False)
class Fp8Weight:
    """A weight w [E_l, N, K] quantised in both orientations (quantize_weight_both's outputs: forward and dgrad
    operands), in buffers allocated once so a CUDA graph reading them stays valid across in-place refreshes.
    ``key``: the :func:`weight_key` the values were quantised from, None when stale; whoever refreshes sets it.
    ``managed``: an optimizer refreshes them after each update (MasterAdamW.maintain_fp8), so a layer may read
    them inside a CUDA graph without quantising there."""

    q: torch.Tensor
    s: torch.Tensor
    qt: torch.Tensor
    st: torch.Tensor
    pow2_scale: bool = False
    key: tuple | None = field(default=None, repr=False)
    managed: bool = False

    @staticmethod
    def specs(w: torch.Tensor, who: str = "Fp8Weight") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} of the four buffers for a weight shaped like w [E_l, N, K]."""
        if w.dim() != 3:
            raise ValueError(f"{who}: the weight must be 3-D [E_l, N, K], got {tuple(w.shape)}")
        E_l, N, K = w.shape
        n_nb, n_kb = triton.cdiv(N, QBLOCK), triton.cdiv(K, QBLOCK)
        f8, f32 = torch.float8_e4m3fn, torch.float32
        return {"q": ((E_l, N, K), f8), "s": ((E_l, n_nb, n_kb), f32), "qt": ((E_l, K, N), f8),
                "st": ((E_l, n_kb, n_nb), f32)}

    @classmethod
    def empty_like(cls, w: torch.Tensor, *, pow2_scale: bool = False) -> Fp8Weight:
        """Unfilled buffers (key None) for a weight shaped like w [E_l, N, K]."""
        return cls(**{name: torch.empty(shape, device=w.device, dtype=dtype)
                      for name, (shape, dtype) in cls.specs(w).items()}, pow2_scale=pow2_scale)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.s, self.qt, self.st

    def check(self, w: torch.Tensor, who: str) -> None:
        """ValueError unless these buffers fit weight w (shapes, dtypes, contiguity, device)."""
        for name, (shape, dtype) in self.specs(w, who).items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != w.device:
                raise ValueError(f"{who}: FP8 buffer {name} must be a contiguous {dtype} tensor of shape {shape} on "
                                 f"{w.device} for a weight of shape {tuple(w.shape)}; got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")


def one_pass_ok(w: torch.Tensor) -> bool:
    """Whether both orientations of w may come from one read (``BOTH``): bf16 weights, or under the interpreter. With
    float32 weights (Triton 3.6) the one-pass kernel stored wrong bytes in one orientation at small shapes (the e4m3
    tensor converted between the two stores' layouts), so they take two passes. Untried with COLS_T's loops."""
    return w.dtype == torch.bfloat16 or interpreting()


def quantize_weight_both(w: torch.Tensor, *, pow2_scale: bool = False,
                         out: Fp8Weight | None = None) -> tuple[torch.Tensor, ...]:
    """w [E_l, N, K] (contiguous) -> (q [E_l, N, K], s [E_l, cdiv(N, 128), cdiv(K, 128)], qt [E_l, K, N],
    st [E_l, cdiv(K, 128), cdiv(N, 128)]): ``quantize_weight(w)`` and ``quantize_weight(w, transpose=True)``
    (bitwise) from one read of w: a layer's forward and dgrad operands. out: an Fp8Weight to fill (key: caller's)."""
    if w.dim() != 3 or not w.is_contiguous():
        raise ValueError(f"quantize_weight_both: w must be a contiguous 3-D [E_l, N, K] tensor, got "
                         f"{tuple(w.shape)} with strides {w.stride()}")
    if out is not None:
        out.check(w, "quantize_weight_both")
        if out.pow2_scale != pow2_scale:
            raise ValueError(f"quantize_weight_both: pow2_scale={pow2_scale} but the out buffers are for "
                             f"pow2_scale={out.pow2_scale}")
    q, s, qt, st = (out if out is not None else Fp8Weight.empty_like(w)).tensors()
    if w.numel() and not one_pass_ok(w):  # two single-orientation passes: see one_pass_ok
        _quant_weight(w, q, s, q, s, pow2_scale=pow2_scale, transpose=False, both=False)
        _quant_weight(w, qt, st, qt, st, pow2_scale=pow2_scale, transpose=True, both=False)
    elif w.numel():  # "both": 16 warps, 91 registers each (8 warps would need 174 and fit one CTA per SM)
        _quant_weight(w, q, s, qt, st, pow2_scale=pow2_scale, transpose=False, both=True)
    return q, s, qt, st


def _scale_ref(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    amax = amax.float().clamp_min(1e-12)
    # tensor / tensor: IEEE division (torch turns "tensor / python scalar" into a reciprocal multiply on CUDA)
    s = amax / torch.full_like(amax, FP8_MAX)
    if pow2:
        m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1)
        s = torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))
    return s


def quantize_act_ref(x: torch.Tensor, *, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    R, K = x.shape
    xp = F.pad(x.float(), (0, -K % QBLOCK)).view(R, -1, QBLOCK)
    s = _scale_ref(xp.abs().amax(-1), pow2_scale)
    q = torch.div(xp, s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(R, -1)[:, :K]
    return q.contiguous(), s


def quantize_weight_ref(w: torch.Tensor, *, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    E_l, N, K = w.shape
    wp = F.pad(w.float(), (0, -K % QBLOCK, 0, -N % QBLOCK))
    nb, kb = wp.shape[1] // QBLOCK, wp.shape[2] // QBLOCK
    blocks = wp.view(E_l, nb, QBLOCK, kb, QBLOCK)
    s = _scale_ref(blocks.abs().amax(dim=(2, 4)), pow2_scale)
    q = (blocks / s[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(E_l, nb * QBLOCK, kb * QBLOCK)[:, :N, :K].contiguous(), s


def dequantize_act_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return q.to(dtype) * s.to(dtype).repeat_interleave(QBLOCK, 1)[:, :q.shape[1]]


def dequantize_weight_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    full = s.to(dtype).repeat_interleave(QBLOCK, 1).repeat_interleave(QBLOCK, 2)
    return q.to(dtype) * full[:, :q.shape[1], :q.shape[2]]
