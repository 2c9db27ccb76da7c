"""The router after its logit GEMM as two Triton kernels forward and one backward (megamoe.router, ``impl="triton"``).
T tokens, E experts, k top-k.

Forward, from float32 logits [T, E]: ``_route_fwd_kernel`` (CHUNKS x BLOCK_T tokens per program, each token's E
logits in registers): softmax (or sigmoid and the biased choice), with n_group > 1 only the experts of the token's
topk_group best groups as candidates (DeepSeek-V3), top-k by k rounds of arg-max (ties to the lowest id, NaN as +inf,
as torch.topk), the gates; each program adds its picks per expert and the column sums of the
balance loss's density (softmax: p; sigmoid: s / sum(s)) into two int64 [E] vectors with integer atomics, the density
in fixed point: integer sums are order-free, so results are bitwise reproducible (float atomics would not be).
``_route_finish_kernel``: the aux loss from the two vectors. Backward: ``_route_bwd_kernel`` recomputes p (or s) and
writes d(logits) from d(gates) and d(aux) in one pass.

It replaces ~15 small torch kernels whose launches and gaps cost ~0.1 ms of qwen3-30b-a3b's layer forward at 4096
tokens. The math is router.py's torch path, up to the rounding of exp / sigmoid and summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_scores(logits_ptr, rows, cols, T, E, SIGMOID: tl.constexpr):
    """Tokens ``rows`` of the logits -> (rmask, m2 (valid token and expert), cmask2 (valid expert), value picked as
    gate, density for the aux loss). Padding columns hold l = -inf, i.e. p = s = 0."""
    rmask = rows < T
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    cmask2 = (rows >= 0)[:, None] & cmask[None, :]
    l = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=m2, other=0.0)
    l = tl.where(cmask2, l, -float("inf"))
    if SIGMOID:
        ex = 1.0 / (1.0 + tl.exp(-l))
    else:
        ex = tl.exp(l - tl.max(l, 1)[:, None])
    ex = tl.where(cmask2, ex, 0.0)
    p = ex / tl.sum(ex, 1)[:, None]  # softmax: the scores; sigmoid: the density s / sum(s)
    return rmask, m2, cmask2, ex if SIGMOID else p, p


@triton.jit
def _kept_groups(choice, cols, EG, G: tl.constexpr, GP: tl.constexpr, TOPK_G: tl.constexpr):
    """[BLOCK_T, BLOCK_E] whether expert (column) e is in one of the token's TOPK_G best groups of EG consecutive
    experts; a group scores the sum of its two best choices, ties to the lower group (router.limit_groups)."""
    grp = cols // EG
    gcols = tl.arange(0, GP)
    gsc = tl.full([choice.shape[0], GP], -float("inf"), tl.float32)
    for g in tl.static_range(G):
        x = tl.where((grp == g)[None, :], choice, -float("inf"))
        m1 = tl.max(x, 1)
        top = x == m1[:, None]
        m2 = tl.where(tl.sum(top.to(tl.int32), 1) >= 2, m1, tl.max(tl.where(top, -float("inf"), x), 1))
        gsc = tl.where(gcols[None, :] == g, (m1 + m2)[:, None], gsc)
    a = gsc[:, :, None]  # group g (axis 1) against g' (axis 2): the groups ranked above g
    b = gsc[:, None, :]
    above = (b > a) | ((b == a) & (gcols[None, None, :] < gcols[None, :, None]))
    keep = (tl.sum(above.to(tl.int32), 2) < TOPK_G) & (gcols < G)[None, :]  # [BLOCK_T, GP]
    mine = grp[None, None, :] == gcols[None, :, None]  # [1, GP, BLOCK_E]
    return tl.sum((mine & keep[:, :, None]).to(tl.int32), 1) > 0


@triton.jit
def _route_fwd_kernel(
    logits_ptr,  # float32 [T, E] contiguous
    bias_ptr,    # float32 [E] (HAS_BIAS)
    idx_ptr,     # int64 [T, K] out
    gates_ptr,   # float32 [T, K] out
    counts_ptr,  # int64 [E], zeroed: picks of each expert
    denfx_ptr,   # int64 [E], zeroed: column sums of the density in fixed point (units of 1 / DEN_ONE)
    T, E, scale,
    K: tl.constexpr, KP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr, DEN_ONE: tl.constexpr,
    G: tl.constexpr = 1, GP: tl.constexpr = 1, TOPK_G: tl.constexpr = 1,
):
    GATE_IS_CHOICE: tl.constexpr = not SIGMOID and not HAS_BIAS
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    kcols = tl.arange(0, KP)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0)
    cnt_acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    den_acc = tl.zeros([BLOCK_E], dtype=tl.int64)
    for c in range(CHUNKS):
        rows = (pid * CHUNKS + c) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask, m2, cmask2, val, den = _load_scores(logits_ptr, rows, cols, T, E, SIGMOID)
        choice = val
        if HAS_BIAS:
            choice = choice + bias[None, :]
        choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks above everything, as in torch.topk
        # one int64 key per score: its float bits made monotonic, above the reversed expert id, so that one max
        # gives the largest score and, among equal scores, the lowest id; taken experts get the sentinel
        bits = choice.to(tl.int32, bitcast=True)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (mono.to(tl.int64) << 32) + (BLOCK_E - 1 - cols)[None, :].to(tl.int64)
        gone = tl.full([BLOCK_T, BLOCK_E], -2147483648, tl.int64) << 32  # below the key of -inf
        key = tl.where(cmask2, key, gone)
        if G > 1:  # outside the token's TOPK_G best groups: above taken, below every candidate
            key = tl.where(_kept_groups(choice, cols, E // G, G, GP, TOPK_G), key, gone + 1)
        g2 = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        i2 = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        for j in tl.static_range(K):
            top = tl.max(key, 1)
            j_idx = (BLOCK_E - 1) - (top & 0xFFFFFFFF).to(tl.int32)
            hit = cols[None, :] == j_idx[:, None]
            if GATE_IS_CHOICE:  # the gate is the score just ranked: read it back from the key
                tb = (top >> 32).to(tl.int32)
                g = (tb ^ ((tb >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            else:
                g = tl.sum(tl.where(hit, val, 0.0), 1)
            g2 = tl.where(kcols[None, :] == j, g[:, None], g2)
            i2 = tl.where(kcols[None, :] == j, j_idx[:, None], i2)
            key = tl.where(hit, gone, key)
        if NORM:
            g2 = g2 / tl.sum(g2, 1)[:, None]
        g2 = g2 * scale
        kmask = rmask[:, None] & (kcols[None, :] < K)
        out_off = rows[:, None].to(tl.int64) * K + kcols[None, :]
        tl.store(idx_ptr + out_off, i2.to(tl.int64), mask=kmask)
        tl.store(gates_ptr + out_off, g2, mask=kmask)
        picked = m2 & (key == gone)  # the K experts taken from each valid token
        cnt_acc += tl.sum(picked.to(tl.int32), 0)
        den_acc += tl.sum(tl.where(m2, den * DEN_ONE, 0.0).to(tl.int64), 0)
    tl.atomic_add(counts_ptr + cols, cnt_acc.to(tl.int64), mask=cmask)
    tl.atomic_add(denfx_ptr + cols, den_acc, mask=cmask)


@triton.jit
def _route_finish_kernel(
    counts_ptr, denfx_ptr,  # int64 [E]: the forward kernel's sums
    aux_ptr,     # float32 [1] out: coef * E * sum_e counts_e / (T K) * den_e / T
    E, inv_tk, inv_t, coef_e,
    BLOCK_E: tl.constexpr, DEN_ONE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    frac = tl.load(counts_ptr + cols, mask=cmask, other=0).to(tl.float32) * inv_tk
    den = tl.load(denfx_ptr + cols, mask=cmask, other=0).to(tl.float32) * (1.0 / DEN_ONE)
    aux = coef_e * tl.sum(tl.where(cmask, frac * (den * inv_t), 0.0), 0)
    tl.store(aux_ptr + tl.arange(0, 1), tl.full([1], 0.0, tl.float32) + aux)


@triton.jit
def _route_bwd_kernel(
    logits_ptr,  # float32 [T, E]
    idx_ptr,     # int64 [T, K]
    dgates_ptr,  # float32 [T, K] (HAS_DG)
    counts_ptr,  # int64 [E]
    daux_ptr,    # float32 [1] (HAS_DAUX)
    dlogits_ptr,  # float32 [T, E] out
    T, E, scale, inv_tk, inv_t, coef_e,
    K: tl.constexpr, KP: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr,
    HAS_DG: tl.constexpr, HAS_DAUX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    rmask, m2, cmask2, val, den = _load_scores(logits_ptr, rows, cols, T, E, SIGMOID)
    # d(value) from the gates: g_j = val[idx_j]; w_j = scale * g_j / S (NORM, S = sum_j g_j) or scale * g_j
    dval = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DG:
        kcols = tl.arange(0, KP)
        kmask = rmask[:, None] & (kcols[None, :] < K)
        off = rows[:, None].to(tl.int64) * K + kcols[None, :]
        i2 = tl.load(idx_ptr + off, mask=kmask, other=-1).to(tl.int32)
        dw2 = tl.load(dgates_ptr + off, mask=kmask, other=0.0) * scale
        g2 = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            ij = tl.sum(tl.where(kcols[None, :] == j, i2, 0), 1)
            g = tl.sum(tl.where(cols[None, :] == ij[:, None], val, 0.0), 1)
            g2 = tl.where(kcols[None, :] == j, g[:, None], g2)
        if NORM:
            s = tl.where(rmask, tl.sum(g2, 1), 1.0)  # rows past T hold no gates
            dot = tl.sum(dw2 * g2, 1)
            dw2 = dw2 / s[:, None] - (dot / (s * s))[:, None]
        for j in tl.static_range(K):
            ij = tl.sum(tl.where(kcols[None, :] == j, i2, 0), 1)
            dj = tl.sum(tl.where(kcols[None, :] == j, dw2, 0.0), 1)
            dval += tl.where(cols[None, :] == ij[:, None], dj[:, None], 0.0)
    # d(density) from the aux loss: coef * E * f_e / T per token, f_e = counts_e / (T K)
    dden = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DAUX:
        daux = tl.sum(tl.load(daux_ptr + tl.arange(0, 1)), 0)
        f = tl.load(counts_ptr + cols, mask=cmask, other=0).to(tl.float32) * inv_tk
        dden += (daux * coef_e * inv_t * f)[None, :]
        dden = tl.where(cmask2, dden, 0.0)
    if SIGMOID:
        # den = s / Z, Z = sum_e s: d s = dval + (dden - sum(dden * den)) / Z; d l = d s * s * (1 - s)
        z = tl.sum(val, 1)
        ds = dval + (dden - tl.sum(dden * den, 1)[:, None]) / z[:, None]
        dl = ds * val * (1.0 - val)
    else:
        dp = dval + dden
        dl = val * (dp - tl.sum(val * dp, 1)[:, None])
    tl.store(dlogits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], dl, mask=m2)


#: fixed-point unit of the density sums (a token's density is <= 1; T * 2^32 fits int64 for T < 2^31)
DEN_ONE = 4294967296.0


#: (BLOCK_T, CHUNKS, num_warps) of the forward kernel, or None for :func:`_blocks`' choice (benchmarks/router_bench.py)
PIN: tuple[int, int, int] | None = None
#: (BLOCK_T, num_warps) of the backward kernel, or None for ~4 values per thread at 4 warps (not swept)
PIN_BWD: tuple[int, int] | None = None


def _blocks(E: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_E, KP, CHUNKS, num_warps) of the forward kernel: small tiles so thousands of warps are in
    flight (the time is a per-token chain of dependent reductions), enough tokens per program to share its fixed
    work (bias loads, atomics). From ``benchmarks/router_bench.py --sweep`` on an H200 at 4096 tokens: 8 tokens,
    4 warps at E = 128; 8 warps at E = 256; 32 tokens at E <= 32; more chunks were slower, larger tiles spilled."""
    block_e = triton.next_power_of_2(E)
    # past E = 256 (not swept) the tile stays at 2048 values: 16 per thread at 4 warps, 8 at 8
    block_t = 32 if block_e <= 32 else 8 if block_e <= 256 else max(1, 2048 // block_e)
    return block_t, block_e, triton.next_power_of_2(K), 1, 8 if block_e >= 256 else 4


class RouteTopk(torch.autograd.Function):
    """(logits [T, E] float32, bias [E] or None) -> (topk_idx int64 [T, k], gates float32 [T, k], aux 0-d,
    tokens_per_expert int64 [E]); gradients flow to the logits from the gates and the aux loss. T > 0. With
    n_group > 1 each token picks among the experts of its topk_group best groups (router.limit_groups)."""

    @staticmethod
    def forward(ctx, logits, bias, k: int, sigmoid: bool, norm: bool, scale: float, coef: float, n_group: int,
                topk_group: int):
        logits = logits.contiguous()
        T, E = logits.shape
        if T >= 2**31:  # the fixed-point density sums (T * 2^32) and the kernels' int32 row numbers
            raise ValueError(f"the Triton router takes fewer than 2^31 tokens per call, got {T}; use impl='torch'")
        dev = logits.device
        block_t, block_e, kp, chunks, warps = _blocks(E, k)
        if PIN is not None:
            block_t, chunks, warps = PIN
        idx = torch.empty(T, k, dtype=torch.int64, device=dev)
        gates = torch.empty(T, k, dtype=torch.float32, device=dev)
        counts, denfx = torch.zeros(2, E, dtype=torch.int64, device=dev)  # picks, density in fixed point
        has_bias = bias is not None
        b = bias.detach().to(torch.float32).contiguous() if has_bias else gates
        _route_fwd_kernel[(triton.cdiv(T, block_t * chunks),)](
            logits, b, idx, gates, counts, denfx, T, E, float(scale),
            K=k, KP=kp, SIGMOID=sigmoid, HAS_BIAS=has_bias, NORM=norm, BLOCK_T=block_t, BLOCK_E=block_e,
            CHUNKS=chunks, DEN_ONE=DEN_ONE, G=n_group, GP=triton.next_power_of_2(n_group), TOPK_G=topk_group,
            num_warps=warps)
        aux = torch.empty(1, dtype=torch.float32, device=dev)
        coef_e = float(coef) * E
        _route_finish_kernel[(1,)](counts, denfx, aux, E, 1.0 / (T * k), 1.0 / T, coef_e, BLOCK_E=block_e,
                                   DEN_ONE=DEN_ONE, num_warps=4)
        ctx.save_for_backward(logits, idx, counts)
        ctx.cfg = (k, sigmoid, norm, float(scale), coef_e)
        ctx.mark_non_differentiable(idx, counts)
        return idx, gates, aux.view(()), counts

    @staticmethod
    def backward(ctx, d_idx, d_gates, d_aux, d_counts):
        logits, idx, counts = ctx.saved_tensors
        k, sigmoid, norm, scale, coef_e = ctx.cfg
        T, E = logits.shape
        _, block_e, kp, _, _ = _blocks(E, k)
        block_t, warps = (max(1, 512 // block_e), 4) if PIN_BWD is None else PIN_BWD
        dlogits = torch.empty_like(logits)
        has_dg = d_gates is not None
        has_daux = d_aux is not None and coef_e != 0.0
        dg = d_gates.to(torch.float32).contiguous() if has_dg else logits
        da = d_aux.to(torch.float32).reshape(1) if has_daux else logits
        _route_bwd_kernel[(triton.cdiv(T, block_t),)](
            logits, idx, dg, counts, da, dlogits, T, E, scale, 1.0 / (T * k), 1.0 / T, coef_e,
            K=k, KP=kp, SIGMOID=sigmoid, NORM=norm, HAS_DG=has_dg, HAS_DAUX=has_daux,
            BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps)
        return dlogits, None, None, None, None, None, None, None, None
