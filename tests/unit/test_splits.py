"""The held-out split (data.val, data/splits.py): never trained on, the same samples on every read, and one-line
errors for splits that overlap the training data or leave nothing to train on."""

from __future__ import annotations

import itertools
import shutil

import pytest

from disttrain_core.data.blend import open_stream
from disttrain_core.data.splits import open_val_stream
from disttrain_core.validation import ConfigError
from disttrain_core.validation.settings import validate_data


def keys(stream, count: int) -> set[str]:
    return {e.item.key for e in itertools.islice(stream.elements(), count)}


def test_held_out_shards_are_never_in_any_training_stream(compose_cfg):
    cfg = compose_cfg("data.val.path=null", "data.val.holdout_shards=1")
    validate_data(cfg)
    held = keys(open_val_stream(cfg.data, 0), 24)
    assert len(held) == 24 and len({k.split("/")[0] for k in held}) == 1  # one whole shard of 24 samples
    assert keys(open_val_stream(cfg.data, 5), 24) == held  # a fixed order: every evaluation reads the same
    for dp in (1, 3):  # the canonical stream, and each replica's own, over three epochs
        trained = set().union(*(keys(open_stream(cfg.data, 0, rank, dp), 3 * 72 // dp) for rank in range(dp)))
        assert len(trained) == 72 and not trained & held, dp
    assert open_val_stream(compose_cfg("data.val.path=null").data, 0) is None


def test_a_split_that_overlaps_training_or_leaves_nothing_is_one_line(compose_cfg, shards, tmp_path):
    other = tmp_path / "val"
    other.mkdir()
    shutil.copy(shards / "shard-000000.tar", other / "held.tar")
    val = "trainer.val_every_n_steps=5"  # what reads data.val.path
    validate_data(compose_cfg(f"data.val.path={other}", val))  # a copy under another name is another shard
    validate_data(compose_cfg(f"data.val.path={tmp_path}/none"))  # not read: not checked
    cases = {
        f"data.val.path={shards}/shard-000002.tar": r"shares 1 shard\(s\) with the training data \(first: .*000002",
        "data.val.holdout_shards=4": r"holdout_shards=4 of data.path's 4 shard\(s\) leaves 0 to train 1",
        "data.val.holdout_shards=-1": r"holdout_shards=-1: use 0",
        f"data.val.path={tmp_path}/none": r"data.val.path=.*none': no .tar shards found \(trainer.val_every_n_steps=5",
        "data.val.path=null": r"trainer.val_every_n_steps=5 evaluates on held-out data, and data.val names none",
    }
    for override, match in cases.items():
        path = [] if override.startswith("data.val.path") else ["data.val.path=null"]
        with pytest.raises(ConfigError, match=match):
            validate_data(compose_cfg(*path, override, val))
    with pytest.raises(ConfigError, match="set one of them"):
        validate_data(compose_cfg(f"data.val.path={other}", "data.val.holdout_shards=1"))
    with pytest.raises(ConfigError, match=r"leaves 2 to train 3 data-parallel"):
        validate_data(compose_cfg("data.val.path=null", "data.val.holdout_shards=2"), dp=3)
    blend = f"data.blend=[{{path:{shards}}}]"
    with pytest.raises(ConfigError, match="a blend does not read"):
        validate_data(compose_cfg(blend, "data.val.path=null", "data.val.holdout_shards=1"))
    with pytest.raises(ConfigError, match="shares 4 shard"):
        validate_data(compose_cfg(blend, f"data.val.path={shards}", val))
