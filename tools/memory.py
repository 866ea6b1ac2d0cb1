"""Memory per rank role of a layout, item by item: the numbers the planner uses (docs/MEMORY.md).

    python tools/memory.py model=llama3_8b parallel=dp trainer.devices=8 parallel.shard=zero3
    python tools/memory.py model=mllm_tiny parallel=disagg4_llm2_gen1 parallel.units.llm.shard=zero3 format=json
    python tools/memory.py model=llama3_70b convention=standard dp=64 zero=1
    python tools/memory.py model=llama3_8b convention=standard fp32_grad_accumulation=true

``convention=runtime`` (default): this runtime's allocations per (unit, pipeline stage) -- model state
(parameters, gradients, fp32 masters, Adam moments, communication buffers), in-flight activations,
logits, the recompute transient, gathered FSDP2 parameters and autocast's weight copies -- for the
configured layout, shard modes, recompute policies and schedule, on ``cluster`` (GPU clusters in
bf16-mixed). ``convention=standard``: the textbook mixed-precision model state (bf16 parameters and
gradients, fp32 master weights and Adam moments: 16 bytes per parameter, 20 with fp32 gradient
accumulation) under ZeRO stage ``zero`` over ``dp`` ranks. ``format=table|json``.
"""

from __future__ import annotations

import json
import sys

from disttrain_core.config import compose
from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.validation import ConfigError

GB = 1e9


def standard(cfg, options: dict) -> dict:
    from disttrain_core.planner.memory import standard_model_state
    from disttrain_core.planner.workload import workload_of

    params = float(sum(u.params for u in workload_of(cfg.model).units.values()))
    dp, zero = int(options["dp"]), int(options["zero"])
    if dp < 1 or zero not in (0, 1, 2, 3):
        raise ConfigError(f"dp={dp} zero={zero}: use dp >= 1 and zero in 0, 1, 2, 3")
    accumulate = options["fp32_grad_accumulation"].lower() in ("1", "true", "yes")
    state = standard_model_state(params, dp, zero, accumulate)
    return {
        "model": cfg.model.name,
        "parameters": params,
        "dp": dp,
        "zero": zero,
        "fp32_grad_accumulation": accumulate,
        "bytes": state,
    }


def runtime(cfg) -> dict:
    from disttrain_core.planner import config_roles

    if cfg.parallel.mode == "auto":
        raise ConfigError(
            "tools/memory.py breaks down a configured layout; for parallel=auto run "
            "python train.py ... parallel=auto trainer.dry_run=true (the plan's memory per unit and a rehearsal)"
        )
    roles, context = config_roles(cfg)
    return {**context, "roles": [role.as_dict() for role in roles]}


def table(result: dict) -> str:
    if "roles" not in result:
        lines = [
            f"{result['model']}: {result['parameters'] / 1e9:.2f} B parameters, "
            f"ZeRO-{result['zero']} over dp={result['dp']}"
            f"{', fp32 gradient accumulation' if result['fp32_grad_accumulation'] else ''} (standard mixed precision)",
        ]
        for key in ("params", "grads", "optimizer", "total"):
            lines.append(f"  {key:10s} {result['bytes'][key] / GB:12.2f} GB")
        return "\n".join(lines)
    lines = [
        f"{result['model']} ({result['precision']}), {result['layout']}, {result['microbatches']} microbatch(es), "
        f"schedule {result['schedule']}",
        "",
        f"{'role':19s} {'shard':6s} {'recompute':>16s} {'params':>9s} {'grads':>9s} {'master':>9s} {'moments':>9s} "
        f"{'buffers':>9s} {'state':>9s} {'activ.':>9s} {'transient':>9s} {'peak':>9s}  (GB)",
    ]
    for role in result["roles"]:
        s = role["state"]
        transient = role["step_transient"] + role["recompute_transient"] + role["logits"]
        lines.append(
            f"{role['unit'] + ' pp' + str(role['pp']):19s} {role['shard']:6s} {role['recompute']:>16s} "
            + " ".join(f"{s[k] / GB:9.3f}" for k in ("params", "grads", "master", "moments", "buffers", "total"))
            + f" {role['activations'] / GB:9.3f} {transient / GB:9.3f} {role['peak'] / GB:9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    defaults = {"format": "table", "convention": "runtime", "dp": "1", "zero": "0", "fp32_grad_accumulation": "false"}
    options, overrides = split_tool_args(argv, defaults)
    cfg = compose(overrides)
    if options["convention"] not in ("runtime", "standard"):
        raise ConfigError(f"convention={options['convention']!r}: use convention=runtime or convention=standard")
    result = standard(cfg, options) if options["convention"] == "standard" else runtime(cfg)
    if options["format"] == "json":
        print(json.dumps(result, indent=1))
    elif options["format"] == "table":
        print(table(result))
    else:
        raise ConfigError(f"format={options['format']!r}: use format=table or format=json")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
