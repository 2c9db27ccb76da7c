"""Expert SwiGLU MLP over expert-grouped rows: op-level API, the one place that picks a kernel, torch twins, autograd.

Shapes: R received rows (buffer capacity), H hidden, I intermediate, E_l local experts. Group e is rows
``offs[e]:offs[e+1]``, ``offs`` an int32 device tensor [E_l+1] with offs[0] = 0. Rows from offs[E_l] on are padding,
never read as data nor written (unspecified in outputs allocated here, except ExpertsFn's input gradients: zero).
Launchers never read ``offs`` on the host: no sync, graph-capturable.

Weights w13 [E_l, 2I, H] (rows 0..I-1 gate, I..2I-1 up), w2 [E_l, H, I]:
    h   = x @ w13[e]^T               [n, 2I]     g = h[:, :I], u = h[:, I:]
    act = silu(g) * u                [n, I]
    out = s[r] * (act @ w2[e]^T)     [n, H]      s: optional per-row gate scale, fp32 [R]

gpt-oss experts (``bias=``, ``clamp=(alpha, limit)``): h = x @ w13[e]^T + b13[e], act = min(g, limit) *
sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1), out = s[r] * (act @ w2[e]^T + b2[e]); their bias
gradients are per-expert row sums (segment_sum). These epilogues exist in the Triton kernels only (gluon_reason).

Launchers take ``config=`` to pin a GemmConfig (default: gemm_config.default_config per shape). On Hopper (not
under the interpreter) every op of gemm_config.GLUON_OPS runs its Gluon kernel (kernels/gluon/) where its limits
hold; everything else runs the Triton kernels (kernels/grouped_gemm.py, kernels/wgrad.py), the Gluon kernels'
references. A given or pinned config runs the kernel it names (``kernel="gluon"`` raises ValueError with the reason
where it cannot run). Twins (``*_ref``): pure torch, any float dtype, padding rows 0.
"""

from __future__ import annotations

import torch

from megamoe.kernels.bias_grad import row_bias_dot, segment_sum, segment_sum_ref
from megamoe.kernels.fp8_quant import (  # the FP8 operands' quantisers, part of this module's op-level API
    dequantize_act,
    dequantize_act_ref,
    dequantize_weight_ref,
    quantize_act,
    quantize_act_ref,
    quantize_weight,
    quantize_weight_both,
    quantize_weight_ref,
)
from megamoe.kernels.gemm_config import (
    EPI_DSWIGLU,
    EPI_NONE,
    EPI_SWIGLU,
    GLUON_OPS,
    GemmConfig,
    default_config,
    gluon_device_reason,
    pin_config,
    pinned_config,
    tma_ok,
)
from megamoe.kernels.grouped_gemm import check_fp8, check_grouped, launch_grouped_gemm
from megamoe.kernels.interpreter import row_buffer
from megamoe.kernels.wgrad import launch_grouped_wgrad
from megamoe.reference import gpt_oss_act, swiglu

__all__ = ["GemmConfig", "default_config", "pin_config", "choose_config", "gluon_reason", "grouped_gemm",
           "gemm1_swiglu", "gemm2", "gemm2_dgrad_swiglu", "gemm1_dgrad", "grouped_wgrad", "segment_sum", "quantize_act",
           "dequantize_act", "quantize_weight", "quantize_weight_both", "grouped_gemm_fp8", "gemm1_swiglu_fp8",
           "gemm2_fp8", "gemm2_dgrad_swiglu_fp8", "gemm1_dgrad_fp8", "ExpertsFn", "experts_mlp", "grouped_gemm_ref",
           "gemm1_swiglu_ref", "gemm2_ref", "gemm2_dgrad_swiglu_ref", "gemm1_dgrad_ref", "grouped_wgrad_ref",
           "segment_sum_ref", "experts_mlp_ref", "grouped_gemm_fp8_ref", "gemm1_swiglu_fp8_ref",
           "gemm2_dgrad_swiglu_fp8_ref", "quantize_act_ref", "quantize_weight_ref", "dequantize_act_ref",
           "dequantize_weight_ref"]


def _check(t: torch.Tensor | None, what: str, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """``t`` (None passes) must be a contiguous ``dtype`` tensor of ``shape``; ``what``: its name and symbolic shape."""
    if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous()):
        raise ValueError(f"{name}: {what} must be a contiguous {dtype} {shape} tensor, got {t.dtype} {tuple(t.shape)}")


