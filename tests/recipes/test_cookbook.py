"""Every command of the cookbook (docs/COOKBOOK.md; the README's front page links it) runs in CI, in a reduced
form.

The commands are read from docs/COOKBOOK.md itself, so a command added there without a reduced form here
fails ``test_every_cookbook_command_has_a_reduced_form``. Reduced means: the test shards instead of
the embedded data, models shrunk by ``tiny_overrides`` (structure kept), 2 optimizer steps, the
profiler's shortest measurement. Layouts, schedules, process counts and every other override are the
command's own. ``python train.py`` commands run in this process through ``launch`` (ranks fork from
the session's warm fork server); tools run their ``main``.

A command another test already runs as typed is named with that test (ELSEWHERE), and so is a
command that needs what this machine does not have -- SLURM, other hosts, the Meta-Llama weights --
with the test that runs its emulation (srun-style variables, two emulated nodes, randomly
initialized Hugging Face weights); that test must exist and be part of ``make test``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import math
import shlex
from pathlib import Path

import pytest

from disttrain_core.config import compose
from disttrain_core.launch.entry import launch

from ..conftest import REPO, base_overrides, cli_overrides, read_metrics, run_script, run_train, tiny_overrides
from .hf_files import hf_files

pytestmark = pytest.mark.distributed


def cookbook() -> dict[str, list[str]]:
    """The cookbook's commands as the shell passes them (continuation lines joined, comments
    dropped), keyed by their arguments joined with single spaces."""
    text = (REPO / "docs" / "COOKBOOK.md").read_text()
    block = text.split("# Cookbook", 1)[1].split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = {}
    for line in block.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                commands[" ".join(argv)] = argv
    commands.pop(". .venv/bin/activate")
    return commands


# Commands another test of make test runs as typed (reduced alike), or -- for what this machine does not
# have -- runs their emulation: command -> that test.
LLAVA = "tests/distributed/test_llava_two_stage.py::test_llava_two_stages_from_hugging_face_parts"  # random HF parts
ELSEWHERE = {
    "python train.py model=llama_tiny data=tokens data.path=/data/tokens.npy": (
        "tests/distributed/test_token_file_training.py::test_two_processes_and_a_resumed_run_equal_one_process"
    ),
    "python train.py model=llama_tiny parallel=dp parallel.cp=2 trainer.devices=4": (
        "tests/distributed/test_context_parallel_training.py::test_llama_context_parallel_matches_one_process[dp2_cp2]"
    ),
    "python train.py model=llama_moe_tiny parallel=zero1 parallel.ep=2 trainer.devices=4": (
        "tests/distributed/test_moe_training.py::test_expert_parallel_moe_matches_one_process"
    ),
    "python train.py parallel=disagg4_tp2": (
        "tests/distributed/test_units.py::test_four_process_layouts_match_one_process[disagg4_tp2]"
    ),
    "python train.py parallel=megatron_pp2": (
        "tests/distributed/test_units.py::test_four_process_layouts_match_one_process[megatron_pp2]"
    ),
    "python tools/netem_cluster.py nodes=2 rate=1gbit -- python train.py trainer.num_nodes=2 trainer.devices=1 "
    "hydra.run.dir=outputs/netem": "tests/distributed/test_netem.py::test_two_emulated_nodes_reproduce_one_node",
    "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=0 python train.py trainer.num_nodes=2 trainer.devices=8": (
        "tests/distributed/test_netem.py::test_two_emulated_nodes_reproduce_one_node"
    ),
    "srun --ntasks-per-node=8 python train.py trainer.devices=8 trainer.num_nodes=4 trainer.resume=auto": (
        "tests/faults/test_launchers.py::test_srun_tasks_start_one_job"
    ),
    "torchrun --nproc-per-node 2 train.py trainer.devices=2": (
        "tests/faults/test_launchers.py::test_torchrun_starts_one_job"
    ),
    "python tools/flight.py outputs/train/runs/<run>": (
        "tests/faults/test_launchers.py::test_hung_rank_is_named_by_the_flight_tool"
    ),
    "python train.py model=llama3_8b model.init_from=/w/Meta-Llama-3.1-8B": (
        "tests/distributed/test_pretrained.py::test_llama_weights_land_in_tensor_parallel_shards"
    ),
    "python train.py recipe=llava_two_stage model.init_from={llm: /w/llama, encoder: /w/clip} "
    "hydra.run.dir=outputs/llava1": LLAVA,
    "python train.py recipe=llava_two_stage_sft trainer.checkpoint.initial_load=outputs/llava1 "
    "data.path=/data/llava_shards": LLAVA,
    "python train.py model/encoder=vit_tiny model/llm=llama_tiny model/generator=unet_tiny": (
        "tests/unit/test_model_modules.py::test_the_modules_of_mllm_tiny_train_as_the_preset"
    ),
    "python train.py model=any2any_tiny data=synthetic_any2any": (
        "tests/distributed/test_any2any.py::test_one_process_trains_on_images_video_and_audio"
    ),
    # the test runs it at 6 processes (the audio tower at dp=2) fed by a data producer, against one process
    "python train.py model=any2any_tiny data=synthetic_any2any parallel=disagg5_audio": (
        "tests/distributed/test_any2any.py::test_layouts_match_one_process[audio_units]"
    ),
    "python train.py model=any2any_video_tiny data=synthetic_any2any": (
        "tests/distributed/test_any2any.py::test_one_process_trains_with_a_video_tower"
    ),
    # the test runs it at 7 processes (the video tower at dp=2) fed by a data producer, against one process
    "python train.py model=any2any_video_tiny data=synthetic_any2any parallel=disagg6_video": (
        "tests/distributed/test_any2any.py::test_video_tower_layouts_match_one_process[three_encoder_units]"
    ),
    # the vocabulary size 476 is the embedded data's; the test reads the size its tokenizer reports
    "python tools/train_tokenizer.py out=data/tokenizer": (
        "tests/unit/test_tokenizer.py::test_the_tool_writes_a_tokenizer_the_trainer_reads"
    ),
    "python train.py model=llama_tiny data.tokenizer=data/tokenizer/tokenizer.json model.llm.vocab_size=476": (
        "tests/unit/test_tokenizer.py::test_llama_trains_with_the_trained_tokenizer"
    ),
    # the sweeps as typed (plus the test shards); Hydra's multirun needs its own process
    "python train.py -m optim.lr=1e-3,3e-4 trainer.max_steps=5 trainer.devices=2": (
        "tests/distributed/test_sweeps.py::test_multirun_with_two_processes_per_job"
    ),
    "python train.py hparams_search=optuna": (
        "tests/distributed/test_sweeps.py::test_optuna_sweeper_runs_trials_and_reports_the_best"
    ),
    # validation needs the held-out split beside the test shards (tests/conftest.py val_shards)
    "python train.py trainer.val_every_n_steps=5 trainer.max_steps=20": (
        "tests/distributed/test_validation.py::test_validation_is_logged_and_leaves_training_bit_equal"
    ),
    "python tools/evaluate.py path=outputs/exp1 trainer.devices=1": (
        "tests/distributed/test_validation.py::test_a_layouts_validation_loss_equals_one_process"
    ),
    # samples and the four trackers (W&B, MLflow: the .[trackers] extra the suite installs), then generation
    "python train.py trainer.sample_every_n_steps=50 logger=[tensorboard,csv,wandb,mlflow]": (
        "tests/distributed/test_sampling.py::test_every_tracker_holds_the_same_series_and_the_samples"
    ),
    "python tools/generate.py path=outputs/exp1 prompt=photo of a red temperature=0.8 top_p=0.9 samples=4": (
        "tests/distributed/test_sampling.py::test_generate_tool_reads_the_checkpoint_and_its_cache_changes_no_token"
    ),
}
# One run directory through three commands, then the checkpoint tool on it (test_resume_chain).
RESUME_CHAIN = [
    "python train.py hydra.run.dir=outputs/exp1 trainer.checkpoint.every_n_steps=50",
    "python train.py hydra.run.dir=outputs/exp1 trainer.resume=auto",
    "python train.py hydra.run.dir=outputs/exp1 trainer.resume=auto parallel=megatron_tp2",
    "python tools/checkpoint.py verify path=outputs/exp1",
]
# The benchmarks, reduced: fewer steps, layouts, rounds, groups and samples (their full runs: make bench).
BENCHMARKS = {
    "python tools/bench_layouts.py": [
        "steps=2",
        "repeats=1",
        "layouts=disagg2,megatron_folded_pp2",
        "predict=false",
        "samples_per_shard=16",
        "global_batch=8",
    ],
    "python tools/bench_layouts.py workload=video": [
        "layouts=disagg2_video_reorder,megatron_folded_pp2",
        "steps=2",
        "repeats=1",
        "predict=false",
        "samples_per_shard=16",
        "global_batch=8",
    ],
    "python tools/bench_layouts.py layouts=megatron_folded_pp2,dp2_zero1,dp2_arrival,dp2_reordered,dp2_rebalanced,"
    "dp2_reordered_rebalanced repeats=3": [
        "layouts=dp2_rebalanced,megatron_folded_pp2",
        "steps=2",
        "repeats=1",
        "predict=false",
        "samples_per_shard=16",
        "global_batch=8",
    ],
    "python tools/bench_reorder.py": ["measure=false", "groups=16,64", "trials=1"],
    "python tools/regime.py": ["models=mllm9b", "gpus=256", "presets=laion_pairs,gen_512"],
    "sudo python tools/bench_overlap.py": ["network=loopback", "cycles=2", "block=2", "rounds=1"],
    "sudo python tools/bench_local_sgd.py": [
        "scenarios=straggler",
        "methods=dp,a_edit",
        "steps=6",
        "warmup=2",
        "sync_every=2",
        "heldout=16",
        "picture=none",
    ],
    "sudo python tools/bench_overlap.py rate=500mbit micro_batch=6 network=emulated": [
        "cycles=2",
        "block=2",
        "rounds=1",
        "picture=none",
    ],
}
OTHER = {"tensorboard --logdir outputs/", "python train.py --cfg job"}  # their own tests below


def kind(command: str) -> str:
    if command in ELSEWHERE:
        return "elsewhere"
    if command in RESUME_CHAIN:
        return "chain"
    if command in BENCHMARKS:
        return "benchmark"
    if command in OTHER:
        return "other"
    argv = COMMANDS[command]
    if argv[:2] == ["python", "train.py"] and "data=hf" in argv:
        return "hf"
    if argv[:2] == ["python", "train.py"]:
        return "train"
    if argv[0] == "python" and argv[1].startswith("tools/"):
        return "tool"
    return "unknown"


COMMANDS = cookbook()
TRAIN = [c for c in COMMANDS if kind(c) == "train"]
TOOLS = [c for c in COMMANDS if kind(c) == "tool"]
HF = [c for c in COMMANDS if kind(c) == "hf"]


def test_every_cookbook_command_has_a_reduced_form():
    unknown = [c for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, f"cookbook commands without a reduced form in {__file__}: {unknown}"
    stale = [c for c in [*ELSEWHERE, *RESUME_CHAIN, *BENCHMARKS, *OTHER] if c not in COMMANDS]
    assert not stale, f"no longer in docs/COOKBOOK.md: {stale}"


@pytest.mark.parametrize("command", sorted(set(ELSEWHERE.values())))
def test_the_test_named_for_a_command_exists_and_runs_in_make_test(command):
    path, node = command.split("::")
    name, _, parameter = node.partition("[")
    tree = ast.parse((REPO / path).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert name in functions, f"{command} is gone: update ELSEWHERE"
    decorators = [ast.unparse(d) for d in functions[name].decorator_list]
    assert "pytest.mark.slow" not in decorators, f"{command} is marked slow: make test skips it"
    if parameter:
        assert any(repr(parameter.rstrip("]")) in d for d in decorators), f"{command}: no such parameter"
    module_marks = [
        ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and "pytestmark" in ast.unparse(node)
    ]
    assert not any("slow" in m for m in module_marks), f"{path} is marked slow"


def reduce(overrides: list[str], shards: Path, run_dir: Path) -> list[str]:
    """The command's overrides on the test shards, a tiny model, 2 steps, a log line per step (the
    command's own values win except for these)."""
    reduced = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "data.path" and "{" in value:  # a brace pattern over the test shards instead, quoted alike
            override = f"data.path='{shards}/shard-{{000000..000003}}.tar'"
        if key == "data.packing.corpus":  # a text corpus of shards: the test shards' captions
            override = f"data.packing.corpus={shards}"
        reduced.append(override)
    data = [] if any(o.startswith("data.path=") for o in reduced) else [f"data.path={shards}"]
    # the command's own decode workers (base_overrides turns them off for tests that compare losses)
    run = [o for o in base_overrides(shards, run_dir) if not o.startswith(("data.path=", "data.num_workers="))]
    run += data
    run += ["trainer.log_every_n_steps=1", "optim.warmup_steps=1", "planner.profile_repeats=1"]
    if not any(o == "trainer.dry_run=true" for o in reduced):
        run += ["trainer.max_steps=2"]
    cfg = compose(reduced + run)
    return reduced + run + ([] if cfg.trainer.dry_run else tiny_overrides(cfg))


