"""Stable Diffusion's VAE decoder (a diffusers ``AutoencoderKL``'s other half), for images sampled from the
generator when its latents are ``sd_vae`` latents (models/image_sampling.py). Never part of training.

Latents are first un-normalized (the inverse of the encoder's ``scaling_factor``/``shift_factor`` or
``latents_mean``/``latents_std``), then ``post_quant_conv`` -> ``conv_in`` -> mid block (ResNet, single-head
self-attention, ResNet) -> up blocks (``layers_per_block + 1`` ResNet blocks each, then a nearest 2x upsample
and a 3x3 convolution on every level but the last, widths in reverse) -> ``conv_norm_out``, SiLU,
``conv_out``: pixels in [-1, 1]. The ``decoder.*`` and ``post_quant_conv.*`` tensors are read from the same
directory as the encoder's, as frozen buffers (models/vae.py ``FrozenVAEPart``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf import PretrainedError
from .vae import ACTIVATIONS, FrozenVAEPart, _Conv, _GroupNorm, _MidBlock, _ResnetBlock, read_vae_config


class _Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = _Conv(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, groups: int, act, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(_ResnetBlock(cin if i == 0 else cout, cout, groups, act) for i in range(layers))
        self.upsamplers = nn.ModuleList([_Upsample(cout)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for upsampler in self.upsamplers or ():
            x = upsampler(x)
        return x


class _Decoder(nn.Module):
    def __init__(self, widths: list[int], layers: int, latent_channels: int, groups: int, act, attention: bool):
        super().__init__()
        self.act = act
        reverse = list(reversed(widths))
        self.conv_in = _Conv(latent_channels, reverse[0], 3, padding=1)
        self.mid_block = _MidBlock(reverse[0], groups, act, attention)
        self.up_blocks = nn.ModuleList(
            _UpBlock(reverse[max(i - 1, 0)], width, layers + 1, groups, act, upsample=i < len(reverse) - 1)
            for i, width in enumerate(reverse)
        )
        self.conv_norm_out = _GroupNorm(groups, widths[0])
        self.conv_out = _Conv(widths[0], 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.act(self.conv_norm_out(x)))


class StableDiffusionVAEDecoder(FrozenVAEPart):
    """Latents as the ``sd_vae`` encoder writes them [B, latent_channels, h, w] -> uint8 images
    [B, 3, h * 2**(levels-1), same], in fp32 without gradients."""

    def __init__(self, directory: str | Path, config: dict[str, Any] | None = None):
        super().__init__()
        self.directory, config = read_vae_config(directory) if config is None else (Path(directory), config)
        where = f"model.latent_encoder_path={self.directory}"
        for block_type in config.get("up_block_types", ["UpDecoderBlock2D"]):
            if block_type != "UpDecoderBlock2D":
                raise PretrainedError(f"{where}: up block {block_type!r} is not supported (UpDecoderBlock2D only)")
        if config.get("out_channels", 3) != 3:
            raise PretrainedError(f"{where}: out_channels={config['out_channels']}; images have 3 channels")
        act_fn = config.get("act_fn", "silu")
        if act_fn not in ACTIVATIONS:
            raise PretrainedError(f"{where}: act_fn={act_fn!r} is not supported ({', '.join(ACTIVATIONS)})")
        self._latent_normalization(config, int(config.get("latent_channels", 4)))
        use_post_quant = config.get("use_post_quant_conv", config.get("use_quant_conv", True))
        self.post_quant_conv = _Conv(self.latent_channels, self.latent_channels, 1) if use_post_quant else None
        self.decoder = _Decoder(
            [int(w) for w in config.get("block_out_channels", [64])],
            int(config.get("layers_per_block", 1)),
            self.latent_channels,
            int(config.get("norm_num_groups", 32)),
            ACTIVATIONS[act_fn],
            attention=bool(config.get("mid_block_add_attention", True)),
        )
        self.reset_buffers()

    def unscaled(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's own latents of normalized ones (what diffusers' pipelines pass to ``vae.decode``)."""
        if self.latent_stats is not None:
            stats = (self.latents_mean.view(1, -1, 1, 1), self.latents_std.view(1, -1, 1, 1))
            return latents * stats[1] / self.scaling_factor + stats[0]
        return latents / self.scaling_factor + self.shift_factor

    @torch.no_grad()
    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] (before clamping) of normalized latents."""
        with torch.autocast(latents.device.type, enabled=False):
            z = self.unscaled(latents.float())
            if self.post_quant_conv is not None:
                z = self.post_quant_conv(z)
            return self.decoder(z)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return ((self.pixels(latents).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
