"""Disaggregated layouts against the rigid Megatron layout on 2 or 4 processes (issues 4 and 19).

The workload is an encoder-heavy variant of ``mllm_tiny``: a wider, deeper ViT and shards
with many images per sample (generated into a temporary directory), so the image encoder
costs about as much as the LLM backbone and the generator together. Every layout trains
the same model on the same global batches. The layouts run ``repeats`` times in alternation
(A B, B A, A B, ...: adjacent runs share the machine's state of the moment); the tool reports each
layout's median throughput after the first logging window, the per-repeat ratio of each
disaggregated layout to the Megatron layout (median and spread), the planner's predicted ratio from
its profiled cost model and the measured ratio as a fraction of it, and copies one measured pipeline
timeline per pipelined layout.

    python tools/bench_layouts.py                  # 2 processes, 5 alternations, ~8 minutes on 2 cores
    python tools/bench_layouts.py processes=4      # 4 processes, ~12 minutes
    python tools/bench_layouts.py layouts=all repeats=1 format=json
    python tools/bench_layouts.py workload=audio    # the audio tower as a unit of its own, ~8 minutes
    python tools/bench_layouts.py workload=video    # the video tower as a unit of its own, ~8 minutes

The audio workload (issue 42) is ``any2any_tiny`` with an audio tower grown until its stage takes about as long as
the rest of the model's on this CPU (384 wide, 10 blocks, every sample with a 1 s clip), on shards where every
sample carries one: the regime where an encoder weighs as much as the backbone. On 2 processes:
  disagg2_audio        the audio tower's unit | the LLM unit with the image encoder and both generators
                       colocated, 1F1B
  megatron_folded_pp2  the baseline above: the audio tower folded into the first LLM stage with the ViT

The video workload is ``mllm_tiny`` with a video tower (256 wide, 5 blocks, groups of 4 frames averaged) on shards
where half the images are videos of 2..16 frames: the tower takes every frame, the LLM one group of patch embeddings
per 4 frames, and the frame counts vary from sample to sample (the skew the reordering weighs). On 2 processes:
  disagg2_video          the video tower's unit | the LLM unit with the image encoder and the generator colocated
  megatron_folded_pp2    the baseline: the video tower folded into the first LLM stage with the ViT
  disagg2_video_reorder  disagg2_video with the decoding in a data producer that reorders every global batch
                         (docs/DATA.md): DistTrain whole

Item rebalancing (parallel.rebalance_items: each encoder's items spread evenly over its data-parallel replicas by an
all-to-all) against DistTrain's reordering, on 2 processes holding the whole model each (ZeRO-1) and reading the same
global batches from a data producer: ``dp2_arrival`` (arrival order), ``dp2_reordered`` (Algorithms 2 and 3),
``dp2_rebalanced``, ``dp2_reordered_rebalanced``; beside ``dp2_zero1``, the rigid data-parallel layout reading its own
shards (the audio and video workloads offer ``dp2_arrival`` and ``dp2_rebalanced``). On 4 processes:
``disagg4_enc2_llm2_rebalanced`` and ``megatron_folded_pp2_dp2_rebalanced``. On the image workload each prediction
also comes straggler-adjusted (planner/stragglers.py on the shards' own images-per-sample law, the layout's
reordering and rebalancing). Bubble filling (schedule.fill_bubbles: the folded encoder cut into one chunk per
pipeline stage, its actions in the 1F1B bubbles; image workload only, the towers' models refuse it):
``megatron_folded_pp2_fill``, ``megatron_folded_pp2_fill_reordered`` (with the producer's reordering), the same two
``_planned`` (the encoder's blocks per stage from the planner's profiled costs: planner/api.py planned_fill_split)
and, on 4 processes, ``megatron_folded_pp2_dp2_fill``; the planner prices each (schedule_choice.py
filled_pipeline_s).

Layouts on 2 processes:
  disagg2              encoder unit | LLM unit with the generator colocated, 1F1B
  disagg2_gen          LLM unit with the encoder colocated | generator unit, 1F1B
  megatron_folded_pp2  Megatron-LM's multimodal layout: LLM split in 2 stages, the encoder folded
                       into the first stage and the generator into the last, 1F1B (the baseline)
  megatron_folded_tp2  the same model with tensor parallelism 2 instead (one stage)
  ddp                  data parallel over 2 ranks (the whole model on each), for reference
On 4 processes:
  disagg4_enc2_llm2          encoder unit of 2 replicas | LLM unit of 2 replicas with the generator
                             colocated, 1F1B (disagg2 doubled; the planner's fastest 4-process guess)
  disagg4_enc2               encoder unit of 2 replicas | LLM unit | generator unit, 1F1B
  megatron_folded_pp2_dp2    the Megatron layout above with 2 data-parallel replicas (the baseline)
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
    "steps": "14",
    "global_batch": "16",
    "micro_batch": "2",
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_layouts.json"),
    # default (the baseline and the main disaggregated layout), all, or a comma-separated subset of the layouts
    # (the ratio needs the baseline and a disaggregated one)
    "layouts": "default",
    "predict": "true",  # the planner's profiled prediction per layout (profiles this CPU once)
    "samples_per_shard": "256",
    "processes": "2",  # 2 or 4
    "repeats": "5",  # alternations of the layouts
    # image (the encoder-heavy ViT), audio (an audio tower as heavy as the rest) or video (a video tower as heavy)
    "workload": "image",
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
    # the whole model on each of 2 ranks (ZeRO-1), each reading its own shards: the rigid data-parallel layout
    "dp2_zero1": ["parallel=zero1", "trainer.devices=2"],
}
# The same on global batches from a data producer (every variant reads the same samples): in arrival order, reordered
# (DistTrain's Algorithms 2 and 3), its encoder's images rebalanced over both replicas, and both.
ARRIVAL = ["data.producer.workers=1", "data.producer.reorder.intra=false", "data.producer.reorder.inter=false"]
REBALANCED = ["parallel.rebalance_items=true"]
LAYOUTS["dp2_arrival"] = [*LAYOUTS["dp2_zero1"], *ARRIVAL]
LAYOUTS["dp2_reordered"] = [*LAYOUTS["dp2_zero1"], "data.producer.workers=1"]
LAYOUTS["dp2_rebalanced"] = [*LAYOUTS["dp2_arrival"], *REBALANCED]
LAYOUTS["dp2_reordered_rebalanced"] = [*LAYOUTS["dp2_reordered"], *REBALANCED]
# Under FSDP2 (zero3) the replicas meet at every block's gather already: the exchange adds no new meeting point
LAYOUTS["dp2_fsdp_arrival"] = ["parallel.shard=zero3", "trainer.devices=2", *ARRIVAL]
LAYOUTS["dp2_fsdp_rebalanced"] = [*LAYOUTS["dp2_fsdp_arrival"], *REBALANCED]
# Bubble filling (schedule.fill_bubbles): the folded encoder cut into one chunk per stage, in the 1F1B bubbles
FILL = ["schedule.fill_bubbles=true"]
LAYOUTS["megatron_folded_pp2_fill"] = [*LAYOUTS["megatron_folded_pp2"], *FILL]
LAYOUTS["megatron_folded_pp2_fill_reordered"] = [*LAYOUTS["megatron_folded_pp2_fill"], "data.producer.workers=1"]
LAYOUTS["megatron_folded_pp2_fill_planned"] = LAYOUTS["megatron_folded_pp2_fill"]  # + the planner's fill_split
LAYOUTS["megatron_folded_pp2_fill_planned_reordered"] = LAYOUTS["megatron_folded_pp2_fill_reordered"]
LAYOUTS_4 = {
    "disagg4_enc2_llm2": [
        "parallel=disagg2",
        "parallel.units.encoder.dp=2",
        "parallel.units.llm.dp=2",
        "trainer.devices=4",
    ],
    "disagg4_enc2": ["parallel=disagg4_enc2"],
    "megatron_folded_pp2_dp2": ["parallel=pp2", "schedule=1f1b", "trainer.devices=4"],
}
LAYOUTS_4["disagg4_enc2_llm2_rebalanced"] = [*LAYOUTS_4["disagg4_enc2_llm2"], *REBALANCED]
LAYOUTS_4["megatron_folded_pp2_dp2_rebalanced"] = [*LAYOUTS_4["megatron_folded_pp2_dp2"], *REBALANCED]
LAYOUTS_4["megatron_folded_pp2_dp2_fill"] = [*LAYOUTS_4["megatron_folded_pp2_dp2"], *FILL]
# The audio workload: every sample has a 1 s clip; the tower is 384 wide and 10 blocks deep.
MODEL_AUDIO = [
    "model=any2any_tiny",
    "model.audio_encoder.dim=384",
    "model.audio_encoder.n_layers=10",
    "model.audio_encoder.mlp_dim=1536",
    "model.audio_encoder.n_heads=8",
    "model.nominal_clips_per_sample=1.0",
]
DATA_SHAPE_AUDIO = [*DATA_SHAPE, "data.synthetic.audio_fraction=1.0"]
LAYOUTS_AUDIO = {
    "disagg2_audio": [
        "parallel=disagg2",
        "parallel.units.encoder.colocate=true",
        "parallel.units.audio_encoder.colocate=false",
    ],
    "megatron_folded_pp2": LAYOUTS["megatron_folded_pp2"],
    "dp2_arrival": LAYOUTS["dp2_arrival"],
    "dp2_rebalanced": LAYOUTS["dp2_rebalanced"],  # the images and clips of both replicas rebalanced
    "dp2_zero1": LAYOUTS["dp2_zero1"],  # the rigid data-parallel layout (the strongest rigid on images)
    "dp2_reordered": LAYOUTS["dp2_reordered"],
}
# The video workload: half the images are videos of 2..16 frames, all given to a video tower 256 wide and 5 blocks
# deep that averages groups of 4 frames (64 <video> positions for 16 frames): many frames, few LLM tokens.
MODEL_VIDEO = [
    "model=mllm_tiny",
    "model/video_encoder=vit_video_tiny",
    "model.video_encoder.dim=256",
    "model.video_encoder.n_layers=5",
    "model.video_encoder.mlp_dim=1024",
    "model.video_encoder.n_heads=8",
    "model.video_encoder.temporal_merge=4",
    "model.nominal_images_per_sample=1.0",
    "model.nominal_video_groups_per_sample=2.6",
]
DATA_SHAPE_VIDEO = [
    *DATA_SHAPE,
    "data.synthetic.video_fraction=0.5",
    "data.synthetic.video_frames_max=16",
    "data.video_frames=16",
]
LAYOUTS_VIDEO = {
    "disagg2_video": [
        "parallel=disagg2",
        "parallel.units.encoder.colocate=true",
        "parallel.units.video_encoder.colocate=false",
    ],
    "megatron_folded_pp2": LAYOUTS["megatron_folded_pp2"],
}
# DistTrain whole: the tower's unit, and the decoding in a data producer that reorders each global batch (docs/DATA.md)
LAYOUTS_VIDEO["disagg2_video_reorder"] = [*LAYOUTS_VIDEO["disagg2_video"], "data.producer.workers=1"]
LAYOUTS_VIDEO["dp2_arrival"] = LAYOUTS["dp2_arrival"]
LAYOUTS_VIDEO["dp2_rebalanced"] = LAYOUTS["dp2_rebalanced"]  # the images and frame groups rebalanced
LAYOUTS_VIDEO["dp2_zero1"] = LAYOUTS["dp2_zero1"]
LAYOUTS_VIDEO["dp2_reordered"] = LAYOUTS["dp2_reordered"]
# The layouts compared with the baseline (each ratio is one of them over it, measured in the same alternation).
DISAGGREGATED = {"disagg2", "disagg2_gen", "disagg4_enc2_llm2", "disagg4_enc2", "disagg2_audio", "disagg2_video"}
DISAGGREGATED |= {"disagg2_video_reorder", "dp2_zero1", "dp2_arrival", "dp2_reordered", "dp2_rebalanced"}
DISAGGREGATED |= {"dp2_reordered_rebalanced", "disagg4_enc2_llm2_rebalanced", "megatron_folded_pp2_dp2_rebalanced"}
DISAGGREGATED |= {"dp2_fsdp_arrival", "dp2_fsdp_rebalanced"}
DISAGGREGATED |= {"megatron_folded_pp2_fill", "megatron_folded_pp2_fill_reordered", "megatron_folded_pp2_dp2_fill"}
DISAGGREGATED |= {"megatron_folded_pp2_fill_planned", "megatron_folded_pp2_fill_planned_reordered"}
BASELINES = {2: "megatron_folded_pp2", 4: "megatron_folded_pp2_dp2"}
# Rigid layouts: every module with the same data, tensor and pipeline parallel sizes (the strongest measured one is
# the other reference of each run)
RIGID = {"megatron_folded_pp2", "megatron_folded_tp2", "ddp", "dp2_zero1", "megatron_folded_pp2_dp2"}
DEFAULT_LAYOUTS = {2: "disagg2,megatron_folded_pp2", 4: "disagg4_enc2_llm2,megatron_folded_pp2_dp2"}
# The side-tower workloads (2 processes only): model, data, layouts, default layouts, file prefix.
TOWER_WORKLOADS = {
    "audio": (MODEL_AUDIO, DATA_SHAPE_AUDIO, LAYOUTS_AUDIO, "disagg2_audio,megatron_folded_pp2", "layouts_audio"),
    "video": (MODEL_VIDEO, DATA_SHAPE_VIDEO, LAYOUTS_VIDEO, ",".join(LAYOUTS_VIDEO), "layouts_video"),
}


def shapes(options: dict) -> tuple[list[str], list[str]]:
    """(model overrides, data overrides) of the workload."""
    tower = TOWER_WORKLOADS.get(options["workload"])
    return (tower[0], tower[1]) if tower else (MODEL, DATA_SHAPE)


def train(run_dir: Path, data_dir: Path, options: dict, layout: list[str]) -> list[dict]:
    args = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        *shapes(options)[0],
        *shapes(options)[1],
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


def layout_model(data_dir: Path, options: dict, layout: list[str]):
    """(config, the planner's profiled cost model) of a layout on the workload (docs/PLANNER.md)."""
    from disttrain_core.config import compose
    from disttrain_core.planner import build_layout_model

    model, data = shapes(options)
    overrides = [*model, *data, f"data.path={data_dir}", f"optim.global_batch_size={options['global_batch']}"]
    overrides += [f"optim.micro_batch_size={options['micro_batch']}", *layout]
    cfg = compose(overrides)
    return cfg, build_layout_model(cfg, devices=int(options["processes"]), progress=lambda *_: None)


def planned_split(data_dir: Path, options: dict, layout: list[str]) -> list[str]:
    """A ``*_fill_planned`` layout: the encoder's blocks per stage from the planner's profiled costs."""
    from disttrain_core.planner.api import planned_fill_split

    split = planned_fill_split(*layout_model(data_dir, options, layout))
    return [*layout, f"schedule.fill_split=[{','.join(map(str, split))}]"]


def predicted_step_s(data_dir: Path, options: dict, layout: list[str]) -> dict:
    """The planner's prediction for this layout, from its profiled cost model (docs/PLANNER.md)."""
    from disttrain_core.planner import choices_of_config

    cfg, model = layout_model(data_dir, options, layout)
    evaluation = model.evaluate(*choices_of_config(cfg))
    stages = [round(t, 4) for _, t in evaluation.stage_times]
    out = {"predicted_step_s": evaluation.iteration_s, "predicted_stage_s": stages}
    if options["workload"] == "image":  # the images per sample vary: the straggler model on the shards' own law
        from disttrain_core.planner.stragglers import pipeline_of, straggler_factor, synthetic_law

        producer, order = cfg.data.producer, cfg.data.producer.reorder
        reorder = (producer.address is not None or int(producer.workers) > 0) and bool(order.intra or order.inter)
        factor = straggler_factor(
            pipeline_of(model, evaluation),
            synthetic_law(cfg.data.synthetic),
            reorder,
            rebalance=cfg.parallel.rebalance_items,
        ).factor
        out.update(straggler_factor=factor, predicted_skewed_step_s=evaluation.iteration_s * factor)
    return out


def measure(run_dir: Path, data_dir: Path, options: dict, layout: list[str], out: Path) -> dict:
    metrics = train(run_dir, data_dir, options, layout)
    timed = [m for m in metrics if "perf/samples_per_s" in m]
    window = timed[1:] or timed  # after the first logging window, when there is more than one
    entry = {
        "samples_per_s": statistics.median(m["perf/samples_per_s"] for m in window),
        "step_time_s": statistics.median(m["perf/step_time_s"] for m in window),
        "losses": [round(m["loss"], 4) for m in metrics if "loss" in m],
    }
    reports = [json.loads(p.read_text()) for p in sorted((run_dir / "timelines").glob("step_*.json"))]
    if reports:  # named after the results file (bench_layouts_video.json -> layouts_video_<layout>.png)
        picture = out.parent / f"{out.stem.removeprefix('bench_')}_{run_dir.name}.png"
        shutil.copy(reports[-1]["png"], picture)
        entry["picture"] = str(picture.relative_to(REPO_ROOT) if picture.is_relative_to(REPO_ROOT) else picture)
        entry["simulated_bubble_fraction"] = statistics.median(
            r["simulated_bubble_fraction"] for r in reports[1:] or reports
        )
    return entry


def main(argv: list[str]) -> int:
    options, _ = split_tool_args(argv, OPTIONS)
    processes, repeats = int(options["processes"]), int(options["repeats"])
    if processes not in BASELINES or repeats < 1:
        raise SystemExit(
            f"processes={options['processes']} repeats={options['repeats']}: use processes=2 or 4, repeats>=1"
        )
    tower = TOWER_WORKLOADS.get(options["workload"])
    if (options["workload"] != "image" and not tower) or (tower and processes != 2):
        raise SystemExit(
            f"workload={options['workload']} processes={processes}: use workload=image, or audio or video on 2"
        )
    offered, baseline = (LAYOUTS if processes == 2 else LAYOUTS_4), BASELINES[processes]
    offered = tower[2] if tower else offered
    default = tower[3] if tower else DEFAULT_LAYOUTS[processes]
    requested = default if options["layouts"] == "default" else options["layouts"]
    names = list(offered) if requested == "all" else requested.split(",")
    unknown = [n for n in names if n not in offered]
    if unknown or baseline not in names or not DISAGGREGATED & set(names):
        raise SystemExit(
            f"layouts={requested}: choose from {', '.join(offered)} (processes={processes}), including {baseline} "
            f"and one of {', '.join(sorted(DISAGGREGATED & offered.keys()))}"
        )
    chosen = {n: offered[n] for n in names}
    out = Path(options["out"]).resolve()
    if tower and options["out"] == OPTIONS["out"]:  # each workload keeps its own default file
        out = out.with_name(f"bench_{tower[4]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "workload": options["workload"],
        "model_overrides": shapes(options)[0],
        "data_overrides": shapes(options)[1],
        "processes": processes,
        "global_batch": int(options["global_batch"]),
        "micro_batch": int(options["micro_batch"]),
        "steps": int(options["steps"]),
        "repeats": repeats,
        "layouts": {},
    }
    runs: dict[str, list[dict]] = {n: [] for n in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "shards"
        subprocess.run(
            [
                sys.executable,
                str(REPO_ROOT / "tools" / "make_shards.py"),
                f"out={data_dir}",
                *shapes(options)[1],
                f"data.synthetic.samples_per_shard={options['samples_per_shard']}",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        for name in [n for n in chosen if "_planned" in n]:  # the planner splits the encoder's blocks
            chosen[name] = planned_split(data_dir, options, chosen[name])
        for repeat in range(repeats):  # alternate the order: each layout runs first as often as last
            order = list(chosen) if repeat % 2 == 0 else list(reversed(chosen))
            for name in order:
                entry = measure(Path(tmp) / name, data_dir, options, chosen[name], out)
                shutil.rmtree(Path(tmp) / name)
                runs[name].append(entry)
                if options["format"] != "json":
                    rate, step = entry["samples_per_s"], entry["step_time_s"]
                    print(
                        f"repeat {repeat + 1}/{repeats} {name:24s} {rate:8.2f} samples/s  step {step:.3f}s", flush=True
                    )
        for name, layout in chosen.items():
            entries = runs[name]
            entry = {
                "overrides": layout,
                "samples_per_s": statistics.median(e["samples_per_s"] for e in entries),
                "samples_per_s_runs": [round(e["samples_per_s"], 3) for e in entries],
                "step_time_s": statistics.median(e["step_time_s"] for e in entries),
                "losses": entries[0]["losses"],
                **{k: entries[-1][k] for k in ("picture", "simulated_bubble_fraction") if k in entries[-1]},
            }
            if any(e["losses"] != entries[0]["losses"] for e in entries):
                raise SystemExit(f"{name}: repeated runs gave different losses: {[e['losses'] for e in entries]}")
            if options["predict"] == "true":
                entry.update(predicted_step_s(data_dir, options, layout))
                entry["predicted_over_measured"] = entry["predicted_step_s"] / entry["step_time_s"]
                if "predicted_skewed_step_s" in entry:
                    entry["skewed_predicted_over_measured"] = entry["predicted_skewed_step_s"] / entry["step_time_s"]
            results["layouts"][name] = entry
    ratios = {
        name: [d["samples_per_s"] / b["samples_per_s"] for d, b in zip(runs[name], runs[baseline], strict=True)]
        for name in DISAGGREGATED & chosen.keys()
    }
    best = max(ratios, key=lambda n: statistics.median(ratios[n]))
    results["best_disaggregated"] = best
    results["disaggregated_over_megatron"] = statistics.median(ratios[best])
    results["ratio_runs"] = {n: [round(r, 4) for r in v] for n, v in ratios.items()}
    results["ratio_spread"] = [min(ratios[best]), max(ratios[best])]
    # Over the strongest rigid layout measured (by median throughput), not only the Megatron pipeline baseline
    rigid = [n for n in chosen if n in RIGID]
    if rigid:
        strongest = max(rigid, key=lambda n: results["layouts"][n]["samples_per_s"])
        challengers = [n for n in ratios if n not in RIGID]
        if challengers:
            over = {
                n: [d["samples_per_s"] / r["samples_per_s"] for d, r in zip(runs[n], runs[strongest], strict=True)]
                for n in challengers
            }
            top = max(over, key=lambda n: statistics.median(over[n]))
            results["strongest_rigid"] = strongest
            results["best_over_strongest_rigid"] = {
                "layout": top,
                "median": statistics.median(over[top]),
                "spread": [min(over[top]), max(over[top])],
                "runs": {n: [round(r, 4) for r in v] for n, v in over.items()},
            }
    if options["predict"] == "true":
        layouts = results["layouts"]
        predicted = layouts[baseline]["predicted_step_s"] / layouts[best]["predicted_step_s"]
        results["predicted_ratio"] = predicted
        results["measured_over_predicted_ratio"] = results["disaggregated_over_megatron"] / predicted
    out.write_text(json.dumps(results, indent=1))
    if options["format"] == "json":
        print(json.dumps(results))
    else:
        low, high = results["ratio_spread"]
        guess = f", predicted {results['predicted_ratio']:.2f}" if "predicted_ratio" in results else ""
        print(
            f"best disaggregated ({best}) / megatron throughput: median {results['disaggregated_over_megatron']:.2f} "
            f"over {repeats} alternation(s) (spread {low:.2f}-{high:.2f}){guess}"
        )
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
