"""The MoE forward megakernel: pull dispatch, GEMM1+SwiGLU and GEMM2 in one persistent kernel, then the combine.

Shape legend: W world size, T tokens on this rank, H hidden, I expert intermediate, E_l local experts, k top-k,
R rows this rank receives (device value offs[E_l]), R_cap its worst case, BM rows of a block (128 on GPUs),
NB blocks: expert e's rows offs[e]:offs[e+1] cut into cdiv(n_e, BM) blocks, in expert order (NB <= cdiv(R_cap, BM) +
E_l), T1 = cdiv(I, BN1) GEMM1 column tiles, T2 = cdiv(H, BN2) GEMM2 column tiles.

Before the kernel (stream order, no host sync): stage x and the top-k ids, publish READY (comm/signals.stage),
then the device-side schedule (comm/schedule.py: offs, and each received row's (source rank, token, slot)).

Work items, taken in order from one atomic counter:

    step s = 0, 1, ... covers blocks sG .. sG + G - 1 (G = ``group``):
        [PULL(b) of its blocks, GEMM1(b, j) of step s - L1's blocks, GEMM2(b, j) of step s - L1 - L2's
         blocks], the GEMM items j-major (tile j of every block of the group, then j + 1), so the tiles that
         read one weight tile run side by side and share it in L2
    PULL(b):     block b's x rows from their owners' ``tok`` regions (NVLink) -> xbuf slot of b; ready[b] += 1
    GEMM1(b, j): wait ready[b] == 1; act[:, j-th BN1 cols] = silu(x @ w13g^T) * (x @ w13u^T)
                 (and h when STORE_H); g1[b] += 1
    GEMM2(b, j): wait g1[b] == T1; out = act @ w2[e]^T (cols j*BN2..); each row r = (src, t, slot) is stored
                 straight into rank src's ``slots`` region at [t, slot, cols]; g2[b] += 1

Then, in launches of their own (stream order completes this rank's pushes first): one program publishes DONE to
every rank, and the tail waits for every rank's DONE and sums y[t] = sum_j topk_w[t, j] * slot[t, j] in j order, fp32.

Deadlock-free without any occupancy assumption (docs/design.md, "Residency"): an item only waits on items with a
smaller index, and the ring only makes PULL(b) wait on GEMM1(b - NS) and GEMM1(b) on GEMM2(b - NS), earlier items
when NS > L1 + L2. Under the interpreter a single program runs every item in order.

Ring (``NS`` > 0): xbuf / act hold NS blocks, block b in slot b % NS: NS * BM rows whatever the routing. NS = 0
(dense): block b's rows live at their receive rows (split's expert-grouped layout), so the backward can reuse them.

No static split between communication and compute programs: every program takes the next item, so the share of SMs
moving rows follows the work; the lookahead L1 (pull to GEMM1, in steps) is the knob. Determinism: each output
element comes from one tile in a fixed k order and each y row sums its slots in j order, so results are bitwise
reproducible whichever program takes which item. Visibility: generic-proxy stores (the pull, the SwiGLU epilogue)
are released with a CTA barrier and a release atomic; the consumer acquires the counter and issues
``fence.proxy.async`` before its TMA loads.

``FusedConfig.kernel = "gluon"`` (Hopper): the same items, order, waits and results, warp-specialised in
kernels/gluon/fused.py; the DONE and the tail are these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.comm.dispatch import DispatchHandle, stage_and_schedule
from megamoe.comm.schedule import schedule_buffers
from megamoe.comm.signals import DONE, OP_FUSED, READY, current_call, error_set, publish, wait_flags
from megamoe.kernels.fused_parts import (
    fence_proxy_async,
    locate,
    pull_block,
    push_epilogue,
    push_rows,
    signal_counter,
    wait_counter,
)
from megamoe.kernels.gemm_config import interpreting, num_sms, record, tma_ok
from megamoe.kernels.gluon.fused import gluon_fused_reason, prepare_gluon_fused
from megamoe.kernels.interpreter import row_buffer
from megamoe.kernels.tiles import epilogue, expert_tiles, mma


@triton.jit(do_not_specialize=["rank"])
def _publish_done_kernel(tab, W, rank, WP2: tl.constexpr):
    """grid (1,): DONE = this call's number to every rank, unless a wait of this rank timed out."""
    if error_set(tab, W, rank) == 0:
        publish(tab, W, rank, DONE, current_call(tab, W, rank), WP2)


