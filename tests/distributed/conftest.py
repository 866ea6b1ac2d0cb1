"""Fixtures of the multi-process tests."""

import pytest

from .data_sources import make_sources


@pytest.fixture(scope="session")
def data_sources(shards, tmp_path_factory):
    """The files behind every data source of tests/distributed/data_sources.py, made once per session."""
    return make_sources(tmp_path_factory.mktemp("sources"), shards)
