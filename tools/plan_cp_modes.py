"""The planner's choice among context-parallel modes (parallel.cp_mode, comm/context_modes.py) for a long-sequence
job, and its predicted step time when each mode is the only one allowed (docs/PARALLELISM.md).

    python tools/plan_cp_modes.py          # Llama 3 8B (32 query / 8 KV heads), 128K positions, 32 H100s
    python tools/plan_cp_modes.py model.seq_len=32768 cluster.num_gpus=16 format=json out=outputs/cp_modes.json

Each row is a whole plan (Algorithm 1, analytic costs of the cluster preset) whose LLM may use only that mode
(``cp = 1`` layouts stay allowed in every row); ``auto`` lets the solver weigh every mode the heads allow
(planner/options.py ``cp_mode_candidates``). Everything besides ``format`` and ``out`` is a config override.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disttrain_core.config import compose
from disttrain_core.launch.cli import split_tool_args, tool_main

DEFAULTS = [
    "model=llama3_8b",
    "model.seq_len=131072",
    "cluster=h100_80g",
    "cluster.num_gpus=32",
    "optim.global_batch_size=32",
    "optim.micro_batch_size=1",
    "planner.baselines=false",
]
MODES = ("ring", "allgather", "ulysses", "hybrid")


def plan_modes(overrides: list[str]) -> dict:
    """{"auto": row, mode: row, ...}: each row the plan's predicted step seconds, its LLM layout and the memory of
    its fullest LLM device against the limit; a mode that fits no layout has its reason instead."""
    from disttrain_core.planner import PlanningError, make_plan

    cfg = compose([*DEFAULTS, *overrides])
    llm = cfg.model.llm
    rows = {
        "model": cfg.model.name,
        "seq_len": cfg.model.seq_len,
        "heads": llm.n_heads,
        "kv_heads": llm.n_kv_heads,
        "cluster": cfg.cluster.name,
        "gpus": cfg.cluster.num_gpus,
    }
    for name, modes in (("auto", None), *((m, (m,)) for m in MODES)):
        try:
            result = make_plan(cfg, progress=lambda *_: None, cp_modes=modes)
        except PlanningError as error:
            rows[name] = {"feasible": False, "reason": str(error)}
            continue
        plan = result.plan.evaluation
        rows[name] = {
            "feasible": plan.feasible,
            "iteration_s": plan.iteration_s,
            "llm": plan.choices["llm"].as_dict(),
            "memory_gb": plan.memory["llm"] / 1e9,
            "limit_gb": result.model.limit / 1e9,
        }
    return rows


def table(rows: dict) -> str:
    lines = [
        f"{rows['model']} at {rows['seq_len']} positions ({rows['heads']} query / {rows['kv_heads']} KV heads), "
        f"{rows['gpus']} x {rows['cluster']}",
        f"{'mode':10} {'step s':>9} {'LLM layout':36} {'memory GB':>10}",
    ]
    for name in ("auto", *MODES):
        row = rows[name]
        if not row["feasible"]:
            lines.append(f"{name:10} {'-':>9} {row.get('reason', 'infeasible')[:60]}")
            continue
        llm = row["llm"]
        mode = llm.get("cp_mode", "-") + (f"(u={llm['cp_ulysses']})" if llm.get("cp_mode") == "hybrid" else "")
        layout = f"tp{llm['tp']} cp{llm['cp']} dp{llm['dp']} pp{llm['pp']} {mode}"
        lines.append(f"{name:10} {row['iteration_s']:9.2f} {layout:36} {row['memory_gb']:10.1f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, {"format": "table", "out": ""})
    rows = plan_modes(overrides)
    if options["out"]:
        Path(options["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(options["out"]).write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2) if options["format"] == "json" else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
