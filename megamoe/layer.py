"""``megamoe.MoE``: the expert-parallel MoE layer (shapes as in :mod:`megamoe.config`).

Each rank holds the replicated router (``router.weight`` [E, H]) and experts r*E_l .. (r+1)*E_l - 1: ``w13``
[E_l, 2I, H] (gate rows 0..I-1, up rows I..2I-1) and ``w2`` [E_l, H, I] (gpt_oss experts also ``b13`` [E_l, 2I],
``b2`` [E_l, H]; its router ``router.logit_bias`` [E]); with a shared expert also the replicated ``shared_w13``
[2S, H], ``shared_w2`` [H, S] and (gated) ``shared_gate`` [1, H]. ``forward(x [..., H])`` returns
:class:`MoEOutput`; the token count may differ between ranks, including 0. Expert gradients are complete on their
owning rank; the replicated parameters' cover this rank's tokens only: reduce them over the data-parallel group.

Dtypes follow ``nn.Linear``: under ``torch.autocast`` on the input's device the layer computes in the autocast dtype
(weights cast per call, gradients flow back to them in their own dtype) and returns that dtype; outside autocast the
input must have the layer's dtype (a mismatch raises ``TypeError``). ``split`` and ``fused`` compute in bfloat16: a
float32 layer (mixed-precision training's fp32 master parameters) runs on them under bfloat16 autocast only, and
outside autocast raises ``ValueError``.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megamoe.backends import make_backend
from megamoe.config import MoEConfig, compute_dtype
from megamoe.dist import group_world_rank, wire_dtype
from megamoe.reference import swiglu
from megamoe.router import Router


class MoEOutput(NamedTuple):
    """out [..., H] (the input's leading shape, the compute dtype); aux_loss scalar (coef included);
    tokens_per_expert int64 [E] (device)."""

    out: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


class MoE(nn.Module):
    """Expert-parallel SwiGLU MoE layer.

    ``group``: the expert-parallel group (None: the default one, or a single process without torch.distributed, where
    every backend runs as world 1). ``backend``: ``"torch"``, ``"split"`` or ``"fused"``; an unavailable one raises,
    never replaced by another. ``device``: default the current CUDA device, else CPU; "meta" (with ``init="none"``,
    backend ``torch``) builds the layer without memory, for ``to_empty(device=...)`` and a checkpoint load. ``seed``:
    the router is drawn from it (same on every rank), expert e from seed and e (independent of W). ``init``:
    ``"random"`` (from ``seed``) or ``"none"`` (uninitialised memory, for a checkpoint to be copied in: one copy).
    ``backend_options``: the table in the backend's module. :meth:`close` (or deleting the layer) frees what the
    backend holds on the device."""

    def __init__(self, config: MoEConfig, group=None, backend: str = "torch", device=None, seed: int = 0,
                 init: str = "random", **backend_options):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if init not in ("random", "none"):
            raise ValueError(f"init must be 'random' or 'none', got {init!r}")
        self.config = config
        self.group = group
        _, self.world, self.rank = group_world_rank(group)
        self.local_experts = config.local_experts(self.world)  # raises unless W divides E
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "meta" and (init != "none" or backend != "torch"):
            raise ValueError("a layer on the meta device has no memory: build it with init='none' and backend "
                             "'torch', then to_empty(device=...) and load a checkpoint (or reset_parameters(seed)); "
                             f"split and fused allocate device buffers at construction (got init={init!r}, "
                             f"backend={backend!r})")
        E_l, H, I, S = self.local_experts, config.hidden, config.intermediate, config.shared_intermediate
        kw = dict(device=device, dtype=config.dtype)
        self.router = Router(config, device=device, init=init == "random")
        self.w13 = nn.Parameter(torch.empty(E_l, 2 * I, H, **kw))
        self.w2 = nn.Parameter(torch.empty(E_l, H, I, **kw))
        gpt_oss = config.expert_kind == "gpt_oss"
        self.b13 = nn.Parameter(torch.empty(E_l, 2 * I, **kw)) if gpt_oss else None
        self.b2 = nn.Parameter(torch.empty(E_l, H, **kw)) if gpt_oss else None
        self.shared_w13 = nn.Parameter(torch.empty(2 * S, H, **kw)) if S else None
        self.shared_w2 = nn.Parameter(torch.empty(H, S, **kw)) if S else None
        self.shared_gate = nn.Parameter(torch.empty(1, H, **kw)) if config.shared_gate else None
        self.seed = seed
        if init == "random":
            self.reset_parameters(seed)
        self.backend_name = backend
        # the backend holds the layer weakly, so a one-rank layer's backend goes when the user drops the layer and
        # the autograd graphs of its outputs are gone, and gives its heap back then (comm.heap.hold_heap)
        self.backend = make_backend(backend, self, **backend_options)

    @property
    def device(self) -> torch.device:
        """Where the parameters live (follows ``to_empty`` / ``to``)."""
        return self.w13.device

    @property
    def expert_offset(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.local_experts

    def close(self) -> None:
        """Free the device memory the backend holds (the symmetric heap goes with the last layer using it); the layer
        cannot be called afterwards. A one-rank layer does this also once it and the autograd graphs of its outputs
        are garbage collected; with peers call it on every rank after the last call's results are used (peers read
        this rank's buffers until they finish that call, and ranks must agree on which heaps exist)."""
        getattr(self.backend, "close", lambda: None)()  # backend torch holds nothing
        self.backend = None
        # a forward capture_graphs installed (here or on the module running the layer) would replay into the freed heap
        self.__dict__.pop("_graphed", self).__dict__.pop("forward", None)

    def reset_parameters(self, seed: int = 0) -> None:
        """Router from ``seed``; expert e (global id) from ``seed`` and e, std 1/sqrt(fan_in); the shared expert
        from ``seed`` alone (same on every rank)."""
        cfg = self.config
        self.router.reset_parameters(torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for e_local in range(self.local_experts):
                e = self.expert_offset + e_local
                gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + 7919 * (e + 1))
                kw = dict(generator=gen, device=self.device)
                for p, std in ((self.w13, cfg.hidden ** -0.5), (self.w2, cfg.intermediate ** -0.5)):
                    p[e_local].copy_(torch.randn(p.shape[1:], dtype=torch.float32, **kw) * std)
                if self.b13 is not None:  # drawn after the weights: SwiGLU layers keep their draws
                    for p in (self.b13, self.b2):
                        p[e_local].copy_(torch.randn(p.shape[1:], **kw) * 0.1)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
            fan_in = {"shared_w13": cfg.hidden, "shared_w2": cfg.shared_intermediate, "shared_gate": cfg.hidden}
            for name, fan in fan_in.items():
                if (p := getattr(self, name)) is not None:
                    p.copy_(torch.randn(p.shape, generator=gen) * fan ** -0.5)

    def _prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """x [..., H] -> (x [T, H] contiguous in the compute dtype, compute dtype); see the module docstring."""
        cfg = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE input must be a torch.Tensor, got {type(x).__name__}")
        if self.backend is None:
            raise ValueError("this MoE layer was closed")
        if x.dim() < 1 or x.shape[-1] != cfg.hidden:
            raise ValueError(f"MoE input must be [..., hidden={cfg.hidden}], got shape {tuple(x.shape)}")
        if x.device != self.w13.device:
            raise ValueError(f"MoE input is on {x.device}, the layer's parameters on {self.w13.device}")
        dtype = self.w13.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            if self.backend_name != "torch" and dtype != torch.bfloat16:
                raise ValueError(f"backend {self.backend_name!r} computes in bfloat16; autocast asks for {dtype}")
        elif self.backend_name != "torch" and dtype != torch.bfloat16:
            raise ValueError(f"backend {self.backend_name!r} computes in bfloat16: a {dtype} layer runs on it only "
                             "under torch.autocast(device_type, dtype=torch.bfloat16), which casts the weights per "
                             "call as nn.Linear does; or cast the layer to bfloat16, or use backend 'torch'")
        elif x.dtype != dtype:
            raise TypeError(f"MoE input dtype is {x.dtype}, the layer's is {dtype} (cast it, or run under "
                            "torch.autocast, where the layer computes in the autocast dtype)")
        return x.reshape(-1, cfg.hidden).to(dtype).contiguous(), dtype

    def expert_weights(self, dtype: torch.dtype) -> tuple:
        """(w13 [E_l, 2I, H], w2 [E_l, H, I], b13 [E_l, 2I] or None, b2 [E_l, H] or None) in ``dtype`` as the backend
        reads them, differentiable (a cast per call under autocast). A subclass storing the experts in another layout
        (megamoe.hf's gpt-oss block keeps transformers') converts them here."""
        b13, b2 = (None, None) if self.b13 is None else (self.b13.to(dtype), self.b2.to(dtype))
        return self.w13.to(dtype), self.w2.to(dtype), b13, b2

    def _run_experts(self, x2: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        w13, w2, b13, b2 = self.expert_weights(dtype)
        return self.backend(x2, idx, w, w13, w2, b13=b13, b2=b2)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        x2, dtype = self._prepare(x)
        with torch.autocast(x.device.type, enabled=False):
            r = self.router(x2)
            y = self._run_experts(x2, r.topk_idx, r.topk_w, dtype)
            if self.shared_w13 is not None:
                y = self._add_shared(x2, y)
        return MoEOutput(y.reshape(*x.shape[:-1], self.config.hidden), r.aux_loss, r.tokens_per_expert)

    def _add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the shared expert's output (gated), summed in float32 or better and rounded once."""
        cdt = compute_dtype(x.dtype)
        s = F.linear(swiglu(F.linear(x, self.shared_w13.to(x.dtype))), self.shared_w2.to(x.dtype)).to(cdt)
        if self.shared_gate is not None:
            s = s * torch.sigmoid(F.linear(x.to(cdt), self.shared_gate.to(cdt)))
        return (y.to(cdt) + s).to(x.dtype)

    def experts_forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """The routed experts on routing computed elsewhere: ``x`` [..., H], ``topk_idx`` [..., k] global expert ids
        (distinct per token, in [0, E): not checked on the device), ``topk_w`` [..., k] gates -> y [..., H] =
        sum_j topk_w[t, j] * expert_{idx[t, j]}(x_t), differentiable in x, topk_w and the expert weights. No router,
        no shared expert. Every rank of the group calls it (the experts are sharded); dtypes as :meth:`forward`."""
        x2, dtype = self._prepare(x)
        k = self.config.top_k
        lead = tuple(x.shape[:-1])
        for name, t in (("topk_idx", topk_idx), ("topk_w", topk_w)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != lead + (k,):
                raise ValueError(f"{name} must be a tensor of shape {lead + (k,)} (the input's leading shape and "
                                 f"top_k={k}), got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
            if t.device != x.device:
                raise ValueError(f"{name} is on {t.device}, the input on {x.device}")
        if topk_idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"topk_idx must be int64 or int32, got {topk_idx.dtype}")
        if not topk_w.is_floating_point():
            raise ValueError(f"topk_w must be a floating-point tensor, got {topk_w.dtype}")
        idx = topk_idx.reshape(-1, k).to(torch.int64).contiguous()
        w = topk_w.reshape(-1, k).to(compute_dtype(dtype)).contiguous()
        with torch.autocast(x.device.type, enabled=False):
            return self._run_experts(x2, idx, w, dtype).reshape(*lead, self.config.hidden)

    def extra_repr(self) -> str:
        c = self.config
        extra = f" groups={c.topk_group}/{c.n_group}" if c.n_group > 1 else ""
        extra += f" shared={c.shared_intermediate}{'(gated)' if c.shared_gate else ''}" if c.shared_intermediate else ""
        extra += " experts=gpt_oss" if c.expert_kind == "gpt_oss" else ""
        return (f"{c.name}: H={c.hidden} I={c.intermediate} E={c.num_experts} (E_l={self.local_experts}) "
                f"k={c.top_k} router={c.router}{extra} dtype={c.dtype} backend={self.backend_name} "
                f"rank={self.rank}/{self.world}")


def capture_moe_layers(layers, tokens: int, autocast=None) -> None:
    """Capture MoE layers' forward and backward in CUDA graphs, in place (torch.cuda.make_graphed_callables, one
    pool): each call then replays one graph instead of ~25 launches, removing eager training's per-layer host cost.

    ``layers``: MoE modules in forward order, backend split or fused (torch reads split sizes on the host);
    ``tokens``: the token count of every call (input [tokens, H]; another shape raises ``ValueError``);
    ``autocast``: the step's autocast context with ``cache_enabled=False``, or None. Call on every rank at once (the
    warm-up communicates), before wrapping the model in DDP. Outputs and parameter gradients live in static buffers
    the next replay overwrites: consume them within the step (no gradient accumulation). Host-side state changed after
    capture (``router.set_logit_offset``) is not seen."""
    layers = tuple(layers)
    capture_graphs("capture_moe_layers", layers, layers, tokens, lambda m, gen: (torch.randn(
        tokens, m.config.hidden, device=m.device, dtype=m.w13.dtype, generator=gen).requires_grad_(),), autocast)


def capture_graphs(name: str, modules, layers, tokens: int, sample, autocast=None) -> None:
    """make_graphed_callables on ``modules`` (one pool), each running MoE layer ``layers[i]``, with the sample
    arguments ``sample(layer, generator)`` of ``tokens`` tokens; the checks every capture of MoE layers needs."""
    if not modules:
        raise ValueError(f"{name}: no layers given")
    if not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"{name}: tokens must be a positive int, got {tokens!r}")
    for m in layers:
        if not isinstance(m, MoE):
            raise TypeError(f"{name}: expected megamoe.MoE modules, got {type(m).__name__}")
        if m.backend_name == "torch":
            raise ValueError("backend 'torch' cannot run in a CUDA graph (it reads split sizes on the host); "
                             "use split or fused")
        if m.device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA devices, the MoE layers are on {m.device}")
        if "_graphed" in m.__dict__:
            raise ValueError(f"{name}: a layer was captured already")
    gen = torch.Generator(device=layers[0].device).manual_seed(1234)
    samples = tuple(sample(m, gen) for m in layers)
    with autocast if autocast is not None else contextlib.nullcontext():
        torch.cuda.make_graphed_callables(tuple(modules), samples, num_warmup_iters=3, allow_unused_input=True)
    for mod, m, args in zip(modules, layers, samples, strict=True):
        mod.forward = _same_shape_only(name, tokens, tuple(args[0].shape), mod.forward)
        m.__dict__["_graphed"] = mod  # for close() (not an attribute: nn.Module would register it as a child)


def _same_shape_only(name: str, tokens: int, shape: tuple, replay):
    """Graphed forward ``replay`` refusing other input shapes: its copy into the static input would broadcast them."""

    def forward(x, *args, **kwargs):
        if x.shape != shape:
            raise ValueError(f"{name}: captured for {tokens} tokens per call (input {shape}), got {tuple(x.shape)}")
        return replay(x, *args, **kwargs)
    return forward


def shard_experts(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows of ``full`` [E, ...] that rank ``rank`` of ``world`` holds: experts rank*E_l .. (rank+1)*E_l - 1."""
    if full.shape[0] % world:
        raise ValueError(f"num_experts ({full.shape[0]}) must be divisible by the world size ({world})")
    return full.chunk(world)[rank]


@torch.no_grad()
def load_full_weights(moe: MoE, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      router_bias: torch.Tensor | None = None, shared: tuple | None = None,
                      expert_bias: tuple | None = None, logit_bias: torch.Tensor | None = None) -> None:
    """Copy unsharded weights into ``moe``: the router whole, this rank's slice of the experts, and ``shared``
    (w13 [2S, H], w2 [H, S], gate [1, H] or None) into the shared expert; gpt_oss experts: ``expert_bias`` (b13
    [E, 2I], b2 [E, H]) and the router's ``logit_bias`` [E]."""
    if (expert_bias is not None) != (moe.b13 is not None):
        raise ValueError("give expert_bias=(b13, b2) exactly when the layer's experts have biases (gpt_oss)")
    if (logit_bias is not None) != (moe.router.logit_bias is not None):
        raise ValueError("give logit_bias exactly when the layer's router has one (router_bias)")
    if (shared is not None) != (moe.shared_w13 is not None):
        raise ValueError("give shared=(w13, w2, gate) exactly when the layer has a shared expert")
    if shared is not None and (shared[2] is not None) != (moe.shared_gate is not None):
        raise ValueError("give the shared expert's gate exactly when the layer's shared expert is gated")
    if router_bias is not None and moe.router.bias is None:
        raise ValueError("this layer's router has no bias (router kind 'softmax')")
    whole = (moe.router.weight, moe.router.bias, moe.router.logit_bias, moe.shared_w13, moe.shared_w2, moe.shared_gate)
    for p, t in zip(whole, (router_weight, router_bias, logit_bias, *(shared or (None,) * 3)), strict=False):
        if t is not None:  # (the checks above: every tensor given has its parameter)
            p.copy_(t)
    for p, t in zip((moe.w13, moe.w2, moe.b13, moe.b2), (w13, w2, *(expert_bias or (None, None))), strict=False):
        if t is not None:
            p.copy_(shard_experts(t, moe.rank, moe.world))


def gather_experts(moe: MoE, tensor: torch.Tensor) -> torch.Tensor:
    """All ranks' [E_l, ...] shards of ``tensor`` (a weight or its gradient) as [E, ...] on every rank."""
    t = tensor.detach().contiguous()
    if moe.world == 1:
        return t.clone()
    wire = wire_dtype(t.dtype, moe.group)
    parts = [torch.empty_like(t, dtype=wire) for _ in range(moe.world)]
    dist.all_gather(parts, t.to(wire), group=moe.group)
    return torch.cat(parts).to(t.dtype)
