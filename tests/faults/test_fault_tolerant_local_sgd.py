"""DiLoCo workers as replica groups (trainer.fault_tolerance with parallel=local_sgd; train/fault_tolerance/
workers.py): 4 workers of 1 process, synced every 4 steps for 12 steps.

- Worker 2 SIGKILLed as step 6 begins (between syncs) and worker 0 SIGKILLed as the sync at step 8 begins to reduce:
  the survivors keep their processes, the sync at 8 commits nowhere until every worker is back, each replacement
  takes its worker's state at step 4 from the next worker in the ring and replays steps 5-8, and the synced model
  equals the same job without failures (fp32, 1e-5).
- Worker 2 killed with trainer.fault_tolerance.replace=false: the syncs at 8 and 12 go on with the 3 others.
"""

from __future__ import annotations

import json

import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import cli_overrides
from .conftest import Job

pytestmark = pytest.mark.distributed
STEPS, EVERY = 12, 4


def _job(shards, run, log, fault=None, *extra):
    args = [
        *cli_overrides(shards, run),
        "optim.global_batch_size=4",
        "optim.micro_batch_size=1",
        "trainer.dist_timeout_s=30",
        f"trainer.max_steps={STEPS}",
        f"trainer.checkpoint.every_n_steps={STEPS}",
        "trainer.devices=4",
        "parallel=local_sgd",
        "parallel.local_sgd.warmup_steps=0",
        f"parallel.local_sgd.sync_every={EVERY}",
        "trainer.fault_tolerance.enabled=true",
        "trainer.fault_tolerance.replicas=4",
        "trainer.fault_tolerance.timeout_s=10",
        *extra,
    ]
    code, out, _ = Job(args, log, fault=fault).finish(timeout=180)
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    return json.loads((run / "fault_tolerance.json").read_text()), read_tensors(latest_checkpoint(run / "checkpoints"))


@pytest.fixture(scope="module")
def without_failures(shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("diloco_ft") / "reference"
    return _job(shards, run, run.parent / "reference.log")


def _worst(ours, theirs) -> float:
    assert ours.keys() == theirs.keys()
    return max((ours[n] - theirs[n]).abs().max().item() for n in ours if ours[n].is_floating_point())


def test_a_worker_killed_between_syncs_and_one_killed_in_a_sync_replay_to_the_same_synced_model(
    shards, tmp_path, without_failures
):
    reference, synced = without_failures
    fault = "kill@step:rank=2:step=6;kill@allreduce:rank=0:step=8"
    report, ours = _job(shards, tmp_path / "ft", tmp_path / "ft.log", fault)
    failures = [{k: v for k, v in f.items() if k != "time"} for f in report["failures"]]
    assert failures == [
        {"group": 2, "rank": 0, "cause": "SIGKILL", "start": 0},
        {"group": 0, "rank": 0, "cause": "SIGKILL", "start": 0},
    ]
    groups = report["groups"]
    for survivor in ("1", "3"):  # the same process from start to end, every sync committed by all 4
        assert report["pids"][survivor] == [[groups[survivor]["pid"]]]
        assert groups[survivor]["groups_per_step"] == {"4": 4, "8": 4, "12": 4}
    assert groups["3"]["local_sgd"]["failed_syncs"] == 1  # the sync at step 8 did not commit, then did
    for replaced in ("0", "2"):  # its own state at step 4 from its ring successor, then steps 5-8 replayed
        assert groups[replaced]["start"] == 1 and len(report["pids"][replaced]) == 2
        assert groups[replaced]["local_sgd"]["restored_from"] == EVERY
        assert groups[replaced]["local_sgd"]["inexact"] == []
        assert groups[replaced]["groups_per_step"] == {"8": 4, "12": 4}
    expected = {g["data"]["index"] for g in reference["groups"].values()}
    assert {g["data"]["index"] for g in groups.values()} == expected, "samples lost or repeated"
    assert len({tuple(g["parameter_fingerprint"]) for g in groups.values()}) == 1
    worst = _worst(ours, synced)
    assert worst < 1e-5, f"the synced model differs from the run without failures by {worst:.2e}"


def test_a_worker_not_replaced_leaves_the_syncs_to_the_others(shards, tmp_path, without_failures):
    _, synced = without_failures
    report, ours = _job(
        shards, tmp_path / "ft", tmp_path / "ft.log", "kill@step:rank=2:step=6", "trainer.fault_tolerance.replace=false"
    )
    assert report["given_up"] == [2] and report["groups"]["2"] is None
    for survivor in ("0", "1", "3"):
        assert report["groups"][survivor]["groups_per_step"] == {"4": 4, "8": 3, "12": 3}
    assert _worst(ours, synced) > 1e-4  # three workers' mean, not four's: another model (seed 003's elastic rule)
