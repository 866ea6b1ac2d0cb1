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
def one_process(shards, tmp_path_factory):
    """``one_process(*overrides)``: the one-process reference run (tests/distributed/test_units.py ``train``) with
    these overrides, trained once per test session and shared by every file and both pytest-xdist workers; the
    parity tests of several files compare against the same few references (read only: losses, checkpoint)."""
    from .test_units import train

    root = shared_dir(tmp_path_factory) / "one_process"

    def run(*overrides: str):
        key = tuple(sorted(set(overrides) - DEFAULTS))
        run_dir = root / hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
        with made_once(run_dir) as todo:
            if todo:
                train(shards, run_dir, *key)
        return run_dir

    return run
