"""Every dimension in one run, on 8 processes, against one process (fp32, 5 steps, losses and parameters within
1e-4): llama_tiny as dp2 x tp2 x pp2 (the vocabulary-parallel embedding and head on the first and last stage)
and as dp2 x cp2 x pp2 (ring attention inside each pipeline stage); on 16 processes, dp2 x tp2 x pp2 x cp2."""

import json
import os

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


def test_sixteen_processes_dp2_tp2_pp2_cp2_match_one_process(reference, shards, tmp_path):
    """The 4-D layout: dp2 x tp2 x pp2 x cp2 (ring attention inside each tensor-parallel pipeline stage of each
    replica) against one process; 13 s on 2 cores (8 processes per core: trainer.cpu_processes_per_core lets a small
    machine oversubscribe on purpose)."""
    layout = [*EIGHT, "parallel.tp=2", "parallel.cp=2", "trainer.devices=16"]
    per_core = max(4, -(-16 // (os.cpu_count() or 1)))
    run = train(
        shards, tmp_path / "sixteen", "model=llama_tiny", *BATCH, *layout, f"trainer.cpu_processes_per_core={per_core}"
    )
    assert_same_run(run, reference)
    key = json.loads((run / "composition.json").read_text())["key"]
    assert key == "units: llm(dp,tp,pp,cp|zero1|none|sp) / 1f1b / fp32", key
