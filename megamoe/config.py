"""MoE layer configuration and the named presets.

Shapes: T tokens per rank, H hidden, I expert intermediate, E experts, W expert-parallel world size,
E_l = E / W local experts, k top-k. A constraint violated at construction or in
:meth:`MoEConfig.validate_world` raises ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

RouterKind = Literal["softmax", "sigmoid"]
ExpertKind = Literal["swiglu", "gpt_oss"]

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"float32"`` / ``torch.bfloat16`` ... -> torch.dtype (ValueError on anything else)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in set(_DTYPES.values()):
            raise ValueError(f"unsupported dtype {dtype}; expected one of bf16, fp16, fp32, fp64")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What routing and sums over rows compute in for ``dtype`` operands: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE layer (SwiGLU experts, top-k routing).

    ``hidden``, ``intermediate``, ``num_experts``, ``top_k``: H, I (w13 [2I, H], w2 [H, I]), E (all ranks), k.
    ``router``: "softmax" or "sigmoid" (:mod:`megamoe.router`); ``norm_topk``: divide a token's gates by their sum;
    ``route_scale``: then multiply them by this; ``aux_loss_coef``: weight of the load-balancing loss; ``dtype``:
    parameters and activations (routing computes in fp32 or better); ``max_tokens_per_rank``: tokens per rank per
    call the ``split``/``fused`` buffers are sized for (``torch`` ignores it).
    ``n_group``, ``topk_group``: group-limited routing (DeepSeek-V3): the E experts form ``n_group`` groups of
    consecutive ids, a group scores the sum of its two best selection scores, and a token picks its k experts from
    its ``topk_group`` best groups (1, 1: no limit). ``shared_intermediate``: S, the width of an always-on SwiGLU
    shared expert added to every token's output (0: none; DeepSeek-V3's n_shared_experts shared experts are one of
    width n * I); ``shared_gate``: scale it by sigmoid(x @ w_gate^T) per token (Qwen2-MoE).
    ``router_bias``: a trained bias [E] added to the router logits (gpt-oss; softmax router only).
    ``expert_kind``: "swiglu" (act = silu(g) * u) or "gpt_oss": biased projections (b13 [2I], b2 [H] per expert) and
    the clamped SwiGLU g = min(g, limit), u = clamp(u, -limit, limit), act = g * sigmoid(alpha * g) * (u + 1), with
    ``swiglu_alpha``, ``swiglu_limit`` (1.702 and 7 in gpt-oss); the routed experts only, never the shared one."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    router: RouterKind = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 1e-2
    dtype: torch.dtype = torch.bfloat16
    max_tokens_per_rank: int = 16384
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate: int = 0
    shared_gate: bool = False
    router_bias: bool = False
    expert_kind: ExpertKind = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "num_experts", "top_k", "max_tokens_per_rank", "n_group", "topk_group"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{field} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig: top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEConfig.router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if not (self.route_scale > 0):
            raise ValueError(f"MoEConfig.route_scale must be > 0, got {self.route_scale}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"MoEConfig: n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and "
                             f"topk_group ({self.topk_group}) be <= n_group")
        if self.n_group > 1 and (self.num_experts // self.n_group < 2
                                 or self.top_k > self.topk_group * (self.num_experts // self.n_group)):
            raise ValueError(f"MoEConfig: group-limited routing needs >= 2 experts per group (a group scores its top "
                             f"2) and top_k ({self.top_k}) <= topk_group * experts per group")
        if not isinstance(self.shared_intermediate, int) or self.shared_intermediate < 0:
            raise ValueError(f"MoEConfig.shared_intermediate must be an int >= 0, got {self.shared_intermediate!r}")
        if self.shared_gate and not self.shared_intermediate:
            raise ValueError("MoEConfig.shared_gate needs a shared expert (shared_intermediate > 0)")
        if self.router_bias and self.router != "softmax":
            raise ValueError("MoEConfig.router_bias (a trained logit bias) is for the softmax router; the sigmoid "
                             "router's bias is DeepSeek-V3's selection-only correction, always present")
        if self.expert_kind not in ("swiglu", "gpt_oss"):
            raise ValueError(f"MoEConfig.expert_kind must be 'swiglu' or 'gpt_oss', got {self.expert_kind!r}")
        if not (self.swiglu_alpha > 0 and self.swiglu_limit > 0):
            raise ValueError(f"MoEConfig: swiglu_alpha ({self.swiglu_alpha}) and swiglu_limit ({self.swiglu_limit}) "
                             "must be > 0")
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    def local_experts(self, world: int) -> int:
        """E_l = E / W, after checking that W divides E."""
        self.validate_world(world)
        return self.num_experts // world

    def validate_world(self, world: int) -> None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world size must be a positive int, got {world!r}")
        if self.num_experts % world != 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the world size ({world}) "
                             f"for expert parallelism (E/W experts per rank)")

    def flops_forward(self, rows: int) -> int:
        """Routed-expert FLOPs of a forward pass over ``rows`` (token, expert) pairs: 2*rows*H*2I + 2*rows*I*H."""
        return 6 * rows * self.hidden * self.intermediate

    def expert_weight_bytes(self, world: int) -> int:
        """Bytes of this rank's expert weights (w13 + w2, and gpt_oss's biases) in the layer dtype."""
        bias = 2 * self.intermediate + self.hidden if self.expert_kind == "gpt_oss" else 0
        return self.local_experts(world) * (3 * self.hidden * self.intermediate + bias) * self.dtype.itemsize

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, MoEConfig] = {c.name: c for c in (
    MoEConfig(hidden=2048, intermediate=768, num_experts=128, top_k=8, name="qwen3-30b-a3b"),
    # DeepSeek-V3's routed experts only (the benchmarks' shape); deepseek-v3-full adds its groups and shared expert
    MoEConfig(hidden=7168, intermediate=2048, num_experts=256, top_k=8, router="sigmoid", route_scale=2.5,
              name="deepseek-v3"),
    MoEConfig(hidden=7168, intermediate=2048, num_experts=256, top_k=8, router="sigmoid", route_scale=2.5,
              n_group=8, topk_group=4, shared_intermediate=2048, name="deepseek-v3-full"),
    MoEConfig(hidden=3584, intermediate=2560, num_experts=64, top_k=8, norm_topk=False, shared_intermediate=20480,
              shared_gate=True, name="qwen2-57b-a14b"),
    MoEConfig(hidden=2048, intermediate=1024, num_experts=64, top_k=8, norm_topk=False, name="olmoe-1b-7b"),
    MoEConfig(hidden=4096, intermediate=14336, num_experts=8, top_k=2, name="mixtral-8x7b"),
    # gpt-oss: router bias, biased projections, clamped SwiGLU (transformers' GptOssMLP)
    MoEConfig(hidden=2880, intermediate=2880, num_experts=128, top_k=4, router_bias=True, expert_kind="gpt_oss",
              name="gpt-oss-120b"),
    MoEConfig(hidden=2880, intermediate=2880, num_experts=32, top_k=4, router_bias=True, expert_kind="gpt_oss",
              name="gpt-oss-20b"),
    # CPU runs and tests; H not a power of two on purpose.
    MoEConfig(hidden=96, intermediate=64, num_experts=8, top_k=2, max_tokens_per_rank=256, name="tiny"),
)}


def preset(name: str, **overrides) -> MoEConfig:
    """A named preset, optionally with fields replaced (``preset("tiny", dtype=torch.float64)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
