"""Checks of packed variable-length text (``data.packing``) and of HotSPa layouts (``parallel.mode=hotspa``):
one line each, before any process starts."""

from __future__ import annotations

from ..config import Config
from .common import ConfigError, _require


def validate_packing(cfg: Config) -> None:
    from ..data.packed_loader import SOURCES
    from ..data.packing import check_boundaries

    pk = cfg.data.packing
    _require(pk.source in SOURCES, f"data.packing.source={pk.source!r}: allowed values are {', '.join(SOURCES)}")
    hf = cfg.data.format == "hf"
    _require(
        pk.source == "corpus" or not hf,
        f"data.packing.source={pk.source!r} draws synthetic documents; data=hf packs the rows of data.path: set "
        "data.packing.source=corpus",
    )
    if pk.source == "corpus":
        from ..data.corpus import corpus_files
        from ..data.packed_loader import corpus_path

        _require(
            corpus_path(cfg.data) is not None,
            "data.packing.source=corpus reads data.packing.corpus: set it to a .jsonl file, a directory of them, or "
            "webdataset shards (data.packing.corpus=${paths.data_dir}/synthetic_laion for the embedded shards)",
        )
        try:
            corpus_files(str(corpus_path(cfg.data)))
        except ValueError as error:
            raise ConfigError(f"data.packing.corpus: {error}") from None
    _require(pk.documents_per_step >= 1, f"data.packing.documents_per_step={pk.documents_per_step}: use 1 or more")
    _require(
        pk.length_scale > 0,
        f"data.packing.length_scale={pk.length_scale}: use a positive factor (1/32 draws 32K-context lengths for "
        "a 1K context)",
    )
    _require(pk.rows_per_microbatch >= 1, f"data.packing.rows_per_microbatch={pk.rows_per_microbatch}: use 1 or more")
    _require(
        pk.tokens_per_microbatch is None or pk.tokens_per_microbatch >= 1,
        f"data.packing.tokens_per_microbatch={pk.tokens_per_microbatch}: use a positive token budget, or null for "
        "data.packing.rows_per_microbatch rows per microbatch",
    )
    if pk.buckets is not None:
        try:
            check_boundaries(list(pk.buckets))
        except ValueError as error:
            raise ConfigError(f"data.packing.buckets: {error}") from None
        _require(
            max(pk.buckets) <= cfg.model.seq_len,
            f"data.packing.buckets={list(pk.buckets)} reach beyond model.seq_len={cfg.model.seq_len} (the rotary "
            f"table's length): set model.seq_len={max(pk.buckets)} or lower the last bucket",
        )
    _require(
        cfg.model.encoder is None and cfg.model.generator is None,
        f"data.packing packs text documents; model={cfg.model.name} has an image encoder or generator: use a "
        "text-only model (model=llama_tiny) or data=synthetic_laion",
    )
    _require(
        cfg.data.producer.address is None,
        "data.packing builds its steps in the trainers; unset data.producer.address",
    )
    mode = cfg.parallel.mode
    _require(
        mode in ("ddp", "hotspa", "local_sgd"),
        f"data.packing runs with parallel.mode=ddp, hotspa or local_sgd (packed rows of several lengths); "
        f"parallel.mode={mode}: "
        "express a static tp/pp/cp layout as parallel=hotspa with one strategy per bucket",
    )
    _require(
        not cfg.parallel.comm.tp_overlap,
        "parallel.comm.tp_overlap does not run packed documents (its sequence split ignores document masks)",
    )
