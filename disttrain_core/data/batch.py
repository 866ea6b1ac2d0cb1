"""The tensors of one microbatch, as the models consume them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

# Per-row audio and video fields and their shapes and types when a batch leaves them out (no audio tower /
# generator, no video tower).
EMPTY_AUDIO = (
    ("audio_counts", (), torch.int64),
    ("video_counts", (), torch.int64),
    ("gen_audio", (1, 1), torch.float32),
    ("audio_gen_weight", (), torch.float32),
    ("audio_gen_noise", (1, 1, 1), torch.float32),
    ("audio_gen_timesteps", (), torch.int64),
)
PER_ROW_AUDIO = tuple(name for name, _, _ in EMPTY_AUDIO)
# The per-row item counts the broker routes encoder embeddings by (images, audio clips, video frame groups).
ITEM_COUNTS = ("image_counts", "audio_counts", "video_counts")


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] int64; image placeholders and generation queries included
    labels: torch.Tensor  # [B, S] int64; -100 where no loss is taken
    images: torch.Tensor  # [N, 3, H, W] uint8, the images of all samples in order
    image_counts: torch.Tensor  # [B] int64, images per sample
    gen_images: torch.Tensor  # [B, 3, Hg, Wg] uint8, generation target (zeros if none)
    gen_weight: torch.Tensor  # [B] float32, 1 if the sample has a generation target
    gen_noise: torch.Tensor  # [B, C, h, w] float32, per-sample seeded diffusion noise
    gen_timesteps: torch.Tensor  # [B] int64, per-sample seeded diffusion timesteps
    # Packed documents (data/packing.py): each position's document (-1: padding) and place inside it.
    doc_ids: torch.Tensor | None = None  # [B, S] int64
    positions: torch.Tensor | None = None  # [B, S] int64
    keys: list[str] = field(default_factory=list)
    # Item rebalancing (parallel.rebalance_items): the images, clips and frame groups of every data-parallel
    # replica's block of this microbatch, by kind (image, clip, group); host integers, set by the trainer.
    replica_items: dict[str, tuple[int, ...]] | None = None
    # Audio clips (model.audio_encoder): log-mel features of all samples' clips in order, and clips per sample.
    # Left out, a batch has none ([0, 1, 1] and zeros), as a text batch has no images.
    audio: torch.Tensor | None = None  # [A, n_mels, frames] float32
    audio_counts: torch.Tensor | None = None  # [B] int64
    # The audio generator's target (model.audio_generator): each row's last clip's features (zeros if none), its
    # weight (1 with a clip), seeded diffusion noise and timestep. Left out: one zero per row.
    gen_audio: torch.Tensor | None = None  # [B, n_mels, frames] float32
    audio_gen_weight: torch.Tensor | None = None  # [B] float32
    audio_gen_noise: torch.Tensor | None = None  # [B, C, h, w] float32
    audio_gen_timesteps: torch.Tensor | None = None  # [B] int64
    # Video frame groups (model.video_encoder): temporal_merge frames each, all samples' groups in order, and groups
    # per sample. Left out: none ([0, 1, 3, 1, 1] and zeros).
    video: torch.Tensor | None = None  # [V, k, 3, H, W] uint8
    video_counts: torch.Tensor | None = None  # [B] int64

    def __post_init__(self) -> None:
        rows, device = self.tokens.shape[0], self.tokens.device
        if self.audio is None:
            self.audio = torch.zeros((0, 1, 1), dtype=torch.float32, device=device)
        if self.video is None:
            self.video = torch.zeros((0, 1, 3, 1, 1), dtype=torch.uint8, device=device)
        for name, shape, dtype in EMPTY_AUDIO:
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros((rows, *shape), dtype=dtype, device=device))

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The batch with ``fn`` applied to every tensor (moving it to a device, pinning it, ...); an absent field
        (``absent_field``) stays one element: ``fn`` sees that element, which is then expanded again."""
        moved = {
            f.name: _map_one(fn, getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return Batch(**moved, keys=list(self.keys), replica_items=self.replica_items)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self.map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def select(self, samples: range) -> Batch:
        """The sub-batch of a contiguous range of samples (with their images, clips and frame groups)."""
        rows = slice(samples.start, samples.stop)
        return Batch(
            tokens=self.tokens[rows],
            labels=self.labels[rows],
            images=self.images[_items_of(self.image_counts, samples)],
            audio=self.audio[_items_of(self.audio_counts, samples)],
            video=self.video[_items_of(self.video_counts, samples)],
            **{name: getattr(self, name)[rows] for name in PER_ROW_AUDIO},
            image_counts=self.image_counts[rows],
            gen_images=self.gen_images[rows],
            gen_weight=self.gen_weight[rows],
            gen_noise=self.gen_noise[rows],
            gen_timesteps=self.gen_timesteps[rows],
            doc_ids=None if self.doc_ids is None else self.doc_ids[rows],
            positions=None if self.positions is None else self.positions[rows],
            keys=self.keys[rows],
        )

    def loss_tokens(self) -> int:
        return int((self.labels != -100).sum())

    def gen_samples(self) -> float:
        """Generation targets: images, and clips with an audio generator (one loss, normalized by both)."""
        return float(self.gen_weight.sum()) + float(self.audio_gen_weight.sum())


def absent_field(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Zeros of ``shape`` for a field this rank does not read (a producer's share leaves it out): one element
    expanded (every stride 0), so neither host memory nor a host-to-device copy is spent on it."""
    return torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))


def is_absent(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 1 and not any(tensor.stride())


def _map_one(fn: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    if is_absent(tensor):
        return fn(tensor.new_zeros(())).expand(tensor.shape)
    return fn(tensor)


def _items_of(counts: torch.Tensor, samples: range) -> slice:
    """The rows of a per-item tensor (images, clips) that belong to ``samples``, given each sample's count."""
    listed = counts.tolist()
    first = sum(listed[: samples.start])
    return slice(first, first + sum(listed[samples.start : samples.stop]))


def concat(parts: list[Batch]) -> Batch:
    """The rows of ``parts`` one after the other (batches without document masks)."""
    if len(parts) == 1:
        return parts[0]
    names = ("tokens", "labels", "images", "image_counts", "gen_images", "gen_weight", "gen_noise", "gen_timesteps")
    clips = [p.audio for p in parts if p.audio.shape[0]] or [parts[0].audio]  # a part without clips may be [0,1,1]
    groups = [p.video for p in parts if p.video.shape[0]] or [parts[0].video]
    return Batch(
        **{name: torch.cat([getattr(p, name) for p in parts]) for name in names},
        audio=torch.cat(clips),
        video=torch.cat(groups),
        **{name: torch.cat([getattr(p, name) for p in parts]) for name in PER_ROW_AUDIO},
        keys=[key for p in parts for key in p.keys],
    )


def text_rows(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    key: str = "row",
) -> Batch:
    """A Batch of text rows for a text-only model: no images, no generation targets; document masks when
    ``doc_ids`` / ``positions`` are given (packed documents), plain causal rows otherwise."""
    b = tokens.shape[0]
    return Batch(
        tokens=tokens,
        labels=labels,
        images=torch.zeros((0, 3, 1, 1), dtype=torch.uint8),
        image_counts=torch.zeros(b, dtype=torch.int64),
        gen_images=torch.zeros((b, 3, 1, 1), dtype=torch.uint8),
        gen_weight=torch.zeros(b, dtype=torch.float32),
        gen_noise=torch.zeros((b, 1, 1, 1), dtype=torch.float32),
        gen_timesteps=torch.zeros(b, dtype=torch.int64),
        doc_ids=doc_ids,
        positions=positions,
        keys=[f"{key}{i}" for i in range(b)],
    )


def pad_rows(rows: Batch, slot: int) -> list[Batch]:
    """The bucket's rows cut into slots of ``slot`` rows, the last padded with empty rows (no loss)."""
    n = rows.size
    count = max(1, -(-n // slot))
    pad = count * slot - n
    if pad:
        rows = with_empty_rows(rows, pad)
    return [rows.select(range(i * slot, (i + 1) * slot)) for i in range(count)]


def with_empty_rows(rows: Batch, pad: int) -> Batch:
    def extend(t: torch.Tensor | None, fill) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])

    return Batch(
        tokens=extend(rows.tokens, 0),
        labels=extend(rows.labels, -100),
        images=rows.images,
        image_counts=extend(rows.image_counts, 0),
        audio=rows.audio,
        video=rows.video,
        **{name: extend(getattr(rows, name), 0) for name in PER_ROW_AUDIO},
        gen_images=extend(rows.gen_images, 0),
        gen_weight=extend(rows.gen_weight, 0),
        gen_noise=extend(rows.gen_noise, 0),
        gen_timesteps=extend(rows.gen_timesteps, 0),
        doc_ids=extend(rows.doc_ids, -1),
        positions=extend(rows.positions, 0),
        keys=list(rows.keys) + [""] * pad,
    )
