"""Image generator in the style of the Stable Diffusion 2.1 U-Net, trained
with the epsilon-prediction denoising loss on image latents.

Layout (SD 2.1 defaults in :class:`UNetConfig`): conv_in -> down blocks
(residual blocks, cross-attention transformers where enabled, strided-conv
downsampling) -> middle (res, transformer, res) -> up blocks (residual blocks
fed with the matching skip connection, transformers, nearest-neighbour
upsampling + conv) -> GroupNorm, SiLU, conv_out. Transformers use linear
in/out projections, self-attention, cross-attention to the conditioning, and a
GEGLU feed-forward. Each residual block receives the timestep embedding.

It computes what diffusers' ``UNet2DConditionModel`` computes for SD 1.x/2.x configs (models/hf/unet.py
imports those weights): timestep features with cosine first and no frequency shift, GroupNorm eps 1e-5 in
the residual blocks and at the output, 1e-6 in front of each transformer, LayerNorm eps 1e-5, unscaled
residual sums, skips concatenated after the running features. SD 1.x's 1x1-conv transformer projections
equal our linear ones (weights reshaped); heads per level come from ``attention_heads`` when given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import UNetConfig

CONDITIONING = ("cross_attention", "film")


def timestep_features(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal timestep features [B, dim] (cosine half first, as in SD)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=timesteps.device, dtype=torch.float32) / half)
    angles = timesteps.float()[:, None] * freqs[None]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, temb_dim: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=1e-5)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=1e-5)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.skip(x) if self.skip is not None else x) + h


class CrossAttention(nn.Module):
    def __init__(self, dim: int, context_dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        batch = x.shape[0]
        q = self.to_q(x).view(batch, x.shape[1], -1, self.head_dim).transpose(1, 2)
        k = self.to_k(context).view(batch, context.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.to_v(context).view(batch, context.shape[1], -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(batch, x.shape[1], -1))


class GEGLUFeedForward(nn.Module):
    """out(proj(x) * gelu(gate(x))). diffusers fuses ``proj`` and ``gate`` into one [2 hidden, dim] matmul
    (models/hf/unet.py splits it); apart, each is column-parallel under TP like SwiGLU's w1 and w3."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, mult * dim)
        self.gate = nn.Linear(dim, mult * dim)
        self.out = nn.Linear(mult * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x) * F.gelu(self.gate(x)))


class SpatialTransformer(nn.Module):
    """GroupNorm -> linear in -> [self-attn, cross-attn, GEGLU] -> linear out, residual."""

    def __init__(self, channels: int, head_dim: int, context_dim: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6)
        self.proj_in = nn.Linear(channels, channels)
        self.norm1 = nn.LayerNorm(channels)
        self.attn1 = CrossAttention(channels, channels, head_dim)
        self.norm2 = nn.LayerNorm(channels)
        self.attn2 = CrossAttention(channels, context_dim, head_dim)
        self.norm3 = nn.LayerNorm(channels)
        self.ff = GEGLUFeedForward(channels)
        self.proj_out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        h = self.proj_in(h)
        h = h + self.attn1(self.norm1(h))
        h = h + self.attn2(self.norm2(h), context)
        h = h + self.ff(self.norm3(h))
        h = self.proj_out(h).transpose(1, 2).reshape(batch, channels, height, width)
        return x + h


