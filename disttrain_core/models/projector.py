"""Projectors between modules (encoder width -> LLM width, LLM width -> generator conditioning width).

``kind: mlp`` (LLaVA-style, NExT-GPT-style): one output position per input position. ``kind: resampler`` (the image
encoder's projector only; validation refuses it elsewhere): a Perceiver / Q-Former-style resampler. ``num_queries``
learned queries, in the output width, pass through ``n_layers`` pre-norm residual blocks -- multi-head
cross-attention from the queries to the (normed) encoder tokens, then a GELU MLP -- and a final LayerNorm, so an
image of any patch count reaches the LLM as ``num_queries`` positions (config/model.py ``image_tokens``). The
keys and values are projected from the encoder's width straight to the output width; the queries attend to the
image tokens only (Flamingo's resampler also lets them attend to themselves; this one does not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ProjectorConfig
from .common import FeedForwardGELU


class MLPProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, cfg: ProjectorConfig):
        super().__init__()
        if cfg.n_layers not in (1, 2):
            raise ValueError(f"projector n_layers={cfg.n_layers}; allowed: 1 or 2")
        hidden = cfg.hidden_dim or out_dim
        if cfg.n_layers == 1:
            self.net = nn.Sequential(nn.Linear(in_dim, out_dim))
        else:
            self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CrossAttention(nn.Module):
    """Multi-head attention from ``x`` [N, Q, dim] to ``context`` [N, P, context_dim]; separate q/k/v projections
    (the ViT's layout, models/vit.py), keys and values projected from the context's width."""

    def __init__(self, dim: int, context_dim: int, n_heads: int):
        super().__init__()
        if n_heads < 1 or dim % n_heads:
            raise ValueError(f"resampler n_heads={n_heads} does not divide its width {dim}")
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(context_dim, dim)
        self.v = nn.Linear(context_dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, queries, _ = x.shape
        heads = self.q.out_features // self.head_dim

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, t.shape[1], heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(context)), split(self.v(context)))
        return self.proj(out.transpose(1, 2).reshape(batch, queries, heads * self.head_dim))


class ResamplerBlock(nn.Module):
    """x + attn(norm(x), context), then x + mlp(norm(x))."""

    def __init__(self, dim: int, context_dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CrossAttention(dim, context_dim, n_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForwardGELU(dim, hidden)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), context)
        return x + self.mlp(self.norm2(x))


class Resampler(nn.Module):
    """Encoder tokens [N, P, in_dim] -> [N, num_queries, out_dim] (module docstring)."""

    def __init__(self, in_dim: int, out_dim: int, cfg: ProjectorConfig):
        super().__init__()
        if cfg.num_queries < 1 or cfg.n_layers < 1:
            raise ValueError(f"resampler num_queries={cfg.num_queries} n_layers={cfg.n_layers}: use 1 or more of each")
        hidden = cfg.hidden_dim or 4 * out_dim
        self.queries = nn.Parameter(torch.empty(cfg.num_queries, out_dim))
        self.norm_context = nn.LayerNorm(in_dim)
        self.blocks = nn.ModuleList(ResamplerBlock(out_dim, in_dim, cfg.n_heads, hidden) for _ in range(cfg.n_layers))
        self.norm_out = nn.LayerNorm(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = self.norm_context(x)
        out = self.queries.expand(x.shape[0], -1, -1)
        for block in self.blocks:
            out = block(out, context)
        return self.norm_out(out)


# The projectors that may resample: their outputs' count is the data path's business (config/model.py image_tokens)
RESAMPLING = ("encoder_projector",)


def build_projector(in_dim: int, out_dim: int, cfg: ProjectorConfig, name: str = "encoder_projector") -> nn.Module:
    """The projector ``cfg.kind`` names, for the model's projector ``name`` (model.<name>)."""
    if cfg.kind == "resampler" and name in RESAMPLING:
        return Resampler(in_dim, out_dim, cfg)
    if cfg.kind != "mlp":
        allowed = "mlp, resampler" if name in RESAMPLING else "mlp (only model.encoder_projector resamples)"
        raise ValueError(f"model.{name}.kind={cfg.kind!r}: allowed values are {allowed}")
    return MLPProjector(in_dim, out_dim, cfg)
