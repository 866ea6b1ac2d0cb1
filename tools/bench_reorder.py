"""Reordering a global batch: straggler and pipeline bubble with and without it (simulated).

LAION-like skew (the embedded data's law: images per sample geometric(0.45) truncated at 8,
5% text-only); each sample's encoder work is its image count, plus a small equal LLM share.
For each number of DP groups G, a global batch gives every group ``per_group`` samples in
``slots`` microbatch slots. Reported, over ``trials`` random batches (medians):

* straggler: the largest DP group's load over the mean, arrival order vs Algorithm 2;
* pipeline: the slot costs (slowest group per slot) run on the first stage of a ``stages``-deep
  1F1B pipeline whose other stages take the arrival order's mean slot cost (the LLM: equal work
  per sample); bubble fraction and speedup of the makespan from the schedule simulator, for the
  arrival order, Algorithm 2 alone, and Algorithms 2 + 3. Algorithm 2 shrinks every slot's
  slowest group, so the varying stage idles more and its bubble *fraction* can rise while the
  makespan falls; Algorithm 3 is judged against Algorithm 2 alone (same slots, new order).

    python tools/bench_reorder.py
    python tools/bench_reorder.py groups=16,64,256,1024 stages=4 format=json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from disttrain_core.cli import split_tool_args, tool_main
from disttrain_core.config import REPO_ROOT

OPTIONS = {
    "groups": "16,32,64,128,256,512,1024",
    "per_group": "32",
    "slots": "16",
    "stages": "4",
    "trials": "5",
    "seed": "0",
    "format": "table",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_reorder.json"),
}


def laion_like_costs(rng: np.random.Generator, n: int) -> list[float]:
    images = np.minimum(rng.geometric(0.45, size=n), 8) * (rng.random(n) > 0.05)
    return (images + 0.05).tolist()


def bubble(costs: list[float], order: list[int], stages: int, period: float) -> tuple[float, float]:
    from disttrain_core.schedule.actions import Kind
    from disttrain_core.schedule.generators import build_schedule
    from disttrain_core.schedule.simulator import simulate

    def duration(action) -> float:
        base = costs[order[action.microbatch]] if action.stage == 0 else period
        return base / 3 if action.kind == Kind.F else 2 * base / 3

    result = simulate(build_schedule("1f1b", stages, len(order)), duration)
    return result.bubble_fraction, result.makespan


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    from disttrain_core.data.reorder import arrange, slot_costs

    rng = np.random.default_rng(int(options["seed"]))
    per_group, slots, stages = int(options["per_group"]), int(options["slots"]), int(options["stages"])
    rows = []
    for groups in (int(g) for g in options["groups"].split(",")):
        per_slot = groups * per_group // slots
        variants = {"none": (False, False), "intra": (True, False), "intra+inter": (True, True)}
        stats: dict[str, list[float]] = {"seconds": []}
        for _ in range(int(options["trials"])):
            costs = laion_like_costs(rng, groups * per_group)
            arrival_slots = slot_costs(
                costs, arrange(costs, slots, per_slot, groups, stages, False, False), slots, groups
            )
            period = float(np.mean(arrival_slots))  # the LLM stages: equal work per sample
            base = None
            for name, (intra, inter) in variants.items():
                started = time.perf_counter()
                order = arrange(costs, slots, per_slot, groups, stages, intra, inter, period)
                if name == "intra+inter":
                    stats["seconds"].append(time.perf_counter() - started)
                loads = np.asarray([costs[i] for i in order]).reshape(slots, groups, -1).sum(axis=(0, 2))
                b, t = bubble(slot_costs(costs, order, slots, groups), list(range(slots)), stages, period)
                base = t if base is None else base
                for key, value in (("straggler", loads.max() / loads.mean()), ("bubble", b), ("speedup", base / t)):
                    stats.setdefault(f"{key}_{name}", []).append(float(value))
        row = {"dp_groups": groups, "samples": groups * per_group}
        row.update({k: statistics.median(v) for k, v in stats.items()})
        rows.append(row)
        if options["format"] != "json":
            print(
                f"{groups:5d} DP groups: straggler {row['straggler_none']:.3f} -> {row['straggler_intra']:.3f}   "
                f"bubble {row['bubble_none']:.1%} | intra {row['bubble_intra']:.1%} | +inter "
                f"{row['bubble_intra+inter']:.1%}   pipeline speedup intra {row['speedup_intra']:.3f}x, "
                f"+inter {row['speedup_intra+inter']:.3f}x   reorder {row['seconds'] * 1e3:.1f} ms",
                flush=True,
            )
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"options": options, "simulated": rows}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if options["format"] == "json" else f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
