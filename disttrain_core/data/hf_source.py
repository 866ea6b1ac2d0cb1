"""Rows of parquet, arrow and jsonl(.gz) files as a sample stream (``data.format=hf``), read with Hugging Face
``datasets``.

``data.path`` names a file, a directory (its files of one of those kinds) or a glob, or a URL fsspec reads
(``http://host/train.parquet``, taken as given). ``data.hf.columns`` says which column holds the text, the image
and the conversation; each row becomes the members dict a webdataset sample has (``txt``, an image member,
``json`` with ``conversations``), so data/samples.py encodes it like a tar sample.

Which replica reads what, as for shards (docs/DATA.md): the mapped dataset (``data.hf.streaming=false``) is put
in one order per epoch, a permutation of its rows seeded by ``(seed, epoch)``, and replica ``r`` of ``D`` reads
rows ``r, r + D, ...`` of it, so its ``l``-th element is element ``lD + r`` of the one order and a position is
one row index. The streaming dataset is datasets' ``IterableDataset``, shuffled with the seed (its files and a
buffer of ``data.hf.shuffle_buffer`` rows, reshuffled each epoch with ``set_epoch``) and split by
``split_dataset_by_node`` (whole files when the replicas divide the file count, else every D-th row). Its
order is a function of the seed and the epoch, so a resumed run reads it again up to its position (without
decoding the rows it passes): datasets' own ``state_dict`` restores a shuffle buffer empty, which would change
the order after a resume.

A row that cannot be used becomes an ``UnusableRow`` the loader skips and counts: ``missing_value`` (the mapped
column is absent or None), ``bad_value`` (not a string, bytes, struct or list as its role needs),
``missing_image`` (an image path that does not read); an image that does not decode is the encoder's
``bad_image``.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import numpy as np
from braceexpand import braceexpand

from .bad_sample import BadSample, UnusableRow
from .reader import Position, RawSample, ShardError, StreamElement, check_name_count

ROLES = ("text", "image", "audio", "conversations")
# file name endings -> datasets' packaged builder
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".jsonl.gz": "json", ".json": "json"}
_MAGIC = ((b"\x89PNG", "png"), (b"GIF8", "gif"), (b"RIFF", "webp"))
_AUDIO_MAGIC = ((b"fLaC", "flac"), (b"OggS", "ogg"))  # RIFF...WAVE: wav; anything else is read as mp3


def is_url(path: str) -> bool:
    return "://" in path


def builder_of(name: str) -> str | None:
    lower = name.lower()
    return next((b for end, b in BUILDERS.items() if lower.endswith(end) or lower.endswith(end + ".gz")), None)


def expand_files(path: str) -> tuple[list[str], list[str]]:
    """(files, missing names) of ``path``: a URL as given; a directory's files of a known kind; a file, a glob or a
    brace pattern (``c4-train.{00000..00007}-of-01024.json.gz``), each name of it a file or a glob that must match."""
    if is_url(path):
        return [path], []
    if os.path.isdir(path):
        return sorted(n for n in (os.path.join(path, f) for f in os.listdir(path)) if _known_file(n)), []
    check_name_count(path)
    found: list[str] = []
    missing: list[str] = []
    for name in braceexpand(path):
        matches = [n for n in sorted(glob.glob(name)) if _known_file(n)]
        found.extend(matches)
        if not matches:
            missing.append(name)
    return found, missing


def resolve_files(path: str) -> list[str]:
    """The files ``path`` names (``expand_files``), the missing names left out (validation refuses them)."""
    return expand_files(path)[0]


def _known_file(name: str) -> bool:
    return os.path.isfile(name) and builder_of(name) is not None


def builder(files: list[str], path: str, key: str = "data.path") -> str:
    """The one builder of ``files``; ValueError naming the fix when they are none or of several kinds."""
    kinds = {builder_of(f) for f in files}
    if not files or None in kinds:
        raise ValueError(
            f"{key}={path!r} names no .parquet, .arrow or .jsonl(.gz) file: point it at such a file, a "
            "directory of them or a glob"
        )
    if len(kinds) > 1:
        raise ValueError(f"{key}={path!r} mixes {sorted(kinds)} files: point it at files of one kind")
    return kinds.pop()


def load(data, streaming: bool, path: str | None = None):
    """datasets' Dataset (or IterableDataset) of ``path``'s files (default data.path), image columns left
    undecoded."""
    import datasets

    datasets.disable_progress_bars()
    path = str(data.path) if path is None else path
    files = resolve_files(path)
    dataset = datasets.load_dataset(
        builder(files, path),
        data_files=files,
        split="train",
        streaming=streaming,
        cache_dir=data.hf.cache_dir,
    )
    features = dataset.features or {}
    for role, kind in (("image", datasets.Image), ("audio", datasets.Audio)):
        column = data.hf.columns.get(role)
        if column and isinstance(features.get(column), kind):  # bytes and path, decoded by the encoder
            dataset = dataset.cast_column(column, kind(decode=False))
    return dataset


def _image_name(data: bytes) -> str:
    return next((name for magic, name in _MAGIC if data.startswith(magic)), "jpg")


def _file_bytes(value, image_root: str, role: str) -> bytes:
    """An image's or audio clip's bytes: given, in datasets' ``{bytes, path}`` struct, or read from a path."""
    if isinstance(value, dict):  # datasets' Image / Audio struct: {bytes, path}
        value = value.get("bytes") or value.get("path")
        if value is None:
            raise BadSample("missing_value", f"the {role} struct holds neither bytes nor a path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, str):
        kind = type(value).__name__
        raise BadSample("bad_value", f"an {role} is bytes, a {{bytes, path}} struct or a path, not {kind}")
    path = value if os.path.isabs(value) else os.path.join(image_root, value)
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise BadSample(f"missing_{role}", f"{path}: {error.strerror or error}") from error


def _audio_name(data: bytes) -> str:
    if data.startswith(b"RIFF") and data[8:12] == b"WAVE":
        return "wav"
    return next((name for magic, name in _AUDIO_MAGIC if data.startswith(magic)), "mp3")


def row_members(row: dict, columns: dict, image_root: str) -> dict[str, bytes]:
    """One row as the members dict of a webdataset sample; BadSample when a mapped value cannot be used."""

    def value(role: str):
        name = columns.get(role)
        if not name:
            return None
        if row.get(name) is None:
            raise BadSample("missing_value", f"column {name!r} ({role}) is missing or None")
        return row[name]

    members: dict[str, bytes] = {}
    conversations = value("conversations")
    if conversations is not None:
        if isinstance(conversations, str):
            try:
                conversations = json.loads(conversations)
            except ValueError as error:
                raise BadSample("bad_value", f"conversations: {error}") from error
        if not isinstance(conversations, list):
            raise BadSample("bad_value", f"conversations are a list of turns, not {type(conversations).__name__}")
        members["json"] = json.dumps({"conversations": conversations}).encode()
    elif (text := value("text")) is not None:
        if not isinstance(text, str):
            raise BadSample("bad_value", f"text is a string, not {type(text).__name__}")
        members["txt"] = text.encode()
    image = value("image")
    if image is not None:
        data = _file_bytes(image, image_root, "image")
        members[_image_name(data)] = data
    clip = value("audio")
    if clip is not None:
        data = _file_bytes(clip, image_root, "audio")
        members[_audio_name(data)] = data
    return members


class HFStream:
    """The rows replica ``dp_rank`` of ``dp_size`` reads, as StreamElements (the interface of a ShardStream)."""

    def __init__(
        self, data, seed: int, dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True, path: str | None = None
    ):
        """``path``: other files than data.path's, read with its mapping (the held-out split, data.val.path)."""
        self.path, self.seed, self.shuffle = str(data.path) if path is None else path, int(seed), bool(shuffle)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.streaming = bool(data.hf.streaming)
        self.columns = {k: v for k, v in dict(data.hf.columns).items() if v}
        local = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        self.image_root = str(data.hf.image_root or local or ".")
        self.shuffle_buffer = int(data.hf.shuffle_buffer)
        self._data = data
        self._dataset = None

    @property
    def shards(self) -> list[str]:
        return resolve_files(self.path)

    def dataset(self):
        if self._dataset is None:
            self._dataset = load(self._data, self.streaming, self.path)
        return self._dataset

    def sample_counts(self) -> list[int]:
        """The mapped dataset as shards of one row each (train/data_position.py maps positions between
        data-parallel sizes with them: the row order is the canonical interleave)."""
        if self.streaming:
            raise ValueError("a streaming dataset's rows are not counted")
        return [1] * len(self.dataset())

    def epoch_length(self) -> int:
        """Elements this replica reads per epoch (a blend places its sources' positions with it); streaming: its
        rows read once."""
        if self.streaming:
            return sum(1 for _ in self._rows(0, 0))
        return len(self.order(0))

    def order(self, epoch: int) -> np.ndarray:
        """The mapped dataset's rows this replica reads in ``epoch``, in order."""
        rows = len(self.dataset())
        order = np.random.default_rng([self.seed, epoch]).permutation(rows) if self.shuffle else np.arange(rows)
        return order[self.dp_rank :: self.dp_size]

    def _item(self, key: str, row: dict) -> RawSample | UnusableRow:
        try:
            return RawSample(key, row_members(row, self.columns, self.image_root))
        except BadSample as error:
            return UnusableRow(key, error.reason, str(error).removeprefix(f"{error.reason}: "))

    def _rows(self, epoch: int, first: int) -> Iterator[tuple[str, dict]]:
        """(key, row) of ``epoch`` from its element ``first`` on."""
        if not self.streaming:
            dataset = self.dataset()
            for row in self.order(epoch)[first:].tolist():
                yield f"hf:{row}", dataset[row]
            return
        from datasets.distributed import split_dataset_by_node

        dataset = self.dataset()
        if self.shuffle:
            dataset = dataset.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        dataset = split_dataset_by_node(dataset, rank=self.dp_rank, world_size=self.dp_size)
        dataset.set_epoch(epoch)
        for index, row in enumerate(dataset):
            if index >= first:
                yield f"hf:{epoch}/{self.dp_rank}/{index}", row

    def elements(self, start: Position = Position()) -> Iterator[StreamElement]:
        epoch, first = start.epoch, start.index
        while True:
            index = first
            try:
                for key, row in self._rows(epoch, first):
                    yield StreamElement(Position(epoch, index), self._item(key, row))
                    index += 1
            except (OSError, ValueError) as error:  # a file that breaks while streaming: the rest of the epoch
                yield StreamElement(Position(epoch, index), ShardError(self.path, f"{type(error).__name__}: {error}"))
                index += 1
            if index == 0:
                raise RuntimeError(
                    f"data.path={self.path!r} gives data-parallel replica {self.dp_rank} of {self.dp_size} no rows"
                )
            epoch, first = epoch + 1, 0
