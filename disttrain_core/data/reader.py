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
skipped shard. Samples are grouped by webdataset's own ``group_by_keys``: members
whose names share the part before the first dot of the file name, extensions
lower-cased, ``__meta__`` members skipped. The members it groups come from
``tarfile`` opened at the cursor's byte offset, not from webdataset's
``tar_file_iterator``, which reads an archive from its start and tells no
member's offset (docs/DATA.md, "What webdataset does here"). Shards may also be URLs (``s3://``, ``gs://``, ``http(s)://``,
``file://``, ``pipe:CMD``): data/storage.py names and opens them; local paths never go through it.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import glob
import gzip
import logging
import lzma
import os
import random
import re
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from braceexpand import braceexpand
from webdataset.tariterators import base_plus_ext, group_by_keys

from . import storage

log = logging.getLogger(__name__)

MAX_OPEN_SHARDS = 16  # shard files one stream keeps open at once
MAX_SHARD_NAMES = 1_000_000  # a brace pattern naming more is taken for a typo
_INT_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")  # {000..099}, {0..100..10}
_SKIP_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members (its tar iterator's skip_meta)
# Compressed shards (.tar.gz, .tar.bz2, .tar.xz) by their magic bytes; reopening one at an offset decompresses
# up to it, so plain .tar (what docs/DATA.md asks for) is the fast case.
_COMPRESSED = (
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)),
    (b"BZh", bz2.BZ2File),
    (b"\xfd7zXZ\x00", lzma.LZMAFile),
)


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


class FileDescriptorsExhausted(RuntimeError):
    """The process cannot open another file: a limit of the machine, not a problem of the shard."""


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


class _Tail:
    """A seekable binary file seen from byte ``base`` on, so tarfile reads an archive that starts there."""

    def __init__(self, raw: BinaryIO, base: int):
        self.raw, self.base = raw, base
        raw.seek(base)

    def read(self, size: int = -1) -> bytes:
        return self.raw.read(size)

    def tell(self) -> int:
        return self.raw.tell() - self.base

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(self.base + offset if whence == 0 else offset, whence) - self.base


def _open_file(path: str) -> BinaryIO:
    if storage.is_url(path):
        return storage.open_binary(path)
    try:
        return open(path, "rb")  # noqa: SIM115  closed by _ShardCursor.park
    except OSError as error:
        if error.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise FileDescriptorsExhausted(
            f"cannot open shard {path}: {error.strerror} (this process may open {soft} files, `ulimit -n`). "
            f"A shard stream keeps at most {MAX_OPEN_SHARDS} shards open, so the descriptors are held elsewhere: "
            "raise the limit (e.g. `ulimit -n 65536` before training) or run fewer processes or data.num_workers"
        ) from error


class _Bytes:
    """A member's bytes, filled in once the reader moves past its header (see ``_ShardCursor._members``)."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""


class _ShardCursor:
    """The reading position in one shard: the archive offset of its next sample's first member. While open
    it holds the file and a tar reader positioned there; ``park`` closes both and keeps the offset."""

    def __init__(self, path: str):
        self.path = path
        self.name = storage.shard_name(path) if storage.is_url(path) else os.path.basename(path)
        self.offset = 0  # archive offset of the next unread member header
        self.done = False
        self._file: BinaryIO | None = None
        self._tar: tarfile.TarFile | None = None
        self._base = 0  # archive offset the open tar reader starts at
        self._samples: Iterator[dict] | None = None  # webdataset's grouping over the open reader's members
        self._pending: int | None = None  # archive offset of the member read ahead (the next sample's first)

    @property
    def is_open(self) -> bool:
        return self._tar is not None

    def park(self) -> None:
        """Close the file; the next read reopens it at the first member of the next sample (read ahead by
        the grouping and read again then), or the shard is done if its members are all returned."""
        if self._samples is not None:
            if self._pending is None:
                self.done = True
            else:
                self.offset = self._pending
            self._samples, self._pending = None, None
        self._tar = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open(self) -> None:
        self._file = _open_file(self.path)
        stream: BinaryIO = self._file
        magic = stream.read(6)
        stream.seek(0)
        for prefix, opener in _COMPRESSED:
            if magic.startswith(prefix):
                stream = opener(self._file)  # type: ignore[operator]
                break
        self._base = self.offset
        self._tar = tarfile.open(fileobj=_Tail(stream, self.offset), mode="r:")  # type: ignore[call-overload]
        self._samples = group_by_keys(self._members())

    def _members(self) -> Iterator[dict]:
        """The shard's regular members from the open reader on, in the form webdataset's tar iterator yields
        (``fname``, ``data``), metadata members skipped. A member's bytes are read when the grouping asks for
        the member after it, so a sample is complete once the next one's first header is read (as a stream
        reads a tar), and a member whose bytes cannot be read fails its own sample, not the one before it.
        ``_pending`` is the archive offset of the member yielded last, None once the archive has no more."""
        assert self._tar is not None
        held: tuple[tarfile.TarInfo, _Bytes] | None = None
        while True:
            if held is not None:
                extracted = self._tar.extractfile(held[0])
                assert extracted is not None
                held[1].data, held = extracted.read(), None
            info = self._tar.next()
            self._tar.members = []  # a stream: keep no member list
            if info is None:
                break
            if not info.isreg() or _SKIP_MEMBER.match(info.name):
                continue
            self._pending, held = self._base + info.offset, (info, _Bytes())
            yield {"fname": info.name, "data": held[1], "__url__": self.name}
        self._pending = None

    def next_item(self) -> RawSample | ShardError | None:
        """The next sample; a ShardError (then nothing more) if the shard breaks; None at its end."""
        if self.done:
            return None
        try:
            if self._tar is None:
                self._open()
            return self._next_sample()
        except FileDescriptorsExhausted:
            raise
        except Exception as error:  # truncated or corrupt tar: the rest of this shard is lost
            self.done = True
            self.park()
            return ShardError(shard=self.name, reason=f"{type(error).__name__}: {error}")

    def _next_sample(self) -> RawSample | None:
        """The next group of members sharing a key, grouped by webdataset's ``group_by_keys`` (its key rule,
        lower-cased extensions, its error for a duplicate name)."""
        assert self._samples is not None
        sample = next(self._samples, None)
        if sample is None:
            self.done = True
            self.park()
            return None
        members = {k: v.data for k, v in sample.items() if not k.startswith("__")}
        return RawSample(key=f"{self.name}/{sample['__key__']}", members=members)


def _read_shard(path: str) -> Iterator[RawSample | ShardError]:
    """One shard's samples in order (one open file); a ShardError ends it."""
    cursor = _ShardCursor(path)
    try:
        while (item := cursor.next_item()) is not None:
            yield item
    finally:
        cursor.park()


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
        cursors = [_ShardCursor(path) for path in self.shards_for_epoch(epoch)]
        opened: OrderedDict[int, _ShardCursor] = OrderedDict()  # least recently read first
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
    import tarfile

    counts = []
    for path in shards:
        keys = set()
        file = storage.open_binary(path) if storage.is_url(path) else None  # a URL: read front to back
        with contextlib.nullcontext() if file is None else file, tarfile.open(path, fileobj=file) as archive:
            for member in archive:
                key, _ = base_plus_ext(member.name)
                if member.isreg() and key is not None and not _SKIP_MEMBER.match(member.name):
                    keys.add(key)
        counts.append(len(keys))
    return counts