def train(command: str, shards: Path, run_dir: Path, extra: tuple[str, ...] = ()):
    """Run a ``python train.py`` command reduced, with ``extra`` overrides last (they win): (its config,
    its metrics)."""
    cfg = compose(reduce(COMMANDS.get(command, shlex.split(command))[2:], shards, run_dir) + list(extra))
    launch(cfg)
    return cfg, read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


@pytest.mark.parametrize("command", TRAIN, ids=TRAIN)
def test_train_command(command, shards, tmp_path):
    run_dir = tmp_path / "run"
    cfg, metrics = train(command, shards, run_dir)
    if cfg.trainer.dry_run:
        assert (run_dir / "plan.json").is_file() and not metrics
        return
    check_trained(cfg, metrics, run_dir)


@pytest.mark.parametrize("command", HF, ids=HF)
def test_hf_command(command, shards, tmp_path):
    """A data=hf command on files of its kind the test writes where its path points (moved under tmp_path)."""
    path = next(a for a in COMMANDS[command] if a.startswith("data.path=")).partition("=")[2].strip("'")
    local = hf_files(path, tmp_path)
    run_dir = tmp_path / "run"
    extra = (f"data.path='{local}'", f"data.hf.cache_dir={tmp_path / 'cache'}")
    cfg, metrics = train(command, shards, run_dir, extra=extra)
    check_trained(cfg, metrics, run_dir)
    assert metrics[-1].get("data/skipped_samples", 0) == 0
    if cfg.data.hf.columns.get("image"):
        assert metrics[-1]["gen_loss"] > 0, metrics[-1]  # the generator had images to reconstruct


