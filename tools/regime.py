"""Where disaggregation pays: the planner's predicted speedup of its plan over the rigid Megatron layout, with the
rigid layout's predicted MFU, over a grid of models, cluster sizes and workload presets fixed before the sweep
(disttrain_core/planner/presets.py, each number with its source). Report, do not fit: no preset is tuned.

    python tools/regime.py                                  # 3 models x 5 sizes x 7 presets, ~5 minutes
    python tools/regime.py models=mllm72b gpus=1172 format=json
    python tools/regime.py presets=laion_pairs,gen_512 picture=none

Analytic H100 costs (cluster=h100_80g), each model's reference batch, Algorithm 1 against the best rigid layout
the planner finds (planner/baselines.py). The rigid layout here has no data-skew stragglers (its model does not
exist yet): the speedups are what model heterogeneity alone gives. Writes docs/results/regime.json and one heat
map per model (docs/results/regime_<model>.png); prints where the paper's figures (54.7% MFU for the plan, ~20%
for Megatron-LM, 2.2x) fall in the grid.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disttrain_core.cli import split_tool_args, tool_main
from disttrain_core.config import REPO_ROOT, compose

OPTIONS = {
    "models": "mllm9b,mllm15b,mllm72b",
    "gpus": "256,512,1172,2048,4096",
    "presets": "all",
    "format": "table",
    "picture": "png",  # png | none
    "out": str(REPO_ROOT / "docs" / "results" / "regime.json"),
}
PAPER = {"plan_mfu": 0.547, "rigid_mfu": 0.20, "speedup": 2.2}  # DistTrain, 72B on 1,172 GPUs (seed 000)


def cell(model: str, gpus: int, preset, overrides: list[str]) -> dict:
    from disttrain_core.planner import PlanningError, make_plan
    from disttrain_core.planner.report import mfu, unit_rows
    from disttrain_core.validation import ConfigError, validate_config

    cfg = compose([f"model={model}", "cluster=h100_80g", f"cluster.num_gpus={gpus}", *preset.overrides(), *overrides])
    row = {"model": model, "gpus": gpus, "preset": preset.name}
    try:
        validate_config(cfg)
    except ConfigError as error:
        return {**row, "feasible": False, "reason": str(error)}
    try:
        result = make_plan(cfg, progress=lambda *_: None)
    except PlanningError as error:
        return {**row, "feasible": False, "reason": str(error)}
    plan, lm = result.plan.evaluation, result.model
    rigid = result.plan.baselines.get("megatron")
    row.update(feasible=True, plan_mfu=mfu(lm, plan), plan_iteration_s=plan.iteration_s, plan_units=unit_rows(plan))
    if rigid is None or not rigid.evaluation.feasible:
        return {**row, "rigid_feasible": False}
    r = rigid.evaluation
    return {
        **row,
        "rigid_feasible": True,
        "rigid_mfu": mfu(lm, r),
        "rigid_iteration_s": r.iteration_s,
        "rigid_units": unit_rows(r),
        "speedup": r.iteration_s / plan.iteration_s,
    }


def where_the_paper_falls(rows: list[dict]) -> dict:
    """The grid cell nearest to each of the paper's figures, and whether any cell reaches it."""
    out = {}
    both = [r for r in rows if r.get("rigid_feasible")]
    for key, target in PAPER.items():
        pool = both if key != "plan_mfu" else [r for r in rows if r.get("feasible")]
        if not pool:
            continue
        nearest = min(pool, key=lambda r: abs(r[key] - target))
        reached = [r for r in pool if (r[key] <= target if key == "rigid_mfu" else r[key] >= target)]
        out[key] = {
            "paper": target,
            "nearest": {k: nearest[k] for k in ("model", "gpus", "preset", key)},
            "cells_reaching_it": len(reached),
        }
    return out


def draw(rows: list[dict], model: str, presets: list[str], sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.full((len(presets), len(sizes)), np.nan)
    labels = {}
    for r in rows:
        if r["model"] != model:
            continue
        i, j = presets.index(r["preset"]), sizes.index(r["gpus"])
        if r.get("rigid_feasible"):
            grid[i, j] = r["speedup"]
            labels[i, j] = f"{r['speedup']:.2f}x\nrigid {r['rigid_mfu']:.0%}"
        else:
            labels[i, j] = "plan only" if r.get("feasible") else "infeasible"
    top = max(1.5, float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.5)
    fig, ax = plt.subplots(figsize=(1.1 * len(sizes) + 3.2, 0.55 * len(presets) + 1.4))
    image = ax.imshow(grid, cmap="viridis", vmin=1.0, vmax=top, aspect="auto")
    for (i, j), text in labels.items():
        dark = not np.isfinite(grid[i, j]) or grid[i, j] < 1.0 + 0.6 * (top - 1.0)
        ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_yticks(range(len(presets)), presets)
    ax.set_xlabel("GPUs (H100, analytic costs)")
    ax.set_title(f"{model}: plan over rigid layout (predicted speedup; rigid MFU)", fontsize=9)
    fig.colorbar(image, ax=ax, label="speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    from disttrain_core.planner.presets import PRESETS

    options, overrides = split_tool_args(argv, OPTIONS)
    names = list(PRESETS) if options["presets"] == "all" else options["presets"].split(",")
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        print(f"presets={unknown[0]!r} is unknown; available: {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    models = options["models"].split(",")
    sizes = [int(g) for g in options["gpus"].split(",")]
    rows, total = [], len(models) * len(sizes) * len(names)
    for model in models:
        for name in names:
            for gpus in sizes:
                row = cell(model, gpus, PRESETS[name], overrides)
                rows.append(row)
                if options["format"] != "json":
                    speed = (
                        f"{row['speedup']:.2f}x, rigid MFU {row['rigid_mfu']:.1%}" if row.get("rigid_feasible") else ""
                    )
                    plan = f"plan MFU {row['plan_mfu']:.1%}" if row.get("feasible") else "infeasible"
                    print(f"[{len(rows)}/{total}] {model} {name:17s} {gpus:5d} GPUs: {plan} {speed}", flush=True)
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "cluster": "h100_80g",
        "overrides": overrides,
        "presets": {n: {**PRESETS[n].__dict__, "overrides": PRESETS[n].overrides()} for n in names},
        "rows": rows,
        "paper": where_the_paper_falls(rows),
    }
    if options["picture"] != "none":
        result["pictures"] = []
        for model in models:
            path = out.parent / f"regime_{model}.png"
            draw(rows, model, names, sizes, path)
            result["pictures"].append(str(path))
    out.write_text(json.dumps(result, indent=1))
    if options["format"] == "json":
        print(json.dumps(result))
    else:
        for key, found in result["paper"].items():
            print(
                f"paper {key} {found['paper']}: nearest {found['nearest']}, "
                f"{found['cells_reaching_it']} cell(s) reach it"
            )
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
