"""Stable Diffusion's VAE encoder (a diffusers ``AutoencoderKL``), frozen, as the ``sd_vae`` latent encoder.

Only the encoder half is built: ``conv_in`` -> down blocks (ResNet blocks, then a stride-2 convolution on
every level but the last) -> mid block (ResNet, single-head self-attention, ResNet) -> ``conv_norm_out``,
SiLU, ``conv_out`` -> ``quant_conv``. Its shape (``block_out_channels``, ``layers_per_block``,
``latent_channels``, ``norm_num_groups``, ``act_fn``, ``mid_block_add_attention``, ``use_quant_conv``) and
latent normalization (``scaling_factor``, ``shift_factor``, ``latents_mean``/``latents_std``) come from the
directory's diffusers ``config.json``; the ``encoder.*`` and ``quant_conv.*`` tensors are read from its
safetensors file (the decoder's are never read).

The weights are *non-persistent buffers*, not parameters: the optimizer, gradient clipping, checkpoints
(``state_dict`` and the engines' parameter lists), ``init_from`` and FSDP2 (no sharding, no bf16 cast of
the weights) never see them, and ``init_weights`` cannot overwrite them. The model is built on the meta
device and then ``materialize``-d (``to_empty`` + ``init_weights``); ``init_weights`` calls
:meth:`StableDiffusionVAEEncoder.reset_buffers`, which reads the file again onto the buffers' device. On
the meta device nothing is read, so planning and stage cutting stay cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hf import PretrainedError

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "mish": F.mish}
# Older diffusers checkpoints name the attention projections as the original LDM code did.
LEGACY_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
EPS = 1e-6  # every GroupNorm of the AutoencoderKL encoder


def _frozen(module: nn.Module, name: str, *shape: int) -> None:
    module.register_buffer(name, torch.empty(*shape), persistent=False)


class _Conv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0):
        super().__init__()
        self.stride, self.padding = stride, padding
        _frozen(self, "weight", cout, cin, kernel, kernel)
        _frozen(self, "bias", cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)


class _GroupNorm(nn.Module):
    def __init__(self, groups: int, channels: int):
        super().__init__()
        self.groups = groups
        _frozen(self, "weight", channels)
        _frozen(self, "bias", channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.groups, self.weight, self.bias, EPS)


class _Linear(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        _frozen(self, "weight", cout, cin)
        _frozen(self, "bias", cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _ResnetBlock(nn.Module):
    """norm1-act-conv1-norm2-act-conv2 plus the input (through a 1x1 convolution when the width changes)."""

    def __init__(self, cin: int, cout: int, groups: int, act):
        super().__init__()
        self.act = act
        self.norm1 = _GroupNorm(groups, cin)
        self.conv1 = _Conv(cin, cout, 3, padding=1)
        self.norm2 = _GroupNorm(groups, cout)
        self.conv2 = _Conv(cout, cout, 3, padding=1)
        self.conv_shortcut = _Conv(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.act(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class _Downsample(nn.Module):
    """A 3x3 stride-2 convolution after padding one zero row and column at the bottom and right."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _Conv(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class _DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, groups: int, act, downsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList(_ResnetBlock(cin if i == 0 else cout, cout, groups, act) for i in range(layers))
        self.downsamplers = nn.ModuleList([_Downsample(cout)]) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        for downsampler in self.downsamplers or ():
            x = downsampler(x)
        return x


