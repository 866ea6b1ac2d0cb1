"""The scaled-down replicas of conf/proven_compositions.yaml, trained from its rows: each parity row against one
process with the same model and batch (fp32, 5 steps, losses every step and final parameters within 1e-4,
tests/distributed/test_units.py ``assert_same_run``), each precision row against the fp32 one-process run within
the bound it states. tests/unit/test_compositions.py checks that the rows resolve to the compositions they name
and that every plan of the planner's grid is made of their facts."""

import json

import pytest

from disttrain_core.planner.proven import proven_runs

from ..conftest import cli_overrides, read_metrics, run_train
from .test_units import assert_same_run, train

pytestmark = pytest.mark.distributed

HERE = "tests/distributed/test_compositions.py::"
ROWS = [row for row in proven_runs() if row.test.startswith(HERE)]


def _params(check: str, name: str):
    rows = [row for row in ROWS if row.check.split(":")[0] == check and row.test.startswith(HERE + name)]
    return [pytest.param(row, id=row.test_id) for row in rows]


@pytest.mark.parametrize("row", _params("parity", "test_replica_matches_one_process"))
def test_replica_matches_one_process(row, one_process, request, tmp_path):
    data = request.getfixturevalue(row.data)
    reference = one_process(*row.reference, data=None if row.data == "shards" else data)
    run = train(data, tmp_path / "run", *row.reference, *row.layout)
    assert_same_run(run, reference)
    # what the runtime recorded is the composition the table names (parallel/composition.py, one function)
    assert json.loads((run / "composition.json").read_text())["key"] == row.composition


@pytest.mark.parametrize("row", _params("bf16", "test_precision_policy_tracks_fp32"))
def test_precision_policy_tracks_fp32(row, one_process, shards, tmp_path):
    """bf16 against fp32 on the same data, 5 steps: every step's loss within the row's relative bound (``check:
    bf16:<bound>``), the run's parameters really moved in bf16 (not an fp32 run under another name)."""
    bound = float(row.check.split(":")[1])
    reference = one_process(*row.reference)
    run_dir = tmp_path / "run"
    steps = ["trainer.max_steps=5", "trainer.checkpoint.every_n_steps=0"]
    result = run_train(cli_overrides(shards, run_dir) + steps + [*row.reference, *row.layout], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = [m["loss"] for m in read_metrics(run_dir)]
    theirs = [m["loss"] for m in read_metrics(reference)]
    assert len(ours) == len(theirs) == 5
    assert ours != theirs  # bf16 rounding reached the losses
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    assert worst < bound, (worst, ours, theirs)