@triton.jit(do_not_specialize=["W", "T", "rank"])
def _fused_tail_kernel(tab, W, rank, gate_ptr, y_ptr, slots_ptr, T, H, timeout_ns, K: tl.constexpr,
                       ROWS_C: tl.constexpr, BLOCK_HC: tl.constexpr, WP2: tl.constexpr):
    """grid (P,): wait for every rank's DONE, then y[t] = sum_j topk_w[t, j] * slot[t, j] in j order, fp32."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    call = current_call(tab, W, rank)
    if wait_flags(tab, W, rank, DONE, 0, W, call, OP_FUSED, timeout_ns, WP2):
        DT = y_ptr.dtype.element_ty
        for t0 in range(pid * ROWS_C, T, P * ROWS_C):
            t = t0 + tl.arange(0, ROWS_C)
            mt = t < T
            for h0 in range(0, H, BLOCK_HC):
                oh = h0 + tl.arange(0, BLOCK_HC)
                m2 = mt[:, None] & (oh < H)[None, :]
                acc = tl.zeros((ROWS_C, BLOCK_HC), dtype=tl.float32)
                for jk in tl.static_range(K):
                    v = tl.load(slots_ptr + (t.to(tl.int64) * K + jk)[:, None] * H + oh[None, :], mask=m2, other=0.0)
                    wj = tl.load(gate_ptr + t * K + jk, mask=mt, other=0.0)
                    acc += wj[:, None] * v.to(tl.float32)
                tl.store(y_ptr + t.to(tl.int64)[:, None] * H + oh[None, :], acc.to(DT), mask=m2)


# W, E_l, T: an int equal to 1 would be specialised to a constexpr, a separate compile that spilled; likewise the
# launcher passes WP2 >= 2 (the peer loops mask lanes >= W). rank: every rank compiles the same kernel.
@triton.jit(do_not_specialize=["W", "E_l", "T", "rank"])
def _fused_fwd_kernel(
    tab, W, rank,
    x_desc, x_ptr,          # xbuf [NROWS, H] bf16 (ring: NS * BM rows; dense: the call's rows_for(T))
    w13_desc, w13_ptr,      # w13 [E_l, 2I, H] bf16
    act_desc, act_ptr,      # act [NROWS, I] bf16
    w2_desc, w2_ptr,        # w2 [E_l, H, I] bf16
    h_ptr,                  # h [NROWS, 2I] bf16 (STORE_H)
    offs_ptr,               # int32 [E_l + 1] (schedule)
    row_src_ptr, row_tok_ptr, row_slot_ptr,  # int32 [R_cap] (schedule): (source rank, token, slot) per row
    ctr_ptr,                # int64 [1 + 3 * NB_MAX] zeroed: queue, ready[NB_MAX], g1[NB_MAX], g2[NB_MAX]
    H, I, E_l, NB_MAX, NS, L1, L2, timeout_ns,
    K: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
    BLOCK_E: tl.constexpr, EPI_SPLIT1: tl.constexpr, EPI_SPLIT2: tl.constexpr,
    GB: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, STORE_H: tl.constexpr, ALIGNED: tl.constexpr, WP2: tl.constexpr,
    b13_ptr, b2_ptr,        # HAS_BIAS: b13 [E_l, 2I], b2 [E_l, H] bf16, contiguous (else None)
    alpha, limit,           # ACT=1: gpt-oss's clamped SwiGLU constants (else None)
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """grid (P,): the work items of the module docstring, until none is left. HAS_BIAS / ACT (gpt-oss's experts):
    GEMM1's epilogue adds b13[e] and applies the clamped SwiGLU (tiles.epi_part), GEMM2's adds b2[e] to the rows it
    pushes (the tail applies the gates to them); the trailing arguments come last so that the plain kernel's code
    stays as it was."""
    call = current_call(tab, W, rank)
    ok = wait_flags(tab, W, rank, READY, 0, W, call, OP_FUSED, timeout_ns, WP2)
    DT = x_ptr.dtype.element_ty
    e_idx, starts, cnts, nblk, cum, nb = expert_tiles(offs_ptr, E_l, 1, BM, 1, BLOCK_E)  # BM-row blocks
    T1 = tl.cdiv(I, BN1)
    T2 = tl.cdiv(H, BN2)
    PS = GB * (1 + T1 + T2)
    n_steps = tl.where(nb > 0, tl.cdiv(nb, GB) + L1 + L2, 0)
    ready = ctr_ptr + 1
    g1 = ready + NB_MAX
    g2 = g1 + NB_MAX
    go = ok
    while go:
        item = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
        s = (item // PS).to(tl.int32)
        sub = (item % PS).to(tl.int32)
        go = s < n_steps
        if go:
            if sub < GB:  # PULL(b) for the GB blocks of step s
                b = s * GB + sub
                if b < nb:
                    e, row0, nrows, base = locate(b, e_idx, starts, cnts, nblk, cum, NS, BM)
                    free = b >= 0
                    if NS > 0:
                        if b >= NS:  # the slot's previous block has been read by all its GEMM1 tiles
                            free = wait_counter(g1 + b - NS, T1, tab, W, rank, call, timeout_ns)
                    if free:
                        pull_block(tab, W, row0, nrows, base, 0, BM, row_src_ptr, row_tok_ptr, x_ptr, H, H, ROWS_P,
                                   BLOCK_H, ALIGNED)
                    signal_counter(ready + b)
                    go = free
            elif sub < GB * (1 + T1):  # GEMM1(b, j) for the blocks of step s - L1, j-major
                q = sub - GB
                b = (s - L1) * GB + q % GB
                j = q // GB
                if (b >= 0) & (b < nb):
                    e, row0, nrows, base = locate(b, e_idx, starts, cnts, nblk, cum, NS, BM)
                    fine = wait_counter(ready + b, 1, tab, W, rank, call, timeout_ns)
                    if NS > 0:
                        if b >= NS:  # act slot: GEMM2 of the slot's previous block is done
                            fine = fine & wait_counter(g2 + b - NS, T2, tab, W, rank, call, timeout_ns)
                    if fine:
                        fence_proxy_async()
                        off_n = j * BN1
                        acc, acc2 = mma(x_desc, x_ptr, w13_desc, w13_ptr, e, base, off_n, base + nrows, I, H, I,
                                        tl.cdiv(H, BK), H, 2 * I * H, H, BM, BN1, BK, False, USE_TMA, DOT_F32, True,
                                        True)
                        epilogue(acc, acc2, base, off_n, base + nrows, j, 0, I, act_ptr, I, h_ptr, 2 * I,
                                 act_ptr, act_ptr, act_ptr, BM, BN1, 1, False, STORE_H, EPI_SPLIT1,
                                 b13_ptr, e, 2 * I, alpha, limit, HAS_BIAS, ACT)
                    signal_counter(g1 + b)
                    go = fine
            else:  # GEMM2(b, j) for the blocks of step s - L1 - L2, j-major
                q = sub - GB * (1 + T1)
                b = (s - L1 - L2) * GB + q % GB
                j = q // GB
                if (b >= 0) & (b < nb):
                    e, row0, nrows, base = locate(b, e_idx, starts, cnts, nblk, cum, NS, BM)
                    fine = wait_counter(g1 + b, T1, tab, W, rank, call, timeout_ns)
                    if fine:
                        fence_proxy_async()
                        # the rows' owner addresses, loaded under the k-loop
                        rp, rvalid = push_rows(row0, nrows, tab, W, row_src_ptr, row_tok_ptr, row_slot_ptr, H,
                                                K, BM, DT, ALIGNED)
                        off_n = j * BN2
                        acc, _ = mma(act_desc, act_ptr, w2_desc, w2_ptr, e, base, off_n, base + nrows, H, I, 0,
                                     tl.cdiv(I, BK), I, H * I, I, BM, BN2, BK, False, USE_TMA, DOT_F32, False)
                        if HAS_BIAS:  # before the gate, which the tail applies: y = sum_j w_j * (a @ w2^T + b2)
                            rn = off_n + tl.arange(0, BN2)
                            b2v = tl.load(b2_ptr + e.to(tl.int64) * H + rn, mask=rn < H, other=0.0)
                            acc = acc + b2v.to(tl.float32)[None, :]
                        push_epilogue(acc, off_n, rp, rvalid, H, BM, BN2, DT, EPI_SPLIT2)
                    signal_counter(g2 + b)
                    go = fine


@dataclass(frozen=True)
class FusedConfig:
    """Launch config of the megakernel (not a public option: the backend picks it; tests ``with_`` fields).
    block_m: BM; bn1: GEMM1 columns per tile (gate and up each); bn2: GEMM2 columns per tile; programs: None = SM
    count; lookahead: L1 (None: max(programs / items per step + 1, 8), capped by a ring); lag: L2 (None: 3 dense, 1
    with a ring); at L1 = 3, L2 = 1 qwen3's GEMM items waited on pulls and GEMM1 tiles. kernel: "triton" | "gluon"."""

    block_m: int = 128
    bn1: int = 128
    bn2: int = 256
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 8
    epi_split1: int = 2
    epi_split2: int = 4
    programs: int | None = None
    lookahead: int | None = None
    lag: int | None = None
    pull_elems: int = 16384  # ROWS_P x BLOCK_H of one pull step
    group: int = 8           # blocks per step (GEMM items j-major over them: L2 reuse of weight tiles)
    use_tma: bool | None = None
    kernel: str = "triton"

    def with_(self, **kw) -> FusedConfig:
        return replace(self, **kw)


def default_fused_config(device: torch.device) -> FusedConfig:
    if interpreting():  # lookahead 2 / lag 1: the GPU defaults (8 / 3) triple the empty items the interpreter walks
        return FusedConfig(block_m=32, bn1=32, bn2=32, block_k=32, num_stages=1, num_warps=4, epi_split1=1,
                           epi_split2=1, programs=1, pull_elems=4096, lookahead=2, lag=1)
    return FusedConfig()


@dataclass
class FusedState:
    """What one fused forward leaves for the backward (see megamoe/backends/fused.py)."""

    handle: DispatchHandle
    xbuf: torch.Tensor           # [NROWS, H] received rows (dense: receive-row layout)
    act: torch.Tensor            # [NROWS, I]
    h: torch.Tensor | None       # [NROWS, 2I] (dense + store_h)


def plan_launch(cfg: FusedConfig, device: torch.device, H: int, I: int, ring_blocks: int) -> tuple[int, int, int, int]:
    """(programs, blocks per step G, lookahead L1, lag L2) for a launch; with a ring, G and L1 shrink so that
    every wait is on an earlier item (PULL(b) on GEMM1(b - NS), GEMM1(b) on GEMM2(b - NS): NS // G > L1 + L2)."""
    P = cfg.programs if cfg.programs is not None else num_sms(device)
    G, L2 = cfg.group, cfg.lag if cfg.lag is not None else (1 if ring_blocks else 3)
    steps_items = G * (1 + triton.cdiv(I, cfg.bn1) + triton.cdiv(H, cfg.bn2))
    L1 = cfg.lookahead if cfg.lookahead is not None else max(triton.cdiv(P, steps_items) + 1, 8)
    if ring_blocks:
        if ring_blocks < L2 + 3:
            raise ValueError(f"ring_blocks must be >= {L2 + 3} (lag + 3), got {ring_blocks}")
        G = max(1, min(G, ring_blocks // (L2 + 3)))
        L1 = max(1, min(L1, ring_blocks // G - L2 - 2))
    return P, G, L1, L2


def fused_forward(heap, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, cfg: FusedConfig, ring_blocks: int = 0, store_h: bool = False,
                  comm_programs: int | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  clamp: tuple[float, float] | None = None) -> tuple[torch.Tensor, FusedState]:
    """y [T, H] = the MoE layer's expert part for this rank's tokens (gates applied), via the megakernel.
    ring_blocks: 0 = dense buffers (CommShape.rows_for(T) rows, split's layout); else the ring's slots (>= lag + 3
    blocks). store_h: keep the SwiGLU input h (dense only, for the backward; gpt-oss: the biased pre-activation).
    gpt-oss experts: b13 [E_l, 2I], b2 [E_l, H] bf16 and clamp = (alpha, limit), all three or none; y[t] =
    sum_j topk_w[t, j] * (act_j @ w2[e_j]^T + b2[e_j]); the Triton items only (gluon_fused_reason)."""
    sh = heap.shape
    if not sh.slots:
        raise ValueError("fused_forward pushes rows into the owners' slots: the heap needs CommShape(slots=True)")
    T = x.shape[0]
    H, k, E_l = sh.hidden, sh.topk, sh.local_experts
    I = w2.shape[2]
    if tuple(w13.shape) != (E_l, 2 * I, H) or tuple(w2.shape) != (E_l, H, I):
        raise ValueError(f"w13 must be [E_l={E_l}, 2I, H={H}] and w2 [E_l, H, I]; got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError("fused_forward takes bf16 x, w13, w2")
    if tuple(topk_idx.shape) != (T, k) or tuple(topk_w.shape) != (T, k):
        raise ValueError(f"topk_idx and topk_w must be [T={T}, k={k}]")
    gpt_oss = clamp is not None
    if (b13 is None) == gpt_oss or (b2 is None) == gpt_oss:
        raise ValueError("fused_forward: give b13, b2 and clamp together (gpt-oss experts) or none of them")
    if gpt_oss:
        for name, b, shape in (("b13", b13, (E_l, 2 * I)), ("b2", b2, (E_l, H))):
            if tuple(b.shape) != shape or b.dtype != torch.bfloat16 or not b.is_contiguous():
                raise ValueError(f"fused_forward: {name} must be a contiguous bf16 {list(shape)}, got {b.dtype} "
                                 f"{list(b.shape)}")
    # every check, buffer and descriptor before READY: an error after it would leave the peers waiting for DONE
    if cfg.kernel not in ("triton", "gluon"):
        raise ValueError(f"FusedConfig.kernel must be 'triton' or 'gluon', got {cfg.kernel!r}")
    if cfg.kernel == "gluon" and (why := gluon_fused_reason(cfg, H=H, I=I, device=heap.device, gpt_oss=gpt_oss)):
        raise ValueError(f"fused_forward (kernel='gluon'): {why}")
    BM, BK, dev = cfg.block_m, cfg.block_k, heap.device
    P, GB, L1, L2 = plan_launch(cfg, dev, H, I, ring_blocks)
    Pc = max(1, int(comm_programs or heap.num_sms))
    R = sh.rows_for(T)
    nrows = ring_blocks * BM if ring_blocks else R
    xbuf = row_buffer((nrows, H), x.dtype, dev)
    act = row_buffer((nrows, I), x.dtype, dev)
    nb_max = triton.cdiv(R, BM) + E_l + GB
    h = row_buffer((nrows, 2 * I), torch.bfloat16, dev) if (store_h and not ring_blocks) else None
    y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    gate = topk_w.to(torch.float32).contiguous()
    sched = schedule_buffers(heap, T)
    ctr = torch.zeros(1 + 3 * nb_max, dtype=torch.int64, device=dev)
    wp2 = max(2, heap.wp2)
    if cfg.kernel == "gluon":
        items = prepare_gluon_fused(heap, cfg, sched, P, a=xbuf, w1=w13, act=act, w2=w2, h=h, ctr=ctr, I=I,
                                    nb_max=nb_max, ring_blocks=ring_blocks, group=GB, lookahead=L1, lag=L2)
    else:
        use_tma = cfg.use_tma if cfg.use_tma is not None else tma_ok([xbuf, act, w13, w2])
        x_desc = act_desc = w13_desc = w2_desc = None
        if use_tma:
            x_desc, act_desc = (TensorDescriptor.from_tensor(t, [BM, BK]) for t in (xbuf, act))
            w13_desc = TensorDescriptor.from_tensor(w13, [1, cfg.bn1, BK])
            w2_desc = TensorDescriptor.from_tensor(w2, [1, cfg.bn2, BK])
        block_h = min(triton.next_power_of_2(H), 2048)

        def items():
            record("_fused_fwd_kernel", _fused_fwd_kernel[(P,)](
                heap.tab, heap.world, heap.rank,
                x_desc, xbuf, w13_desc, w13, act_desc, act, w2_desc, w2, h if h is not None else act,
                sched.offs, sched.row_src, sched.row_tok, sched.row_slot, ctr,
                H, I, E_l, nb_max, ring_blocks, L1, L2, heap.timeout_ns,
                K=k, BM=BM, BN1=cfg.bn1, BN2=cfg.bn2, BK=BK, BLOCK_E=triton.next_power_of_2(max(E_l, 2)),
                EPI_SPLIT1=cfg.epi_split1, EPI_SPLIT2=cfg.epi_split2, GB=GB,
                ROWS_P=max(1, min(BM, cfg.pull_elems // block_h)), BLOCK_H=block_h,
                USE_TMA=use_tma, DOT_F32=interpreting(), STORE_H=h is not None, ALIGNED=(H * 2) % 16 == 0, WP2=wp2,
                b13_ptr=b13, b2_ptr=b2, alpha=None if clamp is None else float(clamp[0]),
                limit=None if clamp is None else float(clamp[1]), HAS_BIAS=b13 is not None, ACT=int(clamp is not None),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            ))
    block_hc = min(triton.next_power_of_2(H), 1024)
    y_arg = y if T > 0 else heap.rows_buffer()
    slots = heap.buffer("slots")
    # stage x and the routing, READY, the schedule (device-side, no host reads); then the items, DONE and the tail
    stage_and_schedule(heap, x, topk_idx, Pc, sched=sched)
    items()
    heap.after_launch()
    _publish_done_kernel[(1,)](heap.tab, heap.world, heap.rank, WP2=wp2)
    record("_fused_tail_kernel", _fused_tail_kernel[(P,)](
        heap.tab, heap.world, heap.rank, gate, y_arg, slots, T, H, heap.timeout_ns, K=k,
        ROWS_C=max(1, 4096 // block_hc), BLOCK_HC=block_hc, WP2=wp2,
        num_warps=16))  # bandwidth-bound (k rows of H per token): 16 warps 2.5x faster than 4 on an H200
    heap.after_launch()
    handle = DispatchHandle(heap=heap, num_tokens=T, schedule=sched, offs=sched.offs, num_sms=Pc)
    return y, FusedState(handle=handle, xbuf=xbuf, act=act, h=h)
