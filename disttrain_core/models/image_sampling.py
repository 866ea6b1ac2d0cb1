"""Images from the generator: the LLM's states at the ``<gen>`` positions of a caption condition a DDIM/DDPM
sampler of the denoising model the U-Net trains, and the latents it ends with are decoded to pixels.

Prompt rows follow the training layout (data/samples.py): ``<bos> caption <gen>*G``, the generation queries
being the last G positions, which causal attention keeps from seeing anything after them.

The sampler walks ``steps`` timesteps of the training schedule from T-1 down to 0 (evenly spaced). At each it
predicts the noise, the clean latents it implies, and moves to the next timestep (Song et al.'s DDIM update):
``eta=0`` is deterministic DDIM; ``eta=1`` adds fresh noise of DDPM's posterior variance (with every one of
the training timesteps it is DDPM's ancestral sampler). Checked against a denoiser whose optimum is known in
closed form (Gaussian data): tests/unit/test_generation.py.

Decoding: the default ``pixel`` latent encoder is a fixed channel mixing of average-pooled pixels
(models/latents.py), inverted here exactly on its pooled image (the mixing's pseudo-inverse), then upsampled.
``sd_vae`` latents go through the same VAE's decoder, read from the encoder's directory
(models/vae_decoder.py). Other registered latent encoders have no decoder: images from them are refused.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .latents import LATENT_SCALE, PixelLatentEncoder

SAMPLERS = {"ddim": 0.0, "ddpm": 1.0}  # name -> eta


def timesteps_for(steps: int, train_steps: int) -> list[int]:
    """``steps`` timesteps from ``train_steps - 1`` down to 0, evenly spaced, each once."""
    if not 1 <= steps <= train_steps:
        raise ValueError(f"steps={steps}: use 1 to {train_steps} (the schedule's timesteps)")
    if steps == 1:
        return [train_steps - 1]
    return [round((train_steps - 1) * (1 - i / (steps - 1))) for i in range(steps)]


@torch.no_grad()
def sample_latents(
    denoise, alphas_cumprod: torch.Tensor, shape, steps: int, eta: float = 0.0, seed: int = 0, device=None
) -> torch.Tensor:
    """Latents of ``shape`` [B, C, h, w] from pure noise, ``denoise(x, t [B]) -> predicted noise`` at each of
    ``steps`` timesteps; ``alphas_cumprod`` [T] is the training schedule's."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=generator, device=device)
    ab = alphas_cumprod.to(device=device, dtype=torch.float64)
    times = timesteps_for(steps, ab.shape[0])
    for i, t in enumerate(times):
        eps = denoise(x, torch.full((shape[0],), t, device=device, dtype=torch.long)).double()
        now = ab[t]
        before = ab[times[i + 1]] if i + 1 < len(times) else torch.ones((), dtype=torch.float64, device=device)
        clean = (x.double() - (1 - now).sqrt() * eps) / now.sqrt()
        sigma = eta * ((1 - before) / (1 - now) * (1 - now / before)).clamp(min=0).sqrt()
        direction = (1 - before - sigma**2).clamp(min=0).sqrt() * eps
        x = before.sqrt() * clean + direction
        if eta > 0 and i + 1 < len(times):
            x = x + sigma * torch.randn(shape, generator=generator, device=device, dtype=torch.float64)
        x = x.float()
    return x


DECODABLE = ("pixel", "sd_vae")  # model.latent_encoder values whose latents decode to images


@functools.lru_cache(maxsize=2)
def _vae_decoder(directory: str, device: str):
    from .vae_decoder import StableDiffusionVAEDecoder

    return StableDiffusionVAEDecoder(directory).to(device)


def decode_latents(latent_encoder, latents: torch.Tensor) -> torch.Tensor:
    """uint8 images of latents written by ``latent_encoder`` (``pixel`` or ``sd_vae``)."""
    from .vae import StableDiffusionVAEEncoder

    if isinstance(latent_encoder, PixelLatentEncoder):
        return decode_pixel_latents(latent_encoder, latents)
    if isinstance(latent_encoder, StableDiffusionVAEEncoder):
        return _vae_decoder(str(latent_encoder.directory), str(latents.device))(latents)
    raise ValueError(f"{type(latent_encoder).__name__} latents have no decoder (only {', '.join(DECODABLE)})")


def decode_pixel_latents(encoder: PixelLatentEncoder, latents: torch.Tensor) -> torch.Tensor:
    """uint8 images [B, 3, H, W] of latents [B, C, h, w] from the ``pixel`` encoder: the mixing's pseudo-inverse
    recovers the pooled image exactly (C >= 3), then nearest upsampling by the pooling factor."""
    mixing = encoder.mixing.float().to(latents.device)  # [C, 3]
    pooled = torch.einsum("dc,bchw->bdhw", torch.linalg.pinv(mixing), latents.float() / LATENT_SCALE)
    pixels = F.interpolate(pooled, scale_factor=encoder.downsample, mode="nearest")
    return ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def caption_rows(tokenizer, captions: list[str], gen_tokens: int, device) -> torch.Tensor:
    """``<bos> caption <gen>*G`` per caption, right-padded to one length: [B, S]."""
    rows = [[tokenizer.bos_id, *tokenizer.encode(c), *([tokenizer.gen_id] * gen_tokens)] for c in captions]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in rows], device=device)


@torch.no_grad()
def generate_images(
    model, tokenizer, captions: list[str], steps: int = 25, sampler: str = "ddim", seed: int = 0
) -> torch.Tensor:
    """uint8 images [B, 3, H, W] for ``captions`` from a MultimodalLLM with a generator (in eval mode)."""
    if model.generator is None:
        raise ValueError(f"model {model.cfg.name!r} has no generator: it cannot sample images")
    if model.cfg.latent_encoder not in DECODABLE:
        raise ValueError(
            f"model.latent_encoder={model.cfg.latent_encoder!r} has no decoder here (only {', '.join(DECODABLE)} "
            "latents decode to images)"
        )
    cfg = model.cfg
    device = model.llm.tok_embeddings.weight.device
    tokens = caption_rows(tokenizer, captions, cfg.gen_tokens, device)
    hidden = model.llm.final_norm(model.llm.run_layers(model.llm.embed(tokens)))
    context = model.generator_projector(model.generation_queries(hidden, tokens))
    side = cfg.gen_image_size // cfg.latent_downsample
    shape = (len(captions), cfg.generator.in_channels, side, side)
    generator = model.generator

    def denoise(x, t):
        return generator.unet(x, t, context)

    latents = sample_latents(denoise, generator.alphas_cumprod, shape, steps, SAMPLERS[sampler], seed, device)
    return decode_latents(model.latent_encoder, latents)


def image_grid(images: torch.Tensor, columns: int = 4, gap: int = 2) -> torch.Tensor:
    """uint8 images [N, 3, H, W] tiled in rows of ``columns`` with white gaps: [rows*H', cols*W', 3] (HWC)."""
    count, _, height, width = images.shape
    columns = max(1, min(columns, count))
    rows = -(-count // columns)
    grid = torch.full((3, rows * (height + gap) + gap, columns * (width + gap) + gap), 255, dtype=torch.uint8)
    for i in range(count):
        top, left = gap + (i // columns) * (height + gap), gap + (i % columns) * (width + gap)
        grid[:, top : top + height, left : left + width] = images[i].cpu()
    return grid.permute(1, 2, 0).contiguous()
