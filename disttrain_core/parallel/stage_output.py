"""What a pipeline stage's forward returns (parallel/stages.py, parallel/generator_stages.py), and the batch
fields the generation loss reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StageOutput:
    send: torch.Tensor | None
    loss_sums: dict[str, torch.Tensor] = field(default_factory=dict)


# A pytree node, so hooks that look for tensors in a module's outputs (FSDP2's pre-backward) find them.
torch.utils._pytree.register_dataclass(StageOutput)

GENERATION_FIELDS = ("gen_images", "gen_noise", "gen_timesteps", "gen_weight")
