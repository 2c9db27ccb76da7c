"""Peers for ``megamoe bench --peers``: HuggingFace transformers' own MoE modules on a megamoe layer's weights.

A peer is the router and experts modules of the preset's architecture in transformers (qwen3_moe for softmax
presets, mixtral for ``mixtral-8x7b``, deepseek_v3 with one group for sigmoid presets, gpt_oss for gpt-oss experts),
with the experts implementation ``grouped_mm`` (transformers' fastest built-in on a GPU), the layer's router and expert
weights copied in (converted to transformers' layout: gpt_oss stores gate/up interleaved as [E, H, 2I] and down_proj
as [E, I, H]), run on one process. It computes what HF's block does, except DeepSeek-V3's shared expert, which
megamoe's preset does not have. SonicMoE (``sonicmoe``, where installed: Hopper, softmax top-k routers) is a second
peer: its fused layer on the same weights and router, gate/up in megamoe's concatenated layout.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import nn

IMPLEMENTATION = "grouped_mm"


class PeerOutput(NamedTuple):
    out: torch.Tensor


def _hf_modules(cfg):
    """(router, experts, family) of transformers for MoEConfig ``cfg``; ValueError names what has no peer."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("--peers needs transformers (pip install transformers)") from None
    common = dict(hidden_size=cfg.hidden, moe_intermediate_size=cfg.intermediate, num_experts_per_tok=cfg.top_k,
                  norm_topk_prob=cfg.norm_topk, hidden_act="silu", experts_implementation=IMPLEMENTATION)
    if cfg.expert_kind == "gpt_oss":
        if (cfg.swiglu_alpha, cfg.swiglu_limit) != (1.702, 7.0) or not cfg.router_bias or cfg.route_scale != 1.0:
            raise ValueError("no peer for gpt-oss experts other than transformers' (alpha 1.702, limit 7, router "
                             "bias, route_scale 1)")
        from transformers.models.gpt_oss import modeling_gpt_oss as m
        from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig

        hf = GptOssConfig(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate, num_local_experts=cfg.num_experts,
                          num_experts_per_tok=cfg.top_k, experts_implementation=IMPLEMENTATION)
        return m.GptOssTopKRouter(hf), m.GptOssExperts(hf), "gpt_oss"
    if cfg.expert_kind != "swiglu" or cfg.router_bias:
        raise ValueError(f"no peer for expert_kind {cfg.expert_kind!r} with router_bias={cfg.router_bias}")
    if cfg.router == "sigmoid":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

        hf = DeepseekV3Config(n_routed_experts=cfg.num_experts, n_group=1, topk_group=1, n_shared_experts=1,
                              routed_scaling_factor=cfg.route_scale, **common)
        return m.DeepseekV3TopkRouter(hf), m.DeepseekV3Experts(hf), "deepseek_v3"
    if cfg.route_scale != 1.0 or not cfg.norm_topk:
        raise ValueError("no peer for a softmax router with route_scale != 1 or without top-k renormalisation")
    if cfg.name.startswith("mixtral"):
        from transformers.models.mixtral import modeling_mixtral as m
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig

        del common["moe_intermediate_size"], common["norm_topk_prob"]
        hf = MixtralConfig(num_local_experts=cfg.num_experts, intermediate_size=cfg.intermediate, **common)
        return m.MixtralTopKRouter(hf), m.MixtralExperts(hf), "mixtral"
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    hf = Qwen3MoeConfig(num_experts=cfg.num_experts, **common)
    return m.Qwen3MoeTopKRouter(hf), m.Qwen3MoeExperts(hf), "qwen3_moe"


