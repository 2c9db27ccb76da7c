"""Pure-torch twins of the communication ops (single process, CPU or GPU), used by tests and benchmarks.

Shape legend: W world size, T_s tokens of rank s, H hidden, k top-k, E experts, E_l = E / W.
"""

from __future__ import annotations

import torch


def dispatch_ref(xs: list[torch.Tensor], idxs: list[torch.Tensor], rank: int, num_experts: int):
    """Rows rank ``rank`` receives, in (local expert, source rank, token, slot) order.

    xs[s]: [T_s, H]; idxs[s]: [T_s, k]. Returns (recv [R, H], offs int64 [E_l + 1], src, tok, slot int64 [R]).
    """
    W = len(xs)
    E_l = num_experts // W
    rows, src, tok, slot = [], [], [], []
    counts = []
    for le in range(E_l):
        e = rank * E_l + le
        n = 0
        for s in range(W):
            hit = (idxs[s].long() == e).nonzero()  # [n, 2] (t, j) in row-major order
            for t, j in hit.tolist():
                rows.append(xs[s][t])
                src.append(s)
                tok.append(t)
                slot.append(j)
                n += 1
        counts.append(n)
    H = xs[0].shape[1]
    recv = torch.stack(rows) if rows else xs[0].new_empty(0, H)
    offs = torch.zeros(E_l + 1, dtype=torch.int64)
    offs[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)
    return recv, offs, as_t(src), as_t(tok), as_t(slot)


def combine_ref(x: torch.Tensor, topk_w: torch.Tensor, out_rows: list[torch.Tensor]) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * out_rows[j][t] in j order, fp32 accumulation, cast to x.dtype.

    out_rows[j]: [T, H] the expert output that token t's slot j came back with.
    """
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for j, o in enumerate(out_rows):
        acc = acc + topk_w[:, j : j + 1].float() * o.float()
    return acc.to(x.dtype)