def _check_bf16(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name}: expected bfloat16 operands, got {t.dtype}")


def _out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    _check(out, "out", shape, dtype, "megamoe.experts")
    return row_buffer(shape, dtype, like.device) if out is None else out


def gluon_reason(op: str, cfg: GemmConfig, a: torch.Tensor, w: torch.Tensor, *, n: int, epilogue: int = EPI_NONE,
                 n_up: int = 0, w_kn: bool = False, h: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, gpt_oss: bool = False) -> str | None:
    """Why ``op``'s Gluon kernel cannot run this launch with ``cfg`` (device, interpreter, TMA alignment, config
    and shape limits), or None; no device sync. For "wgrad", a = x [R, M] and w = y [R, N]. ``gpt_oss``: the launch
    has a bias or the clamped SwiGLU in its epilogue."""
    if gpt_oss:
        return "gpt-oss's epilogue (biases, clamped SwiGLU) exists in the Triton kernels only"
    if (why := gluon_device_reason(a, cfg)) is not None:
        return why
    if not tma_ok([a, w] + ([h] if h is not None and epilogue == EPI_DSWIGLU else [])):
        return "TMA needs 16-byte aligned base pointers and row strides"
    if op == "wgrad":
        from megamoe.kernels.gluon.wgrad import ws_wgrad_limits  # Gluon modules are imported only where they run

        return ws_wgrad_limits(cfg, m=a.shape[1], n=w.shape[1], out_dtype=out_dtype)
    if op == "dgrad_swiglu_fp8":
        from megamoe.kernels.gluon.fp8_dswiglu import dswiglu_limits

        return dswiglu_limits(cfg, n=n, k=a.shape[1], n_w=w.shape[1])
    if op.endswith("fp8"):
        from megamoe.kernels.gluon.fp8 import ws_limits

        return ws_limits(cfg, n=n, k=a.shape[1], n_w=w.shape[1], epilogue=epilogue, n_up=n_up)
    if op == "dgrad1" or (op == "grouped_gemm" and w_kn):
        return "GEMM1's dgrad (kn weights) runs the Triton kernel on Hopper too"
    from megamoe.kernels.gluon.bf16 import ws_bf16_limits

    return ws_bf16_limits(cfg, n=n, k=a.shape[1], n_w=w.shape[2] if w_kn else w.shape[1], epilogue=epilogue,
                          w_kn=w_kn, n_up=n_up)


def choose_config(op: str, config: GemmConfig | None, a: torch.Tensor, w: torch.Tensor, *, n: int,
                  epilogue: int = EPI_NONE, n_up: int = 0, w_kn: bool = False, h: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, gpt_oss: bool = False) -> GemmConfig:
    """``config``, else the one pinned for ``op``, else the Gluon default where it can run, else the Triton one.
    kernel="gluon" that cannot run raises ValueError. ``a`` [R, K] (for "wgrad" as in gluon_reason)."""
    cfg = config or pinned_config(op)
    reason = dict(n=n, epilogue=epilogue, n_up=n_up, w_kn=w_kn, h=h, out_dtype=out_dtype, gpt_oss=gpt_oss)
    R, K = a.shape
    if cfg is None:
        rows_n_k = (R, w.shape[1], K) if op == "wgrad" else (R, n, K)
        gluon = default_config(op, *rows_n_k, kernel="gluon") if op in GLUON_OPS and not gpt_oss else None
        if gluon is not None and gluon_reason(op, gluon, a, w, **reason) is None:
            return gluon
        return default_config(op, *rows_n_k, kernel="triton" if op.endswith("fp8") else None)
    if cfg.kernel == "gluon" and (why := gluon_reason(op, cfg, a, w, **reason)) is not None:
        raise ValueError(f"{op}: the config pins kernel='gluon', but {why}")
    return cfg


