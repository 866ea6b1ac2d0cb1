"""Chaos drill for per-step fault tolerance (trainer.fault_tolerance, docs/FAULT_TOLERANCE.md): one job of
``replicas`` replica groups of one process trains ``steps`` steps while ``kills`` of its processes are SIGKILLed,
each at a planned point of a planned step -- as a step begins (``step``), in a forward (``forward``), in a backward
(``backward``), while the groups' all-reduce is under way (``allreduce``) or while a checkpoint is being written
(``save``) -- and the same job without a failure is the reference.

Plan (fixed before running; base/faults.py): kill ``i`` of ``kills`` hits group ``i % replicas`` (that group's
``i // replicas``-th start, so a replacement meets its own next fault) at step ``first + i * spacing``; group 0's
odd-numbered kills strike while it writes a checkpoint (the first group of a quorum writes them; the step is
rounded to the nearest multiple of ``checkpoint_every``), the others cycle through step, forward, backward and
all-reduce.

Reported (JSON; a PNG of committed steps against wall seconds with each failure marked): failures survived (the
launcher's record), unplanned failures (a failure no plan entry explains: a survivor that crashed), survivors'
restarts (group starts beyond one per planned failure), steps committed and by how many groups, samples lost or
repeated (each group's final data position against the reference's), seconds per step with and without failures
(``train.py``'s wall time over ``steps``), and the largest difference of the final parameters from the reference's
(fp32, the same seed and data: the math is the same through failures, so it should be rounding only).

    python tools/chaos.py                                   # 4 replicas, 200 steps, 20 kills: ~12 minutes here
    python tools/chaos.py steps=60 kills=5 format=json      # a quick one
    python tools/chaos.py trainer.fault_tolerance.timeout_s=10   # other names: Hydra overrides for both runs
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain_core.config import REPO_ROOT  # noqa: E402
from disttrain_core.launch.cli import split_tool_args, tool_main  # noqa: E402
from disttrain_core.validation import ConfigError  # noqa: E402

OPTIONS = {
    "replicas": "4",
    "steps": "200",
    "kills": "20",
    "first": "10",  # the step of the first kill
    "checkpoint_every": "10",
    "timeout_s": "5",  # trainer.fault_tolerance.timeout_s: how long a survivor waits on a dead peer's collective
    "format": "text",
    "out": str(REPO_ROOT / "docs" / "results" / "chaos.json"),
    "picture": str(REPO_ROOT / "docs" / "results" / "chaos.png"),
}
NON_SAVE = ("step", "forward", "backward", "allreduce")
# mllm_tiny with the test suite's smaller LLM, fp32, on small images
MODEL = ["model.llm.n_layers=2", "model.llm.ffn_dim=128", "model.seq_len=128"]


def plan(options: dict[str, str]) -> list[dict]:
    """The kills: each a group (job rank: groups of one process), its start, a point and a step."""
    replicas, steps, kills = int(options["replicas"]), int(options["steps"]), int(options["kills"])
    first, every = int(options["first"]), int(options["checkpoint_every"])
    spacing = (steps - first - 2 * every) // max(kills, 1)
    if spacing < 1:
        raise ConfigError(f"kills={kills} do not fit in steps={steps} after first={first}: use more steps")
    planned = []
    for i in range(kills):
        group, start = i % replicas, i // replicas
        step = first + i * spacing
        if group == 0 and start % 2 == 1:
            point, step = "save", round(step / every) * every  # the nearest checkpoint's step
        else:
            point = NON_SAVE[(i + start) % len(NON_SAVE)]
        planned.append({"group": group, "start": start, "point": point, "step": step})
    return planned


def fault_text(planned: list[dict]) -> str:
    return ";".join(f"kill@{k['point']}:rank={k['group']}:step={k['step']}:restart={k['start']}" for k in planned)


def make_shards(out: Path) -> None:
    """The embedded data's generator with small images (the test suite's), written once for both jobs."""
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    generate_shards(SyntheticDataConfig(num_shards=4, samples_per_shard=64, image_side_max=128), out, processes=1)


def train(options: dict[str, str], run_dir: Path, fault: str | None) -> float:
    """One job; its wall seconds."""
    import os

    args = [
        *MODEL,
        f"trainer.devices={options['replicas']}",
        "trainer.accelerator=cpu",
        "trainer.precision=32",
        f"trainer.max_steps={options['steps']}",
        "trainer.log_every_n_steps=1",
        "trainer.progress_bar=false",
        f"trainer.checkpoint.every_n_steps={options['checkpoint_every']}",
        "trainer.checkpoint.async_save=false",
        "trainer.fault_tolerance.enabled=true",
        f"trainer.fault_tolerance.replicas={options['replicas']}",
        f"trainer.fault_tolerance.timeout_s={options['timeout_s']}",
        f"optim.global_batch_size={options['replicas']}",
        "optim.micro_batch_size=1",
        "data.num_workers=0",
        f"data.path={run_dir.parent / 'shards'}",
        "data.generate_if_missing=false",
        "logger.tensorboard=false",
        *json.loads(options["_extra"]),
        f"hydra.run.dir={run_dir}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "DISTTRAIN_FAULT"}
    # more processes than cores here: OpenMP's spinning waiters would take the cores the others need (as in the
    # test suite, tests/conftest.py; 20 steps of 4 groups on 2 cores took 40 s with spinning, 16 s without)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if fault:
        env["DISTTRAIN_FAULT"] = fault
    started = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        code = subprocess.run(
            [sys.executable, str(REPO_ROOT / "train.py"), *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=log
        ).returncode
    if code != 0:
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text()[-2500:]
        raise SystemExit(f"the {'chaos' if fault else 'reference'} job failed (exit {code}):\n{tail}")
    return time.monotonic() - started


def largest_difference(a: Path, b: Path) -> float:
    from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

    ours, theirs = (
        read_tensors(latest_checkpoint(a / "checkpoints")),
        read_tensors(latest_checkpoint(b / "checkpoints")),
    )
    if ours.keys() != theirs.keys():
        raise SystemExit("the two jobs' checkpoints hold different tensors")
    return max((ours[n].double() - theirs[n].double()).abs().max().item() for n in ours)


def positions(report: dict) -> list[str]:
    """The groups' distinct final data positions (epoch, index, samples skipped): one if none lost or repeated."""
    keys = ("epoch", "index", "skipped")
    return sorted({json.dumps([g["data"][k] for k in keys]) for g in report["groups"].values()})


