"""What producer and trainers say to each other: the trainers' layout and job identity, the data
position a trainer starts from, and global batches as frames (data/transport.py)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from .batch import PER_ROW_AUDIO, Batch, absent_field, concat
from .transport import ProtocolError, pack_arrays, unpack_arrays

DTYPES = {
    "tokens": "int64",
    "labels": "int64",
    "images": "uint8",
    "image_counts": "int64",
    "gen_images": "uint8",
    "gen_weight": "float32",
    "gen_noise": "float32",
    "gen_timesteps": "int64",
    "audio": "float32",
    "audio_counts": "int64",
    "gen_audio": "float32",
    "audio_gen_weight": "float32",
    "audio_gen_noise": "float32",
    "audio_gen_timesteps": "int64",
    "video": "uint8",
    "video_counts": "int64",
}
FIELDS = tuple(DTYPES)
LAYOUT_FIELDS = ("slots", "samples_per_slot", "groups", "stages", "world")


@dataclass(frozen=True)
class Layout:
    """What the producer needs to know about the trainers to arrange a global batch.

    ``job`` is the trainers' identity (``job_identity``): sorted (name, value) pairs the producer
    compares with its own configuration before it serves a batch.
    """

    slots: int  # microbatch slots per step
    samples_per_slot: int
    groups: int  # canonical DP grid (lcm of the units' DP sizes)
    stages: int  # pipeline stages (1F1B), for Algorithm 3
    world: int  # trainer ranks that fetch every batch
    job: tuple = ()
    # Training FLOPs per image, per sequence, per generation target, per audio clip and per video frame group (the
    # trainers know the model: they send them, models/flops.py); a sample's cost for reordering (Algorithms 2, 3).
    costs: tuple = (1.0, 1.0, 1.0, 0.0, 0.0)

    def to_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in LAYOUT_FIELDS}, "costs": list(self.costs)}

    @classmethod
    def from_dict(cls, raw) -> Layout:
        try:
            values = {k: raw[k] for k in LAYOUT_FIELDS}
        except (KeyError, TypeError) as error:
            raise ProtocolError(f"bad layout in HELLO: {error!r}") from error
        if not all(type(v) is int and 1 <= v <= 1 << 20 for v in values.values()):
            raise ProtocolError(f"bad layout in HELLO: {values}")
        costs = raw.get("costs")
        if not (
            isinstance(costs, list)
            and len(costs) == 5
            and all(type(c) in (int, float) and math.isfinite(c) and c >= 0 for c in costs)
        ):
            raise ProtocolError(f"bad layout in HELLO: costs={costs!r}")
        return cls(**values, costs=tuple(float(c) for c in costs))


def tokenizer_identity(name: str) -> str:
    """``byte`` for the built-in tokenizer; a tokenizer file (tokenizer.json or tiktoken) by its content (paths
    differ between hosts)."""
    from .tokenizer import TOKENIZERS
    from .tokenizer_files import tokenizer_file

    name = str(name)
    if name in TOKENIZERS:
        return name
    try:
        file = tokenizer_file(name)
        digest = hashlib.sha256(file.read_bytes())
    except (OSError, ValueError):
        return name
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    return f"{file.name}#sha256:{digest.hexdigest()[:16]}"


def job_identity(cfg) -> dict:
    """What must agree between producer and trainers for the batches to be the ones the trainers expect."""
    model = cfg.model
    encoder, generator = model.encoder, model.generator
    resampled = encoder is not None and model.encoder_projector.kind == "resampler"
    identity = {
        "trainer.seed": int(cfg.trainer.seed),
        "data.tokenizer": tokenizer_identity(cfg.data.tokenizer),
        "model.name": str(model.name),
        "model.family": str(model.family),
        "model.seq_len": int(model.seq_len),
        "model.llm.vocab_size": int(model.llm.vocab_size),
        "model.encoder.image_size": int(encoder.image_size) if encoder is not None else None,
        "model.encoder.patch_size": int(encoder.patch_size) if encoder is not None else None,
        # the <img> positions per image: the patches, or the resampler's queries (config/model.py image_tokens)
        "model.encoder_projector.kind": str(model.encoder_projector.kind) if encoder is not None else None,
        "model.encoder_projector.num_queries": int(model.encoder_projector.num_queries) if resampled else None,
        "model.gen_tokens": int(model.gen_tokens) if generator is not None else None,
        "model.gen_image_size": int(model.gen_image_size) if generator is not None else None,
        "model.latent_downsample": int(model.latent_downsample) if generator is not None else None,
        "model.generator.in_channels": int(generator.in_channels) if generator is not None else None,
        "model.generator.num_train_timesteps": int(generator.num_train_timesteps) if generator is not None else None,
    }
    return json.loads(json.dumps(identity))


def job_mismatch(producer: dict, trainer) -> str | None:
    """None when they agree, else one line naming each differing value on both sides."""
    if not isinstance(trainer, dict) or not trainer:
        return "the trainer did not send its seed, model and tokenizer (an older trainer?): update it"
    differences = [
        f"producer has {name}={producer[name]}, trainer has {name}={trainer.get(name, '<missing>')}"
        for name in producer
        if trainer.get(name, "<missing>") != producer[name]
    ]
    if not differences:
        return None
    return "the trainer's configuration differs from the producer's: " + "; ".join(differences)


def parse_start(raw) -> dict:
    """The data position a trainer sends in HELLO, checked (it seeds the producer's stream)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ProtocolError("bad start state: not an object")
    start = dict(raw)
    for name in ("step", "epoch", "index", "truncated_images"):
        value = start.setdefault(name, 0)
        if type(value) is not int or not 0 <= value < 1 << 62:
            raise ProtocolError(f"bad start state: {name}={value!r}")
    skipped = start.setdefault("skipped", {})
    if not isinstance(skipped, dict) or not all(type(v) is int and v >= 0 for v in skipped.values()):
        raise ProtocolError("bad start state: skipped counters")
    return start


def parse_hello(meta: dict) -> tuple[Layout, dict, str, object, Want | None, tuple[int, int]]:
    """A trainer's HELLO: its layout, start position, trainer id, job identity (checked by the caller), what it
    wants of every step (None: the whole global batch) and the producer's place in its pool ([index, count]:
    the share of every slot it serves, data/producer_assembly.py)."""
    layout = Layout.from_dict(meta.get("layout"))
    start = parse_start(meta.get("start"))
    trainer = meta.get("trainer")
    if not isinstance(trainer, str) or not 0 < len(trainer) <= 64:
        raise ProtocolError("HELLO without a trainer id")
    block, want = meta.get("block"), None
    if block is not None:
        if not _ordered_pair(block, layout.samples_per_slot):
            raise ProtocolError(f"bad block in HELLO: {block!r} (slots of {layout.samples_per_slot} samples)")
        want = Want(range(*block), parse_fields(meta.get("fields")))
    pool = meta.get("pool", [0, 1])
    if not _ordered_pair(pool, layout.groups):
        raise ProtocolError(f"bad pool in HELLO: {pool!r} ([index, count], at most {layout.groups} producers)")
    return layout, start, trainer, meta.get("job"), want, (pool[0], pool[1])


def _ordered_pair(raw, bound: int) -> bool:
    """A JSON ``[a, b]`` of two ints with ``0 <= a < b <= bound`` (a block of a slot, a place in a pool)."""
    pair = isinstance(raw, list) and len(raw) == 2 and all(type(n) is int for n in raw)
    return pair and 0 <= raw[0] < raw[1] <= bound


def parse_fields(raw) -> tuple[str, ...]:
    """The Batch fields a trainer wants (None: all); the image, clip and frame-group counts always come (a share is
    cut by them, and the items it leaves out keep their shapes)."""
    if raw is None:
        return FIELDS
    if not isinstance(raw, list) or not all(isinstance(f, str) and f in DTYPES for f in raw):
        raise ProtocolError(f"bad fields in HELLO: {raw!r} (choose from {', '.join(FIELDS)})")
    wanted = {"image_counts", "audio_counts", "video_counts", *raw}
    return tuple(f for f in FIELDS if f in wanted)


@dataclass(frozen=True)
class Want:
    """What one trainer receives of every step: ``block`` of each slot's samples, and of them only ``fields``
    (a pipeline's middle stage reads no field but the image counts; the others arrive as zeros)."""

    block: range
    fields: tuple[str, ...] = FIELDS

    @classmethod
    def of(cls, block: range, fields: tuple[str, ...] | None = None) -> Want:
        """As the producer reads it back from a HELLO (the fields in FIELDS order, image counts included)."""
        return cls(block, parse_fields(None if fields is None else list(fields)))

    def to_hello(self) -> dict:
        return {"block": [self.block.start, self.block.stop], "fields": list(self.fields)}


def encode_batch(batch: Batch) -> tuple[dict, bytes]:
    tables, payload = pack_arrays({name: getattr(batch, name).numpy() for name in FIELDS})
    return {"tensors": tables, "keys": list(batch.keys)}, payload


@dataclass(frozen=True)
class StepSummary:
    """What a trainer that receives only its own block still needs of the whole global batch: every sample's
    image, clip and video frame-group counts (``[slots, samples_per_slot]``; the broker routes embeddings between
    units by them) and, per slot, the loss normalizers and work counts (train/step_data.py): loss tokens, generation
    samples, images, audio clips, frame groups. About 12 bytes a sample."""

    image_counts: torch.Tensor  # int64 [slots, per]
    loss_tokens: torch.Tensor  # int64 [slots], labels that take a loss
    gen_samples: torch.Tensor  # float32 [slots], the generation weights' sum
    images: torch.Tensor  # int64 [slots]
    clips: torch.Tensor  # int64 [slots]
    clip_counts: torch.Tensor  # int64 [slots, per]
    group_counts: torch.Tensor  # int64 [slots, per], video frame groups

    @classmethod
    def of(cls, batch: Batch, slots: int) -> StepSummary:
        per = batch.size // slots
        counts = batch.image_counts.view(slots, per)
        clips = batch.audio_counts.view(slots, per)
        return cls(
            counts,
            (batch.labels != -100).view(slots, -1).sum(dim=1),
            (batch.gen_weight + batch.audio_gen_weight).view(slots, per).sum(dim=1),
            counts.sum(dim=1),
            clips.sum(dim=1),
            clips,
            batch.video_counts.view(slots, per),
        )

    def totals(self) -> list[float]:
        """Loss tokens, generation samples, sequences, images, clips and frame groups of the whole step (the counts
        train/step_data.py normalizes the loss by and the throughput metrics count)."""
        return [
            float(self.loss_tokens.sum()),
            float(self.gen_samples.sum()),
            float(self.image_counts.numel()),
            float(self.images.sum()),
            float(self.clips.sum()),
            float(self.group_counts.sum()),
        ]

    def arrays(self) -> dict:
        return {
            "summary_image_counts": self.image_counts.to(torch.int32).numpy(),
            "summary_clip_counts": self.clip_counts.to(torch.int32).numpy(),
            "summary_group_counts": self.group_counts.to(torch.int32).numpy(),
            "summary_counts": torch.stack([self.loss_tokens, self.images, self.clips], dim=1).numpy(),
            "summary_gen_samples": self.gen_samples.numpy(),
        }

    @classmethod
    def from_arrays(cls, arrays: dict, slots: int, per: int) -> StepSummary:
        shapes = {
            "summary_image_counts": (slots, per),
            "summary_clip_counts": (slots, per),
            "summary_group_counts": (slots, per),
            "summary_counts": (slots, 3),
            "summary_gen_samples": (slots,),
        }
        if any(arrays[name].shape != shape for name, shape in shapes.items()):
            raise ProtocolError(f"a step summary not of {slots} slots x {per} samples")
        counts = torch.from_numpy(arrays["summary_counts"])
        image_counts = torch.from_numpy(arrays["summary_image_counts"]).to(torch.int64)
        clip_counts = torch.from_numpy(arrays["summary_clip_counts"]).to(torch.int64)
        for per_sample, total in ((image_counts, counts[:, 1]), (clip_counts, counts[:, 2])):
            if (per_sample < 0).any() or not torch.equal(per_sample.sum(dim=1), total) or (counts < 0).any():
                raise ProtocolError("a step summary whose image or clip counts disagree with its totals")
        group_counts = torch.from_numpy(arrays["summary_group_counts"]).to(torch.int64)
        if (group_counts < 0).any():
            raise ProtocolError("a step summary with negative frame-group counts")
        gen = torch.from_numpy(arrays["summary_gen_samples"])
        return cls(image_counts, counts[:, 0], gen, counts[:, 1], counts[:, 2], clip_counts, group_counts)


SUMMARY = {
    "summary_image_counts": "int32",
    "summary_clip_counts": "int32",
    "summary_group_counts": "int32",
    "summary_counts": "int64",
    "summary_gen_samples": "float32",
}


def block_of(batch: Batch, slots: int, block: range) -> Batch:
    """The rows ``block`` of every slot of a global batch, slot after slot, as one Batch."""
    per = batch.size // slots
    return concat([batch.select(range(k * per + block.start, k * per + block.stop)) for k in range(slots)])


def encode_share(
    batch: Batch, slots: int, want: Want, summary: StepSummary | None = None, offset: int = 0
) -> tuple[dict, bytes]:
    """One trainer's share of a global batch: the fields it wants of its block of every slot (the shapes of
    the others), and the whole batch's StepSummary. ``batch`` may hold only samples ``offset`` on of every slot
    (a pool's producer holds its share), with the whole batch's ``summary`` given."""
    share = block_of(batch, slots, range(want.block.start - offset, want.block.stop - offset))
    summary = summary if summary is not None else StepSummary.of(batch, slots)
    arrays = {name: getattr(share, name).numpy() for name in want.fields}
    arrays.update(summary.arrays())
    tables, payload = pack_arrays(arrays)
    absent = {name: list(getattr(share, name).shape) for name in FIELDS if name not in want.fields}
    return {"tensors": tables, "keys": list(share.keys), **want.to_hello(), "absent": absent}, payload


def decode_share(
    meta: dict, payload, slots: int, per_slot: int, want: Want, limit: int
) -> tuple[list[Batch], StepSummary]:
    """``encode_share``'s frame: this trainer's block of every slot (one Batch each; the fields it did not want
    as zeros, at most ``limit`` bytes of them) and the StepSummary."""
    if meta.get("block") != [want.block.start, want.block.stop] or meta.get("fields") != list(want.fields):
        raise ProtocolError(
            f"a share of block {meta.get('block')} fields {meta.get('fields')}, this trainer asked for {want}"
        )
    batch, arrays = _decode(meta, payload, extra=SUMMARY, absent=_absent(meta.get("absent"), want, limit))
    block = want.block
    width = len(block)
    if batch.size != slots * width:
        raise ProtocolError(f"a share of {batch.size} rows, expected {slots} slots x {width}")
    summary = StepSummary.from_arrays(arrays, slots, per_slot)
    if not torch.equal(summary.image_counts[:, block].reshape(-1), batch.image_counts):
        raise ProtocolError("the step summary's image counts disagree with the share's")
    return [batch.select(range(k * width, (k + 1) * width)) for k in range(slots)], summary


def _absent(raw, want: Want, limit: int) -> dict[str, np.ndarray]:
    """Zeros for the fields a share leaves out, of the shapes the producer states (bounded by ``limit``)."""
    names = [f for f in FIELDS if f not in want.fields]
    if not isinstance(raw, dict) or sorted(raw) != sorted(names):
        raise ProtocolError(f"a share that leaves out {raw if not isinstance(raw, dict) else sorted(raw)}")
    total = 0
    for name in names:
        shape = raw[name]
        if not (isinstance(shape, list) and 0 < len(shape) <= 5 and all(type(n) is int and n >= 0 for n in shape)):
            raise ProtocolError(f"bad shape of absent field {name}: {shape!r}")
        total += math.prod(shape) * np.dtype(DTYPES[name]).itemsize
    if total > limit:
        raise ProtocolError(f"absent fields of {total} bytes exceed the limit of {limit}")
    # one zero broadcast to the stated shape: decoded as an absent field (data/batch.py), never materialized
    return {name: np.broadcast_to(np.zeros((), dtype=DTYPES[name]), raw[name]) for name in names}


def decode_batch(meta: dict, payload) -> Batch:
    return _decode(meta, payload)[0]


def _decode(meta: dict, payload, extra: dict | None = None, absent: dict | None = None) -> tuple[Batch, dict]:
    arrays = {**unpack_arrays(meta.get("tensors"), payload), **(absent or {})}
    expected = {**DTYPES, **(extra or {})}
    missing = [name for name in expected if name not in arrays]
    if missing:
        raise ProtocolError(f"batch without {missing}")
    wrong = [name for name in expected if arrays[name].dtype.name != expected[name]]
    if wrong:
        raise ProtocolError(f"batch tensors of unexpected types: {wrong}")
    rows = arrays["tokens"].shape[0] if arrays["tokens"].ndim == 2 else -1
    keys = meta.get("keys")
    if rows < 0 or not isinstance(keys, list) or len(keys) != rows:
        raise ProtocolError("batch keys do not match its rows")
    per_row = ("labels", "image_counts", "gen_images", "gen_weight", "gen_noise", "gen_timesteps", *PER_ROW_AUDIO)
    if any(arrays[name].ndim == 0 or arrays[name].shape[0] != rows for name in per_row):
        raise ProtocolError("batch tensors disagree on the number of rows")
    for items, kind in (("images", "image"), ("audio", "audio"), ("video", "video")):
        counts = arrays[f"{kind}_counts"]
        if arrays[items].ndim == 0 or (counts < 0).any() or int(counts.sum()) != arrays[items].shape[0]:
            raise ProtocolError(f"batch {kind} counts do not match its {items}")
    left_out = set(absent or ())
    tensors = {name: _tensor(arrays[name], name in left_out) for name in FIELDS}
    return Batch(**tensors, keys=[str(k) for k in keys]), arrays


def _tensor(array: np.ndarray, left_out: bool) -> torch.Tensor:
    if left_out:  # one zero, broadcast (``_absent``): an absent field of the Batch (data/batch.py)
        return absent_field(array.shape, torch.from_numpy(np.zeros((), dtype=array.dtype)).dtype)
    return torch.from_numpy(array)
