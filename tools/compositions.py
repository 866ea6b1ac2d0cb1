"""Every composition the planner's plans and the GPU recipes use, and which facts of them no proven run trains.

    python tools/compositions.py                 # the grid of tools/regime.py and tools/bench_planner.py + recipes
    python tools/compositions.py format=json out=compositions.json

A plan is made as ``parallel=auto`` makes it (planner/auto.py ``planned_container``), validated as the launch
validates it except the pipeline schedule's replay (seconds for a plan of a thousand GPUs), and its composition
read by parallel/composition.py. Baselines are off: only the chosen plan is run. The GPU recipes are resolved
without validation (their data is not here; tests/recipes/test_gpu_recipes.py validates each). Each composition's
facts are then looked up among those of the runs in conf/proven_compositions.yaml (planner/proven.py).
tests/unit/test_compositions.py runs the same instances in ``make test`` and fails on the first unproven fact.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from disttrain_core.config import compose
from disttrain_core.launch.cli import split_tool_args, tool_main

OPTIONS = {"format": "table", "out": ""}
# tools/regime.py's grid (models x GPU counts x workload presets) and tools/bench_planner.py's instances: the
# same defaults as those tools, read from them where they run as tools
REGIME = {"models": ("mllm9b", "mllm15b", "mllm72b"), "gpus": (256, 512, 1172, 2048, 4096)}
BENCH_PLANNER = {"models": ("mllm9b", "mllm15b", "mllm72b"), "gpus": (64, 256, 1172, 4096)}
# what those plans run on: H100s, bf16-mixed (conf/trainer/gpu.yaml); planned here, trained there
GPU = ["cluster=h100_80g", "trainer=gpu", "trainer.dry_run=true"]


@dataclass
class Found:
    """A composition and the instances that use it."""

    composition: object
    instances: list[str] = field(default_factory=list)


def grid_instances() -> list[tuple[str, list[str]]]:
    """(name, overrides) of the planner's instances: the regime grid and the planner benchmark's."""
    from disttrain_core.planner.presets import PRESETS

    out = []
    for model in REGIME["models"]:
        for name, preset in PRESETS.items():
            for gpus in REGIME["gpus"]:
                overrides = [f"model={model}", *GPU, f"cluster.num_gpus={gpus}", *preset.overrides()]
                out.append((f"regime {model} {name} {gpus}", ["parallel=auto", *overrides]))
    for model in BENCH_PLANNER["models"]:
        for gpus in BENCH_PLANNER["gpus"]:
            overrides = [f"model={model}", *GPU, f"cluster.num_gpus={gpus}", "parallel=auto"]
            out.append((f"bench_planner {model} {gpus}", overrides))
    return out


def recipe_instances() -> list[tuple[str, list[str]]]:
    """(name, overrides) of every GPU recipe (recipes/*.yaml tagged gpu)."""
    from omegaconf import OmegaConf

    from disttrain_core.config import RECIPES_DIR, group_options

    names = [
        n for n in group_options("recipe") if "gpu" in (OmegaConf.load(RECIPES_DIR / f"{n}.yaml").get("tags") or [])
    ]
    return [(f"recipe {name}", [f"recipe={name}", "trainer.dry_run=true"]) for name in names]


class PlanRefused(RuntimeError):
    """A plan parallel=auto made that the launch's validation refuses."""


def standin_data(container: dict, gpus: int) -> None:
    """Validate a plan against data with a shard per GPU, as a job of that size reads (the embedded data has 8:
    a one-unit plan of 32 replicas would be refused for the data, not for its layout). The shards are the ones
    ``data.generate_if_missing`` would generate into a directory that does not exist: validation counts them,
    nothing is written. The plan itself was made with the instance's own data, as parallel=auto makes it."""
    data, root = container["data"], "/nonexistent/grid-data"
    if data.get("format", "webdataset") == "webdataset" and not data.get("blend") and not data["packing"]["enabled"]:
        container["paths"]["data_dir"] = root
        data.update(path=f"{root}/{data['name']}", generate_if_missing=True)
        data["synthetic"]["num_shards"] = max(gpus, data["synthetic"]["num_shards"])


def composition_of_instance(overrides: list[str], validate: bool = True):
    """The composition ``overrides`` train (planned first under parallel=auto), or None when the planner finds no
    feasible layout or validation refuses the instance (what tools/regime.py reports as infeasible); PlanRefused
    when validation refuses the plan the planner made.
    ``validate=False`` (the GPU recipes, whose data is not here; tests/recipes/test_gpu_recipes.py validates and
    rehearses each with stand-in data) only resolves."""
    from omegaconf import OmegaConf

    from disttrain_core.config import typed_config
    from disttrain_core.parallel.composition import composition_of
    from disttrain_core.parallel.resolved import resolve_run
    from disttrain_core.planner import PlanningError, make_plan
    from disttrain_core.planner.auto import planned_container
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    def checked(cfg, container, plan=None):
        # every check of the launch but the schedule's replay (module doc)
        if validate:
            return validate_run(cfg, container, plan=plan, schedules=False)
        return None if cfg.parallel.mode == "auto" else resolve_run(cfg, container, plan)

    # paths.output_dir: Hydra sets it for a run; an instance planned here writes nothing
    cfg = compose([*overrides, "planner.baselines=false", "paths.output_dir=/nonexistent/plan-only"])
    container = OmegaConf.to_container(cfg, resolve=True)
    cfg = typed_config(container)
    try:
        run = checked(cfg, container)
        if run is None:
            result = make_plan(cfg, progress=lambda *_: None)
            container = planned_container(cfg, container, result)
            # the processes the plan needs, as one node: its composition does not depend on how they are spread
            # (a plan of 255 GPUs fills no whole 8-GPU nodes; tools/launch_script.py refuses it, the planner
            # placed its TP groups inside nodes)
            gpus = result.plan.evaluation.gpus
            container["trainer"].update(devices=gpus, num_nodes=1)
            container["cluster"].update(gpus_per_node=gpus, num_gpus=gpus)
            standin_data(container, gpus)
            try:
                run = checked(typed_config(container), container, container["parallel"])
            except ConfigError as error:  # the runtime refuses what the planner planned: the closure's business
                raise PlanRefused(f"{' '.join(overrides)}: the plan is refused at launch: {error}") from None
    except (ConfigError, PlanningError):
        return None
    return composition_of(run)


def all_instances() -> list[tuple[str, list[str], bool]]:
    """(name, overrides, validate) of the planner's grid and the GPU recipes."""
    return [(n, o, True) for n, o in grid_instances()] + [(n, o, False) for n, o in recipe_instances()]


def collect(instances: list[tuple[str, list[str], bool]], progress=None) -> dict[str, Found]:
    """Composition key -> the composition and the instances using it."""
    found: dict[str, Found] = {}
    for i, (name, overrides, validate) in enumerate(instances):
        composition = composition_of_instance(overrides, validate)
        if progress:
            progress(i, len(instances), name, composition)
        if composition is not None:
            found.setdefault(composition.key, Found(composition)).instances.append(name)
    return found


def table_facts():
    """The proven runs (conf/proven_compositions.yaml), their compositions and the facts they prove."""
    from disttrain_core.planner.proven import proven_facts, proven_runs, resolve_row

    runs = proven_runs()
    compositions = [resolve_row(run) for run in runs]
    return runs, compositions, proven_facts(runs, compositions)


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, OPTIONS)
    runs, _, proven = table_facts()
    instances = [(name, [*o, *overrides], validate) for name, o, validate in all_instances()]

    def progress(i, total, name, composition):
        if options["format"] != "json":
            print(f"[{i + 1}/{total}] {name}: {composition.key if composition else 'infeasible'}", flush=True)

    found = collect(instances, progress)
    rows = []
    for key, item in sorted(found.items()):
        missing = proven.missing(item.composition)
        rows.append({"key": key, "instances": len(item.instances), "example": item.instances[0], "unproven": missing})
    needed = sorted({fact for item in found.values() for fact in item.composition.facts()})
    summary = {
        "instances": len(instances),
        "compositions": len(rows),
        "facts": len(needed),
        "proven_runs": len(runs),
        "unproven_compositions": sum(1 for row in rows if row["unproven"]),
    }
    result = {"summary": summary, "rows": rows, "facts": {f: list(proven.facts.get(f, ())) for f in needed}}
    if options["out"]:
        with open(options["out"], "w") as f:
            json.dump(result, f, indent=1)
    if options["format"] == "json":
        print(json.dumps(result))
        return 0
    for row in rows:
        state = "proven" if not row["unproven"] else "UNPROVEN: " + "; ".join(row["unproven"])
        print(f"{row['instances']:4d} x {row['key']}\n       {state} (e.g. {row['example']})")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
