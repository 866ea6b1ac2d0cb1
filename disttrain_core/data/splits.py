"""The held-out split (``data.val``): shards an evaluation reads and training never does.

Either ``data.val.path`` names shards of their own (a directory, glob or brace pattern, as ``data.path``), or
``data.val.holdout_shards=N`` holds out the last ``N`` of ``data.path``'s shards in sorted order (the same on
every host and run; training then reads the others). The validation (validation/data.py ``check_val``) refuses
a split that shares a shard file with the training data, a blend source included.
"""

from __future__ import annotations

import os

from .reader import ShardStream, resolve_shards


def _split_path(data) -> tuple[list[str], list[str]]:
    """``data.path``'s shards as (trained, held out by ``data.val.holdout_shards``), resolved once."""
    shards = resolve_shards(str(data.path))
    count = int(data.val.holdout_shards) if data.val is not None else 0
    held = sorted(shards)[-count:] if count > 0 else []
    dropped = set(held)
    return [s for s in shards if s not in dropped], held


def training_shards(data) -> list[str]:
    """``data.path``'s shards less those ``data.val.holdout_shards`` holds out."""
    return _split_path(data)[0]


def held_out_shards(data) -> list[str]:
    """The held-out split's shards ([] when there is none)."""
    if data.val is None:
        return []
    if data.val.path:
        return resolve_shards(str(data.val.path))
    return _split_path(data)[1]


def open_val_stream(data, seed: int) -> ShardStream | None:
    """The held-out split as one stream in a fixed order (no reshuffling: every evaluation reads the same
    samples); None when there is no split."""
    if data.format == "hf":  # held-out rows of their own files (data/hf_source.py), read in file order
        from .hf_source import HFStream

        return HFStream(data, seed, shuffle=False, path=str(data.val.path)) if data.val.path else None
    shards = held_out_shards(data)
    return ShardStream(shards, 0, 1, seed=seed, shuffle=False) if shards else None


def overlap(held: list[str], training: list[str]) -> list[str]:
    """Shard files in both lists (compared by real path)."""
    train = {os.path.realpath(s) for s in training}
    return [s for s in held if os.path.realpath(s) in train]
