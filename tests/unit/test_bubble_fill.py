"""Bubble filling (issue 64; schedule/bubble_fill.py, parallel/bubble_plan.py): the colocated image encoder cut
into one chunk per pipeline rank, its forwards and backwards list-scheduled into the LLM schedule's bubbles.
The simulator's step against the colocated schedule (the whole encoder on the first stage), the replay under
NCCL's rules, the memory cap, and the refusals. Training against one process:
tests/distributed/test_bubble_fill.py."""

import pytest

from disttrain_core.config import compose, typed_config
from disttrain_core.schedule.actions import Action, Kind
from disttrain_core.schedule.bubble_fill import StageDurations, fill_bubbles
from disttrain_core.schedule.generators import build_schedule
from disttrain_core.schedule.simulator import ScheduleError, peak_activations, simulate
from disttrain_core.schedule.transfers import GRAD, RowRouting, plan_all
from disttrain_core.schedule.validate import validate_schedule


def _colocated(ranks: int, encoder: float) -> StageDurations:
    """One LLM stage costs 1 forward, 2 backward; the first also runs the whole encoder (``encoder`` forward)."""
    return StageDurations([1.0 + encoder] + [1.0] * (ranks - 1), [2.0 * (1.0 + encoder)] + [2.0] * (ranks - 1))


def _filled(ranks: int, encoder: float) -> StageDurations:
    return StageDurations([encoder / ranks] * ranks + [1.0] * ranks, [2 * encoder / ranks] * ranks + [2.0] * ranks)


# (ranks, microbatches, encoder forward in LLM-stage forwards): colocated 1F1B step, filled step, and 1F1B over
# stages with the encoder's work spread perfectly evenly (the best a rigid split of blocks could do)
CASES = [(2, 8, 1.0, 49.0, 39.0, 40.5), (4, 8, 1.0, 51.0, 39.0, 41.25), (4, 16, 2.0, 144.0, 81.0, 85.5)]


@pytest.mark.parametrize("ranks, m, encoder, colocated, filled, even", CASES)
def test_the_encoder_in_the_bubbles_shortens_the_step(ranks, m, encoder, colocated, filled, even):
    base = build_schedule("1f1b", ranks, m)
    assert simulate(base, _colocated(ranks, encoder)).makespan == pytest.approx(colocated)
    schedule = fill_bubbles(base, _filled(ranks, encoder))
    validate_schedule(schedule)  # the data flow, and every rank's posts replayed under NCCL's rules
    assert simulate(schedule, _filled(ranks, encoder)).makespan == pytest.approx(filled)
    assert (m + ranks - 1) * 3 * (1.0 + encoder / ranks) == pytest.approx(even)
    assert filled < even < colocated  # beyond balancing: the fill and drain ramps carry encoder work
    assert schedule.stage_to_rank == list(range(ranks)) * 2
    for rank in range(ranks):  # the base order of the LLM's actions is kept; every encoder action is placed once
        llm = [Action(a.stage - ranks, a.kind, a.microbatch) for a in schedule.compute(rank) if a.stage >= ranks]
        assert llm == base.compute(rank)
        encoder_actions = sorted(a for a in schedule.compute(rank) if a.stage < ranks)
        assert encoder_actions == sorted(Action(rank, kind, k) for kind in (Kind.F, Kind.B) for k in range(m))


def test_encoder_activations_stay_within_the_colocated_first_rank_bytes():
    """At most P x (the base schedule's first-rank peak) chunks of 1/P of the encoder in flight on any rank."""
    ranks, m = 4, 16
    base = build_schedule("1f1b", ranks, m)
    schedule = fill_bubbles(base, _filled(ranks, 2.0))
    cap = ranks * peak_activations(base)[0]
    for rank in range(ranks):
        held = peak = 0
        for action in schedule.compute(rank):
            if action.stage < ranks:
                held += 1 if action.kind == Kind.F else -1
                peak = max(peak, held)
        assert 0 < peak <= cap


def test_a_frozen_encoder_runs_forwards_only_and_receives_no_gradient():
    ranks = 2
    schedule = fill_bubbles(build_schedule("1f1b", ranks, 4), _filled(ranks, 1.0), forward_only=ranks)
    validate_schedule(schedule)
    assert {a.kind for r in range(ranks) for a in schedule.compute(r) if a.stage < ranks} == {Kind.F}
    gradients = [t for steps in plan_all(schedule, RowRouting(schedule)).values() for s in steps for t in s.sends]
    assert not any(t.kind == GRAD and t.stage < ranks for t in gradients)


