"""Frozen-aware pipelines (issue 64; schedule/actions.py ``drop_backward``, parallel/plan.py
``forward_only_stages``): leading stages whose modules are all frozen run forwards only -- no backward action, no
gradient sent to them, nothing kept -- and the planner's memory model keeps no activations for a frozen encoder.
Training against one process: tests/distributed/test_frozen_stages.py."""

import pytest

from disttrain_core.config import compose
from disttrain_core.schedule.actions import Kind, drop_backward
from disttrain_core.schedule.generators import build_schedule
from disttrain_core.schedule.simulator import peak_activations, simulate
from disttrain_core.schedule.transfers import GRAD, RowRouting, plan_all
from disttrain_core.schedule.validate import validate_schedule

FROZEN = ["model.freeze.encoder=true", "model.freeze.encoder_projector=true"]


def _duration(action):
    return 1.0 if action.kind == Kind.F else 2.0


def test_a_forward_only_stage_runs_ahead_and_receives_no_gradient():
    whole = build_schedule("1f1b", 3, 6)
    frozen = drop_backward(whole, 1)
    validate_schedule(frozen)  # data flow and every rank's posts replayed under NCCL's rules
    assert [a.kind for a in frozen.compute(0)] == [Kind.F] * 6
    assert frozen.compute(1) == whole.compute(1) and frozen.compute(2) == whole.compute(2)
    gradients = [t for steps in plan_all(frozen, RowRouting(frozen)).values() for s in steps for t in s.sends]
    assert not any(t.kind == GRAD and t.stage == 0 for t in gradients)
    assert any(t.kind == GRAD and t.stage == 1 for t in gradients)
    assert peak_activations(frozen)[0] == 1  # kept only while it runs
    with pytest.raises(ValueError, match="some stage must train"):
        drop_backward(whole, 3)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_in_1f1b_it_saves_the_gradient_transfers_not_step_time(stages, microbatches):
    """With its (empty) backward kept at no cost, the whole schedule's step is as long as the forward-only one's,
    the frozen forward 1-4x a trainable stage's: the next stage cannot take the forwards faster."""
    whole = build_schedule("1f1b", stages, microbatches)
    frozen = drop_backward(whole, 1)
    for forward in (1.0, 2.0, 3.0, 4.0):

        def duration(action, forward=forward):
            if action.stage == 0:
                return forward if action.kind == Kind.F else 0.0
            return _duration(action)

        assert simulate(frozen, duration).makespan == simulate(whole, duration).makespan


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel=disagg2", *FROZEN], 1),  # the encoder's unit, encoder and projector frozen
        (["parallel=disagg2", "model.freeze.encoder=true"], 0),  # the projector trains: it needs a backward
        (["parallel=disagg4_pp2", *FROZEN], 1),
        (["parallel=pp2", "schedule=1f1b", "trainer.devices=2", *FROZEN], 0),  # folded into the LLM's first stage
        (["parallel=disagg5_audio", *FROZEN], 0),  # the audio tower beside it on the same row trains
    ],
)
def test_the_frozen_leading_rows_are_forward_only(overrides, expected):
    from disttrain_core.parallel.plan import forward_only_stages, pipeline_schedule, units_of

    model = ["model=any2any_tiny"] if "disagg5_audio" in " ".join(overrides) else []
    cfg = compose([*model, *overrides])
    layout = units_of(cfg)
    schedule = pipeline_schedule(cfg, layout, 4)
    assert forward_only_stages(cfg.model, layout, schedule) == expected
    assert schedule.forward_only == frozenset(range(expected))


def test_the_memory_model_keeps_nothing_for_a_frozen_encoder():
    from disttrain_core.planner import build_layout_model

    def model(*extra):
        cfg = compose(["model=mllm9b", "cluster=h100_80g", "parallel=disagg2", *extra])
        return build_layout_model(cfg, devices=2, progress=lambda *_: None).c

    trained, frozen = model(), model(*FROZEN)
    assert trained.activation_bytes("encoder", 1, 8.0, "none") > 0
    assert frozen.activation_bytes("encoder", 1, 8.0, "none") == 0.0
    assert frozen.recompute_transient_bytes("encoder", 1, 8.0, "full") == 0.0
    assert model("model.freeze.encoder=true").activation_bytes("encoder", 1, 8.0, "none") > 0  # projector trains
