"""The planner's choice among pipeline schedules (planner.schedules; planner/schedule_choice.py): its time and
memory per schedule against the simulator, and what it may pick."""

import dataclasses
import math

import pytest

from disttrain_core.config import compose
from disttrain_core.planner.breakdown import in_flight
from disttrain_core.planner.evaluate import COLOCATED, UnitChoice
from disttrain_core.planner.memory import FSDP, split_shard
from disttrain_core.planner.schedule_choice import BUBBLE_SHARE, candidates, pipeline_s, splits_backward
from disttrain_core.schedule.generators import PLANNABLE, V_SHAPED, build_schedule, stages_per_rank
from disttrain_core.schedule.simulator import Durations, simulate

SIZES = [(S, m) for S in (2, 4, 6, 8) for m in (2 * S, 4 * S)]


def simulated(name: str, stages: int, m: int) -> float:
    """The simulator's step on a uniform pipeline: 1 s per microbatch and stage, t_F = t_I = t_W."""
    v = stages_per_rank(name, 2)
    chunk = 1.0 / (3 * v)
    return simulate(build_schedule(name, stages, m, v), Durations(chunk, 2 * chunk, chunk, chunk)).makespan


@pytest.mark.parametrize("S, m", SIZES)
def test_pipeline_time_against_the_simulator(S, m):
    """1F1B, ZB-H1, ZB-H2 and DualPipeV exactly; ZBV's greedy order within a tenth of a stage per stage (its
    bubble share, 1/6 to 0.27, charged 1/4); interleaved (and breadth-first)
    1F1B's fill, the planner's since before these schedules, optimistic by at most (1 - 1/v) of a stage."""
    uniform = [("llm", 1.0)] * S
    for name in ("1f1b", "zb_h1", "zb_h2", "dualpipev"):
        assert pipeline_s(name, uniform, stages_per_rank(name, 1), m) == pytest.approx(simulated(name, S, m)), name
    assert pipeline_s("zbv", uniform, 2, m) == pytest.approx(simulated("zbv", S, m), abs=(S - 1) / 10)
    for name in ("interleaved_1f1b", "breadth_first"):
        if name == "interleaved_1f1b" and m % S:
            continue
        gap = simulated(name, S, m) - pipeline_s(name, uniform, 2, m)
        assert -1e-9 <= gap <= 0.5 + 1e-9, (name, gap)


@pytest.mark.parametrize("S, m", SIZES)
def test_activations_in_flight_are_the_simulators_peaks(S, m):
    """In whole-rank shares (a rank's chunks of one microbatch count one), the first rank's peak."""
    for name in ("gpipe", "1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev", "breadth_first"):
        vpp = stages_per_rank(name, 2)
        peak = max(simulate(build_schedule(name, S, m, vpp), lambda a: 1.0).peak_activations)
        assert in_flight(name, S, 0, m, vpp) == math.ceil(peak / vpp), name


def test_candidates_follow_what_each_schedule_needs():
    allowed = PLANNABLE
    assert candidates(allowed, 1, False, 4, 6) == ["1f1b", "zb_h1"]  # zb_h2 needs 2 x 4 - 1 = 7 microbatches
    assert candidates(allowed, 1, True, 4, 7) == ["1f1b", "zb_h1", "zb_h2"]
    assert candidates(allowed, 2, False, 4, 8) == ["interleaved_1f1b"]  # across units: the loop alone
    assert candidates(allowed, 2, True, 4, 7) == ["interleaved_1f1b", "breadth_first", "zbv"]  # dualpipev: 8
    assert candidates(allowed, 3, True, 4, 8) == ["interleaved_1f1b", "breadth_first"]
    assert candidates(("1f1b",), 2, True, 4, 8) == []


def planner_model(schedules):
    from disttrain_core.planner.api import build_layout_model

    cfg = compose(["model=mllm9b", "cluster=h100_80g", "cluster.num_gpus=32", f"planner.schedules=[{schedules}]"])
    return build_layout_model(cfg, progress=lambda *_: None)


