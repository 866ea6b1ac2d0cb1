"""No host synchronization on the hot path: train.py with trainer.sync_debug=error (train/host_sync.py)
finishes, having checked every step that is neither the first nor a logging step."""

import pytest

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = pytest.mark.distributed

COMMON = ["trainer.sync_debug=error", "trainer.max_steps=4", "trainer.log_every_n_steps=4", "trainer.precision=32"]
LAYOUTS = {
    "ddp": ["optim.global_batch_size=8", "optim.micro_batch_size=4"],
    "zero1_dp2": ["parallel=zero1", "trainer.devices=2", "optim.global_batch_size=8", "optim.micro_batch_size=2"],
    "disagg2": ["parallel=disagg2", "optim.global_batch_size=8", "optim.micro_batch_size=2"],
    "tp2_overlap": [
        "model=llama_tiny",
        "parallel=pp2",
        "parallel.pp=1",
        "parallel.tp=2",
        "parallel.comm.tp_overlap=true",
        "trainer.devices=2",
        "optim.global_batch_size=8",
        "optim.micro_batch_size=2",
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_steps_read_nothing_back_from_the_device(layout, shards, tmp_path):
    run = tmp_path / layout
    result = run_train(cli_overrides(shards, run) + COMMON + LAYOUTS[layout], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    last = read_metrics(run)[-1]
    assert last["step"] == 4
    assert last["debug/sync_checked_steps"] == 2.0  # steps 2 and 3
    assert last["debug/host_syncs"] == 0.0
