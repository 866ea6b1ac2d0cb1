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

A stream keeps at most ``MAX_OPEN_SHARDS`` shard files open, however many
shards its rank reads: a shard that has to make room is closed and later
reopened at the byte offset of its next sample (tar members are found from
their headers), so the interleaved order does not depend on the bound. Running
out of file descriptors is an error (``FileDescriptorsExhausted``), never a
skipped shard. One shard is read by a cursor (data/shard_cursor.py): samples grouped by webdataset's own
``group_by_keys`` over ``tarfile`` members read from the cursor's byte offset. Shards may also be URLs
(``s3://``, ``gs://``, ``http(s)://``, ``file://``, ``pipe:CMD``): data/storage.py names and opens them; local
paths never go through it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import re
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from braceexpand import braceexpand
from webdataset.tariterators import base_plus_ext

from . import storage
from .shard_cursor import (  # noqa: F401  RawSample, ShardError, FileDescriptorsExhausted: this module's API too
    MAX_OPEN_SHARDS,
    SKIP_MEMBER,
    FileDescriptorsExhausted,
    RawSample,
    ShardCursor,
    ShardError,
)

log = logging.getLogger(__name__)

MAX_SHARD_NAMES = 1_000_000  # a brace pattern naming more is taken for a typo
_INT_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")  # {000..099}, {0..100..10}


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    index: int = 0  # elements of this epoch already consumed


@dataclass
class StreamElement:
    position: Position  # position of this element; the next one starts at index + 1
    item: RawSample | ShardError


def _files_in(directory: str, listings: dict[str, set[str]]) -> set[str]:
    """Names of the files in ``directory`` (one listing per directory, not a stat per shard name)."""
    if directory not in listings:
        try:
            with os.scandir(directory or ".") as entries:
                listings[directory] = {e.name for e in entries if e.is_file()}
        except OSError:  # missing, not a directory, unreadable: none of its shards can be read
            listings[directory] = set()
    return listings[directory]


def check_name_count(path: str) -> None:
    """ValueError if a brace pattern names more than MAX_SHARD_NAMES files: braceexpand holds every range in
    memory, so the names of the integer ranges are counted first."""
    names = 1
    for first, last, step in _INT_RANGE.findall(path):
        names *= abs(int(last) - int(first)) // max(1, abs(int(step or 1))) + 1
    if names > MAX_SHARD_NAMES:
        raise ValueError(f"the pattern names {names} shard files, more than {MAX_SHARD_NAMES}: check its braces")


def expand_shards(path: str) -> tuple[list[str], list[str]]:
    """(shard files, names that are missing) of a directory, a file, a glob, or a brace pattern. A missing
    name is a file of the pattern that does not exist, or a glob in it that matches no file. URLs: storage.py."""
    url = storage.is_url(path)
    if not url and os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "*.tar"))), []
    check_name_count(path)
    if url:
        return storage.expand(path)
    found: list[str] = []
    missing: list[str] = []
    listings: dict[str, set[str]] = {}
    for pattern in braceexpand(path):
        if any(c in pattern for c in "*?["):
            matches = [m for m in sorted(glob.glob(pattern)) if os.path.isfile(m)]
            found.extend(matches)
            if not matches:
                missing.append(pattern)
        elif os.path.basename(pattern) in _files_in(os.path.dirname(pattern), listings):
            found.append(pattern)
        else:
            missing.append(pattern)
    return found, missing


_warned_missing: set[str] = set()


def resolve_shards(path: str) -> list[str]:
    """Shard files named by a directory, a file, a glob, or a brace pattern. Names that are missing are left
    out with a warning that counts them (validation refuses them unless data.allow_missing_shards=true)."""
    found, missing = expand_shards(path)
    if found and missing and path not in _warned_missing:
        _warned_missing.add(path)
        log.warning(
            "%d of the %d shard(s) named by %s are missing (first: %s); reading the %d that exist",
            len(missing),
            len(found) + len(missing),
            path,
            missing[0],
            len(found),
        )
    return found


class ShardStream:
    """The deterministic, infinite stream of one data-parallel rank."""

    def __init__(
        self,
        shards: list[str],
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        max_open: int = MAX_OPEN_SHARDS,
    ):
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
        self.max_open = max(1, max_open)  # shard files open at once
        if warning := storage.reopen_warning(self.shards, len(range(dp_rank, len(shards), dp_size)), self.max_open):
            log.warning(warning)

    def shards_for_epoch(self, epoch: int) -> list[str]:
        order = list(self.shards)
        if self.shuffle:
            random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order[self.dp_rank :: self.dp_size]

    def epoch_elements(self, epoch: int) -> Iterator[StreamElement]:
        """One sample of each unfinished shard in turn, with at most ``max_open`` files open."""
        cursors = [ShardCursor(path) for path in self.shards_for_epoch(epoch)]
        opened: OrderedDict[int, ShardCursor] = OrderedDict()  # least recently read first
        index = 0
        try:
            while cursors:
                unfinished = []
                for cursor in cursors:
                    if id(cursor) in opened:
                        opened.move_to_end(id(cursor))
                    else:
                        if len(opened) >= self.max_open:
                            opened.popitem(last=False)[1].park()
                        opened[id(cursor)] = cursor
                    item = cursor.next_item()
                    if not cursor.is_open:
                        opened.pop(id(cursor), None)
                    if item is None:
                        continue
                    yield StreamElement(Position(epoch, index), item)
                    index += 1
                    if not cursor.done:
                        unfinished.append(cursor)
                cursors = unfinished
        finally:
            for cursor in opened.values():
                cursor.park()

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

    counts = []
    for path in shards:
        keys = set()
        file = storage.open_binary(path) if storage.is_url(path) else None  # a URL: read front to back
        with contextlib.nullcontext() if file is None else file, tarfile.open(path, fileobj=file) as archive:
            for member in archive:
                key, _ = base_plus_ext(member.name)
                if member.isreg() and key is not None and not SKIP_MEMBER.match(member.name):
                    keys.add(key)
        counts.append(len(keys))
    return counts
