"""MLP projectors between modules (encoder width -> LLM width, LLM width ->
generator conditioning width), as in LLaVA-style and NExT-GPT-style MLLMs."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ProjectorConfig


class MLPProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, cfg: ProjectorConfig):
        super().__init__()
        if cfg.n_layers not in (1, 2):
            raise ValueError(f"projector n_layers={cfg.n_layers}; allowed: 1 or 2")
        hidden = cfg.hidden_dim or out_dim
        if cfg.n_layers == 1:
            self.net = nn.Sequential(nn.Linear(in_dim, out_dim))
        else:
            self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