def _launch(cfg: GemmConfig, a, w, offs, out, *, n: int, epilogue: int = EPI_NONE, a_s=None, w_s=None, bias=None,
            clamp=None, **kw) -> None:
    """Run the kernel cfg names on a, w (FP8 with their scales a_s, w_s); kw: the launchers' optional arguments."""
    if cfg.kernel != "gluon" or bias is not None or clamp is not None:  # gpt-oss's epilogue: Triton only
        launch_grouped_gemm(a, w, offs, out, cfg, n=n, epilogue=epilogue, a_s=a_s, w_s=w_s, bias=bias, clamp=clamp,
                            **kw)
    elif a_s is None:
        from megamoe.kernels.gluon.bf16 import launch_gluon_bf16_ws

        launch_gluon_bf16_ws(a, w, offs, out, cfg, n=n, epilogue=epilogue, **kw)
    elif epilogue == EPI_DSWIGLU:
        from megamoe.kernels.gluon.fp8_dswiglu import launch_gluon_fp8_dswiglu

        launch_gluon_fp8_dswiglu(a, a_s, w, w_s, offs, out, cfg, n=n, **kw)
    else:
        from megamoe.kernels.gluon.fp8 import launch_gluon_fp8_ws

        launch_gluon_fp8_ws(a, a_s, w, w_s, offs, out, cfg, n=n, epilogue=epilogue, **kw)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, w_layout: str = "nk",
                 scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 config: GemmConfig | None = None) -> torch.Tensor:
    """out[rows_e] = s * a[rows_e] @ w[e]^T (w_layout 'nk': w [E_l, N, K]) or @ w[e] ('kn': w [E_l, K, N])."""
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"grouped_gemm: w_layout must be 'nk' or 'kn', got {w_layout!r}")
    kn = w_layout == "kn"
    k_dim, n = (w.shape[1], w.shape[2]) if kn else (w.shape[2], w.shape[1])
    check_grouped(a, w, offs, k_dim, "grouped_gemm")
    _check_bf16("grouped_gemm", a, w)
    _check(scale, "scale [R]", (a.shape[0],), torch.float32, "grouped_gemm")
    out = _out(out, (a.shape[0], n), a)
    cfg = choose_config("grouped_gemm", config, a, w, n=n, w_kn=kn)
    _launch(cfg, a, w, offs, out, n=n, w_kn=kn, scale=scale)
    return out


def _check_clamp(clamp, name: str) -> None:
    if clamp is not None and (len(clamp) != 2 or not (clamp[0] > 0 and clamp[1] > 0)):
        raise ValueError(f"{name}: clamp must be (alpha, limit) with both > 0, got {clamp!r}")


