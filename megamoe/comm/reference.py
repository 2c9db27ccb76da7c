"""Pure-torch twins of the communication ops (one process, any device), used by tests and benchmarks. W world size,
T_s tokens of rank s, H hidden, k top-k, E experts, E_l = E / W, R_q rows received by rank q."""

from __future__ import annotations

import torch


def placement_ref(idxs: list[torch.Tensor], rank: int, num_experts: int):
    """(src, tok, slot) int64 [R] of the rows rank ``rank`` receives, ordered by (expert, source, token, slot),
    and offs int64 [E_l + 1]."""
    W = len(idxs)
    E_l = num_experts // W
    k = idxs[0].shape[1] if idxs[0].dim() == 2 else 1
    keys, src, tok, slot = [], [], [], []
    T_max = max([int(i.shape[0]) for i in idxs] + [1])
    counts = torch.zeros(E_l, dtype=torch.int64)
    for s, idx in enumerate(idxs):
        idx = idx.long().cpu()
        t, j = torch.meshgrid(torch.arange(idx.shape[0]), torch.arange(k), indexing="ij")
        e = idx.reshape(-1)
        m = (e // E_l) == rank
        le = e[m] - rank * E_l
        tt, jj = t.reshape(-1)[m], j.reshape(-1)[m]
        keys.append(((le * W + s) * T_max + tt) * k + jj)
        src.append(torch.full_like(tt, s))
        tok.append(tt)
        slot.append(jj)
        counts += torch.bincount(le, minlength=E_l)
    key = torch.cat(keys)
    order = torch.argsort(key)
    offs = torch.zeros(E_l + 1, dtype=torch.int64)
    offs[1:] = counts.cumsum(0)
    return torch.cat(src)[order], torch.cat(tok)[order], torch.cat(slot)[order], offs


def dispatch_ref(xs: list[torch.Tensor], idxs: list[torch.Tensor], rank: int, num_experts: int):
    """Rows rank ``rank`` receives: (recv [R, H], offs [E_l + 1], src, tok, slot [R]); xs[s]: [T_s, H]."""
    src, tok, slot, offs = placement_ref(idxs, rank, num_experts)
    H = xs[0].shape[1]
    recv = xs[0].new_empty(src.shape[0], H)
    for s in range(len(xs)):
        m = src == s
        if m.any():
            recv[m] = xs[s][tok[m].to(xs[s].device)].to(recv.device)
    return recv, offs, src, tok, slot


def gather_rows_ref(rows_by_rank: list[torch.Tensor], idxs: list[torch.Tensor], rank: int, num_experts: int):
    """out_rows[j] [T, H]: the row that rank ``rank``'s token t slot j has on its expert rank; rows_by_rank[q]:
    [>= R_q, H] rows of rank q in its receive order."""
    W = len(idxs)
    idx = idxs[rank].long().cpu()
    T, k = idx.shape
    out = [torch.empty(T, rows_by_rank[0].shape[1], dtype=rows_by_rank[0].dtype) for _ in range(k)]
    for q in range(W):
        src, tok, slot, _ = placement_ref(idxs, q, num_experts)
        m = src == rank
        pos = torch.nonzero(m).reshape(-1)
        rq = rows_by_rank[q].cpu()
        for j in range(k):
            mj = slot[m] == j
            out[j][tok[m][mj]] = rq[pos[mj]]
    return out


def combine_ref(topk_w: torch.Tensor | None, out_rows: list[torch.Tensor]) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * out_rows[j][t] in j order (w = 1 when topk_w is None), accumulated in float64 when
    the rows or gates are float64, else in float32."""
    wide = any(o.dtype == torch.float64 for o in out_rows) or (topk_w is not None and topk_w.dtype == torch.float64)
    cdt = torch.float64 if wide else torch.float32
    acc = torch.zeros(out_rows[0].shape, dtype=cdt) if out_rows else None
    for j, o in enumerate(out_rows):
        acc = acc + (topk_w[:, j : j + 1].to(cdt) * o.to(cdt) if topk_w is not None else o.to(cdt))
    return acc
