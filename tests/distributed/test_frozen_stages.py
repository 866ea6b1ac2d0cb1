"""A frozen encoder unit runs forwards only (schedule/actions.py ``drop_backward``): ``parallel=disagg2`` with the
image encoder and its projector frozen trains as one process does with the same modules frozen (fp32, 5 steps,
losses and final parameters within 1e-4), the encoder's rank running no backward and receiving no gradient, with
an empty optimizer (issue 36); the frozen weights end as they were initialized, the LLM learns."""

import json

import pytest
import torch

from disttrain_core.schedule.actions import Action, Kind

from .test_units import SMALL, assert_same_run, parameters, train

pytestmark = pytest.mark.distributed

FROZEN = ["model.freeze.encoder=true", "model.freeze.encoder_projector=true"]


def test_a_frozen_encoder_unit_trains_like_one_process(shards, one_process, tmp_path):
    run = train(shards, tmp_path / "run", *SMALL, *FROZEN, "parallel=disagg2", "trainer.record_timeline=true")
    assert_same_run(run, one_process(*SMALL, *FROZEN))
    timeline = json.loads(sorted((run / "timelines").glob("step_*.json"))[-1].read_text())
    kinds = {(a["rank"], Action.parse(a["action"]).kind) for a in timeline["measured"]}
    assert {kind for row, kind in kinds if row == 0} == {Kind.F}  # the encoder's row: forwards only
    assert Kind.B in {kind for row, kind in kinds if row == 1}
    from disttrain_core.config import compose
    from disttrain_core.data.tokenizer import build_tokenizer
    from disttrain_core.models import build_model, materialize

    cfg = compose(["parallel=disagg2"])
    model = build_model(cfg.model, build_tokenizer(cfg.data.tokenizer), device="meta")
    materialize(model, "cpu", seed=cfg.trainer.seed, std=cfg.model.init_std)
    initial = dict(model.named_parameters())
    trained = parameters(run)
    encoder = [k for k in trained if k.startswith(("encoder.", "encoder_projector."))]
    assert encoder and all(torch.equal(trained[k], initial[k]) for k in encoder)
    assert not torch.equal(trained["llm.output.weight"], initial["llm.output.weight"])
