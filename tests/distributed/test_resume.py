"""A run stopped after a checkpoint and resumed continues exactly like an uninterrupted run (20 steps).

Six runs of 20 steps: in ``make test-slow``. The default suite resumes across layouts in
test_reshard.py and through damaged checkpoints in test_checkpoint_faults.py (losses within 1e-5 / 1e-6)."""

import pytest

from ..conftest import cli_overrides, read_metrics, run_train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = ["trainer.max_steps=20", "trainer.precision=32", "trainer.checkpoint.every_n_steps=5", "data.num_workers=1"]


@pytest.mark.parametrize("devices", [1, 2])
def test_resume_reproduces_the_next_ten_losses(devices, shards, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    common = COMMON + [f"trainer.devices={devices}"]
    result = run_train(cli_overrides(shards, straight) + common)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train(cli_overrides(shards, stopped) + common + ["trainer.exit_after_step=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["step"] for m in read_metrics(stopped)] == list(range(1, 11))
    result = run_train(cli_overrides(shards, stopped) + common + ["trainer.resume=auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    reference = {m["step"]: m["loss"] for m in read_metrics(straight)}
    resumed = [m for m in read_metrics(stopped) if m["step"] > 10]
    assert [m["step"] for m in resumed] == list(range(11, 21))
    for m in resumed:
        assert abs(m["loss"] - reference[m["step"]]) <= 1e-6, (m["step"], m["loss"], reference[m["step"]])