def check_trained(cfg, metrics, run_dir: Path) -> None:
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    assert (run_dir / "checkpoints" / "latest").is_file()
    if cfg.trainer.record_timeline:
        assert list(run_dir.glob("timelines/*.png"))


def run_tool(path: str, argv: list[str], cwd: Path) -> str:
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.chdir(cwd):
        status = tool.main(argv)
    assert status in (0, None), printed.getvalue()[-2000:]
    return printed.getvalue()


@pytest.mark.parametrize("command", TOOLS, ids=TOOLS)
def test_tool_command(command, tmp_path):
    argv = COMMANDS[command][2:]
    if command.startswith("python tools/make_shards.py"):  # 64 shards of 1,000 samples -> 2 of 4
        argv = [f"out={tmp_path / 'shards'}", *argv[1:], "data.synthetic.num_shards=2"]
        argv += ["data.synthetic.samples_per_shard=4", "processes=1"]
    printed = run_tool(COMMANDS[command][1], argv, tmp_path)
    assert printed.strip()
    if "format=json" in argv:
        json.loads(printed)
    if command.startswith("python tools/make_shards.py"):
        assert len(list((tmp_path / "shards").glob("*.tar"))) == 2


@pytest.mark.slow  # 30 s: three runs and the checkpoint tool; resume=auto and resharded resumes stay in make test
def test_resume_chain(shards, tmp_path):
    """A fixed run directory, resume=auto there, resume in another layout, then the checkpoint tool."""
    run_dir = tmp_path / "outputs" / "exp1"
    steps = []
    for command, last in zip(RESUME_CHAIN[:3], (2, 3, 4), strict=True):
        argv = [a for a in COMMANDS[command][2:] if not a.startswith("hydra.run.dir=")]
        train(shlex.join(["python", "train.py", *argv]), shards, run_dir, extra=(f"trainer.max_steps={last}",))
        steps.append(read_metrics(run_dir)[-1]["step"])
    assert steps == [2, 3, 4]
    verified = run_tool("tools/checkpoint.py", ["verify", f"path={run_dir}"], tmp_path)
    assert "verified" in verified


