"""Audio encoder in the Whisper-encoder layout: log-mel features -> two 1-D convolutions (GELU; the second with
stride 2) -> learned positions -> pre-norm transformer blocks -> a final norm.

Input is the log-mel spectrogram [N, n_mels, frames] that the data workers compute (data/audio.py), so the
trainers move compact features rather than waveforms. Output is one embedding per position [N, frames / 2, dim],
which the audio projector maps into the LLM's width. With ``conf/model/audio_encoder/whisper_large_v3.yaml`` the
parameter names differ from Hugging Face's ``WhisperEncoder`` but the count is the same, 636,968,960;
``model.init_from`` imports its weights (models/hf/whisper.py: the same function, renamed tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import AudioEncoderConfig
from ..data.audio import audio_frames, audio_tokens
from .vit import VitBlock

__all__ = ["AudioEncoder", "audio_frames", "audio_tokens"]


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"model.audio_encoder.dim={cfg.dim} is not divisible by n_heads={cfg.n_heads}")
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.dim, cfg.dim, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Parameter(torch.empty(audio_tokens(cfg), cfg.dim))
        block = (cfg.dim, cfg.n_heads, cfg.mlp_dim, cfg.norm_eps)
        self.blocks = nn.ModuleDict({str(i): VitBlock(*block, key_bias=False) for i in range(cfg.n_layers)})
        self.sequence = None  # sequence parallelism: the blocks' SequenceSplit (as the ViT's)
        self.norm_post = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.out_dim = cfg.dim

    @property
    def tokens_per_clip(self) -> int:
        return audio_tokens(self.cfg)

    # The LLM unit's first stage runs it whole; the pieces mirror the ViT's (embed, run_blocks, head).
    def embed(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mel features [N, n_mels, frames] -> the blocks' input [N, frames / 2, dim]."""
        x = mels.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)
        return x + self.positional_embedding[: x.shape[1]].to(x.dtype)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        seq = self.sequence
        if seq is not None:
            x = seq.scatter(x)
        for block in self.blocks.values():
            x = block(x)
        return x if seq is None else seq.leave(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_post(x)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(self.embed(mels)))
