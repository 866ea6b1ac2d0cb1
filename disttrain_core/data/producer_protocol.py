"""What producer and trainers say to each other: the trainers' layout and job identity, the data
position a trainer starts from, and global batches as frames (data/transport.py)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .batch import Batch
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
    # Training FLOPs per image, per sequence and per generation target (the trainers know the model: they
    # send them, models/flops.py); a sample's cost for reordering (Algorithms 2 and 3).
    costs: tuple = (1.0, 1.0, 1.0)

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
            and len(costs) == 3
            and all(type(c) in (int, float) and math.isfinite(c) and c >= 0 for c in costs)
        ):
            raise ProtocolError(f"bad layout in HELLO: costs={costs!r}")
        return cls(**values, costs=tuple(float(c) for c in costs))


def tokenizer_identity(name: str) -> str:
    """``byte`` for the built-in tokenizer; a tokenizer.json by its content (paths differ between hosts)."""
    from .tokenizer import TOKENIZERS

    name = str(name)
    if name in TOKENIZERS:
        return name
    file = Path(name)
    if file.is_dir():
        file = file / "tokenizer.json"
    try:
        digest = hashlib.sha256(file.read_bytes())
    except OSError:
        return name
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    return f"{file.name}#sha256:{digest.hexdigest()[:16]}"


def job_identity(cfg) -> dict:
    """What must agree between producer and trainers for the batches to be the ones the trainers expect."""
    model = cfg.model
    encoder, generator = model.encoder, model.generator
    identity = {
        "trainer.seed": int(cfg.trainer.seed),
        "data.tokenizer": tokenizer_identity(cfg.data.tokenizer),
        "model.name": str(model.name),
        "model.family": str(model.family),
        "model.seq_len": int(model.seq_len),
        "model.llm.vocab_size": int(model.llm.vocab_size),
        "model.encoder.image_size": int(encoder.image_size) if encoder is not None else None,
        "model.encoder.patch_size": int(encoder.patch_size) if encoder is not None else None,
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


def parse_hello(meta: dict) -> tuple[Layout, dict, str, object]:
    """A trainer's HELLO: its layout, start position, trainer id and job identity (checked by the caller)."""
    layout = Layout.from_dict(meta.get("layout"))
    start = parse_start(meta.get("start"))
    trainer = meta.get("trainer")
    if not isinstance(trainer, str) or not 0 < len(trainer) <= 64:
        raise ProtocolError("HELLO without a trainer id")
    return layout, start, trainer, meta.get("job")


def encode_batch(batch: Batch) -> tuple[dict, bytes]:
    tables, payload = pack_arrays({name: getattr(batch, name).numpy() for name in FIELDS})
    return {"tensors": tables, "keys": list(batch.keys)}, payload


def decode_batch(meta: dict, payload) -> Batch:
    arrays = unpack_arrays(meta.get("tensors"), payload)
    missing = [name for name in FIELDS if name not in arrays]
    if missing:
        raise ProtocolError(f"batch without {missing}")
    wrong = [name for name in FIELDS if arrays[name].dtype.name != DTYPES[name]]
    if wrong:
        raise ProtocolError(f"batch tensors of unexpected types: {wrong}")
    rows = arrays["tokens"].shape[0] if arrays["tokens"].ndim == 2 else -1
    keys = meta.get("keys")
    if rows < 0 or not isinstance(keys, list) or len(keys) != rows:
        raise ProtocolError("batch keys do not match its rows")
    per_row = ("labels", "image_counts", "gen_images", "gen_weight", "gen_noise", "gen_timesteps")
    if any(arrays[name].ndim == 0 or arrays[name].shape[0] != rows for name in per_row):
        raise ProtocolError("batch tensors disagree on the number of rows")
    counts = arrays["image_counts"]
    if arrays["images"].ndim == 0 or (counts < 0).any() or int(counts.sum()) != arrays["images"].shape[0]:
        raise ProtocolError("batch image counts do not match its images")
    return Batch(**{name: torch.from_numpy(arrays[name]) for name in FIELDS}, keys=[str(k) for k in keys])
