"""From raw webdataset members to one fixed-length training row.

Accepted sample layouts (keys are the member extensions, lower case):

* interleaved: ``json`` = ``{"texts": [...], "images": [...]}``, two lists of
  equal length where position i holds either a text or the member name of an
  image or audio clip (``"0.jpg"``, ``"1.flac"``), the other entry being null
  (MMC4 / OBELICS style);
* caption pairs (img2dataset): one image member (``jpg``, ``jpeg``, ``png`` or
  ``webp``) and/or one audio member (``flac``, ``wav``, ``ogg``, ``mp3``) plus
  ``txt`` or ``json`` with a ``"caption"`` field;
* text only: ``txt`` or ``json`` with ``"caption"`` / ``"text"``.

One sample becomes one row of ``seq_len`` tokens (padded; never packed with
other samples, so every row has its own generation target and the per-sample
cost used for reordering is exact)::

    <bos> text <img>*P text <audio>*Q ... <gen>*G <img>*P text <eos> <pad>...

An audio clip (with model.audio_encoder) becomes Q ``<audio>`` placeholders, its
log-mel features computed here (data/audio.py); without an audio tower the clip is
dropped and counted (``truncated_audio``), as a text model ignores images.

A video member (an animated webp, gif or apng) gives up to ``data.video_frames`` frames.
Without a video tower each frame is an image (P ``<img>`` each). With one
(model.video_encoder) its frames are cut into groups of ``temporal_merge`` (the last
padded with the last frame) and each group becomes P' ``<video>`` placeholders; the
groups that do not fit are dropped and counted with the truncated images, and the
video's frames are never a generation target.

If a sample does not fit, trailing content is dropped (a partial text
segment is kept; an image is kept only whole) and counted as truncation.
``<gen>`` tokens sit before the last kept image, which becomes the
generation target; a sample without images still gets them, with weight 0.
For text-only models (``family: llama``) the text segments are joined and
images are ignored.

Problems that make a sample unusable raise :class:`BadSample`; the loader
skips such samples and counts them by reason.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from ..config import ModelConfig, image_tokens
from .audio import audio_frames, audio_tokens, check_audio, decode_audio, log_mel
from .bad_sample import BadSample  # noqa: F401  re-exported: the loaders and tests read it from here
from .conversations import template_source
from .images import decode_frame, decode_image, frame_indices
from .sample_layouts import (  # noqa: F401  parse_segments and the extensions are read from here too
    AUDIO_EXTENSIONS,
    IMAGE_EXTENSIONS,
    conversation_of,
    conversation_segments,
    parse_segments,
)
from .tokenizer import Tokenizer


@dataclass
class EncodedSample:
    """One row. Arrays are numpy: they cross the worker->trainer pipe as plain bytes,
    which for many small arrays is an order of magnitude cheaper than shared-memory tensors."""

    key: str
    tokens: np.ndarray  # [S] int64
    labels: np.ndarray  # [S] int64
    images: np.ndarray  # [n, 3, H, W] uint8
    gen_image: np.ndarray  # [3, Hg, Wg] uint8 (zeros without a target)
    gen_weight: float
    gen_noise: np.ndarray  # [C, h, w] float32
    gen_timestep: int
    truncated_images: int = 0
    audio: np.ndarray = None  # [a, n_mels, frames] float32 log-mel features ([0, 1, 1] without an audio tower)
    truncated_audio: int = 0
    # The audio generator's target (model.audio_generator): the last clip's features, its weight, seeded noise and
    # timestep ([1, 1], 0, [1, 1, 1], 0 without one)
    gen_audio: np.ndarray = None
    audio_gen_weight: float = 0.0
    audio_gen_noise: np.ndarray = None
    audio_gen_timestep: int = 0
    video: np.ndarray = None  # [g, k, 3, H, W] uint8 frame groups for the video tower ([0, 1, 3, 1, 1] without one)

    def __post_init__(self) -> None:
        if self.video is None:
            self.video = np.zeros((0, 1, 3, 1, 1), dtype=np.uint8)
        if self.audio is None:
            self.audio = np.zeros((0, 1, 1), dtype=np.float32)
        if self.gen_audio is None:
            self.gen_audio = np.zeros((1, 1), dtype=np.float32)
        if self.audio_gen_noise is None:
            self.audio_gen_noise = np.zeros((1, 1, 1), dtype=np.float32)


@dataclass
class PlannedSample:
    """A sample read and tokenized whose images were checked from their headers but not decoded: what
    reordering and the loss normalizers need (its cost, image count, loss tokens). ``SampleEncoder.finish``
    decodes it into an EncodedSample; a producer pool plans every sample of a step and decodes its share."""

    key: str
    tokens: np.ndarray  # [S] int64
    labels: np.ndarray  # [S] int64
    images: list[bytes | tuple[bytes, int]]  # the images the row keeps, encoded; a video's frame: (video, index)
    gen_weight: float
    truncated_images: int = 0
    audio: list[bytes] = field(default_factory=list)  # the clips the row keeps, encoded
    truncated_audio: int = 0
    audio_gen_weight: float = 0.0  # 1: the audio generator trains on the row's last clip
    # the video tower's frame groups the row keeps: each temporal_merge (video, frame index) pairs
    video: list[tuple[tuple[bytes, int], ...]] = field(default_factory=list)


def sample_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


class SampleEncoder:
    """Turns raw samples into rows for one model configuration."""

    def __init__(
        self,
        model: ModelConfig,
        tokenizer: Tokenizer,
        seed: int,
        max_image_pixels: int,
        video_frames: int = 8,
        chat_template: str = "auto",
    ):
        # Plain attributes, not config lookups: this runs for every sample (OmegaConf access is slow).
        self.tokenizer = tokenizer
        self.video_frames = int(video_frames)  # data.video_frames: frames a video member contributes, at most
        self.seed = seed
        self.max_image_pixels = max_image_pixels
        self.seq_len = int(model.seq_len)
        self.multimodal = model.family == "mllm"
        self.has_encoder = model.encoder is not None
        self.has_generator = model.generator is not None
        self.image_size = int(model.encoder.image_size) if self.has_encoder else 0
        # <img> positions per image: the encoder's patches, or the resampler's queries (config/model.py)
        self.image_tokens = image_tokens(model) if self.has_encoder else 0
        self.gen_tokens = int(model.gen_tokens) if self.has_generator else 0
        self.gen_image_size = int(model.gen_image_size) if self.has_generator else 0
        self.latent_side = model.gen_image_size // model.latent_downsample if self.has_generator else 0
        self.latent_channels = int(model.generator.in_channels) if self.has_generator else 0
        self.timesteps = int(model.generator.num_train_timesteps) if self.has_generator else 0
        self.audio_cfg = model.audio_encoder if self.multimodal else None
        self.audio_tokens = audio_tokens(self.audio_cfg) if self.audio_cfg is not None else 0
        self.audio_gen = model.audio_generator if self.audio_cfg is not None else None  # validation: both or none
        video = model.video_encoder if self.multimodal else None
        self.video_merge = int(video.temporal_merge) if video is not None else 0
        self.video_size = int(video.image_size) if video is not None else 0
        self.video_patches = (video.image_size // video.patch_size) ** 2 if video is not None else 0
        self.chat_template = chat_template  # data.chat_template: its Jinja text read at the first conversation
        self._template: str | None = None

    def encode(self, key: str, members: dict[str, bytes]) -> EncodedSample:
        return self.finish(self.plan(key, members))

    def plan(self, key: str, members: dict[str, bytes]) -> PlannedSample:
        """Everything but the pixels: the row's tokens and labels, the images it keeps (checked from their
        headers), its generation weight. BadSample for what a header read can tell is unusable."""
        conversation = conversation_of(members)
        if conversation is not None:
            if self._template is None:
                self._template = template_source(self.chat_template, getattr(self.tokenizer, "path", "byte"))
            segments = conversation_segments(conversation, members, self.tokenizer, self._template, self.has_encoder)
            if not self.multimodal:
                return self._planned(key, [seg for seg in segments if seg[0] == "turn"], 0)
        else:
            segments = parse_segments(members)
        if not self.multimodal:
            text = "\n".join(str(v) for kind, v in segments if kind == "text")
            return self._planned(key, [("text", self.tokenizer.encode(text))], 0)
        budget = self.seq_len - 2 - self.gen_tokens
        kept: list[tuple[str, object]] = []
        total_images = sum(kind == "image" for kind, _ in segments)  # a video beyond the budget counts as one
        total_audio = sum(kind == "audio" for kind, _ in segments)
        for kind, value in segments:
            if kind in ("text", "turn"):  # a turn: (ids, trained) of a conversation
                ids = value[0] if kind == "turn" else self.tokenizer.encode(str(value))  # type: ignore[index]
                ids = ids[: max(budget, 0)]
                if ids:
                    kept.append((kind, ids if kind == "text" else (ids, value[1])))  # type: ignore[index]
                    budget -= len(ids)
            elif kind == "audio":
                if self.audio_tokens and budget >= self.audio_tokens:
                    check_audio(value)  # type: ignore[arg-type]
                    kept.append(("audio", value))
                    budget -= self.audio_tokens
            elif self.video_merge:
                budget, total_images = self._image_or_video(value, budget, kept, total_images)  # type: ignore
            elif self.has_encoder and budget >= self.image_tokens:
                frames = frame_indices(value, self.video_frames, self.max_image_pixels)  # type: ignore[arg-type]
                total_images += len(frames) - 1  # a video's frames are images to the encoder, each its positions
                for frame in frames:
                    if budget < self.image_tokens:
                        break
                    kept.append(("image", value if len(frames) == 1 else (value, frame)))
                    budget -= self.image_tokens
            if budget <= 0:
                break
        kept_images = sum(kind in ("image", "video") for kind, _ in kept)
        planned = self._planned(key, kept, total_images - kept_images)
        planned.truncated_audio = total_audio - len(planned.audio)
        return planned

    def _image_or_video(self, data: bytes, budget: int, kept: list, total_images: int) -> tuple[int, int]:
        """An image member with a video tower: a still image to the image encoder, a video's frame groups to the
        tower, what fits of each; returns the budget left and the images counted (a video's groups count)."""
        least = min(self.video_patches, self.image_tokens) if self.has_encoder else self.video_patches
        if budget < least:
            return budget, total_images
        frames = frame_indices(data, self.video_frames, self.max_image_pixels)
        if len(frames) > 1:
            total_images += -(-len(frames) // self.video_merge) - 1
            return self._video_groups(data, frames, budget, kept), total_images
        if self.has_encoder and budget >= self.image_tokens:
            kept.append(("image", data))
            budget -= self.image_tokens
        return budget, total_images

    def _video_groups(self, data: bytes, frames: list[int], budget: int, kept: list) -> int:
        """The video's frames as groups of temporal_merge (the last padded with the last frame), as many as fit in
        ``budget`` tokens, appended to ``kept``; returns the budget left."""
        merge = self.video_merge
        for start in range(0, len(frames), merge):
            if budget < self.video_patches:
                break
            group = frames[start : start + merge]
            group += [group[-1]] * (merge - len(group))
            kept.append(("video", tuple((data, index) for index in group)))
            budget -= self.video_patches
        return budget

    def _video(self, groups: list[tuple[tuple[bytes, int], ...]], opened: dict) -> np.ndarray:
        """The row's frame groups decoded at the video tower's size: [g, k, 3, H, W] uint8."""
        size = self.video_size
        if not groups:
            return np.zeros((0, max(self.video_merge, 1), 3, size or 1, size or 1), dtype=np.uint8)
        decode = (
            decode_frame(data, index, (size,), self.max_image_pixels, opened)[0] for g in groups for data, index in g
        )
        return np.stack(list(decode)).reshape(len(groups), self.video_merge, 3, size, size)

    def finish(self, planned: PlannedSample) -> EncodedSample:
        """The planned row with its images decoded and its generation noise drawn; BadSample if a pixel decode
        fails (a header that reads, a body that does not)."""
        decoded = []
        gen_image = None
        opened: dict[int, Image.Image] = {}  # this row's videos, each decoded once
        for index, data in enumerate(planned.images):
            sizes = [self.image_size]
            if index == len(planned.images) - 1 and self.has_generator:
                sizes.append(self.gen_image_size)
            if isinstance(data, tuple):  # a video's frame
                tensors = decode_frame(data[0], data[1], tuple(sizes), self.max_image_pixels, opened)
            else:
                tensors = decode_image(data, tuple(sizes), self.max_image_pixels)
            decoded.append(tensors[0])
            if len(tensors) > 1:
                gen_image = tensors[1]
        size = self.image_size
        image_array = np.stack(decoded) if decoded else np.zeros((0, 3, size, size), dtype=np.uint8)
        if self.has_generator:
            # Diffusion noise and timestep are seeded by the sample, not by the process that
            # happens to train on it, so every parallel layout sees the same targets.
            generator = torch.Generator().manual_seed(sample_seed(self.seed, planned.key))
            side = self.latent_side
            noise = torch.randn(self.latent_channels, side, side, generator=generator).numpy()
            timestep = int(torch.randint(0, self.timesteps, (1,), generator=generator))
            size = self.gen_image_size
            gen_image = gen_image if gen_image is not None else np.zeros((3, size, size), dtype=np.uint8)
        else:
            noise, timestep = np.zeros(0, dtype=np.float32), 0
            gen_image = np.zeros(0, dtype=np.uint8)
        clips = self._clips(planned.audio)
        sample = EncodedSample(
            planned.key,
            planned.tokens,
            planned.labels,
            image_array,
            gen_image,
            planned.gen_weight,
            noise,
            timestep,
            planned.truncated_images,
            clips,
            planned.truncated_audio,
        )
        if self.audio_gen is not None:
            self._audio_target(sample, planned.key, planned.audio_gen_weight)  # 0 unless a clip follows <gen>
        if self.video_merge:
            sample.video = self._video(planned.video, opened)
        return sample

    def _audio_target(self, sample: EncodedSample, key: str, weight: float) -> None:
        """The audio generator's target: the row's last clip (zeros and weight 0 without one), with noise and a
        timestep seeded by the sample (another stream than the image generator's)."""
        gen, clips = self.audio_gen, sample.audio
        sample.gen_audio = clips[-1] if len(clips) else np.zeros(clips.shape[1:], dtype=np.float32)
        sample.audio_gen_weight = weight
        generator = torch.Generator().manual_seed(sample_seed(self.seed, "audio:" + key))
        shape = (int(gen.in_channels), *map(int, gen.latent_shape))
        sample.audio_gen_noise = torch.randn(*shape, generator=generator).numpy()
        sample.audio_gen_timestep = int(torch.randint(0, int(gen.num_train_timesteps), (1,), generator=generator))

    def _clips(self, clips: list[bytes]) -> np.ndarray:
        """The row's audio clips as log-mel features [a, n_mels, frames] ([0, 1, 1] without an audio tower)."""
        cfg = self.audio_cfg
        if cfg is None:
            return np.zeros((0, 1, 1), dtype=np.float32)
        features = [log_mel(decode_audio(clip, int(cfg.sample_rate)), cfg) for clip in clips]
        if not features:
            return np.zeros((0, int(cfg.n_mels), audio_frames(cfg)), dtype=np.float32)
        return np.stack(features)

    def _planned(self, key: str, kept: list[tuple[str, object]], truncated_images: int) -> PlannedSample:
        """The row of ``kept`` segments (token-id lists and image bytes): tokens, labels, and the images it keeps."""
        tok = self.tokenizer
        seq_len = self.seq_len
        tokens = [tok.bos_id]
        trains = [False]  # per token: the loss is taken where it is the next token (a conversation's assistant)
        # The <gen> queries go before every generation target, so causal attention never shows them one: before
        # the last image (the image target), or without one before the last clip (the audio generator's target).
        image_indices = [i for i, seg in enumerate(kept) if seg[0] == "image"]
        clip_indices = [i for i, seg in enumerate(kept) if seg[0] == "audio"] if self.audio_gen is not None else []
        targets = image_indices or clip_indices
        gen_before = targets[-1] if targets else None
        # the audio target: the last clip, if the queries come before it (else it would condition itself)
        heard = bool(clip_indices) and gen_before is not None and clip_indices[-1] >= gen_before
        for i, (kind, value) in enumerate(kept):
            if i == gen_before and self.has_generator:
                tokens += [tok.gen_id] * self.gen_tokens
            if kind == "text":
                tokens += value  # type: ignore[operator]
            elif kind == "turn":
                tokens += value[0]  # type: ignore[index]
                trains += [bool(value[1])] * len(value[0])  # type: ignore[index]
            elif kind == "audio":
                tokens += [tok.audio_id] * self.audio_tokens
            elif kind == "video":
                tokens += [tok.video_id] * self.video_patches
            else:
                tokens += [tok.image_id] * self.image_tokens
            trains += [kind == "text"] * (len(tokens) - len(trains))
        if self.has_generator and gen_before is None:
            tokens += [tok.gen_id] * self.gen_tokens
            trains += [False] * self.gen_tokens
        turns = any(kind == "turn" for kind, _ in kept)  # a conversation's own end marks are trained, not <eos>
        trains = trains[: seq_len - 1] + [not turns]
        tokens = tokens[: seq_len - 1] + [tok.eos_id]
        length = len(tokens)
        tokens += [tok.pad_id] * (seq_len - length)
        token_array = np.asarray(tokens, dtype=np.int64)
        # Predict the next token only where it is text (or the <eos>): not an image or <gen> placeholder, nothing
        # after <eos>. By position and placeholder id, so any tokenizer works (pad may equal eos).
        following = np.append(token_array[1:], tok.pad_id)
        placeholder = (following == tok.image_id) | (following == tok.gen_id) | (following == tok.audio_id)
        if self.video_merge:
            placeholder |= following == tok.video_id
        trained = np.zeros(seq_len, dtype=bool)
        trained[: length - 1] = np.asarray(trains[1:length], dtype=bool)  # the next token's flag
        is_text = (np.arange(seq_len) < length - 1) & ~placeholder & trained
        labels = np.where(is_text, following, -100).astype(np.int64)
        images = [value for kind, value in kept if kind == "image"]
        clips = [value for kind, value in kept if kind == "audio"]
        weight = 1.0 if self.has_generator and images else 0.0
        planned = PlannedSample(key, token_array, labels, images, weight, truncated_images, clips)  # type: ignore
        planned.audio_gen_weight = 1.0 if heard else 0.0
        planned.video = [value for kind, value in kept if kind == "video"]  # type: ignore[misc]
        return planned
