"""Checks of ``data.path``: the shards it names, shards it names that are missing, and where
``data.generate_if_missing`` may write the embedded synthetic data.

Generation rule: with no shards at ``data.path``, the embedded data is generated only if ``data.path`` is
the data group's own location, ``paths.data_dir/<data.name>`` (``conf/data/synthetic_laion.yaml``: the
default, and wherever ``paths.data_dir`` moves it), or a directory that exists and is empty (the user made
it for this). Any other path is an error: a mistyped path must not fill a new directory with synthetic data.

A URL (``s3://``, ``gs://``, ``http(s)://``, ``file://``, ``pipe:``; data/storage.py) is never generated into: one
that names no shards is an error, and one whose storage does not answer is one line naming the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import Config
from .common import ConfigError


def generation_target(cfg: Config) -> str | None:
    """Where the data group generates its data: ``paths.data_dir/<data.name>`` (None if unset)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return os.path.join(str(cfg.paths.data_dir), str(cfg.data.name))
    except OmegaConfBaseException:  # paths.data_dir left unset (???) or not resolvable here
        return None


def may_generate_into(cfg: Config, path: str) -> bool:
    """The generation rule (module docstring)."""
    target = generation_target(cfg)
    if target is not None and os.path.realpath(path) == os.path.realpath(target):
        return True
    return os.path.isdir(path) and not os.listdir(path)


def configure_storage(cfg: Config) -> None:
    """``data.storage_options`` applied to fsspec here and in the processes started later (data/storage.py);
    ConfigError unless it maps protocols to options, or if it holds credentials."""
    from ..data import storage

    try:
        options = storage.storage_options(cfg.data)
    except ValueError as error:
        raise ConfigError(f"data.storage_options={cfg.data.storage_options!r}: {error}") from None
    secrets = storage.secret_options(options)
    if secrets:
        raise ConfigError(
            f"data.storage_options.{secrets[0]}: credentials do not go in the config (it is saved with the run); "
            "drop it and set them in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3, "
            "GOOGLE_APPLICATION_CREDENTIALS for gs)"
        )
    storage.configure(cfg.data)


def _reach_fix(path: str) -> str:
    from ..data.storage import protocol

    proto = protocol(path)
    if proto in ("s3", "s3a"):
        return "check the bucket name, data.storage_options.s3.endpoint_url and the AWS_* credentials"
    if proto in ("gs", "gcs"):
        return "check the bucket name, data.storage_options.gs and GOOGLE_APPLICATION_CREDENTIALS"
    if proto in ("http", "https"):
        return "check the URL and that the server is up and serves the shards"
    return f"check the URL and data.storage_options.{proto}"


def check_url(where: str, path: str) -> None:
    """A shard URL's storage answers (its bucket or directory exists; http: the first shard is there); ConfigError
    naming the reason and the fix otherwise. Local paths pass. Call it after the brace pattern's size check."""
    from ..data.storage import check_reachable, is_url

    if not is_url(path):
        return
    reason = check_reachable(path)
    if reason is not None:
        raise ConfigError(f"{where}: cannot reach it ({reason}); {_reach_fix(path)}")


def check_shards(cfg: Config) -> int:
    """The number of shards the run will read (generated ones included); ConfigError if there are none,
    if some are missing, or if generation would write somewhere it should not."""
    from ..data.reader import check_name_count, expand_shards
    from ..data.storage import is_url

    d = cfg.data
    path = str(d.path)
    configure_storage(cfg)
    try:
        check_name_count(path)  # a pattern that names too many files, before any URL is reached
        check_url(f"data.path={path!r}", path)
        found, missing = expand_shards(path)
    except ConfigError:
        raise
    except ValueError as error:  # too many names, unbalanced braces
        raise ConfigError(f"data.path={path!r}: {error}") from None
    if not found:
        if is_url(path):
            raise ConfigError(
                f"data.path={path!r}: no .tar shards found there; point it at a directory, glob or brace pattern "
                "of shards (data.generate_if_missing generates local data only)"
            )
        if not d.generate_if_missing:
            raise ConfigError(
                f"data.path={path!r}: no .tar shards found; point data.path at a directory or brace pattern of "
                "webdataset shards, or run `python tools/make_shards.py` to create the embedded data"
            )
        if not may_generate_into(cfg, path):
            target = generation_target(cfg)
            where = f"into {target} (paths.data_dir/data.name) or " if target else ""
            raise ConfigError(
                f"data.path={path!r}: no .tar shards found there, and data.generate_if_missing=true generates the "
                f"embedded data only {where}into an existing empty directory; fix data.path if it is mistyped, "
                "create the directory first to generate into it, or set data.generate_if_missing=false"
            )
        return d.synthetic.num_shards
    if missing and not d.allow_missing_shards:
        total = len(found) + len(missing)
        raise ConfigError(
            f"data.path={path!r}: {len(missing)} of the {total} shard(s) it names are missing (first: "
            f"{missing[0]}); restore them or fix data.path, or set data.allow_missing_shards=true to train on the "
            f"{len(found)} that exist (a warning counts the missing ones)"
        )
    return len(found)