def summarize(options: dict[str, str], planned: list[dict], runs: dict, seconds: dict) -> dict:
    chaos, reference = (json.loads((runs[k] / "fault_tolerance.json").read_text()) for k in ("chaos", "reference"))
    steps = int(options["steps"])
    explained = {(k["group"], k["start"]) for k in planned}
    failures = chaos["failures"]
    unplanned = [f for f in failures if (f["group"], f["start"]) not in explained or f["cause"] != "SIGKILL"]
    fired = {(f["group"], f["start"]) for f in failures} & explained
    starts = sum(chaos["starts"].values())
    committed = committed_steps(runs["chaos"])
    by_size: dict[str, int] = {}
    for _, size in committed.values():
        by_size[str(size)] = by_size.get(str(size), 0) + 1

    return {
        "setting": {k: v for k, v in options.items() if not k.startswith("_") and k not in ("out", "picture")},
        "planned_kills": len(planned),
        "kills_by_point": {p: sum(k["point"] == p for k in planned) for p in (*NON_SAVE, "save")},
        "failures_survived": len(failures),
        "planned_kills_that_fired": len(fired),
        "unplanned_failures": len(unplanned),
        "survivor_restarts": starts - int(options["replicas"]) - len(failures),
        "given_up_groups": chaos["given_up"],
        "steps_committed": len(committed),
        "all_steps_committed": sorted(committed) == list(range(1, steps + 1)),
        "steps_by_quorum_size": by_size,
        "final_data_positions": {"chaos": positions(chaos), "reference": positions(reference)},
        "samples_lost_or_repeated": positions(chaos) != positions(reference),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "seconds_per_step": {k: round(v / steps, 3) for k, v in seconds.items()},
        "seconds_per_failure": round((seconds["chaos"] - seconds["reference"]) / max(len(failures), 1), 1),
        "max_parameter_difference": largest_difference(runs["chaos"], runs["reference"]),
        "failures": failures,
        "plan": planned,
    }


def committed_steps(run: Path) -> dict[int, tuple[float, int]]:
    """Each committed step -> (when the first group to log it ended it, unix seconds; the groups that took part),
    from every group's metrics (a replacement appends to its group's)."""
    steps: dict[int, tuple[float, int]] = {}
    for metrics in (run / "replicas").glob("r*/metrics.jsonl"):
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "loss" in row:
                ended, groups = steps.get(row["step"], (row["time"], 0))
                steps[row["step"]] = (min(ended, row["time"]), max(groups, int(row["fault_tolerance/groups"])))
    return steps


def draw(runs: dict, result: dict, path: str) -> None:
    """Committed steps against wall seconds for both jobs, each failure marked by its point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    origin = {}
    for name, run in runs.items():
        ended = {step: when for step, (when, _) in committed_steps(run).items()}
        origin[name] = min(ended.values())
        ax.plot([ended[s] - origin[name] for s in sorted(ended)], sorted(ended), label=name)
    points = {f"{k['group']}/{k['start']}": k["point"] for k in result["plan"]}
    colors = dict(zip((*NON_SAVE, "save"), ("C2", "C3", "C4", "C5", "C6"), strict=True))
    shown = set()
    for failure in result["failures"]:
        point = points.get(f"{failure['group']}/{failure['start']}", "unplanned")
        label = None if point in shown else f"kill at {point}"
        shown.add(point)
        ax.axvline(failure["time"] - origin["chaos"], color=colors.get(point, "k"), lw=0.8, alpha=0.7, label=label)
    ax.set_xlabel("seconds since the first step ended")
    ax.set_ylabel("committed step")
    ax.set_title(
        f"{result['failures_survived']} failures survived, {result['steps_committed']} steps committed, "
        f"parameters within {result['max_parameter_difference']:.1e} of the run without failures"
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, OPTIONS)
    options["_extra"] = json.dumps(overrides)
    planned = plan(options)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        runs = {"reference": Path(tmp) / "reference", "chaos": Path(tmp) / "chaos"}
        make_shards(Path(tmp) / "shards")
        seconds = {}
        for name, run in runs.items():
            print(f"{name}: {options['steps']} steps on {options['replicas']} replica groups ...", flush=True)
            seconds[name] = train(options, run, fault_text(planned) if name == "chaos" else None)
        result = summarize(options, planned, runs, seconds)
        Path(options["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(options["out"]).write_text(json.dumps(result, indent=1) + "\n")
        if options["picture"]:
            draw(runs, result, options["picture"])
    if options["format"] == "json":
        print(json.dumps(result, indent=1))
    else:
        keys = [k for k in result if k not in ("failures", "plan", "setting")]
        print("\n".join(f"{k}: {result[k]}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