def level_head_dims(cfg: UNetConfig) -> list[int]:
    """Attention head width per level: channels // attention_heads[level], else ``head_dim`` everywhere."""
    chans = list(cfg.block_out_channels)
    heads = list(getattr(cfg, "attention_heads", None) or [])
    if not heads:
        return [cfg.head_dim] * len(chans)
    if len(heads) != len(chans):
        raise ValueError(f"generator.attention_heads={heads} needs one entry per block_out_channels entry {chans}")
    for ch, n in zip(chans, heads, strict=True):
        if n <= 0 or ch % n:
            raise ValueError(f"generator.attention_heads={heads}: {ch} channels do not split into {n} heads")
    return [ch // n for ch, n in zip(chans, heads, strict=True)]


def block_temb_dim(cfg: UNetConfig) -> int:
    """The embedding width the residual blocks receive: the timestep MLP's 4 x channels, twice that when FiLM
    conditioning is concatenated to it (AudioLDM's released checkpoints)."""
    return 4 * cfg.block_out_channels[0] * (2 if cfg.conditioning == "film" and cfg.film_concat else 1)


class UNetLevel(nn.Module):
    """One resolution level: residual blocks, optional transformers, optional resampler."""

    def __init__(
        self, res_in: list[int], channels: int, attention: bool, resample: str | None, head_dim: int, cfg: UNetConfig
    ):
        super().__init__()
        temb_dim = block_temb_dim(cfg)
        self.resnets = nn.ModuleList(ResBlock(c, channels, temb_dim, cfg.norm_groups) for c in res_in)
        context = channels if cfg.conditioning == "film" else cfg.cross_attention_dim
        self.attentions = (
            nn.ModuleList(SpatialTransformer(channels, head_dim, context, cfg.norm_groups) for _ in res_in)
            if attention
            else None
        )
        self.resample = (
            nn.Conv2d(channels, channels, 3, stride=2 if resample == "down" else 1, padding=1) if resample else None
        )
        self.resample_kind = resample


@dataclass
class UNetState:
    """What flows between the U-Net's segments: the running features, the skip connections not yet consumed
    (oldest first), the timestep embedding and the conditioning. A pipeline boundary carries all of it."""

    h: torch.Tensor
    skips: list[torch.Tensor]
    temb: torch.Tensor
    context: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.h, *self.skips, self.temb, self.context]