def gemm1_swiglu(x: torch.Tensor, w13: torch.Tensor, offs: torch.Tensor, *, store_h: bool = True,
                 out: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
                 config: GemmConfig | None = None, bias: torch.Tensor | None = None,
                 clamp: tuple[float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """act [R, I] = silu(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T); also h [R, 2I] (pre-activation) if store_h.
    gpt-oss: ``bias`` b13 [E_l, 2I] added to h (h keeps it), ``clamp`` = (alpha, limit) its clamped SwiGLU."""
    check_grouped(x, w13, offs, w13.shape[2], "gemm1_swiglu")
    _check_bf16("gemm1_swiglu", x, w13)
    if w13.shape[1] % 2:
        raise ValueError(f"gemm1_swiglu: w13 must be [E_l, 2I, H], got {tuple(w13.shape)}")
    R, I = x.shape[0], w13.shape[1] // 2
    _check(bias, "bias [E_l, 2I]", (w13.shape[0], 2 * I), torch.bfloat16, "gemm1_swiglu")
    _check_clamp(clamp, "gemm1_swiglu")
    act = _out(out, (R, I), x)
    h = _out(h_out, (R, 2 * I), x) if store_h else None
    gpt_oss = bias is not None or clamp is not None
    cfg = choose_config("gemm1_swiglu", config, x, w13, n=I, epilogue=EPI_SWIGLU, n_up=I, gpt_oss=gpt_oss)
    _launch(cfg, x, w13, offs, act, n=I, epilogue=EPI_SWIGLU, h=h, store_h=store_h, n_up=I, bias=bias, clamp=clamp)
    return act, h


def gemm2(act: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, *, scale: torch.Tensor | None = None,
          out: torch.Tensor | None = None, config: GemmConfig | None = None,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """out [R, H] = s[r] * (act @ w2[e]^T + b[e]) (s optional fp32 [R]; bias optional b2 [E_l, H], gpt-oss)."""
    check_grouped(act, w2, offs, w2.shape[2], "gemm2")
    _check_bf16("gemm2", act, w2)
    _check(scale, "scale [R]", (act.shape[0],), torch.float32, "gemm2")
    _check(bias, "bias [E_l, H]", tuple(w2.shape[:2]), torch.bfloat16, "gemm2")
    out = _out(out, (act.shape[0], w2.shape[1]), act)
    cfg = choose_config("gemm2", config, act, w2, n=w2.shape[1], gpt_oss=bias is not None)
    _launch(cfg, act, w2, offs, out, n=w2.shape[1], scale=scale, bias=bias)
    return out


def gemm2_dgrad_swiglu(dy: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, offs: torch.Tensor, *,
                       scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       config: GemmConfig | None = None, acts_out: torch.Tensor | None = None,
                       clamp: tuple[float, float] | None = None,
                       b2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dh [R, 2I] = d(silu(g) * u) for dact = s[r] * dy @ w2[e]; with scale also ds [R] = <dy, act @ w2^T>;
    acts_out (contiguous bf16 [R, I]) also gets s[r] * silu(g) * u from h, the dW2 operand when dy has no gate.
    gpt-oss: ``clamp`` = (alpha, limit) differentiates its clamped SwiGLU (h holds the biased pre-activation) and
    ``b2`` [E_l, H] adds <dy, b2[e]> to ds."""
    check_grouped(dy, w2, offs, w2.shape[1], "gemm2_dgrad_swiglu")
    _check_bf16("gemm2_dgrad_swiglu", dy, w2, h)
    R, I = dy.shape[0], w2.shape[2]
    _check(h, "h [R, 2I]", (R, 2 * I), dy.dtype, "gemm2_dgrad_swiglu")
    _check(scale, "scale [R]", (R,), torch.float32, "gemm2_dgrad_swiglu")
    _check_clamp(clamp, "gemm2_dgrad_swiglu")
    _check(b2, "b2 [E_l, H]", tuple(w2.shape[:2]), torch.bfloat16, "gemm2_dgrad_swiglu")
    dh = _out(out, (R, 2 * I), dy)
    cfg = choose_config("dgrad_swiglu", config, dy, w2, n=I, epilogue=EPI_DSWIGLU, w_kn=True, h=h,
                        gpt_oss=clamp is not None)
    _check(acts_out, "acts_out [R, I]", (R, I), dy.dtype, "gemm2_dgrad_swiglu")
    dsp = None if scale is None else dy.new_zeros(((I + cfg.block_n - 1) // cfg.block_n, R), dtype=torch.float32)
    _launch(cfg, dy, w2, offs, dh, n=I, w_kn=True, epilogue=EPI_DSWIGLU, h=h, scale=scale, dsp=dsp, acts=acts_out,
            clamp=clamp)
    ds = None if dsp is None else dsp.sum(0)
    return dh, (ds if ds is None or b2 is None else ds + row_bias_dot(dy, b2, offs))


def gemm1_dgrad(dh: torch.Tensor, w13: torch.Tensor, offs: torch.Tensor, *, out: torch.Tensor | None = None,
                config: GemmConfig | None = None) -> torch.Tensor:
    """dx [R, H] = dh @ w13[e]."""
    check_grouped(dh, w13, offs, w13.shape[1], "gemm1_dgrad")
    _check_bf16("gemm1_dgrad", dh, w13)
    out = _out(out, (dh.shape[0], w13.shape[2]), dh)
    cfg = choose_config("dgrad1", config, dh, w13, n=w13.shape[2], w_kn=True)
    _launch(cfg, dh, w13, offs, out, n=w13.shape[2], w_kn=True)
    return out


def grouped_wgrad(x: torch.Tensor, y: torch.Tensor, offs: torch.Tensor, *, out_dtype: torch.dtype = torch.float32,
                  config: GemmConfig | None = None) -> torch.Tensor:
    """c [E_l, M, N] with c[e] = x[rows_e]^T @ y[rows_e]; x [R, M], y [R, N]. Deterministic (no atomics)."""
    _check_bf16("grouped_wgrad", x, y)
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError(f"grouped_wgrad: x [R, M] and y [R, N] must be contiguous with equal R, got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise ValueError("grouped_wgrad: offs must be an int32 [E_l + 1] tensor")
    out = x.new_empty((offs.numel() - 1, x.shape[1], y.shape[1]), dtype=out_dtype)  # [E_l, M, N]
    cfg = choose_config("wgrad", config, x, y, n=y.shape[1], out_dtype=out_dtype)
    if cfg.kernel == "gluon":
        from megamoe.kernels.gluon.wgrad import launch_gluon_wgrad_ws

        launch_gluon_wgrad_ws(x, y, offs, out, cfg)
    else:
        launch_grouped_wgrad(x, y, offs, out, cfg)
    return out


def _gemm_fp8(op, name, aq, a_s, wq, w_s, offs, scale, out, config) -> torch.Tensor:
    """The plain FP8 GEMM of grouped_gemm_fp8, gemm2_fp8 and gemm1_dgrad_fp8 (op: its config name)."""
    check_fp8(aq, a_s, wq, w_s, offs, name)
    _check(scale, "scale [R]", (aq.shape[0],), torch.float32, name)
    out = _out(out, (aq.shape[0], wq.shape[1]), aq)
    cfg = choose_config(op, config, aq, wq, n=wq.shape[1])
    _launch(cfg, aq, wq, offs, out, n=wq.shape[1], a_s=a_s, w_s=w_s, scale=scale)
    return out


def grouped_gemm_fp8(aq, a_s, wq, w_s, offs, *, scale=None, out=None, config=None) -> torch.Tensor:
    """out [R, N] bf16 = s[r] * dequant(aq) @ dequant(wq[e])^T; wq [E_l, N, K] (transpose weights for dgrad)."""
    return _gemm_fp8("grouped_gemm_fp8", "grouped_gemm_fp8", aq, a_s, wq, w_s, offs, scale, out, config)


def gemm1_swiglu_fp8(xq, x_s, w13q, w13_s, offs, *, store_h=True, out=None, h_out=None, config=None):
    """FP8 GEMM1 + SwiGLU: (act [R, I] bf16, h [R, 2I] bf16 or None); out / h_out: preallocated act / h."""
    check_fp8(xq, x_s, w13q, w13_s, offs, "gemm1_swiglu_fp8")
    if w13q.shape[1] % 2:
        raise ValueError(f"gemm1_swiglu_fp8: w13 must be [E_l, 2I, H], got {tuple(w13q.shape)}")
    R, I = xq.shape[0], w13q.shape[1] // 2
    act = _out(out, (R, I), xq)
    h = _out(h_out, (R, 2 * I), xq) if store_h else None
    cfg = choose_config("gemm1_swiglu_fp8", config, xq, w13q, n=I, epilogue=EPI_SWIGLU, n_up=I)
    _launch(cfg, xq, w13q, offs, act, n=I, epilogue=EPI_SWIGLU, a_s=x_s, w_s=w13_s, h=h, store_h=store_h, n_up=I)
    return act, h


def gemm2_fp8(aq, a_s, w2q, w2_s, offs, *, scale=None, out=None, config=None) -> torch.Tensor:
    """FP8 GEMM2: out [R, H] bf16 = s[r] * act @ w2[e]^T; out: preallocated."""
    return _gemm_fp8("gemm2_fp8", "gemm2_fp8", aq, a_s, w2q, w2_s, offs, scale, out, config)


def gemm2_dgrad_swiglu_fp8(dyq, dy_s, w2tq, w2t_s, h, offs, *, scale=None, out=None, config=None, acts_out=None):
    """FP8 gemm2_dgrad_swiglu: (dh [R, 2I] bf16, ds [R] fp32 or None); w2t = quantize_weight(w2.transpose(1, 2))
    [E_l, I, H]; out: preallocated dh; acts_out as in gemm2_dgrad_swiglu."""
    check_fp8(dyq, dy_s, w2tq, w2t_s, offs, "gemm2_dgrad_swiglu_fp8")
    R, I = dyq.shape[0], w2tq.shape[1]
    _check(h, "h [R, 2I]", (R, 2 * I), torch.bfloat16, "gemm2_dgrad_swiglu_fp8")
    _check(scale, "scale [R]", (R,), torch.float32, "gemm2_dgrad_swiglu_fp8")
    cfg = choose_config("dgrad_swiglu_fp8", config, dyq, w2tq, n=I, epilogue=EPI_DSWIGLU, h=h)
    dh = _out(out, (R, 2 * I), dyq)
    _check(acts_out, "acts_out [R, I]", (R, I), torch.bfloat16, "gemm2_dgrad_swiglu_fp8")
    dsp = None if scale is None else dyq.new_zeros(((I + cfg.block_n - 1) // cfg.block_n, R), dtype=torch.float32)
    _launch(cfg, dyq, w2tq, offs, dh, n=I, epilogue=EPI_DSWIGLU, a_s=dy_s, w_s=w2t_s, h=h, scale=scale, dsp=dsp,
            acts=acts_out)
    return dh, (dsp.sum(0) if dsp is not None else None)


def gemm1_dgrad_fp8(dhq, dh_s, w13tq, w13t_s, offs, *, out=None, config=None) -> torch.Tensor:
    """FP8 dgrad of GEMM1: dx [R, H] = dh @ w13[e]; w13t = quantize_weight(w13.transpose(1, 2)) [E_l, H, 2I]."""
    return _gemm_fp8("dgrad1_fp8", "gemm1_dgrad_fp8", dhq, dh_s, w13tq, w13t_s, offs, None, out, config)


class ExpertsFn(torch.autograd.Function):
    """out = s[r] * (silu(x @ w13_g^T) * (x @ w13_u^T)) @ w2^T over expert-grouped bf16 rows. forward: gemm1_swiglu
    (keeps h) + gemm2 (gate in the epilogue). backward: dh, ds from gemm2_dgrad_swiglu, dx = dh @ w13 (padding rows
    zero), dW2 = (s * dy)^T @ act, dW13 = dh^T @ x, deterministic."""

    @staticmethod
    def forward(ctx, x, offs, w13, w2, scale=None):
        act, h = gemm1_swiglu(x, w13, offs, store_h=True)
        out = gemm2(act, w2, offs, scale=scale)
        ctx.save_for_backward(x, offs, w13, w2, h, act, scale)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, offs, w13, w2, h, act, scale = ctx.saved_tensors
        dy = dy.contiguous()
        dh, ds = gemm2_dgrad_swiglu(dy, w2, h, offs, scale=scale)  # ds: None without scale
        dx = dw13 = dw2 = None
        if ctx.needs_input_grad[0]:
            dx = gemm1_dgrad(dh, w13, offs, out=torch.zeros_like(x))
        if ctx.needs_input_grad[3]:
            dys = (dy * scale[:, None]).to(dy.dtype) if scale is not None else dy
            dw2 = grouped_wgrad(dys, act, offs, out_dtype=w2.dtype)
        if ctx.needs_input_grad[2]:
            dw13 = grouped_wgrad(dh, x, offs, out_dtype=w13.dtype)
        return dx, None, dw13, dw2, ds


def experts_mlp(x: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """Autograd entry: ExpertsFn.apply(x, offs, w13, w2, scale)."""
    return ExpertsFn.apply(x, offs, w13, w2, scale)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    o = offs.tolist()
    return [(o[e], o[e + 1]) for e in range(len(o) - 1)]


def grouped_gemm_ref(a, w, offs, *, w_layout="nk", scale=None):
    """Twin of grouped_gemm, computed in a's dtype; padding rows 0."""
    n = w.shape[2] if w_layout == "kn" else w.shape[1]
    out = torch.zeros((a.shape[0], n), dtype=a.dtype, device=a.device)
    for e, (s0, s1) in enumerate(_bounds(offs)):
        if s1 > s0:
            we = w[e].to(a.dtype)
            out[s0:s1] = a[s0:s1] @ (we if w_layout == "kn" else we.T)
    if scale is not None:
        out = out * scale.to(a.dtype)[:, None]
    return out


def _row_bias(bias, offs, R: int, dtype) -> torch.Tensor:
    """bias [E_l, N] -> [R, N] in ``dtype``: each row's expert's bias, 0 on the padding (host read: twins only)."""
    eid = torch.zeros(R, dtype=torch.long, device=bias.device)
    valid = torch.zeros(R, dtype=torch.bool, device=bias.device)
    for e, (s0, s1) in enumerate(_bounds(offs)):
        eid[s0:s1], valid[s0:s1] = e, True
    return bias.to(dtype)[eid] * valid.to(dtype)[:, None]


def gemm1_swiglu_ref(x, w13, offs, *, bias=None, clamp=None):
    """(act, h) twin of gemm1_swiglu (bias and clamp as there)."""
    h = grouped_gemm_ref(x, w13, offs)
    if bias is not None:
        h = h + _row_bias(bias, offs, x.shape[0], x.dtype)
    return (swiglu(h) if clamp is None else gpt_oss_act(h, *clamp)), h


def gemm2_ref(act, w2, offs, *, scale=None, bias=None):
    out = grouped_gemm_ref(act, w2, offs)
    out = out if bias is None else out + _row_bias(bias, offs, act.shape[0], act.dtype)
    return out if scale is None else out * scale.to(act.dtype)[:, None]


def gemm2_dgrad_swiglu_ref(dy, w2, h, offs, *, scale=None, clamp=None, b2=None):
    """(dh, ds) twin of gemm2_dgrad_swiglu (ds None without scale)."""
    dact = grouped_gemm_ref(dy, w2, offs, w_layout="kn")
    I = w2.shape[2]
    g, u = h[:, :I].to(dy.dtype), h[:, I:].to(dy.dtype)
    if clamp is not None:  # by autograd through the clamps (torch.clamp's gradient: 0 where a bound holds)
        with torch.enable_grad():
            hg = h.to(dy.dtype).detach().requires_grad_()
            act = gpt_oss_act(hg, *clamp)
        ds = None if scale is None else (dact * act.detach()).sum(1)
        if scale is not None:
            dact = dact * scale.to(dy.dtype)[:, None]
        dh = torch.autograd.grad(act, hg, dact)[0]
    else:
        sig = torch.sigmoid(g)
        ds = None if scale is None else (dact * (g * sig) * u).sum(1)
        if scale is not None:
            dact = dact * scale.to(dy.dtype)[:, None]
        dh = torch.cat([dact * u * sig * (1 + g * (1 - sig)), dact * g * sig], 1)
    if ds is not None and b2 is not None:  # the output's bias is part of the expert row that ds differentiates
        ds = ds + (dy * _row_bias(b2, offs, dy.shape[0], dy.dtype)).sum(1)
    return dh, ds


def gemm1_dgrad_ref(dh, w13, offs):
    return grouped_gemm_ref(dh, w13, offs, w_layout="kn")


def grouped_wgrad_ref(x, y, offs):
    out = x.new_zeros((offs.numel() - 1, x.shape[1], y.shape[1]))
    for e, (s0, s1) in enumerate(_bounds(offs)):
        out[e] = x[s0:s1].T @ y[s0:s1]
    return out


def experts_mlp_ref(x, offs, w13, w2, scale=None):
    """Twin of experts_mlp, differentiable through torch autograd (use float64 leaves for a reference)."""
    return gemm2_ref(gemm1_swiglu_ref(x, w13, offs)[0], w2, offs, scale=scale)


def grouped_gemm_fp8_ref(aq, a_s, wq, w_s, offs, *, scale=None, dtype=torch.float64):
    """Twin of grouped_gemm_fp8: the dequantised operands multiplied in ``dtype`` (padding rows 0)."""
    return grouped_gemm_ref(dequantize_act_ref(aq, a_s, dtype), dequantize_weight_ref(wq, w_s, dtype), offs,
                            scale=scale)


def gemm1_swiglu_fp8_ref(xq, x_s, w13q, w13_s, offs, *, dtype=torch.float64):
    """(act, h) twin of gemm1_swiglu_fp8."""
    return gemm1_swiglu_ref(dequantize_act_ref(xq, x_s, dtype), dequantize_weight_ref(w13q, w13_s, dtype), offs)


def gemm2_dgrad_swiglu_fp8_ref(dyq, dy_s, w2tq, w2t_s, h, offs, *, scale=None, dtype=torch.float64):
    """(dh, ds) twin of gemm2_dgrad_swiglu_fp8 (w2tq [E_l, I, H] the quantised transposed w2; ds None without
    scale), in ``dtype`` from the dequantised operands and h."""
    w2 = dequantize_weight_ref(w2tq, w2t_s, dtype).transpose(1, 2)
    return gemm2_dgrad_swiglu_ref(dequantize_act_ref(dyq, dy_s, dtype), w2, h, offs,
                                  scale=scale.to(dtype) if scale is not None else None)
