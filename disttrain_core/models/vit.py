"""Vision Transformer image encoder (CLIP ViT layout): convolutional patch
embedding, class token, learned positions, pre-norm blocks, output projection.

Input is uint8 pixels [N, 3, H, W]; normalization happens here so the data
pipeline can move compact uint8 tensors. Output is one embedding per patch
[N, P, output_dim] (the class token is dropped), which the projector maps into
the LLM's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VitConfig
from .common import FeedForwardGELU

# CLIP's pixel statistics.
PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)


class VitAttention(nn.Module):
    """Multi-head self-attention. Separate q/k/v projections (same parameter count as CLIP's
    fused qkv) so a tensor-parallel plan can shard them by heads from outside."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = (layer(x) for layer in (self.q, self.k, self.v))
        heads = q.shape[-1] // self.head_dim  # explicit: a microbatch may hold no image at all
        q, k, v = (t.view(batch, tokens, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, heads * self.head_dim))


class VitBlock(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = VitAttention(cfg.dim, cfg.n_heads)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = FeedForwardGELU(cfg.dim, cfg.mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.cfg = cfg
        grid = cfg.image_size // cfg.patch_size
        self.num_patches = grid * grid
        self.out_dim = cfg.output_dim or cfg.dim
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(cfg.dim)) if cfg.class_token else None
        self.positional_embedding = nn.Parameter(torch.empty(self.num_patches + int(cfg.class_token), cfg.dim))
        self.norm_pre = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.blocks = nn.ModuleDict({str(i): VitBlock(cfg) for i in range(cfg.n_layers)})
        self.norm_post = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.proj = nn.Linear(cfg.dim, cfg.output_dim, bias=False) if cfg.output_dim else None
        self.register_buffer("pixel_mean", torch.empty(0), persistent=False)
        self.register_buffer("pixel_std", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        device = self.pixel_mean.device
        self.pixel_mean = torch.tensor(PIXEL_MEAN, device=device).view(1, 3, 1, 1)
        self.pixel_std = torch.tensor(PIXEL_STD, device=device).view(1, 3, 1, 1)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_embed.weight.dtype
        x = images.to(torch.float32) / 255.0
        return ((x - self.pixel_mean) / self.pixel_std).to(dtype)

    # A pipeline stage runs: embed (first stage), run_blocks (its blocks), head (last stage).
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(self.normalize(images)).flatten(2).transpose(1, 2)  # [N, P, D]
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat((cls, x), dim=1)
        return self.norm_pre(x + self.positional_embedding.to(x.dtype))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.class_embedding is not None:
            x = x[:, 1:]
        x = self.norm_post(x)
        return self.proj(x) if self.proj is not None else x

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + int(self.cfg.class_token)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(self.embed(images)))
