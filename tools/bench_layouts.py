"""Disaggregated layouts against the rigid Megatron layout on 2 processes (issue 4).

The workload is an encoder-heavy variant of ``mllm_tiny``: a wider, deeper ViT and shards
with many images per sample (generated into a temporary directory), so the image encoder
costs about as much as the LLM backbone and the generator together. Every layout trains
the same model on the same global batches; the tool reports median throughput after the
first logging window, the throughput ratio of the best disaggregated layout to the
Megatron layout, and copies one measured pipeline timeline per pipelined layout.

    python tools/bench_layouts.py                  # ~5 minutes on 2 cores
    python tools/bench_layouts.py steps=16 format=json

Layouts (all 2 processes):
  disagg2              encoder unit | LLM unit with the generator colocated, 1F1B
  disagg2_gen          LLM unit with the encoder colocated | generator unit, 1F1B
  megatron_folded_pp2  Megatron-LM's multimodal layout: LLM split in 2 stages, the encoder folded
                       into the first stage and the generator into the last, 1F1B (the baseline)
  megatron_folded_tp2  the same model with tensor parallelism 2 instead (one stage)
  ddp                  data parallel over 2 ranks (the whole model on each), for reference
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from disttrain_core.cli import split_tool_args
from disttrain_core.config import REPO_ROOT

OPTIONS = {
    "steps": "14",
    "global_batch": "16",
    "micro_batch": "2",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_layouts.json"),
    # all, or a comma-separated subset of LAYOUTS (the ratio needs megatron_folded_pp2 and a disaggregated one)
    "layouts": "all",
    "predict": "true",  # the planner's profiled prediction per layout (profiles this CPU once)
    "samples_per_shard": "256",
}

# The encoder-heavy model: ViT 256 wide, 16 layers, on shards averaging ~3.5 images per sample.
MODEL = [
    "model=mllm_tiny",
    "model.encoder.dim=256",
    "model.encoder.n_layers=16",
    "model.encoder.mlp_dim=1024",
    "model.encoder.n_heads=8",
    "model.nominal_images_per_sample=3.5",
]
DATA_SHAPE = [
    "data.synthetic.images_geometric_p=0.25",
    "data.synthetic.num_shards=2",
    "data.synthetic.samples_per_shard=256",
]
LAYOUTS = {
    "disagg2": ["parallel=disagg2"],
    "disagg2_gen": [
        "parallel=disagg2",
        "parallel.units.encoder.colocate=true",
        "parallel.units.generator.colocate=false",
    ],
    "megatron_folded_pp2": ["parallel=pp2", "schedule=1f1b", "trainer.devices=2"],
    "megatron_folded_tp2": ["parallel=pp2", "parallel.pp=1", "parallel.tp=2", "trainer.devices=2"],
    "ddp": ["parallel=dp", "trainer.devices=2"],
}
DISAGGREGATED = {"disagg2", "disagg2_gen"}
BASELINE = "megatron_folded_pp2"


def train(run_dir: Path, data_dir: Path, options: dict, layout: list[str]) -> list[dict]:
    args = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        *MODEL,
        *DATA_SHAPE,
        f"data.path={data_dir}",
        f"trainer.max_steps={options['steps']}",
        "trainer.log_every_n_steps=2",
        "trainer.progress_bar=false",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.checkpoint.save_last=false",
        f"optim.global_batch_size={options['global_batch']}",
        f"optim.micro_batch_size={options['micro_batch']}",
        *layout,
    ]
    if any(a.startswith("parallel=") and a != "parallel=dp" for a in layout) and "parallel.pp=1" not in layout:
        args.append("trainer.record_timeline=true")
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"layout {layout} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def predicted_step_s(data_dir: Path, options: dict, layout: list[str]) -> dict:
    """The planner's prediction for this layout, from its profiled cost model (docs/PLANNER.md)."""
    from disttrain_core.config import compose
    from disttrain_core.planner import build_layout_model, choices_of_config

    overrides = [*MODEL, *DATA_SHAPE, f"data.path={data_dir}", f"optim.global_batch_size={options['global_batch']}"]
    overrides += [f"optim.micro_batch_size={options['micro_batch']}", *layout]
    cfg = compose(overrides)
    model = build_layout_model(cfg, devices=2, progress=lambda *_: None)
    evaluation = model.evaluate(*choices_of_config(cfg))
    stages = [round(t, 4) for _, t in evaluation.stage_times]
    return {"predicted_step_s": evaluation.iteration_s, "predicted_stage_s": stages}


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    names = list(LAYOUTS) if options["layouts"] == "all" else options["layouts"].split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or BASELINE not in names or not DISAGGREGATED & set(names):
        raise SystemExit(
            f"layouts={options['layouts']}: choose from {', '.join(LAYOUTS)}, including {BASELINE} and one of "
            f"{', '.join(sorted(DISAGGREGATED))}"
        )
    chosen = {n: LAYOUTS[n] for n in names}
    out = Path(options["out"]).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "model_overrides": MODEL,
        "data_overrides": DATA_SHAPE,
        "global_batch": int(options["global_batch"]),
        "micro_batch": int(options["micro_batch"]),
        "steps": int(options["steps"]),
        "layouts": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "shards"
        subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "tools" / "make_shards.py"),
                f"out={data_dir}",
                *DATA_SHAPE,
                f"data.synthetic.samples_per_shard={options['samples_per_shard']}",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        for name, layout in chosen.items():
            run_dir = Path(tmp) / name
            metrics = train(run_dir, data_dir, options, layout)
            timed = [m for m in metrics if "perf/samples_per_s" in m]
            window = timed[1:] or timed  # after the first logging window, when there is more than one
            entry = {
                "overrides": layout,
                "samples_per_s": statistics.median(m["perf/samples_per_s"] for m in window),
                "step_time_s": statistics.median(m["perf/step_time_s"] for m in window),
                "losses": [round(m["loss"], 4) for m in metrics if "loss" in m],
            }
            reports = [json.loads(p.read_text()) for p in sorted((run_dir / "timelines").glob("step_*.json"))]
            if reports:
                picture = out.parent / f"layouts_{name}.png"
                shutil.copy(reports[-1]["png"], picture)
                entry["picture"] = str(picture.relative_to(REPO_ROOT) if picture.is_relative_to(REPO_ROOT) else picture)
                entry["simulated_bubble_fraction"] = statistics.median(
                    r["simulated_bubble_fraction"] for r in reports[1:] or reports
                )
            if options["predict"] == "true":
                entry.update(predicted_step_s(data_dir, options, layout))
                entry["predicted_over_measured"] = entry["predicted_step_s"] / entry["step_time_s"]
            results["layouts"][name] = entry
            if options["format"] != "json":
                rate, step = entry["samples_per_s"], entry["step_time_s"]
                guess = f"  predicted {entry['predicted_step_s']:.3f}s" if "predicted_step_s" in entry else ""
                print(f"{name:14s} {rate:8.2f} samples/s  step {step:.3f}s{guess}", flush=True)
    best = max(DISAGGREGATED & chosen.keys(), key=lambda n: results["layouts"][n]["samples_per_s"])
    results["best_disaggregated"] = best
    results["disaggregated_over_megatron"] = (
        results["layouts"][best]["samples_per_s"] / results["layouts"][BASELINE]["samples_per_s"]
    )
    out.write_text(json.dumps(results, indent=1))
    if options["format"] == "json":
        print(json.dumps(results))
    else:
        print(f"best disaggregated ({best}) / megatron throughput: {results['disaggregated_over_megatron']:.2f}")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
