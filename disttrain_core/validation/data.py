"""Checks of ``data.path``: the shards it names, shards it names that are missing, and where
``data.generate_if_missing`` may write the embedded synthetic data.

Generation rule: with no shards at ``data.path``, the embedded data is generated only if ``data.path`` is
the data group's own location, ``paths.data_dir/<data.name>`` (``conf/data/synthetic_laion.yaml``: the
default, and wherever ``paths.data_dir`` moves it), or a directory that exists and is empty (the user made
it for this). Any other path is an error: a mistyped path must not fill a new directory with synthetic data.
"""

from __future__ import annotations

import os

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


def check_shards(cfg: Config) -> int:
    """The number of shards the run will read (generated ones included); ConfigError if there are none,
    if some are missing, or if generation would write somewhere it should not."""
    from ..data.reader import expand_shards

    d = cfg.data
    path = str(d.path)
    try:
        found, missing = expand_shards(path)
    except ValueError as error:  # a pattern that names too many files
        raise ConfigError(f"data.path={path!r}: {error}") from None
    if not found:
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