class UNet(nn.Module):
    """``forward`` = ``begin``, each of ``segments()`` through ``run``, then ``finish``: the pieces a pipeline
    split of the U-Net cuts between (parallel/generator_stages.py)."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        chans = list(cfg.block_out_channels)
        attn = list(cfg.cross_attention_blocks)
        if len(attn) != len(chans):
            raise ValueError("generator.cross_attention_blocks needs one entry per block_out_channels entry")
        head_dims = level_head_dims(cfg)
        if cfg.conditioning not in CONDITIONING:
            raise ValueError(
                f"generator.conditioning={cfg.conditioning!r}: allowed values are {', '.join(CONDITIONING)}"
            )
        temb_dim = 4 * chans[0]
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        self.time_linear1 = nn.Linear(chans[0], temb_dim)
        self.time_linear2 = nn.Linear(temb_dim, temb_dim)
        self.film = nn.Linear(cfg.cross_attention_dim, temb_dim) if cfg.conditioning == "film" else None
        block_temb = block_temb_dim(cfg)
        mid_context = chans[-1] if self.film is not None else cfg.cross_attention_dim

        skips = [chans[0]]
        self.down = nn.ModuleList()
        in_ch = chans[0]
        for level, ch in enumerate(chans):
            last = level == len(chans) - 1
            res_in = [in_ch] + [ch] * (cfg.layers_per_block - 1)
            self.down.append(UNetLevel(res_in, ch, attn[level], None if last else "down", head_dims[level], cfg))
            skips += [ch] * cfg.layers_per_block + ([] if last else [ch])
            in_ch = ch

        self.mid_res1 = ResBlock(chans[-1], chans[-1], block_temb, cfg.norm_groups)
        self.mid_attn = SpatialTransformer(chans[-1], head_dims[-1], mid_context, cfg.norm_groups)
        self.mid_res2 = ResBlock(chans[-1], chans[-1], block_temb, cfg.norm_groups)

        self.up = nn.ModuleList()
        prev = chans[-1]
        for level, ch in enumerate(reversed(chans)):
            last = level == len(chans) - 1
            res_in = []
            for j in range(cfg.layers_per_block + 1):
                res_in.append((prev if j == 0 else ch) + skips.pop())
            mirror = len(chans) - 1 - level
            self.up.append(UNetLevel(res_in, ch, attn[mirror], None if last else "up", head_dims[mirror], cfg))
            prev = ch

        self.norm_out = nn.GroupNorm(cfg.norm_groups, chans[0], eps=1e-5)
        self.conv_out = nn.Conv2d(chans[0], cfg.in_channels, 3, padding=1)

    def segments(self) -> list[str]:
        """The pieces between which a pipeline may cut: each down level, the middle block, each up level."""
        levels = len(self.cfg.block_out_channels)
        return [f"down.{i}" for i in range(levels)] + ["mid"] + [f"up.{i}" for i in range(levels)]

    def begin(self, sample: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> UNetState:
        dtype = self.conv_in.weight.dtype
        temb = timestep_features(timesteps, self.cfg.block_out_channels[0]).to(dtype)
        temb = self.time_linear2(F.silu(self.time_linear1(temb)))
        if self.film is not None:  # AudioLDM: one conditioning vector per sample, into the timestep embedding
            film = self.film(context.to(dtype).mean(dim=1))
            temb = torch.cat((temb, film), dim=-1) if self.cfg.film_concat else temb + film
        h = self.conv_in(sample.to(dtype))
        return UNetState(h, [h], temb, context)

    def run(self, segment: str, state: UNetState) -> UNetState:
        h, skips, temb, context = state.h, list(state.skips), state.temb, state.context
        attend = None if self.film is not None else context  # FiLM: the second attention attends to the features
        if segment == "mid":
            h = self.mid_res2(self.mid_attn(self.mid_res1(h, temb), attend), temb)
            return UNetState(h, skips, temb, context)
        kind, index = segment.split(".")
        level = (self.down if kind == "down" else self.up)[int(index)]
        for i, resnet in enumerate(level.resnets):
            h = resnet(h if kind == "down" else torch.cat((h, skips.pop()), dim=1), temb)
            if level.attentions is not None:
                h = level.attentions[i](h, attend)
            if kind == "down":
                skips.append(h)
        if level.resample is not None and kind == "down":
            h = level.resample(h)
            skips.append(h)
        elif level.resample is not None:
            h = level.resample(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return UNetState(h, skips, temb, context)

    def finish(self, state: UNetState) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(state.h)))

    def forward(self, sample: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        state = self.begin(sample, timesteps, context)
        for segment in self.segments():
            state = self.run(segment, state)
        return self.finish(state)


class DiffusionGenerator(nn.Module):
    """U-Net plus the DDPM noise schedule; returns the summed per-sample loss."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        self.unet = UNet(cfg)
        self.register_buffer("alphas_cumprod", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        device = self.alphas_cumprod.device  # a pipeline stage of the U-Net may hold no conv_in
        # SD's "scaled_linear" schedule.
        betas = (
            torch.linspace(
                self.cfg.beta_start**0.5,
                self.cfg.beta_end**0.5,
                self.cfg.num_train_timesteps,
                device=device,
                dtype=torch.float64,
            )
            ** 2
        )
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).to(torch.float32)

    def noisy(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The latents noised to ``timesteps`` (the DDPM forward process)."""
        alpha_bar = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        return alpha_bar.sqrt() * latents.float() + (1.0 - alpha_bar).sqrt() * noise.float()

    @staticmethod
    def loss_sum(predicted: torch.Tensor, noise: torch.Tensor, sample_weight: torch.Tensor) -> torch.Tensor:
        """Sum over samples of weight * mean squared error of the predicted noise."""
        per_sample = (predicted.float() - noise.float()).pow(2).mean(dim=(1, 2, 3))
        return (per_sample * sample_weight.float()).sum()

    def forward(
        self,
        latents: torch.Tensor,
        noise: torch.Tensor,
        timesteps: torch.Tensor,
        context: torch.Tensor,
        sample_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Sum over samples of weight * mean squared error of the predicted noise."""
        predicted = self.unet(self.noisy(latents, noise, timesteps), timesteps, context)
        return self.loss_sum(predicted, noise, sample_weight)
