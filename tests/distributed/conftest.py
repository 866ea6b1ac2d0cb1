"""Fixtures of the multi-process tests."""

import hashlib

import pytest

from ..conftest import made_once, shared_dir
from .data_sources import make_sources

# Overrides that name what a reference run is anyway (the default model)
DEFAULTS = {"model=mllm_tiny"}


@pytest.fixture(scope="session")
def data_sources(shards, tmp_path_factory):
    """The files behind every data source of tests/distributed/data_sources.py, made once per session."""
    return make_sources(tmp_path_factory.mktemp("sources"), shards)


@pytest.fixture(scope="session")
def any2any_shards(tmp_path_factory):
    """2 shards x 24 samples: 30% of the images short videos, half the samples with a clip (made once per session,
    shared by both pytest-xdist workers)."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    out = shared_dir(tmp_path_factory) / "any2any_shards"
    with made_once(out) as todo:
        if todo:
            config = SyntheticDataConfig(
                num_shards=2, samples_per_shard=24, image_side_max=128, video_fraction=0.3, audio_fraction=0.5
            )
            generate_shards(config, out, processes=1)
    return out


@pytest.fixture(scope="session")
def one_process(shards, tmp_path_factory):
    """``one_process(*overrides, data=None)``: the one-process reference run (tests/distributed/test_units.py
    ``train``) with these overrides on ``data`` (default: the session's shards), trained once per test session and
    shared by every file and both pytest-xdist workers; the parity tests of several files compare against the same
    few references (read only: losses, checkpoint)."""
    from .test_units import train

    root = shared_dir(tmp_path_factory) / "one_process"

    def run(*overrides: str, data=None):
        key = tuple(sorted(set(overrides) - DEFAULTS))
        name = "\n".join(key) + (f"\ndata={data.name}" if data is not None else "")
        run_dir = root / hashlib.sha256(name.encode()).hexdigest()[:16]
        with made_once(run_dir) as todo:
            if todo:
                train(data or shards, run_dir, *key)
        return run_dir

    return run
