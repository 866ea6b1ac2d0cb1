"""Reading webdataset shards as one deterministic stream per data-parallel rank.

Shard assignment follows the data-parallel rank, never the global rank (TP and
PP peers of one replica must see the same data): in epoch ``e`` the shard list
is shuffled with ``(seed, e)`` and rank ``r`` of ``D`` takes every D-th shard
starting at ``r``. Each rank reads its shards *interleaved* (one sample from
each shard in turn), which mixes sources without a shuffle buffer.

Why interleave rather than concatenate: if all shards hold the same number of
samples and D divides the number of shards, the samples of global step ``g``
are the same set for every D -- rank ``r``'s ``l``-th sample is the canonical
stream's sample ``l * D + r``. That is what lets a 2-process run reproduce a
1-process run with the same global batch (tests/unit/test_reader.py proves it).

The stream is infinite (epoch after epoch). Every element carries its position
``(epoch, index)``; restarting at a saved position replays the same elements
without decoding the skipped ones. A shard that cannot be read to the end (a
truncated tar, a bad header) yields one ``ShardError`` element and ends; the
samples read before the error stay valid.
"""

from __future__ import annotations

import glob
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

from braceexpand import braceexpand
from webdataset.tariterators import group_by_keys, tar_file_iterator


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    index: int = 0  # elements of this epoch already consumed


@dataclass
class RawSample:
    key: str  # "<shard file name>/<sample key>", unique across the dataset
    members: dict[str, bytes]  # extension (lower case, e.g. "json", "0.jpg") -> bytes


@dataclass
class ShardError:
    shard: str
    reason: str


@dataclass
class StreamElement:
    position: Position  # position of this element; the next one starts at index + 1
    item: RawSample | ShardError


def resolve_shards(path: str) -> list[str]:
    """Shard files named by a directory, a file, a glob, or a brace pattern."""
    if os.path.isdir(path):
        shards = sorted(glob.glob(os.path.join(path, "*.tar")))
    else:
        shards = []
        for pattern in braceexpand(path):
            shards.extend(sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern])
        shards = [s for s in shards if os.path.isfile(s)]
    return shards


def _read_shard(path: str) -> Iterator[RawSample | ShardError]:
    name = os.path.basename(path)
    try:
        with open(path, "rb") as stream:
            files = ({**f, "__url__": path} for f in tar_file_iterator(stream))
            for sample in group_by_keys(files):
                members = {k: v for k, v in sample.items() if not k.startswith("__")}
                yield RawSample(key=f"{name}/{sample['__key__']}", members=members)
    except Exception as error:  # truncated or corrupt tar: the rest of this shard is lost
        yield ShardError(shard=name, reason=f"{type(error).__name__}: {error}")


class ShardStream:
    """The deterministic, infinite stream of one data-parallel rank."""

    def __init__(self, shards: list[str], dp_rank: int, dp_size: int, seed: int, shuffle: bool = True):
        if not shards:
            raise ValueError("no shards to read")
        if dp_size > len(shards):
            raise ValueError(
                f"{len(shards)} shards cannot feed {dp_size} data-parallel ranks; "
                "make at least one shard per rank (more, smaller shards) or lower the data-parallel size"
            )
        self.shards = list(shards)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle

    def shards_for_epoch(self, epoch: int) -> list[str]:
        order = list(self.shards)
        if self.shuffle:
            random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order[self.dp_rank :: self.dp_size]

    def epoch_elements(self, epoch: int) -> Iterator[StreamElement]:
        readers = [_read_shard(path) for path in self.shards_for_epoch(epoch)]
        index = 0
        while readers:
            still_open = []
            for reader in readers:
                item = next(reader, None)
                if item is None:
                    continue
                yield StreamElement(Position(epoch, index), item)
                index += 1
                if not isinstance(item, ShardError):
                    still_open.append(reader)
            readers = still_open

    def elements(self, start: Position = Position()) -> Iterator[StreamElement]:
        """Elements from ``start`` on, forever."""
        epoch = start.epoch
        while True:
            produced = 0
            for element in self.epoch_elements(epoch):
                produced += isinstance(element.item, RawSample)
                if epoch == start.epoch and element.position.index < start.index:
                    continue
                yield element
            if produced == 0:
                raise RuntimeError(f"the shards of data-parallel rank {self.dp_rank} hold no readable samples")
            epoch += 1


def shard_sample_counts(shards: list[str]) -> list[int]:
    """Samples per shard, from the tar headers alone (members grouped by key as the stream groups them).
    Used when a resumed run changes its data-parallel size: positions carry over exactly only when
    every shard holds the same number."""
    import tarfile

    counts = []
    for path in shards:
        keys = set()
        with tarfile.open(path) as archive:
            for member in archive:
                if member.isfile():
                    base = member.name.rsplit("/", 1)[-1]
                    keys.add(member.name[: len(member.name) - len(base)] + base.split(".", 1)[0])
        counts.append(len(keys))
    return counts
