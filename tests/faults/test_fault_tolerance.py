"""Per-step fault tolerance on torchft (trainer.fault_tolerance, docs/FAULT_TOLERANCE.md): 4 processes as 4 replica
groups, and as 2 groups of 2 (DDP inside each), one process SIGKILLed as step 5 begins (after its quorum formed, so
the step fails in the others' all-reduce).
The survivors keep their processes, their step never goes back, step 5 commits nowhere until it is taken again,
a replacement joins and receives the state from a healthy group, and the final parameters equal one process
trained on the same global batches (fp32, 12 steps, 1e-5)."""

from __future__ import annotations

import json

import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import cli_overrides, read_metrics
from .conftest import Job

pytestmark = pytest.mark.distributed
STEPS = 12


def _args(shards, run_dir, *extra: str) -> list[str]:
    return [
        *cli_overrides(shards, run_dir),
        f"trainer.max_steps={STEPS}",
        "optim.global_batch_size=4",
        "optim.micro_batch_size=1",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.dist_timeout_s=30",
        *extra,
    ]


@pytest.fixture(scope="module")
def one_process(shards, tmp_path_factory):
    """The same 12 steps in one process: the run every fault-tolerant run must end at."""
    reference = tmp_path_factory.mktemp("ft_reference") / "one"
    code, out, _ = Job(_args(shards, reference, "trainer.devices=1"), reference.parent / "one.log").finish(timeout=120)
    assert code == 0, out[-3000:]
    return reference


# (replica groups, the rank killed: job rank = group x group size + rank in the group)
@pytest.mark.parametrize("replicas, killed", [(4, 1), (2, 3)], ids=["4 groups of 1", "2 groups of 2"])
def test_a_replica_killed_mid_run_is_replaced_and_the_run_ends_where_one_process_ends(
    replicas, killed, shards, tmp_path, one_process
):
    reference = one_process
    run = tmp_path / "ft"
    args = _args(
        shards,
        run,
        "trainer.devices=4",
        "trainer.fault_tolerance.enabled=true",
        f"trainer.fault_tolerance.replicas={replicas}",
        "trainer.fault_tolerance.timeout_s=10",
    )
    code, out, _ = Job(args, tmp_path / "ft.log", fault=f"kill@step:rank={killed}:step=5").finish(timeout=240)
    assert code == 0, out[-3000:]
    report = json.loads((run / "fault_tolerance.json").read_text())
    size = 4 // replicas
    dead = str(killed // size)
    assert report["failures"] == [{"group": int(dead), "rank": killed % size, "cause": "SIGKILL", "start": 0}]
    groups = report["groups"]
    survivors = [g for g in groups if g != dead]
    for index in survivors:  # the survivors: the same processes from start to end
        assert len(report["pids"][index]) == 1 and report["pids"][index][0][0] == groups[index]["pid"]
        assert groups[index]["start"] == 0
        steps = [m["step"] for m in read_metrics(run / "replicas" / f"r{index}") if "loss" in m]
        # strictly rising to the end (a group left out of one quorum -- slow, or its peer died mid all-reduce --
        # receives the committed state and skips that step's record: never goes back)
        assert steps == sorted(set(steps)) and steps[-1] == STEPS, f"group {index}'s steps went back: {steps}"
    # step 5 failed in the survivors' all-reduce: none committed it, and each took it again
    assert any(groups[i]["uncommitted_steps"] >= 1 for i in survivors)
    replacement = groups[dead]
    assert replacement["start"] == 1 and len(report["pids"][dead]) == 2
    assert replacement["healed_at"] and replacement["healed_at"][0] >= 4, "the replacement must receive a live state"
    assert sum(g["states_sent"] for g in groups.values()) >= 1
    # every group ends at the same step, data position and parameters
    assert {g["step"] for g in groups.values()} == {STEPS}
    one_data = json.loads((latest_checkpoint(reference / "checkpoints") / "data_dp00000.json").read_text())
    assert {g["data"]["index"] for g in groups.values()} == {one_data["index"]}, "samples lost or repeated"
    assert len({tuple(g["parameter_fingerprint"]) for g in groups.values()}) == 1
    ours = read_tensors(latest_checkpoint(run / "checkpoints"))
    theirs = read_tensors(latest_checkpoint(reference / "checkpoints"))
    assert ours.keys() == theirs.keys()
    worst = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    assert worst < 1e-5, f"parameters differ from one process by {worst:.2e}"
