"""Model zoo: single-device modules plus construction helpers.

Construction follows the meta-device pattern: build under
``torch.device("meta")`` (seconds, no memory, even for 72B), let a parallelism
layer decide what each process keeps, then ``materialize`` on the real device.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..data.tokenizer import Tokenizer
from .common import count_parameters, init_weights
from .mllm import MODULE_NAMES, MultimodalLLM

__all__ = ["MODULE_NAMES", "MultimodalLLM", "build_model", "materialize", "parameter_table"]


def build_model(cfg: ModelConfig, tokenizer: Tokenizer, device: str | torch.device = "meta") -> MultimodalLLM:
    with torch.device(device):
        ids = (getattr(tokenizer, name, -1) for name in ("audio_id", "video_id"))
        return MultimodalLLM(cfg, tokenizer.image_id, tokenizer.gen_id, *ids)


def materialize(model: torch.nn.Module, device: str | torch.device, seed: int, std: float, prefix: str = "") -> None:
    """Allocate storage on ``device`` and initialize deterministically from ``seed``."""
    model.to_empty(device=device)
    init_weights(model, seed=seed, std=std, prefix=prefix)


def parameter_table(model: MultimodalLLM) -> dict[str, int]:
    return {name: count_parameters(module) for name, module in model.submodules().items()}