def test_the_run_config_builds_the_filled_schedule_from_flops():
    from disttrain_core.parallel.bubble_plan import stage_durations
    from disttrain_core.parallel.plan import pipeline_schedule, units_of

    cfg = typed_config(compose(["parallel=pp2", "trainer.devices=2", "schedule=1f1b", "schedule.fill_bubbles=true"]))
    schedule = pipeline_schedule(cfg, units_of(cfg), 4)
    assert schedule.meta["encoder_stages"] == 2 and schedule.name == "1f1b+fill"
    durations = stage_durations(cfg, 2)
    assert durations.forward[0] == durations.forward[1] > 0  # the encoder's blocks split evenly
    assert durations.backward[3] > durations.backward[2]  # the generator rides on the LLM's last stage


@pytest.mark.parametrize("name", ["zb_h2", "zbv", "interleaved_1f1b"])
def test_schedules_without_bubbles_to_fill_are_refused(name):
    base = build_schedule(name, 2, 4, 2 if name != "zb_h2" else 1)
    with pytest.raises(ScheduleError, match="bubble filling starts from gpipe or 1f1b"):
        fill_bubbles(base, _filled(2, 1.0))


BAD = [
    (["parallel=pp2", "schedule=zb_h1"], "schedule=zb_h1 has no bubbles to fill this way (a zero-bubble schedule)"),
    (["parallel=pp2", "parallel.pp=1"], "a pipeline of one stage (pp=1) has no bubbles to fill"),
    (["model=llama_tiny", "parallel=pp2"], "model llama_tiny has no image encoder"),
    (["parallel=megatron_pp2", "trainer.devices=4"], "the layout has units encoder, llm, generator"),
    (["parallel=pp2", "parallel.rebalance_items=true", "trainer.devices=4"], "set one of them false"),
    (["parallel=pp4", "trainer.devices=4"], "builds 2 blocks, which do not split evenly into pp=4 chunks"),
    (["parallel=pp2", "schedule.fill_split=[2,1]"], "adding up to the image encoder's 2 blocks"),
    (["parallel=pp2", "schedule.fill_split=even"], "schedule.fill_split='even': use auto, null"),
    (["parallel=auto"], "with parallel.mode=auto: bubble filling is built for a configured colocated layout"),
    (["parallel=pp2", "optim.global_batch_size=65536", "optim.micro_batch_size=1"], "(at most 8192)"),
]


IDS = ["zb_h1", "pp1", "no_encoder", "separate", "rebalance", "pp4", "split_sum", "split_word", "auto", "slots"]


@pytest.mark.parametrize("overrides, message", BAD, ids=IDS)
def test_bad_bubble_filling_is_one_line(overrides, message):
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    cfg = compose(["trainer.devices=2", "schedule=1f1b", *overrides, "schedule.fill_bubbles=true"])
    with pytest.raises(ConfigError) as error:
        validate_run(typed_config(cfg))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_planner_prices_the_fill_by_the_simulators_ratio():
    """planner/schedule_choice.py ``filled_pipeline_s``: the planner's 1F1B time of the colocated stages, scaled by the
    simulator's filled / colocated steps (the first CASES row: 39 / 49)."""
    from disttrain_core.planner.schedule_choice import filled_pipeline_s, pipeline_s

    stages = [("llm", 6.0), ("llm", 3.0)]  # forward + backward: the whole encoder (3) and an LLM stage (3) on stage 0
    assert pipeline_s("1f1b", stages, 1, 8) == pytest.approx(51.0)  # fill 9 + 7 x the slowest 6
    assert filled_pipeline_s("1f1b", stages, 3.0, 8) == pytest.approx(51.0 * 39.0 / 49.0)


HEAVY = ["model.encoder.dim=256", "model.encoder.n_layers=16", "model.encoder.mlp_dim=1024", "model.encoder.n_heads=8"]


