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


def every_option(model: str, devices: int, batch: int, pp_split=None) -> Orchestrator:
    cfg = compose([f"model={model}", "cluster=h100_80g"])
    settings = PlannerSettings(precision="bf16-mixed", recompute="auto", shard="auto", pp_split=pp_split)
    costs = CostModel(workload_of(cfg.model), Hardware.from_config(cfg.cluster, "bf16-mixed"), settings)
    return Orchestrator(LayoutModel(costs, batch, 1, devices), vpp_options=(1, 2))


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
    solver = every_option("mllm72b", devices, 1920)
    plan = solver.solve()
    assert plan.evaluation.feasible
    assert plan.candidates <= 5, plan.candidates
    assert plan.solve_seconds < 1.0, plan.solve_seconds