# The two benchmarks that run training on emulated nodes are checked in make test-slow (~70 s); the default
# bench_overlap command (its loopback half) stays in make test.
SLOW_BENCHMARKS = {
    "sudo python tools/bench_local_sgd.py",
    "sudo python tools/bench_overlap.py rate=500mbit micro_batch=6 network=emulated",
}


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_BENCHMARKS else c for c in BENCHMARKS]
)
def test_benchmark_command(command, tmp_path):
    argv = COMMANDS[command]
    if argv[0] == "sudo":
        argv = argv[1:]
    out = tmp_path / "result.json"
    args = [*argv[2:], *BENCHMARKS[command], f"out={out}"]
    done = run_script(REPO / argv[1], args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    if "network=emulated" in args and "skipped" in result["networks"]["emulated"]:
        pytest.skip(result["networks"]["emulated"]["skipped"])
    assert result
    for entry in result.get("networks", {}).values() if "bench_overlap" in command else ():
        cost = entry["ring_cost"]  # tools/ring_cost.py on the same network: CPU per ring step, measured
        assert cost["reduce_scatter"]["cpu_ms"] > 0 and cost["all_gather"]["cpu_ms"] > 0
        assert cost["cpu_ms_per_step"] == pytest.approx(
            (cost["reduce_scatter"]["cpu_ms"] + cost["all_gather"]["cpu_ms"]) * cost["buckets_per_step"]
        )


def test_quick_start_learns_and_tensorboard_reads_it(shards, tmp_path):
    """`make train` (`python train.py`), 30 steps on the test shards: the loss falls by a third; TensorBoard
    reads the run's loss curve (`tensorboard --logdir outputs/`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, metrics = train("python train.py", shards, tmp_path / "outputs", extra=("trainer.max_steps=30",))
    assert metrics[-1]["step"] == 30
    assert metrics[-1]["loss"] < 0.67 * metrics[0]["loss"], (metrics[0]["loss"], metrics[-1]["loss"])
    events = {p.parent for p in (tmp_path / "outputs").rglob("events.out.tfevents.*")}
    assert len(events) == 1
    accumulator = EventAccumulator(str(events.pop()))
    accumulator.Reload()
    curve = [event.value for event in accumulator.Scalars("train/loss")]
    assert len(curve) == 30 and curve[-1] == pytest.approx(metrics[-1]["loss"], rel=1e-5)


def test_print_the_composed_config(shards, tmp_path):
    done = run_train(["--cfg", "job", *cli_overrides(shards, tmp_path)], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trainer:" in done.stdout and "parallel:" in done.stdout
