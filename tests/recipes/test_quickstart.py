"""The quick start: the default `python train.py` learns (loss falls by at least 30%)."""

import pytest

from ..conftest import read_metrics, run_train

pytestmark = pytest.mark.slow


def test_default_training_run_reduces_the_loss_by_30_percent(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        [f"hydra.run.dir={run_dir}", f"paths.data_dir={tmp_path / 'data'}", "trainer.progress_bar=false"], timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    first, last = records[0]["loss"], records[-1]["loss"]
    assert records[-1]["step"] == 300
    assert last <= 0.7 * first, (first, last)
