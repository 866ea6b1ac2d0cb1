"""Reading one webdataset shard from a byte offset: the cursor a shard stream (data/reader.py) keeps per shard.

A cursor holds the archive offset of its shard's next sample. While open it holds the file and a ``tarfile``
reader started at that offset, and webdataset's ``group_by_keys`` groups the members into samples; ``park``
closes both and keeps the offset, so a stream can bound its open files and reopen a shard where it left off.
webdataset's own ``tar_file_iterator`` is not used: it reads an archive from its first byte and tells no
member's offset (docs/DATA.md, "What webdataset does here"). A shard that breaks yields one ``ShardError``.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import lzma
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from webdataset.tariterators import group_by_keys

from . import storage

MAX_OPEN_SHARDS = 16  # shard files one stream keeps open at once
SKIP_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members (its tar iterator's skip_meta)
# Compressed shards (.tar.gz, .tar.bz2, .tar.xz) by their magic bytes; reopening one at an offset decompresses
# up to it, so plain .tar (what docs/DATA.md asks for) is the fast case.
_COMPRESSED = (
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)),
    (b"BZh", bz2.BZ2File),
    (b"\xfd7zXZ\x00", lzma.LZMAFile),
)


@dataclass
class RawSample:
    key: str  # "<shard file name>/<sample key>", unique across the dataset
    members: dict[str, bytes]  # extension (lower case, e.g. "json", "0.jpg") -> bytes


@dataclass
class ShardError:
    shard: str
    reason: str


class FileDescriptorsExhausted(RuntimeError):
    """The process cannot open another file: a limit of the machine, not a problem of the shard."""


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
        return open(path, "rb")  # noqa: SIM115  closed by ShardCursor.park
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
    """A member's bytes, filled in once the reader moves past its header (see ``ShardCursor._members``)."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""


class ShardCursor:
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
            if not info.isreg() or SKIP_MEMBER.match(info.name):
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


def read_shard(path: str) -> Iterator[RawSample | ShardError]:
    """One shard's samples in order (one open file); a ShardError ends it."""
    cursor = ShardCursor(path)
    try:
        while (item := cursor.next_item()) is not None:
            yield item
    finally:
        cursor.park()
