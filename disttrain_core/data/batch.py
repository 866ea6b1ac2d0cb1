"""The tensors of one microbatch, as the models consume them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64; image placeholders and generation queries included
    labels: torch.Tensor  # [B, S] int64; -100 where no loss is taken
    images: torch.Tensor  # [N, 3, H, W] uint8, the images of all samples in order
    image_counts: torch.Tensor  # [B] int64, images per sample
    gen_images: torch.Tensor  # [B, 3, Hg, Wg] uint8, generation target (zeros if none)
    gen_weight: torch.Tensor  # [B] float32, 1 if the sample has a generation target
    gen_noise: torch.Tensor  # [B, C, h, w] float32, per-sample seeded diffusion noise
    gen_timesteps: torch.Tensor  # [B] int64, per-sample seeded diffusion timesteps
    keys: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The batch with ``fn`` applied to every tensor (moving it to a device, pinning it, ...)."""
        moved = {
            f.name: fn(getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return Batch(**moved, keys=list(self.keys))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self.map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def select(self, samples: range) -> Batch:
        """The sub-batch of a contiguous range of samples (with their images)."""
        counts = self.image_counts.tolist()
        first = sum(counts[: samples.start])
        last = first + sum(counts[samples.start : samples.stop])
        rows = slice(samples.start, samples.stop)
        return Batch(
            tokens=self.tokens[rows],
            labels=self.labels[rows],
            images=self.images[first:last],
            image_counts=self.image_counts[rows],
            gen_images=self.gen_images[rows],
            gen_weight=self.gen_weight[rows],
            gen_noise=self.gen_noise[rows],
            gen_timesteps=self.gen_timesteps[rows],
            keys=self.keys[rows],
        )

    def loss_tokens(self) -> int:
        return int((self.labels != -100).sum())

    def gen_samples(self) -> float:
        return float(self.gen_weight.sum())
