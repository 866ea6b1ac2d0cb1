"""A frozen encoder unit runs forwards only (schedule/actions.py ``drop_backward``): ``parallel=disagg2`` with the
image encoder and its projector frozen trains as one process does with the same modules frozen (fp32, 5 steps,
losses and final parameters within 1e-4), the encoder's rank running no backward and receiving no gradient."""

import json

import pytest

from disttrain_core.schedule.actions import Action, Kind

from .test_units import SMALL, assert_same_run, train

pytestmark = pytest.mark.distributed

FROZEN = ["model.freeze.encoder=true", "model.freeze.encoder_projector=true"]


def test_a_frozen_encoder_unit_trains_like_one_process(shards, one_process, tmp_path):
    run = train(shards, tmp_path / "run", *SMALL, *FROZEN, "parallel=disagg2", "trainer.record_timeline=true")
    assert_same_run(run, one_process(*SMALL, *FROZEN))
    timeline = json.loads(sorted((run / "timelines").glob("step_*.json"))[-1].read_text())
    kinds = {(a["rank"], Action.parse(a["action"]).kind) for a in timeline["measured"]}
    assert {kind for row, kind in kinds if row == 0} == {Kind.F}  # the encoder's row: forwards only
    assert Kind.B in {kind for row, kind in kinds if row == 1}
