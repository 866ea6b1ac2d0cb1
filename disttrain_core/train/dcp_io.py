"""torch.distributed.checkpoint storage with checksums computed while writing and verified while reading.

* :class:`ChecksumWriter` is DCP's ``FileSystemWriter`` whose file streams hash the bytes as they go to
  disk: the whole file's SHA-256 and size, and a SHA-256 per ``BLOCK`` bytes, so each rank knows the
  digests of every file it wrote -- DCP's ``.metadata`` included -- without reading anything back.
  :meth:`ChecksumWriter.digests` hands them to the commit (train/checkpoint.py), which records them in
  ``meta.json``. It also stages exactly one host copy of each tensor it is given
  (:meth:`ChecksumWriter.stage`; DCP's default stager deep-copies CPU DTensors and ShardedTensors,
  which copies the whole buffer behind a view -- a ZeRO-1 bucket per chunk).
* :class:`VerifyingReader` is DCP's ``FileSystemReader`` that checks what it uses against ``meta.json``:
  DCP's ``.metadata`` whole (a pickle: unpickled only after its digest matched the JSON record), and
  for every data file this rank's load plan reads, its size and the blocks holding the byte ranges it
  reads (each rank verifies what it reads, so the reading cost does not grow with the number of ranks
  that need a few bytes of one file). A mismatch raises :class:`CheckpointCorrupt`, which DCP re-raises
  on every rank, so all ranks fall back to the previous checkpoint together.

Data files are written in DCP's ``torch_save`` format and read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

CHUNK = 1 << 22
BLOCK = 1 << 23  # bytes per block digest: 8 MiB (a 1 TB checkpoint lists ~130k of them in meta.json)
WRITE_BUFFER = 1 << 20  # bytes collected before they are hashed and written


class CheckpointCorrupt(RuntimeError):
    """A checkpoint file that is missing, truncated or altered (its digest differs from meta.json's)."""


def file_digest(path: str | os.PathLike) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def file_record(path: str | os.PathLike) -> dict:
    """The digest record of a file on disk (what :class:`ChecksumWriter` computes while writing)."""
    digest, blocks, size = hashlib.sha256(), [], 0
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK):
            digest.update(block)
            blocks.append(hashlib.sha256(block).hexdigest()[:32])
            size += len(block)
    return {"sha256": digest.hexdigest(), "size": size, "blocks": blocks}


def _check_size(path: Path, record: dict | None) -> None:
    name = path.name
    if record is None:
        raise CheckpointCorrupt(f"{name} is not listed in meta.json")
    if not path.is_file():
        raise CheckpointCorrupt(f"{name} is missing")
    size = path.stat().st_size
    if size != record["size"]:
        raise CheckpointCorrupt(f"{name} has {size} bytes, meta.json recorded {record['size']} (truncated?)")


def check_ranges(path: Path, record: dict | None, ranges: list[tuple[int, int]]) -> None:
    """Raise :class:`CheckpointCorrupt` unless ``path`` has the recorded size and every block overlapping
    the byte ``ranges`` ((offset, length) pairs) has its recorded digest."""
    _check_size(path, record)
    blocks = record.get("blocks") or []
    wanted = sorted(
        {b for offset, length in ranges for b in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1)}
    )
    with open(path, "rb") as handle:
        for index in wanted:
            handle.seek(index * BLOCK)
            if index >= len(blocks) or hashlib.sha256(handle.read(BLOCK)).hexdigest()[:32] != blocks[index]:
                raise CheckpointCorrupt(f"{path.name}: block {index} differs from meta.json's SHA-256 (altered bytes)")


def check_file(path: Path, record: dict | None) -> None:
    """Raise :class:`CheckpointCorrupt` unless ``path`` has the recorded size and SHA-256."""
    _check_size(path, record)
    if file_digest(path)[0] != record["sha256"]:
        raise CheckpointCorrupt(f"{path.name}: SHA-256 differs from meta.json (altered bytes)")