def test_each_layout_runs_the_fastest_schedule_that_fits_and_only_what_the_runtime_runs():
    """mllm9b's LLM on 32 H100s at pp 2 and 4, one and two stages per rank, alone and beside a separate image
    encoder: the planner's pick is the fastest feasible of the schedules evaluated one by one; a split backward
    never under zero2/zero3, a V or breadth-first only in a pipeline of the LLM alone."""
    model = planner_model(",".join(PLANNABLE))
    picked = set()
    for pp in (2, 4):
        for vpp in (1, 2):
            for encoder in (COLOCATED, UnitChoice(dp=2, tp=1, pp=1)):
                llm = UnitChoice(dp=2, tp=2, pp=pp, vpp=vpp)
                best = model.evaluate(llm, encoder, COLOCATED)
                alone = {}
                for name in PLANNABLE:
                    model.c.settings = dataclasses.replace(model.c.settings, schedules=(name,))
                    found = model.evaluate(llm, encoder, COLOCATED)
                    if found.schedule == name and not found.reason.startswith("no schedule"):
                        alone[name] = found
                model.c.settings = dataclasses.replace(model.c.settings, schedules=PLANNABLE)
                feasible = {name: e.iteration_s for name, e in alone.items() if e.feasible}
                assert best.feasible and best.schedule == min(feasible, key=feasible.get)
                picked.add(best.schedule)
                for name, e in alone.items():
                    assert not splits_backward(name) or split_shard(e.shard["llm"])[0] not in FSDP, (name, e.shard)
                    assert encoder.colocated or name not in (*V_SHAPED, "breadth_first"), name
    assert picked & set(BUBBLE_SHARE), picked  # the zero-bubble ones win somewhere here


def test_default_settings_plan_what_they_planned_before():
    """planner.schedules defaults to 1F1B and interleaved 1F1B: the choice the plans made when vpp decided it."""
    model = planner_model("1f1b,interleaved_1f1b")
    for vpp in (1, 2):
        e = model.evaluate(UnitChoice(dp=2, tp=2, pp=4, vpp=vpp), COLOCATED, COLOCATED)
        assert e.schedule == ("interleaved_1f1b" if vpp > 1 else "1f1b")


@pytest.mark.parametrize(
    "schedules, message",
    [
        ("pipedream", "planner.schedules=['pipedream']: pipedream cannot be planned; choose among 1f1b"),
        ("gpipe,1f1b", "gpipe cannot be planned"),
    ],
)
def test_bad_planner_schedules_are_one_line(schedules, message):
    from disttrain_core.validation import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
        validate_config(compose(["parallel=auto", f"planner.schedules=[{schedules}]"]))


def test_a_plan_with_a_zero_bubble_schedule_runs_as_planned(monkeypatch):
    """mllm9b on 64 H100s at global batch 128 (16 microbatches per replica: the bubble matters): the default
    schedules plan interleaved 1F1B; offered every schedule, the planner picks a zero-bubble one and predicts a
    shorter step; the planned config validates and its ranks rehearse at the planned model state."""
    from omegaconf import OmegaConf

    from disttrain_core.config import typed_config
    from disttrain_core.planner import make_plan
    from disttrain_core.planner.auto import planned_container
    from disttrain_core.planner.rehearsal import rehearse
    from disttrain_core.validation import validate_config

    base = ["model=mllm9b", "parallel=auto", "cluster=h100_80g", "cluster.num_gpus=64"]
    base += ["optim.global_batch_size=128", "planner.baselines=false"]
    default = make_plan(compose(base), progress=lambda *_: None).plan.evaluation
    cfg = compose([*base, f"planner.schedules=[{','.join(PLANNABLE)}]"])
    result = make_plan(cfg, progress=lambda *_: None)
    chosen = result.plan.evaluation
    assert default.schedule == "interleaved_1f1b" and chosen.schedule in BUBBLE_SHARE, chosen.schedule
    assert chosen.iteration_s < default.iteration_s
    container = planned_container(cfg, OmegaConf.to_container(cfg), result)
    container["trainer"].update(devices=8, num_nodes=8)  # as train.py launches it: 8 nodes of 8 (planner/auto.py)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("NODE_RANK", "0")):
        monkeypatch.setenv(name, value)  # what every node's launcher sets
    planned = typed_config(container)
    assert planned.schedule.name == chosen.schedule
    validate_config(planned)
    roles = rehearse(planned, progress=lambda *_: None)["roles"]
    assert roles and all(r["ratio"] == pytest.approx(1.0, abs=0.001) for r in roles)
