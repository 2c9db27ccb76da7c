"""megamoe as a drop-in for the sparse MoE blocks of HuggingFace transformers (5.x) models.

    from megamoe import hf
    model = AutoModelForCausalLM.from_pretrained(...)     # or from_config; move / cast it first
    hf.patch(model, backend="split")                      # every sparse MoE block now runs megamoe

Supported blocks: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3 (SiLU experts) and gpt_oss. A patched block keeps
transformers' call signature, return value and parameter names: ``gate.weight`` (and DeepSeek-V3's
``gate.e_score_correction_bias``), ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and
``experts.down_proj`` [E, H, I] (megamoe's ``w13`` / ``w2``, the same tensors), and the shared-expert modules
(``shared_expert`` + ``shared_expert_gate``, ``shared_experts``), which stay transformers' dense MLPs. gpt_oss keeps
its own names and layout (``router.weight``, ``router.bias``: megamoe's ``router.logit_bias``; ``experts.*_proj`` and
``experts.*_proj_bias`` as :func:`gpt_oss_from_transformers` takes them), converted each call (one differentiable
copy of the expert weights), and returns ``(out, router_scores)`` as transformers' does. Its ``gate`` (gpt_oss:
``router``) is an instance of the model's own router class whose forward runs megamoe's routing, so the router
logits that transformers records for its load-balancing loss (``output_router_logits``) are still recorded, in
float32. The routed experts run on the chosen backend (:meth:`megamoe.MoE.experts_forward`).

Expert parallelism (``group`` of W ranks): every rank builds and loads the whole model, and ``patch`` keeps rank r's
experts r*E/W .. (r+1)*E/W - 1 of each block (the others are freed). Afterwards ``load_state_dict`` takes either a
patched model's shards or full [E, ...] tensors from a transformers checkpoint (each rank keeps its slice); to save,
``full_state_dict(model)`` gathers the experts on every rank (a collective) and rank 0 writes it with
``model.save_pretrained(path, state_dict=...)``, which plain transformers loads. The router and shared experts are
replicated: reduce their gradients over the data-parallel group as for any replicated parameter.

Patch after moving or casting the model (the backend is built for the device and dtype it finds; an fp32 model runs
on ``split`` / ``fused`` under bf16 autocast). gpt_oss runs on backends ``torch``, ``split`` and ``fused`` (the Triton
megakernel's items). An unsupported block, activation or option raises ``ValueError`` naming it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megamoe.config import MoEConfig
from megamoe.layer import MoE, capture_graphs, gather_experts, shard_experts
from megamoe.router import route

#: transformers block class -> model type
SUPPORTED = {"Qwen3MoeSparseMoeBlock": "qwen3_moe", "Qwen2MoeSparseMoeBlock": "qwen2_moe",
             "MixtralSparseMoeBlock": "mixtral", "OlmoeSparseMoeBlock": "olmoe", "DeepseekV3MoE": "deepseek_v3",
             "GptOssMLP": "gpt_oss"}
_SHARED = ("shared_expert", "shared_expert_gate", "shared_experts")
#: the expert tensors a patched block shards and gathers (gpt_oss has all four)
_EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def _gate_forward(self, hidden_states: torch.Tensor):
    """The patched router: (router_logits [T, E] float32, gates [T, k] float32, expert ids [T, k]) as transformers'
    routers return them, computed by :func:`megamoe.router.route` (gpt_oss: its bias added to the logits; softmax
    over all logits, then the top k renormalised: the softmax of the top-k logits that transformers takes)."""
    x = hidden_states.reshape(-1, self.weight.shape[1])
    cfg = self.megamoe_config
    offset = self.bias if cfg.router_bias else None  # route adds it in the routing dtype
    r = route(x, self.weight, cfg, getattr(self, "e_score_correction_bias", None), offset)
    return r.logits, r.topk_w, r.topk_idx


@functools.cache
def _gate_class(cls: type) -> type:
    """A subclass of the model's router class (so transformers' output recorders still match it by isinstance)
    whose forward is megamoe's routing."""
    return type(f"MegaMoE{cls.__name__}", (cls,), {"forward": _gate_forward, "__module__": __name__})


