"""Building blocks shared by the single-device model files, and weight init.

Initialization is seeded per parameter name, so a module gets the same weights
whether it is built alone, inside the full model, on one process or split over
many. That property is what lets parallel layouts be checked against a
single-process reference.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn


def parameter_seed(base_seed: int, name: str) -> int:
    """A stable 63-bit seed for one named parameter."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _seeded_normal(shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02, prefix: str = "") -> None:
    """Initialize every parameter of ``model`` deterministically from ``seed``.

    ``prefix`` is the module's qualified name inside the full model, so a
    submodule initialized on its own gets exactly the weights it would get as
    part of the whole model. Rules: norm weights 1, biases 0; convolution
    weights N(0, 1/fan_in); every other weight N(0, std).
    Non-persistent buffers are rebuilt through ``reset_buffers`` hooks.
    """
    for module_name, module in model.named_modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
        for param_name, param in module.named_parameters(recurse=False):
            full_name = ".".join(p for p in (prefix, module_name, param_name) if p)
            if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or param_name == "norm_weight":
                value = torch.ones(param.shape) if param_name == "weight" else torch.zeros(param.shape)
            elif param_name == "bias":
                value = torch.zeros(param.shape)
            elif isinstance(module, nn.Conv2d):
                fan_in = param.shape[1] * param.shape[2] * param.shape[3]
                value = _seeded_normal(param.shape, 1.0 / math.sqrt(fan_in), parameter_seed(seed, full_name))
            else:
                value = _seeded_normal(param.shape, std, parameter_seed(seed, full_name))
            param.copy_(value.to(device=param.device, dtype=param.dtype))


def count_parameters(module: nn.Module | None, trainable_only: bool = False) -> int:
    if module is None:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


class FeedForwardGELU(nn.Module):
    """Linear-GELU-Linear, as in ViT blocks and the projectors."""

    def __init__(self, dim: int, hidden_dim: int, out_dim: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))
