"""Bubble filling (schedule.fill_bubbles, parallel/bubble_plan.py) trains as one process does: the colocated image
encoder cut into one chunk per pipeline rank, its actions list-scheduled into the 1F1B bubbles. pp=2 x dp=2 on
shards where a third of the samples carry no image (a replica's microbatch may send its next chunk nothing), and
pp=4 with a frozen 6-block encoder split 3-1-1-1 (schedule.fill_split; three chunks run forwards only, the last
trains the projector). Per-step
losses and final parameters within 1e-4 of one process (fp32, 5 steps); the recorded timeline shows each rank
running its own encoder chunk."""

import json

import pytest

from disttrain_core.planner.proven import proven_runs
from disttrain_core.schedule.actions import Action

from .test_item_balance import skewed  # noqa: F401  (the shards fixture)
from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

FILL = ["schedule=1f1b", "schedule.fill_bubbles=true", "trainer.record_timeline=true"]
CASES = {
    "pp2_dp2": (["parallel=pp2", "trainer.devices=4"], []),
    "pp4_frozen_encoder": (
        ["parallel=pp4", "trainer.devices=4", "schedule.fill_split=[3,1,1,1]"],
        ["model.encoder.n_layers=6", "model.freeze.encoder=true"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_encoder_in_the_bubbles_trains_like_one_process(case, skewed, one_process, tmp_path):  # noqa: F811
    layout, model = CASES[case]
    run = train(skewed, tmp_path / "run", *SMALL, *model, *layout, *FILL)
    assert_same_run(run, one_process(*SMALL, *model, data=skewed))
    row = next(r for r in proven_runs() if r.test.endswith(f"[{case}]") and "test_bubble_fill" in r.test)
    assert json.loads((run / "composition.json").read_text())["key"] == row.composition  # the table's row
    timeline = json.loads(sorted((run / "timelines").glob("step_*.json"))[-1].read_text())
    ranks = 2 if case == "pp2_dp2" else 4
    placed = {(a["rank"], Action.parse(a["action"]).stage) for a in timeline["measured"]}
    assert placed == {(r, s) for r in range(ranks) for s in (r, r + ranks)}  # chunk r and LLM stage r on rank r
    kinds = {Action.parse(a["action"]).kind.value for a in timeline["measured"] if Action.parse(a["action"]).stage == 0}
    assert kinds == ({"F", "B"} if case == "pp2_dp2" else {"F"})