def gpt_oss_from_transformers(gate_up, gate_up_bias, down, down_bias) -> tuple:
    """transformers' gpt_oss experts (gate_up [E, H, 2I] and its bias [E, 2I], gate and up interleaved: 0::2, 1::2;
    down [E, I, H]; down_bias [E, H]) -> megamoe's (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13, b2)."""
    E, H, I2 = gate_up.shape
    return (gate_up.view(E, H, I2 // 2, 2).permute(0, 3, 2, 1).reshape(E, I2, H), down.transpose(1, 2).contiguous(),
            gate_up_bias.view(E, I2 // 2, 2).transpose(1, 2).reshape(E, I2), down_bias)


def gpt_oss_to_transformers(w13, w2, b13, b2) -> tuple:
    """The inverse of :func:`gpt_oss_from_transformers`: (gate_up, gate_up_bias, down, down_bias)."""
    E, I2, H = w13.shape
    return (w13.view(E, 2, I2 // 2, H).permute(0, 3, 2, 1).reshape(E, H, I2),
            b13.view(E, 2, I2 // 2).transpose(1, 2).reshape(E, I2), w2.transpose(1, 2), b2)


class GptOssMoE(MoE):
    """A patched gpt_oss block's layer: ``w13``, ``b13``, ``w2``, ``b2`` in transformers' layout, converted per call."""

    def expert_weights(self, dtype: torch.dtype) -> tuple:
        return gpt_oss_from_transformers(*(t.to(dtype) for t in (self.w13, self.b13, self.w2, self.b2)))


class MegaMoEExperts(nn.Module):
    """A patched block's ``experts``: this rank's expert tensors under transformers' names (module docstring);
    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` runs :meth:`MoE.experts_forward`."""

    def __init__(self, moe: MoE):
        super().__init__()
        for name, t in zip(_EXPERT_TENSORS, (moe.w13, moe.w2, moe.b13, moe.b2), strict=True):
            if t is not None:
                setattr(self, name, t)
        self.num_experts = moe.config.num_experts
        self.__dict__["moe"] = moe  # not a submodule: its parameters are registered here under transformers' names

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.moe.experts_forward(hidden_states, top_k_index, top_k_weights)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        moe = self.moe
        for name in _EXPERT_TENSORS:  # a full transformers tensor: keep this rank's experts
            if (t := state_dict.get(prefix + name)) is not None and moe.world > 1 and t.shape[0] == self.num_experts:
                state_dict[prefix + name] = shard_experts(t, moe.rank, moe.world)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class MegaMoEBlock(nn.Module):
    """A transformers sparse MoE block running on megamoe (module docstring); ``moe`` is the :class:`megamoe.MoE`
    doing the work (``moe.backend``, ``moe.close()``)."""

    def __init__(self, block: nn.Module, group=None, backend: str = "torch", max_tokens_per_rank: int = 16384,
                 **backend_options):
        super().__init__()
        kind = type(block).__name__
        if kind not in SUPPORTED:
            raise ValueError(_unsupported(kind))
        self.model_type = SUPPORTED[kind]
        gpt_oss = self.model_type == "gpt_oss"
        gate, experts = (block.router if gpt_oss else block.gate), block.experts
        act = type(getattr(experts, "act_fn", None)).__name__
        if not gpt_oss and act not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"{kind}: megamoe's experts are SwiGLU (silu); this block's activation is {act}")
        w13, w2 = experts.gate_up_proj, experts.down_proj
        E, H, I2 = w13.shape if gpt_oss else w13.transpose(1, 2).shape  # gpt_oss: [E, H, 2I] and [E, I, H]
        want = (E, I2 // 2, H) if gpt_oss else (E, H, I2 // 2)
        if tuple(w2.shape) != want:
            raise ValueError(f"{kind}: down_proj has shape {tuple(w2.shape)}, expected {want}")
        deepseek = self.model_type == "deepseek_v3"
        n_group = getattr(gate, "num_group", 1) if deepseek else 1
        cfg = MoEConfig(
            hidden=H, intermediate=I2 // 2, num_experts=E, top_k=gate.top_k,
            router="sigmoid" if deepseek else "softmax",
            norm_topk=self.model_type in ("mixtral", "gpt_oss") or bool(gate.norm_topk_prob),
            route_scale=float(gate.routed_scaling_factor) if deepseek else 1.0,
            aux_loss_coef=0.0,  # transformers computes its own from the recorded router logits
            dtype=w13.dtype, max_tokens_per_rank=max_tokens_per_rank,
            n_group=n_group, topk_group=gate.topk_group if n_group > 1 else 1,
            name=f"hf-{self.model_type}")
        tensors = {"w13": w13, "w2": w2}
        if gpt_oss:
            cfg = cfg.replace(router_bias=True, expert_kind="gpt_oss",
                              swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit))
            tensors.update(b13=experts.gate_up_proj_bias, b2=experts.down_proj_bias)
        layer = GptOssMoE if gpt_oss else MoE
        moe = layer(cfg, group=group, backend=backend, device=w13.device, init="none", **backend_options)
        # adopt transformers' tensors: one rank holds them as they are, EP ranks a copy of their slice
        with torch.no_grad():
            for name, full in tensors.items():
                part = full if moe.world == 1 else nn.Parameter(
                    shard_experts(full.detach(), moe.rank, moe.world).clone(), requires_grad=full.requires_grad)
                setattr(moe, name, part)
        moe.router.weight = gate.weight
        if deepseek:
            moe.router.bias = gate.e_score_correction_bias
        if gpt_oss:
            moe.router.logit_bias = gate.bias
        gate.__class__ = _gate_class(type(gate))
        gate.__dict__["megamoe_config"] = cfg
        setattr(self, "router" if gpt_oss else "gate", gate)
        self.experts = MegaMoEExperts(moe)
        for name in _SHARED:
            if hasattr(block, name):
                setattr(self, name, getattr(block, name))
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0))
        self.__dict__["moe"] = moe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x, shape = hidden_states, hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's multiplicative input jitter
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = x.reshape(-1, shape[-1])
        if self.model_type == "gpt_oss":
            _, gates, idx = self.router(x)
            return self.experts(x, idx, gates).reshape(shape), gates
        _, gates, idx = self.gate(x)
        y = self.experts(x, idx, gates)
        if self.model_type == "qwen2_moe":
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.model_type == "deepseek_v3":
            y = y + self.shared_experts(x)
        return y.reshape(shape)


def _unsupported(kind: str) -> str:
    return f"megamoe.hf cannot patch {kind}; supported blocks: {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}"


def patch(model: nn.Module, backend: str = "torch", group=None, max_tokens_per_rank: int = 16384,
          **backend_options) -> nn.Module:
    """Replace every sparse MoE block of ``model`` in place with a :class:`MegaMoEBlock` (module docstring) and return
    ``model``. ``backend``, ``group`` and ``backend_options`` as for :class:`megamoe.MoE`; ``max_tokens_per_rank``:
    tokens (batch x sequence) per rank per call the ``split`` / ``fused`` buffers are sized for. Raises
    ``ValueError`` naming a block it cannot patch (a module with an ``experts`` child of an unknown class), or when
    the model has no MoE block."""
    found, patched = [], blocks(model)  # a block patched already stays as it is
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind in SUPPORTED:
            found.append((name, module))
        elif not isinstance(module, MegaMoEBlock) and isinstance(getattr(module, "experts", None), nn.Module):
            raise ValueError(_unsupported(kind) + f" (module {name!r})")
    if not found and not patched:
        raise ValueError(f"{type(model).__name__} has no sparse MoE block megamoe.hf can patch; supported blocks: "
                         f"{', '.join(SUPPORTED)}")
    for name, block in found:
        parent, _, child = name.rpartition(".")  # get_submodule("") is the model itself
        setattr(model.get_submodule(parent), child, MegaMoEBlock(
            block, group=group, backend=backend, max_tokens_per_rank=max_tokens_per_rank, **backend_options))
    return model


def capture(model: nn.Module, tokens: int, autocast=None) -> nn.Module:
    """Capture the routed experts of every patched block in CUDA graphs, forward and backward, as
    :func:`megamoe.capture_moe_layers` does for MoE layers (its rules hold), and return ``model``: the host cost of the
    backend's kernel chain, which an eager training loop pays per layer, goes. Router and shared experts stay eager;
    every call must have ``tokens`` tokens (batch x sequence; another count raises ``ValueError``)."""
    if not (found := blocks(model)):
        raise ValueError(f"{type(model).__name__} has no patched MoE block: call megamoe.hf.patch first")

    def sample(moe: MoE, gen: torch.Generator) -> tuple:
        c, dev = moe.config, moe.device
        idx = torch.rand(tokens, c.num_experts, device=dev, generator=gen).topk(c.top_k, dim=-1).indices
        gates = torch.rand(tokens, c.top_k, device=dev, generator=gen).requires_grad_()  # the router's float32
        x = torch.randn(tokens, c.hidden, device=dev, dtype=moe.w13.dtype, generator=gen).requires_grad_()
        return x, idx, gates

    capture_graphs("hf.capture", [b.experts for b in found], [b.moe for b in found], tokens, sample, autocast)
    return model


def blocks(model: nn.Module) -> list[MegaMoEBlock]:
    """The patched blocks of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MegaMoEBlock)]


def full_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with every patched block's experts gathered to all E experts: what plain transformers
    loads. A collective under expert parallelism: call it on every rank (each gets the whole dict)."""
    sd = model.state_dict()
    for name, m in model.named_modules():
        if isinstance(m, MegaMoEBlock) and m.moe.world > 1:
            for p in _EXPERT_TENSORS:
                key = f"{name}.experts.{p}" if name else f"experts.{p}"
                if key in sd:
                    sd[key] = gather_experts(m.moe, getattr(m.experts, p))
    return sd
