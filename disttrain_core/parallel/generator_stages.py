"""The generator unit's pipeline stages: the U-Net cut at level boundaries.

The U-Net runs as ``begin`` (timestep embedding, conv_in), its segments in order (each down level, the middle
block, each up level: models/unet.py ``UNet.segments``), then ``finish`` (GroupNorm, SiLU, conv_out). With
``pp`` stages the segments are split into ``pp`` contiguous runs, the earlier stages taking one more when they
do not divide; the first stage also projects the LLM's queries, encodes the latents and noises them, the last
computes the denoising loss. The skip connections cross every level, so a boundary carries everything still
needed downstream: the running features, the skips not yet consumed, the timestep embedding and the
conditioning (``UNetState``), flattened into one row per sample and split back by their known shapes on the
other side (a plain tensor for the point-to-point transport; autograd splits its gradient the same way).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..data.batch import Batch
from ..models.mllm import MultimodalLLM
from ..models.unet import UNet, UNetState
from .stage_output import GENERATION_FIELDS, StageOutput


def segment_ranges(segments: int, count: int) -> list[range]:
    """Contiguous runs of ``segments`` over ``count`` stages, the first ``segments % count`` one longer."""
    if not 1 <= count <= segments:
        raise ValueError(f"the U-Net has {segments} segments (levels down, middle, levels up): use pp <= {segments}")
    per, extra = divmod(segments, count)
    starts = [i * per + min(i, extra) for i in range(count + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(count)]


def boundary_shapes(unet: UNet, cfg, upto: int) -> list[tuple[int, ...]]:
    """Per-sample shapes of the ``UNetState`` after the first ``upto`` segments (traced on meta)."""
    side = cfg.gen_image_size // cfg.latent_downsample
    with torch.device("meta"):
        sample = torch.empty(1, cfg.generator.in_channels, side, side)
        context = torch.empty(1, cfg.gen_tokens, cfg.generator.cross_attention_dim)
        state = unet.begin(sample, torch.zeros(1, dtype=torch.long), context)
        for segment in unet.segments()[:upto]:
            state = unet.run(segment, state)
    return [tuple(t.shape[1:]) for t in state.tensors()]


def cut_floats(unet: UNet, cfg) -> list[int]:
    """Per-sample floats a stage boundary carries after each of the first ``n - 1`` of the U-Net's ``n``
    segments (one trace on meta; the planner's boundary bytes)."""
    side = cfg.gen_image_size // cfg.latent_downsample
    out = []
    with torch.device("meta"):
        sample = torch.empty(1, cfg.generator.in_channels, side, side)
        context = torch.empty(1, cfg.gen_tokens, cfg.generator.cross_attention_dim)
        state = unet.begin(sample, torch.zeros(1, dtype=torch.long), context)
        for segment in unet.segments()[:-1]:
            state = unet.run(segment, state)
            out.append(sum(math.prod(t.shape[1:]) for t in state.tensors()))
    return out


def pack(state: UNetState) -> torch.Tensor:
    """[samples, sum of per-sample sizes]: every tensor of the state, flattened per sample."""
    rows = state.h.shape[0]
    return torch.cat([t.reshape(rows, -1).to(state.h.dtype) for t in state.tensors()], dim=1)


def unpack(row: torch.Tensor, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> UNetState:
    parts = row.to(dtype).split([math.prod(shape) for shape in shapes], dim=1)
    tensors = [part.reshape(row.shape[0], *shape) for part, shape in zip(parts, shapes, strict=True)]
    return UNetState(tensors[0], tensors[1:-2], tensors[-2], tensors[-1])


class GeneratorStage(nn.Module):
    """Stage ``index`` of ``count`` of the generator unit (one stage: the whole U-Net)."""

    kind = "generator"
    splittable_backward = False
    batch_fields = ("image_counts", *GENERATION_FIELDS)

    def __init__(self, model: MultimodalLLM, index: int = 0, count: int = 1):
        super().__init__()
        self.is_first, self.is_last = index == 0, index == count - 1
        unet = model.generator.unet
        names = unet.segments()
        runs = segment_ranges(len(names), count)
        self.segments = [names[i] for i in runs[index]]
        cfg = model.cfg
        self.in_shapes = None if self.is_first else boundary_shapes(unet, cfg, runs[index].start)
        self.out_shapes = None if self.is_last else boundary_shapes(unet, cfg, runs[index].stop)
        self._drop_others(model, set(self.segments))
        others = ("video_projector", "audio_generator_projector", "audio_generator", "audio_latent_encoder")
        for name in (
            "encoder",
            "encoder_projector",
            "audio_encoder",
            "audio_projector",
            "video_encoder",
            "llm",
            *others,
        ):
            setattr(model, name, None)
        self.model = model

    def _drop_others(self, model: MultimodalLLM, kept: set[str]) -> None:
        """Modules other stages run become empty placeholders (None, or an empty module inside a ModuleList),
        so the kept ones keep their names (``generator.unet.up.1...``): checkpoints and seeded init see the
        same names whatever the split."""
        unet = model.generator.unet
        if not self.is_first:
            model.generator_projector = model.latent_encoder = None
            unet.conv_in = unet.time_linear1 = unet.time_linear2 = unet.film = None
        if not self.is_last:
            unet.norm_out = unet.conv_out = None
        for kind, levels in (("down", unet.down), ("up", unet.up)):
            for i in range(len(levels)):
                if f"{kind}.{i}" not in kept:
                    levels[i] = nn.Module()
        if "mid" not in kept:
            unet.mid_res1 = unet.mid_attn = unet.mid_res2 = None

    def _dtype(self) -> torch.dtype:
        return next(self.model.generator.parameters()).dtype

    def forward(self, inbound: torch.Tensor, batch: Batch) -> StageOutput:
        generator = self.model.generator
        unet = generator.unet
        if self.is_first:
            context = self.model.generator_projector(inbound)
            latents = self.model.latent_encoder(batch.gen_images)
            state = unet.begin(
                generator.noisy(latents, batch.gen_noise, batch.gen_timesteps), batch.gen_timesteps, context
            )
        else:
            state = unpack(inbound, self.in_shapes, self._dtype())
        for segment in self.segments:
            state = unet.run(segment, state)
        if not self.is_last:
            return StageOutput(pack(state))
        loss = generator.loss_sum(unet.finish(state), batch.gen_noise, batch.gen_weight)
        return StageOutput(None, {"gen_loss_sum": loss})

    def inbound_row(self) -> tuple[int, ...]:
        if self.is_first:
            return (self.model.cfg.gen_tokens, self.model.cfg.llm.dim)
        return (sum(math.prod(shape) for shape in self.in_shapes),)

    def outbound_row(self) -> tuple[int, ...] | None:
        return None if self.is_last else (sum(math.prod(shape) for shape in self.out_shapes),)
