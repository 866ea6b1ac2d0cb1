"""trainer.replan_on_failure (launch/replan.py): a multi-unit layout that loses a device is planned again by the
solver for the devices that remain and continues from its checkpoint, resharded into the new layout.

parallel=auto (analytic costs, no colocation) plans mllm_tiny on 4 devices as encoder | LLM dp=2 | generator.
The generator's rank is SIGKILLed as step 6 begins; the job re-plans for 3 devices (encoder | LLM | generator),
resumes from its step-4 checkpoint and trains to step 8. Its losses of steps 5-8 equal a run that resumes the
same checkpoint into the 3-device layout by hand, and the job that lost nothing in its 4-device layout (fp32,
1e-4)."""

from __future__ import annotations

import json

import pytest

from ..conftest import cli_overrides, read_metrics
from .conftest import Job

pytestmark = pytest.mark.distributed
PLANNED = [
    "parallel=auto",
    "planner.cost=analytic",
    "cluster.peak_flops_fp32=1e11",  # analytic costs on this CPU: a stated peak, not a profile
    "planner.colocation=false",  # separate encoder and generator units
    "planner.baselines=false",
    "optim.global_batch_size=8",
    "optim.micro_batch_size=2",
    "trainer.precision=32",
    "trainer.max_steps=8",
    "trainer.checkpoint.every_n_steps=4",
    "trainer.checkpoint.async_save=false",  # the step-4 checkpoint is complete before step 6
    "trainer.dist_timeout_s=30",
]


def _losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}  # the last record of each step


def test_a_lost_device_is_replanned_and_the_run_continues_from_the_resharded_checkpoint(shards, tmp_path):
    run = tmp_path / "replan"
    args = [*cli_overrides(shards, run), *PLANNED, "trainer.devices=4", "trainer.replan_on_failure=1"]
    code, out, _ = Job(args, tmp_path / "replan.log", fault="kill@step:rank=3:step=6").finish(timeout=300)
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    assert "rank 3 died (SIGKILL)" in out and "re-planning for 3 device(s) and resuming from step 4" in out
    before = json.loads((run / "plan.4dev.json").read_text())
    after = json.loads((run / "plan.json").read_text())
    assert before["gpus_used"] == 4 and after["gpus_used"] == 3
    (replan,) = json.loads((run / "replans.json").read_text())
    assert replan["lost_rank"] == 3 and replan["devices"] == 3 and replan["resumed_from_step"] == 4
    assert replan["units"] == {"encoder": [1, 1, 1], "llm": [1, 1, 1], "generator": [1, 1, 1]}

    by_hand = tmp_path / "by_hand"  # the same checkpoint resumed into the 3-device plan
    args = [*cli_overrides(shards, by_hand), *PLANNED, "trainer.devices=3"]
    code, out, _ = Job([*args, f"trainer.resume={run / 'checkpoints' / 'step_00000004'}"], tmp_path / "b.log").finish(
        timeout=300
    )
    assert code == 0, out[-3000:]
    ours, theirs = _losses(run), _losses(by_hand)
    assert sorted(theirs) == [5, 6, 7, 8]
    worst = max(abs(ours[s] - theirs[s]) for s in theirs)
    assert worst < 1e-4, f"the re-planned run's losses differ from a resume into its layout by {worst:.2e}"

    # and the same math as the job that lost nothing, in its 4-device layout
    whole = tmp_path / "whole"
    code, out, _ = Job([*cli_overrides(shards, whole), *PLANNED, "trainer.devices=4"], tmp_path / "w.log").finish(
        timeout=300
    )
    assert code == 0, out[-3000:]
    unbroken = _losses(whole)
    worst = max(abs(ours[s] - unbroken[s]) for s in range(1, 9))
    assert worst < 1e-4, f"the re-planned run's losses differ from the run without a failure by {worst:.2e}"