@pytest.mark.parametrize(
    "layout, model, effect",
    [("pp2", HEAVY, "faster"), ("pp2", [], "slower"), ("megatron_pp2", HEAVY, "same")],
    ids=["heavy_encoder", "light_encoder", "separate_unit"],
)
def test_a_configured_layout_is_priced_with_its_fill(layout, model, effect):
    """The planner's evaluation of a configured layout (what bench_layouts predicts with) prices the fill where the
    runtime runs one: with bench_layouts' encoder-heavy ViT it is faster; with mllm_tiny's light one, the even split
    moves half the encoder onto the last stage, already the heavier, and costs a little; a separate encoder unit is
    priced as before."""
    from disttrain_core.planner import build_layout_model, choices_of_config

    def step(*extra):
        overrides = [f"parallel={layout}", "schedule=1f1b", "optim.global_batch_size=16", "optim.micro_batch_size=2"]
        overrides += ["planner.cost=analytic", "cluster.peak_flops_fp32=1e11", "cluster.peak_flops_bf16=4e11"]
        cfg = compose([*overrides, f"trainer.devices={2 if layout == 'pp2' else 4}", *model, *extra])
        planned = build_layout_model(cfg, devices=cfg.trainer.devices, progress=lambda *_: None)
        return planned.evaluate(*choices_of_config(cfg)).iteration_s

    plain, fill = step(), step("schedule.fill_bubbles=true")
    assert {"faster": fill < plain, "slower": fill > plain, "same": fill == plain}[effect], (plain, fill)


def test_a_split_without_filling_is_refused():
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    cfg = compose(["trainer.devices=2", "parallel=pp2", "schedule=1f1b", "schedule.fill_split=[1,1]"])
    with pytest.raises(ConfigError, match="which is off; set schedule.fill_bubbles=true"):
        validate_run(typed_config(cfg))


def test_blocks_go_to_the_lightest_rank_and_auto_balances_by_flops():
    from disttrain_core.parallel.bubble_plan import encoder_split
    from disttrain_core.schedule.bubble_fill import balance_blocks

    assert balance_blocks([0.0, 3.0], 1.0, 8) == (6, 2)  # loads 6 and 5 after the last block
    assert balance_blocks([2.0, 0.0, 0.0], 1.0, 4) == (1, 2, 1)  # ties to the lower rank
    base = ["parallel=pp2", "trainer.devices=2", "schedule=1f1b", "schedule.fill_bubbles=true"]
    cfg = typed_config(compose([*base, "model.encoder.n_layers=8", "schedule.fill_split=auto"]))
    auto = encoder_split(cfg, 2)
    assert sum(auto) == 8 and auto[0] >= auto[1]  # the LLM's last stage also runs the generator
    given = typed_config(compose([*base, "model.encoder.n_layers=8", "schedule.fill_split=[5,3]"]))
    assert encoder_split(given, 2) == (5, 3)


def test_the_rehearsal_counts_each_ranks_chunk():
    """planner/rehearsal.py builds each rank's encoder chunk and LLM stage as the runtime does: the model state
    moves between ranks (the encoder's blocks 3-1 instead of all on the first), the total stays the same."""
    import torch

    from disttrain_core.parallel.plan import units_of
    from disttrain_core.planner.rehearsal import count_role

    def params(*extra):
        cfg = typed_config(
            compose(["parallel=pp2", "trainer.devices=2", "schedule=1f1b", "model.encoder.n_layers=4", *extra])
        )
        return [count_role(cfg, units_of(cfg).llm, rank, torch.float32)["params"] for rank in range(2)]

    folded, filled = params(), params("schedule.fill_bubbles=true", "schedule.fill_split=[3,1]")
    assert sum(filled) == pytest.approx(sum(folded))
    assert filled[0] < folded[0] and filled[1] > folded[1]


@pytest.mark.parametrize("p2p", [0.0, 0.1])
def test_the_list_schedulers_step_is_the_simulators(p2p):
    """fill_bubbles ranks its policies by the list scheduler's own finish time, which must be what the simulator
    gives the order it produced (each action at the earliest its rank and inputs allow)."""
    from disttrain_core.schedule.bubble_fill import FillPolicy, _list_fill

    for ranks, m, encoder in CASES_SHAPES:
        base, durations = build_schedule("1f1b", ranks, m), _filled(ranks, encoder)
        for lead in (0, 1, 2):
            for eager in (False, True):
                schedule, step = _list_fill(base, durations, p2p, 0, FillPolicy(lead, eager))
                assert step == pytest.approx(simulate(schedule, durations, p2p).makespan)


CASES_SHAPES = [(2, 4, 0.5), (3, 6, 1.0), (4, 8, 3.0)]
