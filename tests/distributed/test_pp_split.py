"""Uneven pipeline stages train as one process does: llama_tiny (4 blocks) at pp=2 with parallel.pp_split=[1,3]
(the first stage one block and the embedding, the second three blocks and the head), fp32, 5 steps: losses and
parameters within 1e-4 of one process."""

import pytest

from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed


def test_a_1_3_split_matches_one_process(shards, tmp_path, one_process):
    model = ["model=llama_tiny", *SMALL]
    reference = one_process(*model)
    split = train(
        shards,
        tmp_path / "pp2",
        *model,
        "parallel=pp2",
        "parallel.dp=1",
        "trainer.devices=2",
        "parallel.pp_split=[1,3]",
        "schedule=1f1b",
    )
    assert_same_run(split, reference)
