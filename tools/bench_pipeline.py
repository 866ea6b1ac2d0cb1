"""Pipeline schedules measured on this machine, against the calibrated simulator.

For each schedule it runs ``train.py`` with two pipeline stages (two processes) and
``trainer.record_timeline=true``, then reports the median ratio of the simulated
pipeline time to the measured one, the simulated bubble, and throughput; the last step's
measured-vs-simulated picture is copied next to the JSON. A one-process run of the same
model and batch is the reference.

Two predictions: *in-sample* (each step simulated with its own measured durations: a check of
the dependency and placement model) and *held-out* (``held_out``): every schedule predicted from
the durations and latency measured under each *other* schedule with the same stages (2 stages:
gpipe, 1f1b, zb_h1, zb_h2; 4: interleaved_1f1b and breadth_first with vpp 2, zbv, dualpipev), a whole
backward from a split one's I + W. A pair whose durations cannot be derived (I and W from whole
backwards) is listed as such.

    python tools/bench_pipeline.py                       # ~2.5 minutes on 2 cores (8 schedules)
    python tools/bench_pipeline.py schedules=1f1b,zb_h1 model=llama_tiny steps=8
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import split_tool_args

OPTIONS = {
    "schedules": "gpipe,1f1b,interleaved_1f1b,breadth_first,zb_h1,zb_h2,zbv,dualpipev",
    "model": "mllm_tiny",
    "steps": "12",
    "global_batch": "16",
    "micro_batch": "2",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_pipeline.json"),
}


def run(run_dir: Path, model: str, steps: int, global_batch: int, micro_batch: int, extra: list[str]) -> list[dict]:
    args = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        f"model={model}",
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=2",
        "trainer.progress_bar=false",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=false",
        f"optim.global_batch_size={global_batch}",
        f"optim.micro_batch_size={micro_batch}",
        *extra,
    ]
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=900)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _schedule_and_steps(reports: list[dict]):
    from disttrain_core.schedule.actions import Action
    from disttrain_core.schedule.generators import build_schedule
    from disttrain_core.schedule.simulator import TimedAction

    spec = reports[0]["schedule"]
    vpp = spec["stages"] // spec["pp"]
    schedule = build_schedule(spec["name"], spec["pp"], spec["microbatches"], vpp)
    steps = [
        [TimedAction(r["rank"], Action.parse(r["action"]), r["start"], r["end"]) for r in report["measured"]]
        for report in reports
    ]
    return schedule, steps


def held_out(recorded: dict[str, list[dict]]) -> dict:
    """Every schedule's steps predicted from every other schedule's calibration (same stages): per pair the
    median and worst simulated / measured ratio over the target's steps; over all pairs the median and worst
    absolute error."""
    from disttrain_core.schedule.calibrate import fit, makespan, predict_from

    runs = {name: _schedule_and_steps(reports) for name, reports in recorded.items() if reports}
    pairs, errors = [], []
    for source, (source_schedule, source_steps) in runs.items():
        calibration = fit(source_schedule, source_steps)
        for target, (target_schedule, target_steps) in runs.items():
            if target == source or target_schedule.num_stages != source_schedule.num_stages:
                continue
            try:
                predicted = predict_from(target_schedule, calibration).makespan
            except ValueError as error:
                pairs.append({"calibrated_on": source, "predicted": target, "not_derivable": str(error)})
                continue
            ratios = [predicted / makespan(step) for step in target_steps]
            worst = max(ratios, key=lambda r: abs(r - 1.0))
            errors += [abs(r - 1.0) for r in ratios]
            pairs.append(
                {
                    "calibrated_on": source,
                    "predicted": target,
                    "predicted_over_measured": statistics.median(ratios),
                    "worst": worst,
                    "steps": len(ratios),
                }
            )
    summary = {"pairs": pairs, "steps_predicted": len(errors)}
    if errors:
        summary["median_abs_error"] = statistics.median(errors)
        summary["worst_abs_error"] = max(errors)
    return summary


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    steps, gb, mb = int(options["steps"]), int(options["global_batch"]), int(options["micro_batch"])
    out = Path(options["out"]).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": options["model"], "global_batch": gb, "micro_batch": mb, "steps": steps, "runs": []}
    recorded: dict[str, list[dict]] = {}  # schedule -> its step reports (measured actions included)
    with tempfile.TemporaryDirectory() as tmp:
        single = run(Path(tmp) / "single", options["model"], steps, gb, mb, [])
        results["single_process_tokens_per_s"] = statistics.median(m["perf/tokens_per_s"] for m in single[1:])
        for schedule in options["schedules"].split(","):
            run_dir = Path(tmp) / schedule
            metrics = run(
                run_dir,
                options["model"],
                steps,
                gb,
                mb,
                ["parallel=pp2", f"schedule={schedule}", "trainer.devices=2", "trainer.record_timeline=true"],
            )
            reports = [json.loads(p.read_text()) for p in sorted((run_dir / "timelines").glob("step_*.json"))][1:]
            recorded[schedule] = reports
            picture = out.parent / f"pipeline_{options['model']}_{schedule}.png"
            shutil.copy(reports[-1]["png"], picture)
            entry = {
                "schedule": schedule,
                "predicted_over_measured": statistics.median(r["predicted_over_measured"] for r in reports),
                "ratios": [round(r["predicted_over_measured"], 3) for r in reports],
                "measured_pipeline_s": statistics.median(r["measured_s"] for r in reports),
                "simulated_bubble_fraction": statistics.median(r["simulated_bubble_fraction"] for r in reports),
                "tokens_per_s": statistics.median(m["perf/tokens_per_s"] for m in metrics[1:]),
                "final_loss": metrics[-1]["loss"],
                "picture": str(picture.relative_to(REPO_ROOT)),
            }
            results["runs"].append(entry)
            print(json.dumps(entry), flush=True)
    results["held_out"] = held_out(recorded)
    for pair in results["held_out"]["pairs"]:
        print(json.dumps(pair), flush=True)
    print(json.dumps({k: v for k, v in results["held_out"].items() if k != "pairs"}), flush=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
