"""torch.distributed.checkpoint storage with checksums computed while writing and verified while reading.

* :class:`ChecksumWriter` is DCP's ``FileSystemWriter`` whose file streams hash (SHA-256) and count the
  bytes as they go to disk, so each rank knows the digest and size of every file it wrote -- DCP's
  ``.metadata`` included -- without reading anything back. :meth:`ChecksumWriter.digests` hands them
  to the commit (train/checkpoint.py), which records them in ``meta.json``.
* :class:`VerifyingReader` is DCP's ``FileSystemReader`` that checks, before using a file, that its
  size and digest are the ones ``meta.json`` recorded: DCP's ``.metadata`` (a pickle: it is unpickled
  only after its digest matched the JSON record) and each data file this rank's load plan reads
  (each rank verifies the files it reads). A mismatch raises :class:`CheckpointCorrupt`, which DCP
  re-raises on every rank, so all ranks fall back to the previous checkpoint together.

Data files are written in DCP's ``torch_save`` format and read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import io
import os
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

CHUNK = 1 << 22


class CheckpointCorrupt(RuntimeError):
    """A checkpoint file that is missing, truncated or altered (its digest differs from meta.json's)."""


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def check_file(path: Path, record: dict | None) -> None:
    """Raise :class:`CheckpointCorrupt` unless ``path`` has the recorded size and SHA-256."""
    name = path.name
    if record is None:
        raise CheckpointCorrupt(f"{name} is not listed in meta.json")
    if not path.is_file():
        raise CheckpointCorrupt(f"{name} is missing")
    size = path.stat().st_size
    if size != record["size"]:
        raise CheckpointCorrupt(f"{name} has {size} bytes, meta.json recorded {record['size']} (truncated?)")
    if file_digest(path)[0] != record["sha256"]:
        raise CheckpointCorrupt(f"{name}: SHA-256 differs from meta.json (altered bytes)")


class _HashingStream(io.RawIOBase):
    """Write-through file stream that hashes what it writes. A seek away from the end (which DCP's writers
    do not do) disables the running hash; the file is then hashed from disk when it closes."""

    def __init__(self, raw, on_close):
        super().__init__()
        self.raw, self.on_close = raw, on_close
        self.digest, self.size, self.sequential = hashlib.sha256(), 0, True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        if self.sequential and self.raw.tell() == self.size + len(view):
            self.digest.update(view)
            self.size += len(view)
        else:
            self.sequential = False
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self.raw.seek(offset, whence)
        if position != self.size:
            self.sequential = False
        return position

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
            self.on_close(self)
        super().close()


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)

        def record(stream: _HashingStream) -> None:
            if stream.sequential:
                self.digests[path.name] = {"sha256": stream.digest.hexdigest(), "size": stream.size}
            else:
                sha, size = file_digest(path)
                self.digests[path.name] = {"sha256": sha, "size": size}

        stream = _HashingStream(path.open(mode), record)
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        record = self.digests.pop(Path(path).name, None)
        if record is not None:
            self.digests[Path(new_path).name] = record


class ChecksumWriter(dcp.FileSystemWriter):
    def __init__(self, path: str | os.PathLike, thread_count: int = 1):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fs = _HashingFileSystem()

    def digests(self) -> dict[str, dict]:
        """``{file name: {"sha256", "size"}}`` of every file this rank wrote (DCP's ``.metadata`` included)."""
        return dict(self.fs.digests)


class VerifyingReader(dcp.FileSystemReader):
    def __init__(self, path: str | os.PathLike, records: dict[str, dict]):
        super().__init__(path)
        self.records = records
        self.verified: set[str] = set()

    def _verify(self, name: str) -> None:
        if name not in self.verified:
            check_file(Path(self.path) / name, self.records.get(name))
            self.verified.add(name)

    def read_metadata(self, *args, **kwargs):
        self._verify(".metadata")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        for item in plan.items:
            self._verify(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)
