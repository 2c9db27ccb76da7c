"""The small decoder-only transformer `megamoe train` trains, its FFN blocks megamoe MoE layers (B sequences,
S length, D width = the preset's H, V = 256 byte vocabulary):

    x = embed(tokens)                                        [B, S, D]
    for each block:  x = x + attn(rmsnorm(x))                 causal SDPA, rotary positions
                     x = x + moe(rmsnorm(x).view(B*S, D))     megamoe.MoE (experts sharded over the EP group)
    logits = head(rmsnorm(x))                                [B, S, V]

All but the experts is replicated (DDP averages its gradients). The MoE layers run in their config dtype; the block
casts to it and back to the residual stream's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.backends import parse_backend
from megamoe.config import MoEConfig
from megamoe.layer import MoE

VOCAB = 256


@dataclass(frozen=True)
class ModelConfig:
    moe: MoEConfig
    layers: int = 4
    heads: int = 16
    max_seq: int = 4096
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.moe.hidden % self.heads:
            raise ValueError(f"hidden ({self.moe.hidden}) must be divisible by heads ({self.heads})")
        if (self.moe.hidden // self.heads) % 2:
            raise ValueError(f"head dim ({self.moe.hidden // self.heads}) must be even for rotary embeddings")


def rotary_tables(seq: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)  # [S, hd/2]
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, S, hd]: rotate pairs (x[..., :hd/2], x[..., hd/2:]) by the position angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, group, backend: str, device, seed: int):
        super().__init__()
        D = cfg.moe.hidden
        self.norm1 = nn.RMSNorm(D, eps=1e-6)
        self.attn = Attention(D, cfg.heads)
        self.norm2 = nn.RMSNorm(D, eps=1e-6)
        name, options = parse_backend(backend)  # "split:presum_combine=1" -> ("split", {...})
        self.moe = MoE(cfg.moe, group=group, backend=name, device=device, seed=seed, **options)

    def dense(self, x, cos, sin):
        """(residual after attention, MoE input [B*S, D]); `megamoe train --compile` compiles this part only."""
        x = x + self.attn(self.norm1(x), cos, sin)
        B, S, D = x.shape
        return x, self.norm2(x).reshape(B * S, D).to(self.moe.w13.dtype).contiguous()

    def forward(self, x, cos, sin):
        x, h = self.dense(x, cos, sin)
        out = self.moe(h)
        return x + out.out.view(x.shape).to(x.dtype), out.aux_loss, out.tokens_per_expert


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, group, backend: str, device: torch.device, seed: int):
        super().__init__()
        self.cfg = cfg
        D = cfg.moe.hidden
        gen = torch.Generator().manual_seed(seed)  # replicated parameters: the same on every rank
        self.embed = nn.Embedding(VOCAB, D, device=device)
        self.blocks = nn.ModuleList(Block(cfg, group, backend, device, seed * 100 + i) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(D, eps=1e-6, device=device)
        self.head = nn.Linear(D, VOCAB, bias=False, device=device)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if ".moe." not in name and p.dim() >= 2:  # the MoE layers initialise themselves
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
            for blk in self.blocks:
                blk.attn.out.weight.mul_(1.0 / math.sqrt(2 * cfg.layers))
        self.blocks.to(device)
        cos, sin = rotary_tables(cfg.max_seq, D // cfg.heads, cfg.rope_base, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def expert_parameter_names(self) -> list[str]:
        """The parameters that live on this rank only (the MoE experts); everything else is replicated."""
        return [f"blocks.{i}.moe.{n}" for i in range(len(self.blocks)) for n in ("w13", "w2")]

    def forward(self, tokens: torch.Tensor):
        """tokens int64 [B, S] -> (logits [B, S, V], aux loss (sum over layers), tokens per expert [L, E])."""
        S = tokens.shape[1]
        if S > self.cfg.max_seq:
            raise ValueError(f"sequence length {S} exceeds max_seq {self.cfg.max_seq}")
        x = self.embed(tokens)
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        aux = x.new_zeros((), dtype=torch.float32)
        loads = []
        for blk in self.blocks:
            x, a, load = blk(x, cos, sin)
            aux = aux + a.float()
            loads.append(load)
        return self.head(self.norm(x)), aux, torch.stack(loads)
