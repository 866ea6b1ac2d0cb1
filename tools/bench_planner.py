"""The orchestration solver at scale: solve time, and predicted speedup over the baselines.

For each model and cluster size it solves Algorithm 1 (analytic H100 costs, the model's
reference batch), evaluates the Megatron rigid layout and the FLOPs-proportional allocation
with the same model, and records predicted iteration time, MFU and solve time. The
exhaustive search runs alongside on the small clusters to show the gap (0 expected).

    python tools/bench_planner.py                           # ~1 minute
    python tools/bench_planner.py cluster=a100_80g format=json

Output: docs/results/bench_planner.json (summarized in docs/performance/planner.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from disttrain_core.config import REPO_ROOT, compose
from disttrain_core.launch.cli import split_tool_args, tool_main

OPTIONS = {
    "models": "mllm9b,mllm15b,mllm72b",
    "gpus": "64,256,1172,4096",
    "exhaustive_up_to": "64",
    "format": "table",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_planner.json"),
}


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, OPTIONS)
    from disttrain_core.planner import PlanningError, make_plan
    from disttrain_core.planner.report import mfu, unit_rows

    rows = []
    for model in options["models"].split(","):
        for gpus in (int(g) for g in options["gpus"].split(",")):
            cfg = compose([f"model={model}", "cluster=h100_80g", f"cluster.num_gpus={gpus}", *overrides])
            try:
                result = make_plan(cfg, progress=lambda *_: None)
            except PlanningError as error:
                rows.append({"model": model, "gpus": gpus, "feasible": False, "reason": str(error)})
                continue
            plan, lm = result.plan, result.model
            e = plan.evaluation
            row = {
                "model": model,
                "gpus": gpus,
                "feasible": True,
                "units": unit_rows(e),
                "predicted_iteration_s": e.iteration_s,
                "mfu": mfu(lm, e),
                "solve_seconds": plan.solve_seconds,
                "convex_problems_solved": plan.candidates,
                "baselines": {
                    name: {
                        "predicted_iteration_s": b.evaluation.iteration_s,
                        "mfu": mfu(lm, b.evaluation),
                        "speedup_of_plan": b.evaluation.iteration_s / e.iteration_s,
                        "units": unit_rows(b.evaluation),
                    }
                    for name, b in plan.baselines.items()
                },
            }
            if gpus <= int(options["exhaustive_up_to"]):
                from disttrain_core.planner import Orchestrator
                from disttrain_core.planner.baselines import exhaustive

                started = time.perf_counter()
                exact = exhaustive(Orchestrator(lm, tuple(cfg.planner.tp_options), tuple(cfg.planner.vpp_options)))
                row["exhaustive_seconds"] = time.perf_counter() - started
                row["gap_to_exhaustive"] = e.iteration_s / exact.evaluation.iteration_s - 1
            rows.append(row)
            if options["format"] != "json":
                base = row["baselines"]
                vs = "  ".join(f"{n} {b['speedup_of_plan']:.2f}x" for n, b in base.items())
                print(
                    f"{model:8s} {gpus:5d} GPUs: {e.iteration_s:7.2f} s/iter  MFU {row['mfu']:5.1%}  "
                    f"solve {plan.solve_seconds * 1e3:6.0f} ms  speedup over {vs}",
                    flush=True,
                )
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cluster": "h100_80g", "overrides": overrides, "rows": rows}, indent=1))
    if options["format"] == "json":
        print(json.dumps(rows))
    else:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
