"""Audio encoder in the Whisper-encoder layout: log-mel features -> two 1-D convolutions (GELU; the second with
stride 2) -> learned positions -> pre-norm transformer blocks -> a final norm.

Input is the log-mel spectrogram [N, n_mels, frames] that the data workers compute (data/audio.py), so the
trainers move compact features rather than waveforms. Output is one embedding per position [N, frames / 2, dim],
which the audio projector maps into the LLM's width. With ``conf/model/audio_encoder/whisper_large_v3.yaml`` the
parameter names differ from Hugging Face's ``WhisperEncoder`` but the count is the same, 636,968,960.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import AudioEncoderConfig
from .common import FeedForwardGELU
from .vit import VitAttention


def audio_frames(cfg: AudioEncoderConfig) -> int:
    """Log-mel frames per clip (Whisper drops the centred STFT's last frame): 3,000 for 30 s at 100 per second."""
    return round(cfg.clip_seconds * cfg.sample_rate) // cfg.hop_length


def audio_tokens(cfg: AudioEncoderConfig) -> int:
    """Output positions per clip: the frames after the stride-2 convolution (1,500 for Whisper)."""
    return (audio_frames(cfg) + 1) // 2


class AudioBlock(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = VitAttention(cfg.dim, cfg.n_heads, key_bias=False)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = FeedForwardGELU(cfg.dim, cfg.mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"model.audio_encoder.dim={cfg.dim} is not divisible by n_heads={cfg.n_heads}")
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.dim, cfg.dim, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Parameter(torch.empty(audio_tokens(cfg), cfg.dim))
        self.blocks = nn.ModuleDict({str(i): AudioBlock(cfg) for i in range(cfg.n_layers)})
        self.norm_post = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.out_dim = cfg.dim

    @property
    def tokens_per_clip(self) -> int:
        return audio_tokens(self.cfg)

    # A pipeline stage would run: embed (first stage), run_blocks (its blocks), head (last stage), as the ViT's.
    def embed(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mel features [N, n_mels, frames] -> the blocks' input [N, frames / 2, dim]."""
        x = mels.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)
        return x + self.positional_embedding[: x.shape[1]].to(x.dtype)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_post(x)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(self.embed(mels)))
