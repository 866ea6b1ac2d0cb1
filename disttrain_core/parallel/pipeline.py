"""Cut the model into pipeline stages, from outside the model code.

The LLM's layers are split evenly over the stages; the first stage also holds
what comes before them (image encoder, projector, token embedding) and the last
what comes after (final norm, output head, generator projector and generator).
A stage is the full model built on the meta device with everything it does not
own removed, so parameter names -- and therefore the seeded initialization --
are exactly those of the single-process model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..data.batch import Batch
from ..data.tokenizer import Tokenizer
from ..models import build_model, materialize
from ..models.mllm import MultimodalLLM


def stage_layers(n_layers: int, num_stages: int) -> list[range]:
    if n_layers % num_stages:
        raise ValueError(
            f"model.llm.n_layers={n_layers} cannot be split evenly over {num_stages} pipeline stages; "
            "choose pp x stages-per-rank dividing the layer count"
        )
    per = n_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


class PipelineStageModule(nn.Module):
    """One stage: ``forward(hidden, batch)`` returns hidden states, or the loss sums on the last stage."""

    def __init__(self, model: MultimodalLLM, stage: int, num_stages: int):
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        keep = stage_layers(model.cfg.llm.n_layers, num_stages)[stage]
        for key in list(model.llm.layers.keys()):
            if int(key) not in keep:
                del model.llm.layers[key]
        if not self.is_first:
            model.encoder = model.encoder_projector = None
            model.llm.tok_embeddings = None
        if not self.is_last:
            model.llm.norm = model.llm.output = None
            model.generator_projector = model.generator = model.latent_encoder = None
        self.model = model
        # Split backward (I then W) is exact when every weight acts on the loss only through the stage
        # input's path: true for LLM layers and the head, false where data enters directly (the first
        # stage's embeddings and encoder, the generator's noisy latents and timesteps).
        self.splittable_backward = not self.is_first and (not self.is_last or model.generator is None)

    def forward(self, hidden: torch.Tensor | None, batch: Batch):
        if self.is_first:
            hidden = self.model.input_embeddings(batch)
        hidden = self.model.llm.run_layers(hidden)
        return self.model.output_losses(hidden, batch) if self.is_last else hidden

    def boundary_shape(self, batch: Batch) -> tuple[int, ...]:
        """Shape of the hidden states this stage receives (and, unless last, sends)."""
        return (batch.size, self.model.cfg.seq_len, self.model.cfg.llm.dim)


def build_stage(
    cfg: ModelConfig, tokenizer: Tokenizer, stage: int, num_stages: int, device: torch.device, seed: int
) -> PipelineStageModule:
    module = PipelineStageModule(build_model(cfg, tokenizer, device="meta"), stage, num_stages)
    # Initialize the pruned model under its own names: identical weights to the whole model.
    materialize(module.model, device, seed=seed, std=cfg.init_std)
    return module
