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

(b) measured on this CPU: 2 data-parallel processes fed by a producer (2 decode workers),
reordering on vs off, on an encoder-heavy mllm_tiny (medians after the first logging window).

    python tools/bench_reorder.py                       # ~3 minutes
    python tools/bench_reorder.py groups=16,64,256,1024 stages=4 measure=false format=json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import split_tool_args, tool_main

OPTIONS = {
    "groups": "16,32,64,128,256,512,1024",
    "per_group": "32",
    "slots": "16",
    "stages": "4",
    "trials": "5",
    "seed": "0",
    "format": "table",
    "measure": "true",
    "steps": "14",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_reorder.json"),
}

# (b) the measured part: tools/bench_layouts.py's encoder-heavy mllm_tiny on 2 data-parallel
# processes, fed by a producer with 2 decode workers, reordering on and off.
MEASURED_MODEL = [
    "model=mllm_tiny",
    "model.encoder.dim=256",
    "model.encoder.n_layers=16",
    "model.encoder.mlp_dim=1024",
    "model.encoder.n_heads=8",
]
MEASURED_DATA = ["data.synthetic.images_geometric_p=0.25", "data.synthetic.num_shards=2"]


def measured(steps: int) -> dict:
    import subprocess
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shards"
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "tools" / "make_shards.py"), f"out={data}", *MEASURED_DATA],
            check=True,
            capture_output=True,
            timeout=600,
        )
        for name, flag in (("reorder_off", "false"), ("reorder_on", "true")):
            run_dir = Path(tmp) / name
            args = [
                sys.executable,
                str(REPO_ROOT / "train.py"),
                f"hydra.run.dir={run_dir}",
                *MEASURED_MODEL,
                f"data.path={data}",
                "parallel=dp",
                "trainer.devices=2",
                "data.producer.workers=2",
                f"data.producer.reorder.intra={flag}",
                f"data.producer.reorder.inter={flag}",
                f"trainer.max_steps={steps}",
                "trainer.log_every_n_steps=2",
                "trainer.progress_bar=false",
                "trainer.checkpoint.every_n_steps=0",
                "trainer.checkpoint.save_last=false",
                "optim.global_batch_size=32",
                "optim.micro_batch_size=4",
            ]
            done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
            results[name] = {
                "step_time_s": statistics.median(m["perf/step_time_s"] for m in metrics),
                "data_wait_fraction": statistics.median(m["perf/data_wait_fraction"] for m in metrics),
                "final_loss": metrics[-1]["loss"],
            }
    results["speedup"] = results["reorder_off"]["step_time_s"] / results["reorder_on"]["step_time_s"]
    return results


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
    if options["measure"] == "true":
        result["measured"] = measured(int(options["steps"]))
        if options["format"] != "json":
            m = result["measured"]
            print(
                f"measured, 2 DP processes: step {m['reorder_off']['step_time_s']:.3f} s -> "
                f"{m['reorder_on']['step_time_s']:.3f} s with reordering ({m['speedup']:.3f}x); data wait "
                f"{m['reorder_off']['data_wait_fraction']:.1%} / {m['reorder_on']['data_wait_fraction']:.1%}"
            )
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if options["format"] == "json" else f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
