"""Text documents from a corpus on disk, for packed training (``data.packing.source=corpus``).

A corpus is JSON lines -- a ``.jsonl`` or ``.json`` file (gzipped or not), a directory, glob or brace pattern of
them, one document per line in its ``"text"`` field -- or parquet / arrow tables named the same ways, one document
per row in its ``text`` column (with data=hf: the fields data.hf.columns names, text or conversations) -- or
webdataset shards (a directory of ``.tar`` files, a file, a glob or
a brace pattern: data/reader.py), one document per sample: its ``.txt`` member, else its ``.json``
member's ``"text"`` string or its ``"texts"`` list (the embedded LAION-like shards' interleaved captions,
images left out) joined by spaces.

A document is ``[bos] + tokens + [eos]`` in the run's tokenizer. A JSON record holding LLaVA's ``conversations``
(data/conversations.py) is rendered with the run's chat template instead, its images left out, and carries a loss
mask: the packed row takes the loss on its assistant turns only (``masks``). A document longer than the last bucket is
cut into pieces of that length (Megatron-style; counted in ``split``), a leftover of a single token is
dropped. A record that is not valid JSON, has no text, or a shard that cannot be read is skipped and
counted by reason, never a crash.

Order: records in a fixed order (JSON lines: files sorted by name, lines in order; shards: the reader's
interleaved stream of one data-parallel rank over all shards, shuffled per epoch with ``seed``), epoch after
epoch. Step ``s`` reads records ``s * per_step`` to ``(s + 1) * per_step - 1`` of that infinite order, so the
data position is the step number and a resumed run reads exactly the documents it would have read (found
again by reading past the earlier records: resuming costs one pass over them).
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from collections.abc import Iterator

import torch

from .bad_sample import BadSample
from .reader import RawSample, ShardStream, resolve_shards
from .tokenizer import Tokenizer


def corpus_files(path: str) -> tuple[str, list[str]]:
    """("jsonl" | "table" | "webdataset", files) named by ``path``; no files: ValueError naming the path. JSON lines
    are ``.jsonl``/``.json`` files, gzipped or not (C4's ``.json.gz``); tables are parquet or arrow files
    (data/hf_source.py names them: a directory, a file, a glob or a brace pattern)."""
    from .hf_source import builder, builder_of, expand_files

    if os.path.isdir(path):
        lines = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.jsonl.gz")))
        if lines:
            return "jsonl", lines
    if os.path.isdir(path) or builder_of(path) is not None:
        files, missing = expand_files(path)
        if missing:
            raise ValueError(f"{path}: no such file ({len(missing)} missing, first {missing[0]})")
        if files or not os.path.isdir(path):
            return ("jsonl" if builder(files, path) == "json" else "table"), files
    shards = resolve_shards(path)
    if not shards:
        raise ValueError(f"{path} holds no .jsonl, .parquet or .arrow file and names no webdataset shard")
    return "webdataset", shards


def _table_rows(name: str, columns: list[str]) -> Iterator[dict]:
    """The rows of a parquet or arrow file (a path or an fsspec URL) in order, ``columns`` only, a batch at a time."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fsspec.open(name, "rb") as raw:
        if name.lower().endswith(".parquet"):
            present = [c for c in columns if c in pq.read_schema(raw).names]
            raw.seek(0)
            batches = pq.ParquetFile(raw).iter_batches(batch_size=1024, columns=present)
        else:
            data = raw.read()
            try:
                reader = pa.ipc.open_stream(data)  # datasets' save_to_disk writes the stream format
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(data)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
        for batch in batches:
            yield from batch.select([c for c in columns if c in batch.schema.names]).to_pylist()


def _mapped(record, columns: dict | None):
    """A record seen through data.hf.columns (data=hf): its text column as ``text``, its conversations column
    (a list of turns, or its JSON string) as ``conversations``; without a mapping the record as it is."""
    if columns is None or not isinstance(record, dict):
        return record
    if columns.get("conversations") and record.get(columns["conversations"]) is not None:
        turns = record[columns["conversations"]]
        return {"conversations": json.loads(turns) if isinstance(turns, str) else turns}
    return {"text": record.get(columns["text"])} if columns.get("text") else {}


def _text_of_json(record) -> str | dict | None:
    """A record's text, or the record itself when it holds a conversation."""
    if not isinstance(record, dict):
        return None
    if "conversations" in record or "messages" in record:
        return record
    text = record.get("text")
    if isinstance(text, str):
        return text
    texts = record.get("texts")
    if isinstance(texts, list):
        parts = [t for t in texts if isinstance(t, str)]
        return " ".join(parts) if parts else None
    return None


class CorpusDocuments:
    """``documents(step, per_step)``: the tokenized documents of a step (see the module doc)."""

    def __init__(
        self,
        path: str,
        tokenizer: Tokenizer,
        max_len: int,
        seed: int = 0,
        template: str | None = None,
        columns: dict | None = None,
    ):
        self.kind, self.files = corpus_files(path)
        self.columns = columns  # data.hf.columns (data=hf): which field is the text, which the conversation
        self.template = template  # a chat template's Jinja text, for conversation records
        self.masks: list[torch.Tensor | None] = []  # the last step's documents' loss masks (None: every token)
        self.tokenizer, self.max_len, self.seed = tokenizer, int(max_len), int(seed)
        self.skipped: Counter[str] = Counter()
        self.split = 0
        self._records: Iterator[str | None] | None = None
        self._next = 0  # index of the record self._records yields next

    def _texts(self) -> Iterator[str | None]:
        """Every record's text (None: a bad record, already counted), epoch after epoch."""
        while True:
            found = 0
            for text in {"jsonl": self._jsonl, "table": self._tables, "webdataset": self._shards}[self.kind]():
                found += text is not None
                yield text
            if not found:
                raise ValueError(f"the corpus {self.files[0]}... holds no readable document")

    def _jsonl(self) -> Iterator[str | None]:
        import fsspec  # a local path or a URL (data=hf's data.path may be one), gzipped or not

        for name in self.files:
            with fsspec.open(name, "rt", compression="infer", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        yield self._text(lambda line=line: json.loads(line), self.columns)

    def _tables(self) -> Iterator[str | None]:
        columns = self.columns or {"text": "text", "conversations": "conversations"}
        for name in self.files:
            for record in _table_rows(name, [c for c in columns.values() if c]):
                yield self._text(lambda record=record: record, columns)

    def _text(self, record_of, columns: dict | None) -> str | None:
        """The text of the record ``record_of()`` parses, seen through ``columns``; None (counted) when it is not
        JSON (``corpus_bad_json``) or holds no text (``corpus_no_text``)."""
        try:
            text = _text_of_json(_mapped(record_of(), columns))
        except json.JSONDecodeError:
            self.skipped["corpus_bad_json"] += 1
            return None
        if text is None:
            self.skipped["corpus_no_text"] += 1
        return text

    def _shards(self) -> Iterator[str | None]:
        stream = ShardStream(self.files, 0, 1, self.seed)
        epoch = 0
        while True:
            produced = 0
            for element in stream.epoch_elements(epoch):
                item = element.item
                if not isinstance(item, RawSample):
                    self.skipped["corpus_bad_shard"] += 1
                    yield None
                    continue
                produced += 1
                yield self._sample_text(item)
            if not produced:
                return
            epoch += 1

    def _sample_text(self, sample: RawSample) -> str | None:
        if "txt" in sample.members:
            return sample.members["txt"].decode("utf-8", errors="replace")
        try:
            text = _text_of_json(json.loads(sample.members.get("json", b"")))
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.skipped["corpus_bad_json"] += 1
            return None
        if text is None:
            self.skipped["corpus_no_text"] += 1
        return text

    def _seek(self, index: int) -> None:
        """Position at record ``index``; records passed over are not counted again (a resumed run restores
        its counts)."""
        counts, split = Counter(self.skipped), self.split
        if self._records is None or index < self._next:
            self._records, self._next = self._texts(), 0
        while self._next < index:
            next(self._records)
            self._next += 1
        self.skipped.clear()
        self.skipped.update(counts)
        self.split = split

    def documents(self, step: int, per_step: int) -> list[torch.Tensor]:
        self._seek(step * per_step)
        out, self.masks = [], []
        for _ in range(per_step):
            text = next(self._records)
            self._next += 1
            if text is None:
                continue
            trained = None
            if isinstance(text, dict):
                try:
                    ids, trained = self._conversation(text)
                except BadSample as error:
                    self.skipped[f"corpus_{error.reason}"] += 1
                    continue
            else:
                ids = [self.tokenizer.bos_id, *self.tokenizer.encode(text), self.tokenizer.eos_id]
            pieces = [range(i, min(i + self.max_len, len(ids))) for i in range(0, len(ids), self.max_len)]
            if len(pieces) > 1 and len(pieces[-1]) < 2:
                pieces.pop()
            self.split += len(pieces) - 1
            out += [torch.tensor(ids[p.start : p.stop], dtype=torch.int64) for p in pieces]
            self.masks += [None if trained is None else torch.tensor(trained[p.start : p.stop]) for p in pieces]
        return out

    def _conversation(self, record: dict) -> tuple[list[int], list[bool]]:
        """``[bos] + the rendered turns + [eos]`` and, per token, whether the loss predicts it (the assistant's)."""
        from .conversations import template_source
        from .sample_layouts import conversation_segments

        if self.template is None:
            self.template = template_source("auto", getattr(self.tokenizer, "path", "byte"))
        ids, trained = [self.tokenizer.bos_id], [False]
        for _, (piece, flag) in conversation_segments(record, {}, self.tokenizer, self.template, False):
            ids += piece
            trained += [flag] * len(piece)
        return ids + [self.tokenizer.eos_id], trained + [False]
