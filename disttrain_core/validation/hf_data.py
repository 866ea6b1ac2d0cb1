"""``data.format=hf`` before launch (data/hf_source.py): the column mapping, files that read, and the mapped
columns present in them -- each a one-line error naming the value and the fix."""

from __future__ import annotations

import gzip
import io
import json

from ..config import Config
from .common import ConfigError


def _first_json_keys(path: str, opener) -> list[str]:
    with opener(path) as file:
        for line in file:
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("its first line is not a JSON object")
                return list(row)
    raise ValueError("it holds no rows")


def file_columns(path: str) -> list[str]:
    """The column names of one parquet, arrow or jsonl(.gz) file (a local path or an fsspec URL), read from its
    header or first line; ValueError/OSError when it does not read."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..data.hf_source import builder_of

    kind, gz = builder_of(path), path.lower().endswith(".gz")
    with fsspec.open(path, "rb") as raw:
        if kind == "parquet":
            return list(pq.read_schema(raw).names)
        if kind == "arrow":
            data = raw.read()
            try:
                return list(pa.ipc.open_stream(data).schema.names)  # datasets' save_to_disk writes the stream format
            except pa.ArrowInvalid:
                return list(pa.ipc.open_file(data).schema.names)
        text = gzip.open(raw, "rt", encoding="utf-8") if gz else io.TextIOWrapper(raw, encoding="utf-8")
        return _first_json_keys(text, lambda f: f)


def check_hf(cfg: Config) -> None:
    from ..data.hf_source import ROLES

    d, m, columns = cfg.data, cfg.model, dict(cfg.data.hf.columns)
    unknown = sorted(set(columns) - set(ROLES))
    if unknown:
        raise ConfigError(f"data.hf.columns has {unknown}: the roles are {', '.join(ROLES)}")
    if not (columns.get("text") or columns.get("conversations")):
        raise ConfigError("data.hf.columns names no text: set data.hf.columns.text=<column> (or .conversations)")
    if columns.get("image") and m.encoder is None:
        raise ConfigError(
            f"data.hf.columns.image={columns['image']!r}, but model={m.name} has no image encoder: pick a multimodal "
            "model (model=mllm_tiny) or set data.hf.columns.image=null"
        )
    if columns.get("audio") and m.audio_encoder is None:
        raise ConfigError(
            f"data.hf.columns.audio={columns['audio']!r}, but model={m.name} has no audio tower: pick a model with "
            "one (model=any2any_tiny) or set data.hf.columns.audio=null"
        )
    if d.hf.shuffle_buffer < 1:
        raise ConfigError(f"data.hf.shuffle_buffer={d.hf.shuffle_buffer}: use 1 or more rows")
    if d.blend:  # each source's files, as data.path's would be
        from .data import blend_names

        names = blend_names(cfg)
        files = []
        for i, source in enumerate(d.blend):
            files += _check_files(f"data.blend[{i}] ({names[i]}) path", str(source.path), columns)
        return _check_val(cfg, files, columns)
    files = _check_files("data.path", str(d.path), columns)
    if d.packing.enabled:  # the rows of data.path packed into rows of documents (data/corpus.py)
        from .packing import validate_packing

        return validate_packing(cfg)
    _check_val(cfg, files, columns)


def _check_val(cfg: Config, training: list[str], columns: dict) -> None:
    """data.val with data=hf: held-out files of their own (data.val.path), read when validation runs."""
    from ..data.splits import overlap

    d, t = cfg.data, cfg.trainer
    if d.val.holdout_shards:
        raise ConfigError(
            f"data.val.holdout_shards={d.val.holdout_shards} holds out webdataset shards; with data=hf give the "
            "held-out rows as files of their own: data.val.path=<parquet, arrow or jsonl files>"
        )
    if t.val_every_n_steps <= 0 and not t.eval_only:
        return
    if not d.val.path:
        what = f"trainer.val_every_n_steps={t.val_every_n_steps}" if t.val_every_n_steps > 0 else "trainer.eval_only"
        raise ConfigError(
            f"{what} evaluates on held-out data, and data.val names none: set data.val.path=<held-out parquet, "
            "arrow or jsonl files>"
        )
    both = overlap(_check_files("data.val.path", str(d.val.path), columns), training)
    if both:
        raise ConfigError(
            f"data.val.path={str(d.val.path)!r} shares {len(both)} file(s) with the training files (first: "
            f"{both[0]}): a held-out split is never trained on"
        )


def _check_files(key: str, path: str, columns: dict) -> list[str]:
    """The files ``path`` names, each present, of one kind, the first one readable with the mapped columns."""
    from ..data.hf_source import ROLES, builder, expand_files

    try:
        files, missing = expand_files(path)
    except ValueError as error:
        raise ConfigError(f"{key}={path!r}: {error}") from None
    if missing and files:  # none at all: builder() below names the kinds it reads
        raise ConfigError(
            f"{key}={path!r} names {len(missing)} file(s) that are missing or of no known kind (first: "
            f"{missing[0]}); fix the pattern, or point {key} at the directory"
        )
    try:
        builder(files, path, key)
        names = file_columns(files[0])
    except (ValueError, OSError) as error:
        if not files:
            raise ConfigError(str(error)) from None
        raise ConfigError(
            f"{key}={path!r}: {files[0]} does not read ({type(error).__name__}: {error}); check the file"
        ) from None
    for role in ROLES:
        column = columns.get(role)
        if column and column not in names:
            raise ConfigError(
                f"data.hf.columns.{role}={column!r}: {files[0]} has no such column; its columns are {names}"
            )
    return files
