"""The stages of the units beside the image encoder and generator, when the audio tower, the video tower or the
audio generator runs on processes of its own (``parallel.units.{audio_encoder,video_encoder,audio_generator}
.colocate=false``).

* The audio encoder stage embeds the clips of its replica's samples (log-mel features through the tower and its
  projector) and sends the LLM one row of LLM width per tower position: ``[clips x positions, D]``, the section
  of the LLM first stage's inbound tensor that the broker fills from this unit (parallel/broker.py).
* The video encoder stage does the same for the frame groups of its replica's samples: ``[groups x patches, D]``.
* The audio generator stage receives the generation queries of its replica's samples ``[samples, G, D]`` and
  computes the audio denoising loss (the rows' last clips; weight 0 for rows without one).

Each is one pipeline stage (pp=1): the towers and the audio generator are small beside the LLM, and a stage boundary
inside a tower or the U-Net is not needed to balance them (validation/layout.py says so for pp > 1).
"""

from __future__ import annotations

import torch
from torch import nn

from ..data.batch import Batch
from ..models.mllm import MultimodalLLM
from .item_balance import encode_items
from .stage_output import StageOutput
from .units import AUDIO_GENERATOR_MODULES, AUDIO_MODULES, VIDEO_MODULES

AUDIO_GENERATION = (*AUDIO_GENERATOR_MODULES, "audio_latent_encoder")
AUDIO_TARGET_FIELDS = ("gen_audio", "audio_gen_weight", "audio_gen_noise", "audio_gen_timesteps")


def keep_only(model: MultimodalLLM, keep: tuple[str, ...]) -> None:
    """Every top-level module of the model but ``keep`` becomes None (parameter names stay the whole model's)."""
    for name, _ in list(model.named_children()):
        if name not in keep:
            setattr(model, name, None)


def one_stage(unit: str, index: int, count: int) -> None:
    if count != 1:
        raise ValueError(f"parallel.units.{unit}.pp={count}: the {unit} unit runs as one pipeline stage; use pp=1")


class SideStage(nn.Module):
    """One stage holding only ``keep`` of the model (a side unit: pp=1), fed by the data directly."""

    kind = ""
    keep: tuple[str, ...] = ()  # the model's top-level modules it holds
    splittable_backward = False  # features, frames or noisy latents enter the stage directly

    def __init__(self, model: MultimodalLLM, index: int = 0, count: int = 1):
        super().__init__()
        one_stage(self.kind, index, count)
        self.is_first = self.is_last = True
        keep_only(model, self.keep)
        self.model = model


class TowerStage(SideStage):
    """An encoder tower's stage: no inbound tensor, one row of LLM width per embedding token out."""

    def inbound_row(self) -> None:
        return None

    def outbound_row(self) -> tuple[int, ...]:
        return (self.model.cfg.llm.dim,)


class AudioEncoderStage(TowerStage):
    kind, keep = "audio_encoder", AUDIO_MODULES
    batch_fields = ("image_counts", "audio_counts", "audio")

    def forward(self, inbound: torch.Tensor | None, batch: Batch) -> StageOutput:
        return StageOutput(encode_items(self, "clip", self.model.encode_audio, batch).flatten(0, 1))


class VideoEncoderStage(TowerStage):
    kind, keep = "video_encoder", VIDEO_MODULES
    batch_fields = ("image_counts", "video_counts", "video")

    def forward(self, inbound: torch.Tensor | None, batch: Batch) -> StageOutput:
        return StageOutput(encode_items(self, "group", self.model.encode_video, batch).flatten(0, 1))


class AudioGeneratorStage(SideStage):
    kind, keep = "audio_generator", AUDIO_GENERATION
    batch_fields = ("image_counts", "audio_counts", *AUDIO_TARGET_FIELDS)

    def forward(self, inbound: torch.Tensor, batch: Batch) -> StageOutput:
        return StageOutput(None, {"gen_loss_sum": self.model.audio_generation_loss_from_queries(inbound, batch)})

    def inbound_row(self) -> tuple[int, ...]:
        return (self.model.cfg.gen_tokens, self.model.cfg.llm.dim)

    def outbound_row(self) -> None:
        return None
