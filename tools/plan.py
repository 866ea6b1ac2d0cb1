"""Plan a training job: devices and DP/TP/PP per unit, from the cost model (docs/PLANNER.md).

    python tools/plan.py model=mllm72b cluster=h100_80g cluster.num_gpus=1172
    python tools/plan.py model=mllm72b cluster=h100_80g cluster.num_gpus=1172 format=json
    python tools/plan.py model=mllm15b cluster=a100_80g cluster.num_gpus=64 solver=exhaustive
    python tools/plan.py model=mllm_tiny trainer.devices=4          # this CPU: profiled costs
    python tools/plan.py model=mixtral_8x7b cluster=h100_80g cluster.num_gpus=256   # MoE: cp and ep too

Options: ``format=table|json``, ``solver=algorithm1|exhaustive`` (= planner.solver),
``png=<path>`` for the predicted timelines (default outputs/plan/<model>_<cluster>_<N>.png, or
``png=none``). Everything else is a config override (model, cluster, optim, planner, trainer).
GPU clusters are planned in ``bf16-mixed`` unless ``planner.precision=32``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disttrain_core.config import REPO_ROOT, compose
from disttrain_core.launch.cli import split_tool_args, tool_main


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, {"format": "table", "solver": "", "png": ""})
    if options["solver"]:
        overrides.append(f"planner.solver={options['solver']}")
    cfg = compose(overrides)
    from disttrain_core.planner import PlanningError, make_plan
    from disttrain_core.planner.report import plan_dict, plan_table, predicted_timelines

    quiet = options["format"] == "json"
    try:
        # planning only: expert parallelism is a candidate even before the runtime can run it
        result = make_plan(cfg, progress=(lambda *_: None) if quiet else print, allow_ep=True)
    except PlanningError as error:
        print(f"error: no feasible layout: {error}", file=sys.stderr)
        return 2
    png = options["png"] or str(
        REPO_ROOT / "outputs" / "plan" / f"{cfg.model.name}_{cfg.cluster.name}_{result.model.devices}.png"
    )
    picture = None if png == "none" else predicted_timelines(result, Path(png))
    if quiet:
        out = plan_dict(result)
        out["png"] = str(picture) if picture else None
        print(json.dumps(out))
    else:
        print(plan_table(result))
        if picture:
            print(f"\npredicted timelines: {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
