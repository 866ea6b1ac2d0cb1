"""Vision Transformer image encoder (CLIP ViT layout): convolutional patch
embedding, class token, learned positions, pre-norm blocks, output projection.

Input is uint8 pixels [N, 3, H, W]; normalization happens here so the data
pipeline can move compact uint8 tensors. Output is one embedding per patch
[N, P, out_dim] (the class token is dropped), which the projector maps into
the LLM's width.

``feature_layer`` (LLaVA-style) takes a hidden state instead: only the blocks up
to it are built (:func:`vit_block_count`, which every block-count consumer uses),
and there is no output norm and no projection, so ``out_dim`` is ``dim``.
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


def vit_block_count(cfg: VitConfig) -> int:
    """The number of blocks the encoder builds (and runs, splits, counts FLOPs of).

    ``n_layers`` without ``feature_layer``; with it, the blocks up to that hidden state, indexed as Hugging
    Face's ``hidden_states`` (``n_layers + 1`` entries: 0 = the embeddings, -1 = the last block's output).
    The embeddings themselves (no block at all) are refused: a unit needs a block to split and plan.
    """
    layer = cfg.feature_layer
    if layer is None:
        return cfg.n_layers
    count = layer if layer >= 0 else cfg.n_layers + 1 + layer
    if not 1 <= count <= cfg.n_layers:
        raise ValueError(
            f"model.encoder.feature_layer={layer} is out of range for model.encoder.n_layers={cfg.n_layers}: "
            f"set it within {-cfg.n_layers}..-1 or 1..{cfg.n_layers} (LLaVA uses -2), or null for every block"
        )
    return count


class VitAttention(nn.Module):
    """Multi-head self-attention. Separate q/k/v projections (same parameter count as CLIP's
    fused qkv) so a tensor-parallel plan can shard them by heads from outside."""

    def __init__(self, dim: int, n_heads: int, key_bias: bool = True):
        super().__init__()
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=key_bias)  # Whisper's key projection has none (models/audio.py)
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
    """A pre-norm transformer block with GELU MLP: the ViT's, and the audio tower's (models/audio.py, whose key
    projection has no bias); tensor parallelism, recompute and compile treat both alike."""

    def __init__(
        self, dim: int, n_heads: int, mlp_dim: int, norm_eps: float, activation: str = "gelu", key_bias: bool = True
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = VitAttention(dim, n_heads, key_bias=key_bias)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = FeedForwardGELU(dim, mlp_dim, activation=activation)
        self.sequence = None  # sequence parallelism (models/llama.py DecoderBlock has the same)

    @classmethod
    def of(cls, cfg: VitConfig) -> VitBlock:
        """A block of the ViT ``cfg`` describes."""
        return cls(cfg.dim, cfg.n_heads, cfg.mlp_dim, cfg.norm_eps, cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = self.sequence
        if seq is None:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = x + seq.reduce_scatter(self.attn(seq.gather(self.norm1(x))))
        return x + seq.reduce_scatter(self.mlp(seq.gather(self.norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.cfg = cfg
        grid = cfg.image_size // cfg.patch_size
        self.num_patches = grid * grid
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(cfg.dim)) if cfg.class_token else None
        self.positional_embedding = nn.Parameter(torch.empty(self.num_patches + int(cfg.class_token), cfg.dim))
        self.norm_pre = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.blocks = nn.ModuleDict({str(i): VitBlock.of(cfg) for i in range(vit_block_count(cfg))})
        full = cfg.feature_layer is None  # a selected hidden state skips the output norm and projection
        self.norm_post = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps) if full else None
        self.proj = nn.Linear(cfg.dim, cfg.output_dim, bias=False) if full and cfg.output_dim else None
        self.out_dim = cfg.output_dim if self.proj is not None else cfg.dim
        self.sequence = None  # sequence parallelism: the blocks' SequenceSplit (models/llama.py has the same)
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
        seq = self.sequence
        if seq is not None:
            x = seq.scatter(x)
        for block in self.blocks.values():
            x = block(x)
        return x if seq is None else seq.leave(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        # by the config, not by the class embedding: a later pipeline stage of the encoder unit holds no class
        # embedding (parallel/stages.py drops it) but its inbound tokens still carry the class token
        if self.cfg.class_token:
            x = x[:, 1:]
        if self.norm_post is not None:
            x = self.norm_post(x)
        return self.proj(x) if self.proj is not None else x

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + int(self.cfg.class_token)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(self.embed(images)))
