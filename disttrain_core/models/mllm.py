"""The multimodal LLM: image encoder -> projector -> LLM backbone -> projector
-> image generator. With ``family: llama`` only the backbone exists.

Sequence layout (built by the data pipeline, see data/samples.py)::

    <bos> text <img>*P text <audio>*Q <video>*V ... <gen>*G <img>*P text <eos> <pad>...

Each ``<img>`` run is replaced by the P patch embeddings of one image, each ``<audio>`` run by the Q positions
of one clip through the audio tower (model.audio_encoder), each ``<video>`` run by the P' positions of each
frame group of one video through the video tower (model.video_encoder; models/video.py). The
final hidden states at the G ``<gen>`` positions, projected to the
generator's conditioning width, drive a denoising step on the latents of the
image that follows them (the last image of the sample). Because attention is
causal, those states never see the image they must generate.

The forward returns *sums* and counts, not means: the trainer divides by the
global-batch totals, which keeps the loss identical however the batch is split
over processes and microbatches.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..data.batch import Batch
from .audio import AudioEncoder
from .latents import MelLatentEncoder, build_latent_encoder
from .llama import Documents, Llama
from .projector import build_projector
from .unet import DiffusionGenerator
from .video import VideoTower
from .vit import VisionTransformer

MODULE_NAMES = (
    "encoder",
    "encoder_projector",
    "audio_encoder",
    "audio_projector",
    "video_encoder",
    "video_projector",
    "llm",
    "generator_projector",
    "generator",
    "audio_generator_projector",
    "audio_generator",
)


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the first ``count`` True entries of ``mask`` along its last dimension, in order.

    Boolean indexing would size its output from the data (a device-to-host read); a stable sort that
    puts the True entries first has a fixed shape.
    """
    return torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :count]


class MultimodalLLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, image_token_id: int, gen_token_id: int, audio_token_id: int = -1, video_token_id=-1
    ):
        super().__init__()
        self.cfg = cfg
        self.image_token_id = image_token_id
        self.gen_token_id = gen_token_id
        self.audio_token_id = audio_token_id
        self.video_token_id = video_token_id
        self.llm = Llama(cfg.llm, cfg.seq_len)
        self.llm.output.chunk = int(cfg.loss_chunk)
        kernel = "varlen" if cfg.document_attention == "auto" else str(cfg.document_attention)
        for layer in self.llm.layers.values():
            layer.attention.document_kernel = kernel
        self.encoder = self.encoder_projector = None
        self.generator = self.generator_projector = self.latent_encoder = None
        self.audio_encoder = self.audio_projector = None
        self.audio_generator = self.audio_generator_projector = self.audio_latent_encoder = None
        if cfg.audio_generator is not None:  # the same <gen> queries condition it; its target: the row's last clip
            gen = cfg.audio_generator
            self.audio_generator_projector = build_projector(
                cfg.llm.dim, gen.cross_attention_dim, cfg.audio_generator_projector, "audio_generator_projector"
            )
            self.audio_generator = DiffusionGenerator(gen)
            self.audio_latent_encoder = MelLatentEncoder(gen.in_channels, tuple(gen.latent_shape))
        if cfg.audio_encoder is not None:
            self.audio_encoder = AudioEncoder(cfg.audio_encoder)
            self.audio_projector = build_projector(
                self.audio_encoder.out_dim, cfg.llm.dim, cfg.audio_projector, "audio_projector"
            )
        self.video_encoder = self.video_projector = None
        if cfg.video_encoder is not None:
            self.video_encoder = VideoTower(cfg.video_encoder)
            self.video_projector = build_projector(
                self.video_encoder.out_dim, cfg.llm.dim, cfg.video_projector, "video_projector"
            )
        if cfg.encoder is not None:
            self.encoder = VisionTransformer(cfg.encoder)
            self.encoder_projector = build_projector(self.encoder.out_dim, cfg.llm.dim, cfg.encoder_projector)
        if cfg.generator is not None:
            self.generator_projector = build_projector(
                cfg.llm.dim, cfg.generator.cross_attention_dim, cfg.generator_projector, "generator_projector"
            )
            self.generator = DiffusionGenerator(cfg.generator)
            self.latent_encoder = build_latent_encoder(cfg)
        for name in MODULE_NAMES:
            module = getattr(self, name)
            if module is not None and getattr(cfg.freeze, name):
                module.requires_grad_(False)

    # The pieces below are what a pipeline stage or a parallelism unit calls.
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images [N, 3, H, W] -> embeddings in the LLM's width [N, P, D] (P: config/model.py image_tokens,
        the patches, or the resampler's queries)."""
        return self.encoder_projector(self.encoder(images))

    def encode_audio(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mel features [N, n_mels, frames] -> embeddings in the LLM's width [N, frames / 2, D]."""
        return self.audio_projector(self.audio_encoder(mels))

    def encode_video(self, groups: torch.Tensor) -> torch.Tensor:
        """uint8 frame groups [G, k, 3, H, W] -> embeddings in the LLM's width [G, P, D]."""
        return self.video_projector(self.video_encoder(groups))

    def embed_tokens(
        self,
        tokens: torch.Tensor,
        image_embeds: torch.Tensor | None,
        audio_embeds: torch.Tensor | None = None,
        video_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.llm.embed(tokens)
        placed = ((image_embeds, self.image_token_id), (audio_embeds, self.audio_token_id))
        for embeds, token_id in (*placed, (video_embeds, self.video_token_id)):
            if embeds is not None:
                # The slots, in sequence order; their count is known from the shapes (images x patches, clips x
                # positions), so the copy has a fixed shape and never reads a value back to the host.
                count = embeds.shape[0] * embeds.shape[1]
                slots = _positions(tokens.flatten() == token_id, count)
                h = h.flatten(0, 1).index_copy(0, slots, embeds.flatten(0, 1).to(h.dtype)).view_as(h)
        return h

    def audio_embeddings(self, batch: Batch) -> torch.Tensor | None:
        """The batch's clips through the audio tower (None without one)."""
        return self.encode_audio(batch.audio) if self.audio_encoder is not None else None

    def video_embeddings(self, batch: Batch) -> torch.Tensor | None:
        """The batch's frame groups through the video tower (None without one)."""
        return self.encode_video(batch.video) if self.video_encoder is not None else None

    def lm_loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed next-token loss of the normed final states (the head's logits in chunks of model.loss_chunk
        positions when set: models/chunked_loss.py)."""
        return self.llm.output(hidden, labels)

    def generation_queries(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states at the <gen> positions: [B, gen_tokens, D] (every sample has gen_tokens)."""
        positions = _positions(tokens == self.gen_token_id, self.cfg.gen_tokens)  # [B, G]
        return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))

    def generation_loss_from_queries(self, queries: torch.Tensor, batch: Batch) -> torch.Tensor:
        context = self.generator_projector(queries)
        latents = self.latent_encoder(batch.gen_images)
        return self.generator(latents, batch.gen_noise, batch.gen_timesteps, context, batch.gen_weight)

    def audio_generation_loss_from_queries(self, queries: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The audio generator's summed denoising loss on the rows' last clips (weight 0 for rows without one)."""
        context = self.audio_generator_projector(queries)
        latents = self.audio_latent_encoder(batch.gen_audio)
        return self.audio_generator(
            latents, batch.audio_gen_noise, batch.audio_gen_timesteps, context, batch.audio_gen_weight
        )

    def generation_loss_sum(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Every generator's summed denoising loss: the image's, plus the audio's with an audio generator (one
        generation loss, normalized by the targets of both: Batch.gen_samples)."""
        queries = self.generation_queries(hidden, batch.tokens)
        loss = self.generation_loss_from_queries(queries, batch)
        if self.audio_generator is not None:
            loss = loss + self.audio_generation_loss_from_queries(queries, batch)
        return loss

    # A pipeline stage runs: input_embeddings (first stage), llm.run_layers (its layers),
    # output_losses (last stage). The whole model is the three in a row.
    def input_embeddings(self, batch: Batch) -> torch.Tensor:
        image_embeds = self.encode_images(batch.images) if self.encoder is not None else None
        return self.embed_tokens(batch.tokens, image_embeds, self.audio_embeddings(batch), self.video_embeddings(batch))

    def output_losses(self, hidden: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        hidden = self.llm.final_norm(hidden)
        out = {
            "lm_loss_sum": self.lm_loss_sum(hidden, batch.labels),
            "lm_tokens": (batch.labels != -100).sum(),
        }
        if self.generator is not None:
            out["gen_loss_sum"] = self.generation_loss_sum(hidden, batch)
            out["gen_samples"] = batch.gen_weight.sum() + batch.audio_gen_weight.sum()
        return out

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        documents = None if batch.doc_ids is None else Documents(batch.doc_ids, batch.positions)
        return self.output_losses(self.llm.run_layers(self.input_embeddings(batch), documents), batch)

    def submodules(self) -> dict[str, nn.Module]:
        """The present modules by name, in data-flow order."""
        return {name: getattr(self, name) for name in MODULE_NAMES if getattr(self, name) is not None}