def blend_names(cfg: Config) -> list[str]:
    """``data.blend``'s source names, after checking its weights (finite, non-negative, not all zero) and that the
    names differ."""
    import math

    from ..data.blend import source_name

    sources = list(cfg.data.blend)
    weights = [s.weight for s in sources]
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.blend weights {weights}: give each source a non-negative weight, not all zero "
            "(they are normalized, e.g. 0.7 and 0.3)"
        )
    names = [source_name(s, i) for i, s in enumerate(sources)]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.blend names {names}: give each source a different name (or none)")
    return names


def check_blend(cfg: Config, dp: int) -> None:
    """``data.blend``: finite non-negative weights not all zero, distinct names, and every source's shards there
    (enough for ``dp`` replicas, none missing unless data.allow_missing_shards)."""
    from ..data.reader import check_name_count, expand_shards

    d = cfg.data
    configure_storage(cfg)
    sources, names = list(d.blend), blend_names(cfg)
    for i, (source, name) in enumerate(zip(sources, names, strict=True)):
        where = f"data.blend[{i}] ({name}) path={str(source.path)!r}"
        try:
            check_name_count(str(source.path))
            check_url(where, str(source.path))
            found, missing = expand_shards(str(source.path))
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
        if not found:
            raise ConfigError(f"{where}: no .tar shards found; point it at a directory or brace pattern of shards")
        if missing and not d.allow_missing_shards:
            raise ConfigError(
                f"{where}: {len(missing)} shard(s) it names are missing (first: {missing[0]}); restore them, fix the "
                "path, or set data.allow_missing_shards=true"
            )
        if len(found) < dp:
            raise ConfigError(
                f"{where} has {len(found)} shard(s) for {dp} data-parallel ranks; every rank reads every source: "
                "split it into more shards or use fewer processes"
            )


def check_validation_run(cfg: Config) -> None:
    """``trainer.checkpoint.keep_best`` needs validation, and ``trainer.eval_only`` a checkpoint to evaluate."""
    t = cfg.trainer
    if t.checkpoint.keep_best and t.val_every_n_steps <= 0:
        raise ConfigError(
            "trainer.checkpoint.keep_best=true keeps the checkpoint of the lowest val/loss: set "
            "trainer.val_every_n_steps=N (validation every N steps)"
        )
    if t.eval_only and t.resume == "none":
        raise ConfigError(
            "trainer.eval_only=true evaluates a checkpoint: set trainer.resume=<checkpoint or run directory> "
            "(python tools/evaluate.py path=<run directory> does)"
        )