class _HashingStream(io.RawIOBase):
    """Write-through file stream that hashes what it writes. A seek away from the end (which DCP's writers
    do not do) disables the running hash; the file is then hashed from disk when it closes."""

    def __init__(self, raw, on_close):
        super().__init__()
        self.raw, self.on_close = raw, on_close
        self.digest, self.size, self.sequential = hashlib.sha256(), 0, True
        self.block, self.blocks = hashlib.sha256(), []

    def _blocks(self, view: memoryview) -> None:
        while len(view):
            room = BLOCK - self.size % BLOCK
            part, view = view[:room], view[room:]
            self.block.update(part)
            self.size += len(part)
            if self.size % BLOCK == 0:
                self.blocks.append(self.block.hexdigest()[:32])
                self.block = hashlib.sha256()

    def record(self) -> dict:
        blocks = self.blocks + ([self.block.hexdigest()[:32]] if self.size % BLOCK else [])
        return {"sha256": self.digest.hexdigest(), "size": self.size, "blocks": blocks}

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        if self.sequential and self.raw.tell() == self.size + len(view):
            self.digest.update(view)
            self._blocks(view)
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


class _SyncedBuffer(io.BufferedWriter):
    """Buffers DCP's many small writes (``torch.save`` writes each tensor's record in dozens of pieces) before
    they reach the hashing stream; ``fileno`` flushes first, so DCP's ``os.fsync(stream.fileno())`` syncs every
    byte written so far."""

    def fileno(self) -> int:
        self.flush()
        return super().fileno()


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
            self.digests[path.name] = stream.record() if stream.sequential else file_record(path)

        stream = _SyncedBuffer(_HashingStream(path.open(mode), record), WRITE_BUFFER)
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        record = self.digests.pop(Path(path).name, None)
        if record is not None:
            self.digests[Path(new_path).name] = record


def _host_copy(tensor):
    return tensor.detach().to("cpu", copy=True)  # a view copies its own elements, not its base's


def stage_copy(value):
    """One host copy of a checkpoint value: a tensor, a DTensor (its local shard) or a ShardedTensor (its
    local shards, same metadata)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.tensor import DTensor

    from ..parallel.flat_chunks import quiet_sharded_tensor

    if isinstance(value, ShardedTensor):
        with quiet_sharded_tensor():
            metadata = copy.deepcopy(value.metadata())  # placements say cpu now
            for shard in metadata.shards_metadata:
                shard.placement = type(shard.placement)(f"rank:{shard.placement.rank()}/cpu")
            local = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
            shards = [
                Shard(_host_copy(local[tuple(m.shard_offsets)]), m)
                for m in metadata.shards_metadata
                if tuple(m.shard_offsets) in local and m.placement.rank() == dist.get_rank()
            ]
            return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)
    if isinstance(value, DTensor):
        local = value.to_local()
        return value.detach().clone() if local.device.type == "cpu" else value.detach().to("cpu")
    if hasattr(value, "detach"):
        return _host_copy(value)
    return value


class ChecksumWriter(dcp.FileSystemWriter):
    def __init__(self, path: str | os.PathLike, thread_count: int = 1):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.fs = _HashingFileSystem()

    def stage(self, state_dict: dict) -> dict:
        """``dcp.async_save``'s staging: one host copy of exactly what this rank saves, made before it returns."""
        return {key: stage_copy(value) for key, value in state_dict.items()}

    def digests(self) -> dict[str, dict]:
        """``{file name: {"sha256", "size", "blocks"}}`` of every file this rank wrote (``.metadata`` too)."""
        return dict(self.fs.digests)


class VerifyingReader(dcp.FileSystemReader):
    def __init__(self, path: str | os.PathLike, records: dict[str, dict]):
        super().__init__(path)
        self.records = records

    def read_metadata(self, *args, **kwargs):
        check_file(Path(self.path) / ".metadata", self.records.get(".metadata"))
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            data = self.storage_data[item.storage_index]
            ranges.setdefault(data.relative_path, []).append((data.offset, data.length))
        for name, spans in sorted(ranges.items()):
            check_ranges(Path(self.path) / name, self.records.get(name), spans)
        return super().read_data(plan, planner)