class _SelfAttention(nn.Module):
    """Single-head self-attention over the H*W positions of a group-normalized map, added to its input."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = _GroupNorm(groups, channels)
        self.to_q = _Linear(channels, channels)
        self.to_k = _Linear(channels, channels)
        self.to_v = _Linear(channels, channels)
        self.to_out = nn.ModuleList([_Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)  # scale 1/sqrt(C): one head of width C
        return self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w) + x


class _MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, act, attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList(_ResnetBlock(channels, channels, groups, act) for _ in range(2))
        self.attentions = nn.ModuleList([_SelfAttention(channels, groups)] if attention else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        return self.resnets[1](x)


class _Encoder(nn.Module):
    def __init__(self, widths: list[int], layers: int, latent_channels: int, groups: int, act, attention: bool):
        super().__init__()
        self.act = act
        self.conv_in = _Conv(3, widths[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            _DownBlock(widths[max(i - 1, 0)], width, layers, groups, act, downsample=i < len(widths) - 1)
            for i, width in enumerate(widths)
        )
        self.mid_block = _MidBlock(widths[-1], groups, act, attention)
        self.conv_norm_out = _GroupNorm(groups, widths[-1])
        self.conv_out = _Conv(widths[-1], 2 * latent_channels, 3, padding=1)  # mean and log-variance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(self.act(self.conv_norm_out(self.mid_block(x))))


def read_vae_config(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """The AutoencoderKL directory (a pipeline's ``vae/`` subfolder is followed) and its config."""
    import json

    directory = Path(directory)
    if not (directory / "config.json").is_file() and (directory / "vae" / "config.json").is_file():
        directory = directory / "vae"
    path = directory / "config.json"
    if not path.is_file():
        raise PretrainedError(
            f"model.latent_encoder_path={directory}: no config.json; it wants a diffusers AutoencoderKL directory"
        )
    config = json.loads(path.read_text())
    kind = config.get("_class_name", "AutoencoderKL")
    if kind != "AutoencoderKL":
        raise PretrainedError(f"model.latent_encoder_path={directory} holds a {kind}, not an AutoencoderKL")
    return directory, config


class FrozenVAEPart(nn.Module):
    """A half of a diffusers AutoencoderKL whose frozen buffers are named as the directory's safetensors keys
    (``encoder.*``/``quant_conv.*`` here, ``decoder.*``/``post_quant_conv.*`` in models/vae_decoder.py), read
    onto the buffers' device by :meth:`reset_buffers`; ``latents_mean``/``latents_std`` come from the config."""

    directory: Path
    latent_stats: tuple[list[float], list[float]] | None

    def _latent_normalization(self, config: dict[str, Any], latent_channels: int) -> None:
        """``scaling_factor``, ``shift_factor`` and the per-channel ``latents_mean``/``latents_std`` of the config,
        and the (frozen) buffers the statistics are read into."""
        self.latent_channels = latent_channels
        self.scaling_factor = float(config.get("scaling_factor", 0.18215))
        self.shift_factor = float(config.get("shift_factor") or 0.0)
        mean, std = config.get("latents_mean"), config.get("latents_std")
        self.latent_stats = (list(map(float, mean)), list(map(float, std))) if mean and std else None
        if self.latent_stats is not None and self.shift_factor:
            raise PretrainedError(
                f"model.latent_encoder_path={self.directory}: both shift_factor and latents_mean/latents_std are set"
            )
        channels = latent_channels if self.latent_stats else 0
        _frozen(self, "latents_mean", channels)
        _frozen(self, "latents_std", channels)

    def _weights_file(self) -> Path:
        preferred = self.directory / "diffusion_pytorch_model.safetensors"
        if preferred.is_file():
            return preferred
        files = sorted(self.directory.glob("*.safetensors"))
        full = [f for f in files if ".fp16." not in f.name] or files  # a variant only when nothing else
        if not full:
            raise PretrainedError(
                f"model.latent_encoder_path={self.directory}: no *.safetensors file (convert .bin weights first)"
            )
        return full[0]

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Read the weights onto the buffers' device (nothing on the meta device)."""
        if self.latents_mean.device.type == "meta":
            return
        if self.latent_stats is not None:
            self.latents_mean.copy_(torch.tensor(self.latent_stats[0]))
            self.latents_std.copy_(torch.tensor(self.latent_stats[1]))
        from safetensors import safe_open

        file = self._weights_file()
        where = f"model.latent_encoder_path={self.directory} ({file.name})"
        with safe_open(str(file), framework="pt", device="cpu") as stored:
            keys = set(stored.keys())
            for name, buffer in self.named_buffers():
                if name in ("latents_mean", "latents_std"):
                    continue
                key = name
                if key not in keys:  # an older checkpoint's attention names
                    for new, old in LEGACY_ATTENTION.items():
                        key = key.replace(f".{new}.", f".{old}.")
                if key not in keys:
                    raise PretrainedError(f"{where}: tensor {name!r} is missing")
                tensor = stored.get_tensor(key)
                if tensor.numel() != buffer.numel() or tensor.squeeze().shape != buffer.squeeze().shape:
                    raise PretrainedError(
                        f"{where}: {key} has shape {list(tensor.shape)}, the config implies {list(buffer.shape)}"
                    )
                buffer.copy_(tensor.reshape(buffer.shape))  # old attention weights: [C, C, 1, 1] convolutions


class StableDiffusionVAEEncoder(FrozenVAEPart):
    """uint8 images [B, 3, H, W] -> latents [B, latent_channels, H / 2**(levels-1), W / same].

    Deterministic: the output is the posterior *mean* (the encoder's first ``latent_channels`` channels),
    never a sample, so a sample's target latents are the same at every step. Latents are then normalized as
    the diffusers pipelines do: ``(mean - shift_factor) * scaling_factor``, or, when the config has
    ``latents_mean`` and ``latents_std``, ``(mean - latents_mean) * scaling_factor / latents_std``. Runs in
    fp32 (autocast off) without gradients, on pixels mapped to [-1, 1].
    """

    def __init__(self, directory: str | Path, config: dict[str, Any] | None = None):
        super().__init__()
        self.directory, config = read_vae_config(directory) if config is None else (Path(directory), config)
        self.config = config
        where = f"model.latent_encoder_path={self.directory}"
        for block_type in config.get("down_block_types", ["DownEncoderBlock2D"]):
            if block_type != "DownEncoderBlock2D":
                raise PretrainedError(f"{where}: down block {block_type!r} is not supported (DownEncoderBlock2D only)")
        if config.get("in_channels", 3) != 3:
            raise PretrainedError(f"{where}: in_channels={config['in_channels']}; images have 3 channels")
        act_fn = config.get("act_fn", "silu")
        if act_fn not in ACTIVATIONS:
            raise PretrainedError(f"{where}: act_fn={act_fn!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.widths = [int(w) for w in config.get("block_out_channels", [64])]
        self.downsample = 2 ** (len(self.widths) - 1)
        self._latent_normalization(config, int(config.get("latent_channels", 4)))
        self.encoder = _Encoder(
            self.widths,
            int(config.get("layers_per_block", 1)),
            self.latent_channels,
            int(config.get("norm_num_groups", 32)),
            ACTIVATIONS[act_fn],
            attention=bool(config.get("mid_block_add_attention", True)),
        )
        width = 2 * self.latent_channels
        self.quant_conv = _Conv(width, width, 1) if config.get("use_quant_conv", True) else None
        self.reset_buffers()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.autocast(images.device.type, enabled=False):
            x = images.float() / 127.5 - 1.0
            moments = self.encoder(x)
            if self.quant_conv is not None:
                moments = self.quant_conv(moments)
            mean = moments[:, : self.latent_channels]
            if self.latent_stats is not None:
                stats = (self.latents_mean.view(1, -1, 1, 1), self.latents_std.view(1, -1, 1, 1))
                return (mean - stats[0]) * self.scaling_factor / stats[1]
            return (mean - self.shift_factor) * self.scaling_factor


def sd_vae_encoder(cfg) -> StableDiffusionVAEEncoder:
    """The ``sd_vae`` latent encoder for a :class:`~disttrain_core.config.ModelConfig` (checked against it)."""
    if not cfg.latent_encoder_path:
        raise PretrainedError(
            "model.latent_encoder=sd_vae needs model.latent_encoder_path (a diffusers AutoencoderKL directory)"
        )
    directory, config = read_vae_config(str(cfg.latent_encoder_path))
    where = f"model.latent_encoder_path={directory}"
    latent_channels = int(config.get("latent_channels", 4))
    if latent_channels != cfg.generator.in_channels:
        raise PretrainedError(
            f"{where}: latent_channels={latent_channels} != model.generator.in_channels={cfg.generator.in_channels}"
        )
    widths = list(config.get("block_out_channels", [64]))
    if 2 ** (len(widths) - 1) != cfg.latent_downsample:
        raise PretrainedError(
            f"{where}: the VAE downsamples by {2 ** (len(widths) - 1)} (2**(len(block_out_channels)-1), "
            f"block_out_channels={widths}) != model.latent_downsample={cfg.latent_downsample}"
        )
    return StableDiffusionVAEEncoder(directory, config)