def check_val(cfg: Config, dp: int) -> None:
    """``data.val``: one kind of split; held-out shards of data.path always (they change what trains); the
    split's shards, when validation reads them (trainer.val_every_n_steps), there and none of them trained on
    (data/splits.py)."""
    from ..data.reader import check_name_count, resolve_shards
    from ..data.splits import held_out_shards, overlap, training_shards
    from ..data.storage import is_url

    d, v = cfg.data, cfg.data.val
    configure_storage(cfg)
    if v.holdout_shards < 0:
        raise ConfigError(f"data.val.holdout_shards={v.holdout_shards}: use 0 (none) or a number of shards")
    if v.path and v.holdout_shards:
        raise ConfigError(
            f"data.val.path={str(v.path)!r} and data.val.holdout_shards={v.holdout_shards}: set one of them "
            "(data.val.path=null holds out shards of data.path)"
        )
    if v.holdout_shards and d.blend:
        raise ConfigError(
            "data.val.holdout_shards holds out shards of data.path, which a blend does not read: "
            "give the held-out shards as data.val.path"
        )
    if v.holdout_shards:
        total = len(resolve_shards(str(d.path)))
        if v.holdout_shards >= total or total - v.holdout_shards < dp:
            raise ConfigError(
                f"data.val.holdout_shards={v.holdout_shards} of data.path's {total} shard(s) leaves "
                f"{max(0, total - v.holdout_shards)} to train {dp} data-parallel rank(s) on: hold out fewer"
            )
    every = cfg.trainer.val_every_n_steps
    if every <= 0 and not cfg.trainer.eval_only:
        return  # nothing reads data.val.path
    what = f"trainer.val_every_n_steps={every}" if every > 0 else "trainer.eval_only=true"
    if not v.path and not v.holdout_shards:
        raise ConfigError(
            f"{what} evaluates on held-out data, and data.val names none: set "
            "data.val.path=<held-out shards> or data.val.holdout_shards=N (the last N shards of data.path)"
        )
    if v.path:
        try:
            check_name_count(str(v.path))
            check_url(f"data.val.path={str(v.path)!r}", str(v.path))
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(f"data.val.path={str(v.path)!r}: {error}") from None
    held = held_out_shards(d)
    if not held:
        if v.path and d.generate_if_missing and not is_url(str(v.path)):
            return  # the embedded data's held-out split, generated before launch (launch/entry.py)
        raise ConfigError(f"data.val.path={str(v.path)!r}: no .tar shards found ({what} reads them)")
    training = [s for source in d.blend for s in resolve_shards(str(source.path))] if d.blend else training_shards(d)
    both = overlap(held, training)
    if both:
        raise ConfigError(
            f"data.val.path={str(v.path)!r} shares {len(both)} shard(s) with the training data (first: {both[0]}): a "
            "held-out split is never trained on; point data.val.path at other shards, or hold out shards of "
            "data.path with data.val.holdout_shards=N"
        )


def check_val_kind(cfg: Config) -> None:
    """The held-out split's kind: shards (webdataset), a token file (data.format=tokens), a corpus or another
    seed's documents (data.packing)."""
    d = cfg.data
    if d.packing.enabled:
        check_val_packing(cfg)
    if d.format == "tokens" and d.val.holdout_shards:
        raise ConfigError(
            f"data.val.holdout_shards={d.val.holdout_shards} holds out webdataset shards; with data.format=tokens "
            "give the held-out windows as a token file of their own: data.val.path=<held-out .npy>"
        )


def check_val_packing(cfg: Config) -> None:
    """Packed documents' held-out split: a corpus of its own (data.val.path) for source=corpus; the synthetic
    sources draw held-out documents from another seed, and take no path."""
    from ..data.corpus import corpus_files
    from ..data.packed_loader import corpus_path
    from ..data.splits import overlap

    d, pk, t = cfg.data, cfg.data.packing, cfg.trainer
    if d.val.holdout_shards:
        raise ConfigError(
            f"data.val.holdout_shards={d.val.holdout_shards} holds out webdataset shards; packed documents take a "
            "held-out corpus (data.val.path=<.jsonl or shards>, source=corpus) or none (synthetic sources)"
        )
    if t.val_every_n_steps <= 0 and not t.eval_only:
        return
    if pk.source != "corpus":
        if d.val.path:
            raise ConfigError(
                f"data.val.path={str(d.val.path)!r}: data.packing.source={pk.source} draws its held-out documents "
                "from another seed and reads no path; drop data.val.path (or use data.packing.source=corpus)"
            )
        return
    if not d.val.path:
        raise ConfigError(
            "trainer.val_every_n_steps with data.packing.source=corpus evaluates a held-out corpus: set "
            "data.val.path=<.jsonl file, directory or shards that data.packing.corpus does not hold>"
        )
    try:
        held, training = corpus_files(str(d.val.path))[1], corpus_files(str(corpus_path(d)))[1]
    except ValueError as error:
        raise ConfigError(f"data.val.path: {error}") from None
    both = overlap(held, training)
    if both:
        raise ConfigError(
            f"data.val.path={str(d.val.path)!r} shares {len(both)} file(s) with "
            f"{'data.packing.corpus' if pk.corpus is not None else 'data.path'} (first: "
            f"{both[0]}): a held-out corpus is never trained on"
        )


