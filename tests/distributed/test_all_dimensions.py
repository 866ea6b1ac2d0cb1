"""Every dimension in one run, on 8 processes, against one process (fp32, 5 steps, losses and parameters within
1e-4): llama_tiny as dp2 x tp2 x pp2 (the vocabulary-parallel embedding and head on the first and last stage)
and as dp2 x cp2 x pp2 (ring attention inside each pipeline stage)."""

import pytest

from .test_units import assert_same_run, train

pytestmark = pytest.mark.distributed

BATCH = ["optim.global_batch_size=8", "optim.micro_batch_size=2"]
EIGHT = ["parallel.mode=megatron", "parallel.dp=2", "parallel.pp=2", "schedule=1f1b", "trainer.devices=8"]


@pytest.fixture(scope="module")
def reference(one_process):
    return one_process("model=llama_tiny", *BATCH)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["parallel.tp=2"], id="dp2_tp2_pp2"),
        pytest.param(["parallel.cp=2"], id="dp2_cp2_pp2"),
        # and FSDP2 (ZeRO-3) sharded over the data x context ranks of each stage
        pytest.param(["parallel.cp=2", "parallel.shard=zero3"], id="dp2_cp2_pp2_zero3"),
    ],
)
def test_eight_processes_match_one_process(layout, reference, shards, tmp_path):
    run = train(shards, tmp_path / "eight", "model=llama_tiny", *BATCH, *EIGHT, *layout)
    assert_same_run(run, reference)