class HFPeer(nn.Module):
    """transformers' router + experts for ``moe``'s config with ``moe``'s weights (one process: W must be 1).
    ``forward(x [T, H])`` -> PeerOutput(out [T, H]) in the layer dtype, as ``MoE.forward``'s ``.out``."""

    def __init__(self, moe):
        super().__init__()
        if moe.world != 1:
            raise ValueError(f"peers run on one process; this layer has {moe.world} ranks")
        self.router, self.experts, self.family = _hf_modules(moe.config)
        self.name = f"hf-{self.family}:{IMPLEMENTATION}"
        self.to(device=moe.device, dtype=moe.config.dtype)
        with torch.no_grad():
            self.router.weight.copy_(moe.router.weight.to(self.router.weight.dtype))
            if self.family == "gpt_oss":  # transformers' own layout
                from megamoe.hf import gpt_oss_to_transformers

                self.router.bias.copy_(moe.router.logit_bias)
                ex = self.experts
                for dst, src in zip((ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias),
                                    gpt_oss_to_transformers(moe.w13, moe.w2, moe.b13, moe.b2), strict=True):
                    dst.copy_(src)
            else:
                self.experts.gate_up_proj.copy_(moe.w13)
                self.experts.down_proj.copy_(moe.w2)
            if hasattr(self.router, "e_score_correction_bias"):  # a buffer: kept fp32 as HF's checkpoints hold it
                self.router.e_score_correction_bias = torch.zeros(moe.config.num_experts, device=moe.device)

    def forward(self, x: torch.Tensor) -> PeerOutput:
        _, top_w, top_idx = self.router(x)
        return PeerOutput(self.experts(x, top_idx, top_w))  # the weights as HF's block passes them


class SonicPeer(nn.Module):
    """SonicMoE's layer (``sonicmoe.moe_TC_softmax_topk_layer``: softmax over the top-k logits, which is megamoe's
    softmax router with top-k renormalisation) on ``moe``'s weights, viewed in its (2I, H, E) / (H, I, E) layouts
    without a copy. ValueError says why there is none (not installed, another router or expert kind, not a GPU)."""

    def __init__(self, moe):
        super().__init__()
        c = moe.config
        if moe.world != 1 or moe.device.type != "cuda":
            raise ValueError("SonicMoE runs on one GPU process")
        if (c.router, c.norm_topk, c.route_scale, c.n_group, c.expert_kind, c.router_bias, c.shared_intermediate) != (
                "softmax", True, 1.0, 1, "swiglu", False, 0):
            raise ValueError("SonicMoE's layer has a softmax top-k router and SwiGLU experts only")
        if c.num_experts % 8 or c.num_experts > 4096 or c.top_k > 128:  # its top-k kernel asserts these
            raise ValueError(f"SonicMoE's router takes 8k <= 4096 experts and top-k <= 128, not E {c.num_experts}")
        try:
            import sonicmoe
        except Exception as exc:  # noqa: BLE001 - not installed, or its CUTLASS DSL does not load here
            raise ValueError(f"sonicmoe does not import ({type(exc).__name__}: {exc})") from None
        tune = os.environ.get("MEGAMOE_SONIC_TUNE", "all")
        if tune not in ("all", "default"):
            raise ValueError(f"MEGAMOE_SONIC_TUNE must be 'all' or 'default', got {tune!r}")
        if tune == "default":  # quack's one default GEMM config, not its first-use tuning (~90 compiles, minutes)
            import quack.gemm_interface as qgi
            from quack.autotuner import AutotuneConfig

            for tuned in (qgi.gemm_tuned, qgi.gemm_gated_tuned, qgi.gemm_dgated_tuned):
                tuned.configs = [AutotuneConfig(config=None)]  # one config: no tuning; None is its default
        self.fn, self.act, self.k = sonicmoe.moe_TC_softmax_topk_layer, "swiglu", c.top_k
        self.name = "sonicmoe-untuned" if tune == "default" else "sonicmoe"
        self.router_w = nn.Parameter(moe.router.weight.detach().to(c.dtype))
        self.w13, self.w2 = nn.Parameter(moe.w13.detach()), nn.Parameter(moe.w2.detach())  # shared storage

    def forward(self, x: torch.Tensor) -> PeerOutput:
        y, _, _ = self.fn(x, self.router_w, self.w13.permute(1, 2, 0), None, self.w2.permute(1, 2, 0), None, self.k,
                          torch.cuda.current_stream().cuda_stream, self.act, not torch.is_grad_enabled(), True, False,
                          True)  # (inference, softmax over the top k, norm_topk_probs, concat_layout)
        return PeerOutput(y)