def check_val_tokens(cfg: Config) -> None:
    """``data.format=tokens`` with validation: ``data.val.path`` a token file of its own, with a window."""
    from ..data.token_file import open_tokens, window_count

    d, every = cfg.data, cfg.trainer.val_every_n_steps
    if every <= 0 and not cfg.trainer.eval_only:
        return
    what = f"trainer.val_every_n_steps={every}" if every > 0 else "trainer.eval_only=true"
    if not d.val.path:
        raise ConfigError(f"{what} evaluates on held-out data: set data.val.path=<held-out token .npy file>")
    if Path(str(d.val.path)).resolve() == Path(str(d.path)).resolve():
        raise ConfigError(
            f"data.val.path={str(d.val.path)!r} is the training file: a held-out split is never trained on; "
            "write the held-out tokens to a file of their own"
        )
    try:
        tokens = open_tokens(d.val.path)
    except ValueError as error:
        raise ConfigError(str(error).replace("data.path=", "data.val.path=")) from None
    if window_count(tokens, cfg.model.seq_len) < 1:
        raise ConfigError(
            f"data.val.path={str(d.val.path)!r} has {len(tokens)} tokens, fewer than model.seq_len + 1 = "
            f"{cfg.model.seq_len + 1}"
        )


FORMATS = ("webdataset", "tokens", "hf")
VOCAB_CHECKED_TOKENS = 1 << 20  # the head of a token file checked against the vocabulary before launch


def check_token_file(cfg: Config) -> None:
    """``data.format=tokens``: a text-only model and a readable 1-D integer .npy file with at least one window,
    whose first tokens fit the model's vocabulary (later windows that do not are skipped and counted)."""
    import numpy as np

    from ..data.token_file import open_tokens, window_count

    d, m = cfg.data, cfg.model
    if m.encoder is not None or m.generator is not None:
        raise ConfigError(
            f"data.format=tokens is pre-tokenized text, but model={m.name} has an image "
            f"{'encoder' if m.encoder is not None else 'generator'}: use a text-only model (model=llama_tiny) or "
            "image-text shards (data=synthetic_laion or data=webdataset)"
        )
    if d.packing.enabled or d.producer.address is not None:
        what = "data.packing.enabled=true" if d.packing.enabled else "data.producer.address"
        raise ConfigError(f"data.format=tokens reads its windows in the trainer; {what} does not apply: drop it")
    try:
        tokens = open_tokens(d.path)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if window_count(tokens, m.seq_len) < 1:
        raise ConfigError(
            f"data.path={str(d.path)!r} has {len(tokens)} tokens, fewer than model.seq_len + 1 = {m.seq_len + 1}"
        )
    vocab = m.llm.vocab_size
    if np.iinfo(tokens.dtype).max >= vocab:
        head = np.asarray(tokens[:VOCAB_CHECKED_TOKENS])
        top = int(head.max())
        if top >= vocab or int(head.min()) < 0:
            bad = top if top >= vocab else int(head.min())
            raise ConfigError(
                f"data.path={str(d.path)!r} holds token id {bad} outside model.llm.vocab_size={vocab}: the file was "
                "written by another tokenizer; tokenize with the model's tokenizer (data.tokenizer) or pick the "
                "model that matches it"
            )


def check_chat_template(cfg: Config) -> None:
    """data.chat_template names a template that reads and compiles (data/conversations.py)."""
    from jinja2.exceptions import TemplateSyntaxError

    from ..data.conversations import compiled, template_source

    try:
        compiled(template_source(str(cfg.data.chat_template), str(cfg.data.tokenizer)))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    except TemplateSyntaxError as error:
        raise ConfigError(
            f"data.chat_template={cfg.data.chat_template}: its Jinja does not compile ({error})"
        ) from None
