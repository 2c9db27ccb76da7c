"""``megamoe.MoE``: the expert-parallel MoE layer (shapes as in :mod:`megamoe.config`).

Each rank holds the replicated router (``router.weight`` [E, H]) and experts r*E_l .. (r+1)*E_l - 1:
``w13`` [E_l, 2I, H] (gate rows 0..I-1, up rows I..2I-1) and ``w2`` [E_l, H, I]. ``forward(x [T, H])`` returns
:class:`MoEOutput`; T may differ between ranks, including 0. Expert gradients are complete on their owning rank;
the router's covers this rank's tokens only, so reduce it over the data-parallel group (DDP does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megamoe.backends import make_backend
from megamoe.config import MoEConfig
from megamoe.dist import wire_dtype
from megamoe.router import Router


class MoEOutput(NamedTuple):
    """out [T, H] in the layer dtype; aux_loss scalar (coef included); tokens_per_expert int64 [E] (device)."""

    out: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


def _group_world_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class MoE(nn.Module):
    """Expert-parallel SwiGLU MoE layer.

    ``group``: the expert-parallel group (None: the default one, or a single process without torch.distributed).
    ``backend``: ``"torch"``, ``"split"`` or ``"fused"``; an unavailable one raises, never replaced by another.
    ``device``: default the current CUDA device, else CPU. ``seed``: the router is drawn from it (same on every
    rank), expert e from seed and e (independent of W). ``backend_options``: the table in the backend's module.
    """

    def __init__(self, config: MoEConfig, group=None, backend: str = "torch", device=None, seed: int = 0,
                 **backend_options):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.group = group
        self.world, self.rank = _group_world_rank(group)
        self.local_experts = config.local_experts(self.world)  # raises unless W divides E
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        E_l, H, I = self.local_experts, config.hidden, config.intermediate
        self.router = Router(config, device=self.device)
        self.w13 = nn.Parameter(torch.empty(E_l, 2 * I, H, device=self.device, dtype=config.dtype))
        self.w2 = nn.Parameter(torch.empty(E_l, H, I, device=self.device, dtype=config.dtype))
        self.seed = seed
        self.reset_parameters(seed)
        self.backend_name = backend
        self.backend = make_backend(backend, self, **backend_options)

    @property
    def expert_offset(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.local_experts

    def reset_parameters(self, seed: int = 0) -> None:
        """Router from ``seed``; expert e (global id) from ``seed`` and e, std 1/sqrt(fan_in)."""
        cfg = self.config
        self.router.reset_parameters(torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for e_local in range(self.local_experts):
                e = self.expert_offset + e_local
                gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + 7919 * (e + 1))
                w13 = torch.randn(self.w13.shape[1:], generator=gen, device=self.device, dtype=torch.float32)
                w2 = torch.randn(self.w2.shape[1:], generator=gen, device=self.device, dtype=torch.float32)
                self.w13[e_local].copy_(w13 * cfg.hidden ** -0.5)
                self.w2[e_local].copy_(w2 * cfg.intermediate ** -0.5)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise a clear error if ``x`` is not a contiguous [T, H] tensor of the layer's dtype and device."""
        cfg = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(
                f"MoE input must be 2-D [tokens, hidden={cfg.hidden}], got shape {tuple(x.shape)}; "
                "flatten batch and sequence first (x.view(-1, hidden))"
            )
        if x.shape[1] != cfg.hidden:
            raise ValueError(f"MoE input hidden size is {x.shape[1]}, the layer's is {cfg.hidden}")
        if x.dtype != self.w13.dtype:
            raise TypeError(f"MoE input dtype is {x.dtype}, the layer's is {self.w13.dtype}")
        if x.device != self.w13.device:
            raise ValueError(f"MoE input is on {x.device}, the layer's parameters on {self.w13.device}")
        if not x.is_contiguous():
            raise ValueError("MoE input must be contiguous (call .contiguous() first)")

    def forward(self, x: torch.Tensor) -> MoEOutput:
        self.check_input(x)
        r = self.router(x)
        y = self.backend(x, r.topk_idx, r.topk_w, self.w13, self.w2)
        return MoEOutput(y, r.aux_loss, r.tokens_per_expert)

    def extra_repr(self) -> str:
        c = self.config
        return (f"{c.name}: H={c.hidden} I={c.intermediate} E={c.num_experts} (E_l={self.local_experts}) "
                f"k={c.top_k} router={c.router} dtype={c.dtype} backend={self.backend_name} "
                f"rank={self.rank}/{self.world}")


