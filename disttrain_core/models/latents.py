"""How generation targets become latents.

Stable Diffusion trains its U-Net on latents from a frozen VAE (8x spatial
downsampling, 4 channels, scaled by 0.18215). Shipping and running a real VAE
would need downloaded weights, so the default here is a *fixed, parameter-free*
stand-in with the same interface and shapes:

    pixels uint8 [B, 3, H, W] -> [-1, 1] -> average pool by ``downsample``
    -> fixed 3->C channel mixing (seeded, never trained) -> scaled to unit variance

It is deterministic, costs almost nothing, and keeps the image's coarse
structure, so the denoising loss is learnable. The real thing is registered as
``sd_vae``: Stable Diffusion's frozen VAE encoder read from a diffusers
``AutoencoderKL`` directory named by ``model.latent_encoder_path``
(models/vae.py). Other encoders register a factory and are selected with
``model.latent_encoder=<name>``::

    from disttrain_core.models.latents import register_latent_encoder
    register_latent_encoder("my_vae", lambda cfg: MyFrozenVAEEncoder(...))

A latent encoder is an ``nn.Module`` mapping uint8 images to latents of shape
[B, generator.in_channels, gen_image_size / latent_downsample, same]. It must
hold no trainable parameters (freeze them), because it is not optimized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig

LATENT_SCALE = 1.7  # brings the pooled, mixed pixels to roughly unit variance


class PixelLatentEncoder(nn.Module):
    def __init__(self, channels: int, downsample: int):
        super().__init__()
        self.channels = channels
        self.downsample = downsample
        self.register_buffer("mixing", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        generator = torch.Generator().manual_seed(0)
        mixing = torch.randn(self.channels, 3, generator=generator)
        mixing = mixing / mixing.norm(dim=1, keepdim=True)
        device = self.mixing.device
        self.mixing = mixing.to(device)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float() / 127.5 - 1.0
        x = F.avg_pool2d(x, self.downsample)
        return torch.einsum("cd,bdhw->bchw", self.mixing, x) * LATENT_SCALE


def _sd_vae(cfg: ModelConfig) -> nn.Module:
    from .vae import sd_vae_encoder

    return sd_vae_encoder(cfg)


LatentFactory = Callable[[ModelConfig], nn.Module]
_LATENT_ENCODERS: dict[str, LatentFactory] = {
    "pixel": lambda cfg: PixelLatentEncoder(cfg.generator.in_channels, cfg.latent_downsample),
    "sd_vae": _sd_vae,
}


def register_latent_encoder(name: str, factory: LatentFactory) -> None:
    _LATENT_ENCODERS[name] = factory


def latent_encoder_names() -> list[str]:
    return sorted(_LATENT_ENCODERS)


class MelLatentEncoder(nn.Module):
    """The audio generator's stand-in for AudioLDM's frozen mel VAE, parameter-free like ``PixelLatentEncoder``:

        log-mel [B, n_mels, frames] -> resized (bilinear) to [4 h, 4 w] (frames x mel bins) -> 4 x 4 space-to-depth
        (16 channels) -> fixed 16 -> C channel mixing (seeded, never trained) -> [B, C, h, w]

    for the generator's latent grid ``[h, w]`` (``latent_shape``; AudioLDM's VAE: 10.24 s of 64 bins to [256, 16]).
    The log-mels (data/audio.py) lie in about [-1, 1.5]; the mixing's orthonormal rows keep that scale."""

    def __init__(self, channels: int, shape: tuple[int, int]):
        super().__init__()
        if not 1 <= channels <= 16:
            raise ValueError(f"audio_generator.in_channels={channels}: the mel latents have 1 to 16 channels")
        self.channels, self.shape = channels, (int(shape[0]), int(shape[1]))
        self.register_buffer("mixing", torch.empty(0), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        generator = torch.Generator().manual_seed(1)
        rows = torch.linalg.qr(torch.randn(16, 16, generator=generator))[0][: self.channels]
        self.mixing = rows.to(self.mixing.device)

    @torch.no_grad()
    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        h, w = self.shape
        x = mels.float().transpose(1, 2).unsqueeze(1)  # [B, 1, frames, n_mels]
        x = F.interpolate(x, size=(4 * h, 4 * w), mode="bilinear", align_corners=False)
        x = F.pixel_unshuffle(x, 4)  # [B, 16, h, w]
        return torch.einsum("cd,bdhw->bchw", self.mixing.to(x.device), x)


def build_latent_encoder(cfg: ModelConfig) -> nn.Module:
    if cfg.latent_encoder not in _LATENT_ENCODERS:
        raise ValueError(
            f"model.latent_encoder={cfg.latent_encoder!r} is not registered; available: {latent_encoder_names()}"
        )
    encoder = _LATENT_ENCODERS[cfg.latent_encoder](cfg)
    encoder.requires_grad_(False)
    return encoder
