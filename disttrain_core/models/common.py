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
import torch.nn.functional as F
from torch import nn

from ..base.dtensor import local_block


def parameter_seed(base_seed: int, name: str) -> int:
    """A stable 63-bit seed for one named parameter."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _seeded_normal(shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


# torch's CPU normal generator fills blocks of 16 values from 16 uniforms, and recomputes the last 16 of
# a tensor from fresh uniforms when its size is not a multiple of 16. Drawing a tensor in calls of whole
# blocks, with a last call of at least 16 values, therefore gives exactly the values of one call
# (tests/unit/test_models.py checks it on odd sizes).
BLOCK = 16


DEVICE_BLOCK_VALUES = 1 << 22  # CUDA: values per independently seeded block of rows (16 MB in fp32)


def _device_normal_into(
    target: torch.Tensor, shape: torch.Size, offset: tuple[int, ...], std: float, seed: int
) -> None:
    """The device path of :func:`_seeded_normal_into` (CUDA): the tensor is cut into blocks of whole dim-0 rows
    fixed by its shape alone, block ``b`` drawn on the device from a generator seeded by ``(seed, b)``. A rank
    draws only the blocks its shard overlaps -- the CPU path draws every row before its shard on one host
    generator, minutes for a 70B model -- and the values are the same for every layout on that device type
    (not the CPU path's: another generator)."""
    numel = math.prod(shape)
    rows, row = (shape[0], numel // shape[0]) if len(shape) else (1, 1)
    per_block = max(1, DEVICE_BLOCK_VALUES // max(row, 1))
    first, last = (offset[0], offset[0] + target.shape[0]) if target.ndim else (0, 1)
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], target.shape[1:], strict=True))
    generator = torch.Generator(device=target.device)
    for block in range(first // per_block, (last - 1) // per_block + 1):
        start = block * per_block
        count = min(per_block, rows - start)
        generator.manual_seed((seed * 1_000_003 + block) % (2**63 - 1))
        chunk = torch.randn(count * row, generator=generator, device=target.device, dtype=torch.float32)
        chunk = chunk.view(count, *shape[1:]) if len(shape) else chunk.view(())
        lo, hi = max(start, first), min(start + count, last)
        if target.ndim == 0:
            target.copy_(chunk * std)
        else:
            target[lo - first : hi - first].copy_(chunk[lo - start : hi - start][(slice(None), *inner)] * std)


def _seeded_normal_into(
    target: torch.Tensor,
    shape: torch.Size,
    offset: tuple[int, ...],
    std: float,
    seed: int,
    on_device: bool | None = None,
) -> None:
    """Write the block ``target`` of the tensor ``_seeded_normal(shape, std, seed)``, starting at ``offset``,
    without ever holding the whole tensor: it is drawn in chunks of whole dim-0 slices and only the
    chunk being drawn exists besides ``target`` (a tensor-parallel shard, or a whole replicated weight).
    ``on_device`` (default: ``target`` is on CUDA): :func:`_device_normal_into` instead.
    """
    if on_device if on_device is not None else target.device.type == "cuda":
        return _device_normal_into(target, shape, offset, std, seed)
    numel = math.prod(shape)
    if numel < BLOCK or target.ndim == 0:  # tiny tensors are drawn elementwise by torch: draw them whole
        full = _seeded_normal(shape, std, seed)
        target.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, target.shape, strict=True))])
        return
    rows, row = shape[0], numel // shape[0]
    first, last = offset[0], offset[0] + target.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], target.shape[1:], strict=True))
    # Chunk: whole rows, a multiple of BLOCK values, about 1/32 of the target (transient memory), >= 1 block.
    unit = BLOCK // math.gcd(BLOCK, row)  # rows per multiple of BLOCK values
    per_chunk = unit * max(1, (target.numel() // 32) // (unit * row))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Values in the last BLOCK of the tensor depend on the final call: draw to the end only if needed.
    stop = rows if last * row > numel - BLOCK else last
    start = 0
    while start < stop:
        count = rows - start if (rows - start) * row < per_chunk * row + BLOCK else per_chunk  # last: >= BLOCK
        chunk = torch.randn(count * row, generator=generator, dtype=torch.float32).view(count, *shape[1:])
        lo, hi = max(start, first), min(start + count, last)
        if lo < hi:
            target[lo - first : hi - first].copy_(chunk[lo - start : hi - start][(slice(None), *inner)] * std)
        start += count


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02, prefix: str = "") -> None:
    """Initialize every parameter of ``model`` deterministically from ``seed``.

    ``prefix`` is the module's qualified name inside the full model, so a
    submodule initialized on its own gets exactly the weights it would get as
    part of the whole model. Rules: norm weights 1, biases 0; convolution
    weights N(0, 1/fan_in); every other weight N(0, std).
    A tensor-parallel parameter (a DTensor) gets only its local shard, with the
    values that shard has in the full tensor: a rank never allocates the full
    weight, only its shard and a chunk being drawn (shard before materialize).
    Non-persistent buffers are rebuilt through ``reset_buffers`` hooks.
    """
    for module_name, module in model.named_modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
        for param_name, param in module.named_parameters(recurse=False):
            full_name = ".".join(p for p in (prefix, module_name, param_name) if p)
            target, offset = local_block(param)
            if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or param_name == "norm_weight":
                target.fill_(1.0 if param_name == "weight" else 0.0)
            elif param_name == "bias":
                target.zero_()
            elif isinstance(module, nn.Conv2d):
                fan_in = param.shape[1] * param.shape[2] * param.shape[3]
                _seeded_normal_into(
                    target, param.shape, offset, 1.0 / math.sqrt(fan_in), parameter_seed(seed, full_name)
                )
            else:
                _seeded_normal_into(target, param.shape, offset, std, parameter_seed(seed, full_name))


def count_parameters(module: nn.Module | None, trainable_only: bool = False) -> int:
    if module is None:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's sigmoid approximation of GELU: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": nn.functional.gelu, "quick_gelu": quick_gelu}


class FeedForwardGELU(nn.Module):
    """Linear-GELU-Linear, as in ViT blocks and the projectors. ``activation`` picks the GELU
    variant: ``gelu`` (exact, erf) or ``quick_gelu`` (OpenAI CLIP checkpoints)."""

    def __init__(self, dim: int, hidden_dim: int, out_dim: int | None = None, activation: str = "gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: allowed values are {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)))


class SwiGLU(nn.Module):
    """The gated feed-forward of Llama-style blocks (and of each routed expert, models/moe.py)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