def capture_moe_layers(layers, tokens: int, autocast=None) -> None:
    """Capture MoE layers' forward and backward in CUDA graphs, in place (torch.cuda.make_graphed_callables, one
    pool): each call then replays one graph instead of ~25 launches, removing eager training's per-layer host cost.

    ``layers``: MoE modules in forward order, backend split or fused (torch reads split sizes on the host);
    ``tokens``: the token count of every call; ``autocast``: the step's autocast context with ``cache_enabled=False``,
    or None. Call on every rank at once (the warm-up communicates), before wrapping the model in DDP. Outputs and
    parameter gradients live in static buffers the next replay overwrites: consume them within the step (no gradient
    accumulation). Host-side state changed after capture (``router.set_logit_offset``) is not seen.
    """
    import contextlib

    layers = tuple(layers)
    if not layers:
        raise ValueError("capture_moe_layers: no layers given")
    if not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"capture_moe_layers: tokens must be a positive int, got {tokens!r}")
    for m in layers:
        if not isinstance(m, MoE):
            raise TypeError(f"capture_moe_layers: expected megamoe.MoE modules, got {type(m).__name__}")
        if m.backend_name == "torch":
            raise ValueError("backend 'torch' cannot run in a CUDA graph (it reads split sizes on the host); "
                             "use split or fused")
        if m.device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA devices, the MoE layers are on {m.device}")
        if getattr(m, "_megamoe_captured", False):
            raise ValueError("capture_moe_layers: a layer was captured already")
    gen = torch.Generator(device=layers[0].device).manual_seed(1234)
    samples = tuple((torch.randn(tokens, m.config.hidden, device=m.device, dtype=m.w13.dtype, generator=gen)
                     .requires_grad_(),) for m in layers)
    with autocast if autocast is not None else contextlib.nullcontext():
        torch.cuda.make_graphed_callables(layers, samples, num_warmup_iters=3, allow_unused_input=True)
    for m in layers:
        m._megamoe_captured = True


def shard_experts(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows of ``full`` [E, ...] that rank ``rank`` of ``world`` holds: experts rank*E_l .. (rank+1)*E_l - 1."""
    E = full.shape[0]
    if E % world:
        raise ValueError(f"num_experts ({E}) must be divisible by the world size ({world})")
    E_l = E // world
    return full[rank * E_l:(rank + 1) * E_l]


@torch.no_grad()
def load_full_weights(moe: MoE, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      router_bias: torch.Tensor | None = None) -> None:
    """Copy unsharded weights into ``moe``: the router whole, this rank's slice of the experts."""
    moe.router.weight.copy_(router_weight)
    if router_bias is not None:
        if moe.router.bias is None:
            raise ValueError("this layer's router has no bias (router kind 'softmax')")
        moe.router.bias.copy_(router_bias)
    moe.w13.copy_(shard_experts(w13, moe.rank, moe.world))
    moe.w2.copy_(shard_experts(w2, moe.rank, moe.world))


def gather_experts(moe: MoE, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """All ranks' [E_l, ...] shards of ``tensor`` (default ``moe.w13``; gradients too) as [E, ...] on every rank."""
    t = moe.w13 if tensor is None else tensor
    t = t.detach().contiguous()
    if moe.world == 1:
        return t.clone()
    wire = wire_dtype(t.dtype, moe.group)
    parts = [torch.empty_like(t, dtype=wire) for _ in range(moe.world)]
    dist.all_gather(parts, t.to(wire), group=moe.group)
    return torch.cat(parts).to(t.dtype)
