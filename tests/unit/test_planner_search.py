"""Algorithm 1's search with every option on (recompute and shard modes per unit, virtual stages, balanced uneven
stages): equal to exhaustive search on small clusters, and under a second at the paper's scale.

The search is best first over bounds (planner/solver.py): an LLM option's bound, a combination's cheap bound, then
its refined one (the LLM's exact recompute policy, shard mode and stage times at each pipeline size). Each bound
must stay below every layout it stands for, or the search skips the best; the exhaustive comparisons here are
what would catch a bound that does not.
"""

import pytest

from disttrain_core.config import compose
from disttrain_core.planner import CostModel, Hardware, LayoutModel, Orchestrator, PlanningError, workload_of
from disttrain_core.planner.baselines import exhaustive
from disttrain_core.planner.costs import PlannerSettings

AUDIO = ["model/audio_encoder=whisper_large_v3", "model/audio_generator=audioldm_l", "model.nominal_clips_per_sample=1"]


def every_option(model: str, devices: int, batch: int, pp_split=None, extra=()) -> Orchestrator:
    cfg = compose([f"model={model}", "cluster=h100_80g", *extra])
    settings = PlannerSettings(precision="bf16-mixed", recompute="auto", shard="auto", pp_split=pp_split)
    costs = CostModel(workload_of(cfg.model), Hardware.from_config(cfg.cluster, "bf16-mixed"), settings)
    return Orchestrator(LayoutModel(costs, batch, 1, devices), vpp_options=(1, 2))


def fastest_of_two(make_solver):
    """The faster of two solves, each by a solver with fresh caches (its own cost model): the suite's other workers
    share this machine's two cores, and one solve can be slowed several times over by them."""
    plans = [make_solver().solve() for _ in range(2)]
    assert plans[0].evaluation.iteration_s == plans[1].evaluation.iteration_s
    return min(plans, key=lambda plan: plan.solve_seconds)


@pytest.mark.parametrize("pp_split", [None, "auto"])
def test_with_every_option_algorithm1_equals_exhaustive_search(pp_split):
    """mllm9b on 16..64 H100s: the plan is as fast as the best of every integer layout (0.1%). With
    ``pp_split=auto`` the colocated modules' time spreads over the stages; a bound that kept it on one stage
    missed the best layout at 48 and 64 devices."""
    checked = 0
    # pp_split=auto balances every layout's stages (slow to search exhaustively): the two instances it failed on
    cases = [(d, b) for d in (16, 48, 64) for b in (32, 96)] if pp_split is None else [(48, 96), (64, 32)]
    for devices, batch in cases:
        solver = every_option("mllm9b", devices, batch, pp_split)
        try:
            exact = exhaustive(solver).evaluation
        except PlanningError:
            continue
        found = solver.solve().evaluation
        assert found.iteration_s <= exact.iteration_s * 1.001, (devices, batch, found.choices, exact.choices)
        checked += 1
    assert checked >= min(4, len(cases))


@pytest.mark.parametrize("devices", [1172, 4096])
def test_the_72b_plan_solves_in_under_a_second(devices):
    """The issue's figure: ``tools/plan.py model=mllm72b cluster=h100_80g cluster.num_gpus=1172`` (and 4096) with
    every option in the search, 3.0 s and 2.2 s before the refined bounds. The refined bounds leave one convex
    problem to solve; the rest of the time is bounding."""
    plan = fastest_of_two(lambda: every_option("mllm72b", devices, 1920))
    assert plan.evaluation.feasible
    assert plan.candidates <= 5, plan.candidates
    assert plan.solve_seconds < 1.0, plan.solve_seconds


def test_two_encoders_and_two_generators_equal_exhaustive_search():
    """mllm9b with Whisper large-v3's encoder and AudioLDM-L beside its ViT and U-Net (one clip a sample): every
    module riding in the LLM unit or a unit of its own, the separate audio units sized by the relaxation. On 16,
    24 and 48 H100s the plan is the best of every integer layout and placement; at 24 and 48 it puts both audio
    units on devices of their own."""
    separate = 0
    for devices in (16, 24, 48):
        solver = every_option("mllm9b", devices, 32, extra=AUDIO)
        exact = exhaustive(solver).evaluation
        found = solver.solve().evaluation
        assert found.iteration_s <= exact.iteration_s * 1.001, (devices, found.choices, exact.choices)
        separate += not found.choices["audio_encoder"].colocated and not found.choices["audio_generator"].colocated
    assert separate >= 2


def test_the_72b_plan_with_two_encoders_and_two_generators_solves_in_under_two_seconds():
    """The issue's figure for a model with two encoders and two generators: mllm72b with Whisper large-v3 and
    AudioLDM-L at 1,172 H100s, every option on, each audio module riding or a unit of its own."""
    plan = fastest_of_two(lambda: every_option("mllm72b", 1172, 1920, extra=AUDIO))
    assert plan.evaluation.feasible and {"audio_encoder", "audio_generator"} <= set(plan.evaluation.choices)
    assert plan.solve_seconds < 2.0, plan.solve_seconds


def test_three_encoders_and_two_generators_equal_exhaustive_search():
    """The same with a ViT-L/14 video tower as well (four frame groups a sample): three encoders, each riding in the
    LLM's first stage or a unit of its own side by side. On 16 and 24 H100s the plan is the best of every integer
    layout and placement; at 24 every encoder and generator is a unit of its own."""
    video = [*AUDIO, "model/video_encoder=vit_l14_video", "model.nominal_video_groups_per_sample=4"]
    for devices in (16, 24):
        solver = every_option("mllm9b", devices, 32, extra=video)
        exact = exhaustive(solver).evaluation
        found = solver.solve().evaluation
        assert found.iteration_s <= exact.iteration_s * 1.001, (devices, found.choices, exact.choices)
    assert not any(ch.colocated for ch in found.choices.values())
    assert set(found.choices) == {"llm", "encoder", "audio_encoder", "video_encoder", "generator", "audio_generator"}
