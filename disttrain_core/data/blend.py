"""Dataset blends (``data.blend``): several shard sources mixed at fixed weights, Megatron-LM/NeMo style.

Sample ``i`` of a blend comes from a fixed source, and is that source's ``n``-th sample where ``n`` counts the
earlier blend samples from the same source: the blend is a pure function of its index, so a run resumes exactly
from its position alone (``Position(0, i)``), on any number of decode workers.

Which source: a low-discrepancy (golden-ratio Kronecker) sequence ``u_i = frac((i + 1/2) * phi)`` falls in source
``d``'s interval ``[W_{d-1}, W_d)`` of the cumulative normalized weights. Megatron-LM's blended index picks,
greedily, the source furthest below its share -- exact within one sample, but each index depends on all earlier
ones, so finding where a resumed run stands means replaying it sample by sample. The Kronecker rule gives any
sample's source directly and the counts of the first ``n`` samples in one vectorized pass, and keeps every
source's share within a few samples of its weight at any length (tested: 0.7/0.3 over 10,000 samples).

Each source is an ordinary ShardStream (its own shards, split by data-parallel replica, reshuffled each epoch); a
sample's key is prefixed with its source's name, so keys stay unique across sources.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from .bad_sample import UnusableRow
from .reader import (
    Position,
    RawSample,
    ShardError,
    ShardStream,
    StreamElement,
    resolve_shards,
    shard_sample_counts,
)
from .splits import training_shards
from .storage import configure

PHI = (math.sqrt(5.0) - 1.0) / 2.0  # the golden ratio's fractional part: the lowest-discrepancy rotation
CHUNK = 4096  # sources computed at a time while streaming


def normalized(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)}: give non-negative numbers, not all zero")
    return w / w.sum()


def blend_sources(weights: np.ndarray, start: int, count: int) -> np.ndarray:
    """The source of each of the blend's samples ``start .. start + count - 1``."""
    index = np.arange(start, start + count, dtype=np.float64)
    u = np.mod((index + 0.5) * PHI, 1.0)
    bounds = np.cumsum(weights)[:-1]
    return np.searchsorted(bounds, u, side="right")


def blend_counts(weights: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """Samples each source gave to the blend's samples ``start .. n - 1`` (from the first, by default)."""
    counts = np.zeros(len(weights), dtype=np.int64)
    for first in range(start, n, 1 << 22):  # bounded memory for long runs
        counts += np.bincount(blend_sources(weights, first, min(1 << 22, n - first)), minlength=len(weights))
    return counts


class BlendedStream:
    """The blend of ``streams`` (one ShardStream per source) at ``weights``; the same ``elements`` as a stream."""

    def __init__(self, streams: list[ShardStream], weights: list[float], names: list[str]):
        if not (len(streams) == len(weights) == len(names)) or not streams:
            raise ValueError("a blend needs one weight and one name per source")
        self.streams, self.names = streams, list(names)
        self.weights = normalized(weights)
        self._epoch_lengths: dict[int, int] = {}
        self._counted = (0, np.zeros(len(self.weights), dtype=np.int64))  # shares(): counts carried between logs

    @property
    def shards(self) -> list[str]:
        return [shard for stream in self.streams for shard in stream.shards]

    def _epoch_length(self, source: int) -> int:
        """Elements per epoch of a source (equal in every epoch: the same shards, reordered): its shards' samples
        counted from the tar headers, or, where a shard cannot be read that way, by reading one epoch."""
        if source not in self._epoch_lengths:
            stream = self.streams[source]
            if not isinstance(stream, ShardStream):  # data=hf's rows (data/hf_source.py)
                length = stream.epoch_length()
            else:
                try:
                    length = sum(shard_sample_counts(stream.shards_for_epoch(0)))
                except Exception:  # a broken shard: its readable samples and one error element, as the stream sees it
                    length = sum(1 for _ in stream.epoch_elements(0))
            if length == 0:
                raise RuntimeError(f"blend source {self.names[source]} holds no readable samples")
            self._epoch_lengths[source] = length
        return self._epoch_lengths[source]

    def source_position(self, source: int, taken: int) -> Position:
        """Where a source's stream stands after giving ``taken`` samples."""
        if taken == 0:
            return Position()
        length = self._epoch_length(source)
        return Position(taken // length, taken % length)

    def elements(self, start: Position = Position()) -> Iterator[StreamElement]:
        if start.epoch != 0:
            raise ValueError(f"a blend's position is one index (epoch 0), not {start}")
        index = start.index
        taken = blend_counts(self.weights, index)
        streams = [s.elements(self.source_position(d, int(taken[d]))) for d, s in enumerate(self.streams)]
        while True:
            for source in blend_sources(self.weights, index, CHUNK):
                element = next(streams[source])
                yield StreamElement(Position(0, index), self._label(element.item, int(source)))
                index += 1

    def _label(self, item, source: int):
        name = self.names[source]
        if isinstance(item, RawSample):
            return replace(item, key=f"{name}:{item.key}")
        if isinstance(item, UnusableRow):  # data=hf: a row its mapping cannot read
            return UnusableRow(f"{name}:{item.key}", item.reason, item.detail)
        assert isinstance(item, ShardError)
        return replace(item, shard=f"{name}:{item.shard}")

    def shares(self, consumed: int) -> dict[str, float]:
        """Each source's share of the first ``consumed`` samples (logged as data/blend/<name>)."""
        counted, counts = self._counted
        if consumed < counted:  # another position (a resumed run's): count from the start again
            counted, counts = 0, np.zeros_like(counts)
        counts = counts + blend_counts(self.weights, consumed, counted)  # only the samples since the last call
        self._counted = (consumed, counts)
        return {name: float(c) / max(1, consumed) for name, c in zip(self.names, counts, strict=True)}


def source_name(source, index: int) -> str:
    return str(source.name) if source.name else f"source{index}"


def open_stream(data, seed: int, dp_rank: int = 0, dp_size: int = 1) -> ShardStream | BlendedStream:
    """The training stream of replica ``dp_rank`` of ``dp_size`` (0 of 1: the one canonical stream): ``data.path``'s
    shards (less a held-out split, data/splits.py), or the blend ``data.blend`` names. ``data.storage_options`` is
    applied first (data/storage.py: shards behind URLs), here and in the processes started from here."""
    configure(data)
    hf = data.format == "hf"  # rows of parquet / arrow / jsonl files (data/hf_source.py)
    if hf:
        from .hf_source import HFStream
    if not data.blend:
        if hf:
            return HFStream(data, seed, dp_rank, dp_size, shuffle=data.shuffle_shards)
        return ShardStream(training_shards(data), dp_rank, dp_size, seed=seed, shuffle=data.shuffle_shards)
    seeds = [seed + 1_000_003 * d for d in range(len(data.blend))]
    streams = [
        HFStream(data, seeds[d], dp_rank, dp_size, shuffle=data.shuffle_shards, path=str(s.path))
        if hf
        else ShardStream(resolve_shards(s.path), dp_rank, dp_size, seed=seeds[d], shuffle=data.shuffle_shards)
        for d, s in enumerate(data.blend)
    ]
    names = [source_name(s, d) for d, s in enumerate(data.blend)]
    return BlendedStream(streams, [float(s.weight) for s in data.blend], names)
