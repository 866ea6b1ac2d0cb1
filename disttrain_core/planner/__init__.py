"""``parallel=auto``: the profiler, the cost and memory model, and DistTrain's orchestration solver.

    from disttrain_core.planner import make_plan
    result = make_plan(cfg)            # Plan with baselines, for cfg.cluster / cfg.model / cfg.optim
    print(plan_table(result))

See docs/PLANNER.md for the model, its assumptions and how it is checked.
"""

from __future__ import annotations

from .api import (
    PlanResult,
    build_layout_model,
    check_model_fits,
    choices_of_config,
    config_roles,
    make_plan,
    runtime_has_ep,
    smallest_gpu_cluster,
    with_measured_links,
)
from .costs import CostModel, Hardware, PlannerSettings, planned_devices, planned_precision
from .evaluate import COLOCATED, Evaluation, LayoutModel, UnitChoice
from .options import CP_MIN_TOKENS, CP_OPTIONS, LlmOption
from .solver import Orchestrator, Plan, PlanningError
from .workload import workload_of

__all__ = [
    "COLOCATED",
    "CostModel",
    "Evaluation",
    "Hardware",
    "LayoutModel",
    "LlmOption",
    "Orchestrator",
    "Plan",
    "PlanResult",
    "PlanningError",
    "UnitChoice",
    "build_layout_model",
    "check_model_fits",
    "config_roles",
    "smallest_gpu_cluster",
    "with_measured_links",
    "PlannerSettings",
    "CP_MIN_TOKENS",
    "CP_OPTIONS",
    "workload_of",
    "choices_of_config",
    "make_plan",
    "planned_devices",
    "planned_precision",
    "runtime_has_ep",
]
