"""The video tower (model.video_encoder): a ViT of its own run on every frame, its patch embeddings averaged over
each group of ``temporal_merge`` consecutive frames.

Input is uint8 frames grouped as the data workers send them, ``[G, k, 3, H, W]`` (k = temporal_merge; a video's
last group is padded with its last frame), so the average is a fixed-shape mean over one axis and never needs
per-video boundaries on the device. Output is ``[G, P, out_dim]``: one set of P patch embeddings per group, which
the video projector maps into the LLM's width and the LLM reads at the ``<video>`` placeholders. A video of F
frames thus costs the tower F frame passes and the LLM ceil(F / k) x P positions: the regime where encoder work
outgrows the backbone's as k grows.

Averaging is temporal pooling after the blocks (frames never attend to each other): the tower is a per-frame
image encoder, as in LLaVA-style video models, and Qwen2-VL's 3-D patches over frame pairs give the same token
count. It is a VisionTransformer, so tensor and sequence parallelism, recompute and compile treat it as one.
"""

from __future__ import annotations

import torch

from ..config import VideoEncoderConfig
from .vit import VisionTransformer


class VideoTower(VisionTransformer):
    def __init__(self, cfg: VideoEncoderConfig):
        if int(cfg.temporal_merge) < 1:
            raise ValueError(f"model.video_encoder.temporal_merge={cfg.temporal_merge}: use 1 or more (2 merges pairs)")
        super().__init__(cfg)
        self.temporal_merge = int(cfg.temporal_merge)

    def forward(self, groups: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """uint8 frame groups [G, k, 3, H, W] -> [G, P, out_dim], each group's frames averaged."""
        count, merge = groups.shape[0], groups.shape[1]
        per_frame = super().forward(groups.flatten(0, 1))  # [G * k, P, D]
        return per_frame.view(count, merge, *per_frame.shape[1:]).mean(dim=1)
