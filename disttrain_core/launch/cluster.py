"""What a recipe's header means as a job: the sbatch script Hydra's SLURM launcher submits for it, or the
torchrun command, for people who submit by hand (tools/launch_script.py, docs/RECIPES.md).

A GPU recipe's header carries its launch command (``# Launch: python train.py recipe=<name> ...``) and its
assumptions (``# Assumes: <G> GPUs (<N> nodes x <D>), <M> GB each, ... (cluster=<preset>)``). The job is
composed from the recipe, the header's arguments and the caller's overrides with a launcher preset of
conf/hydra/launcher/ (``slurm`` by default), validated as it will be on the cluster -- the GPU cluster preset
against the layout's GPUs (validation/cluster_fit.py) and memory (planner/fit.py) included -- and rendered by
submitit's own sbatch writer with the launcher's parameters, exactly as the plugin passes them, so the
``#SBATCH`` lines are the ones ``python train.py -m recipe=<name> hydra/launcher=slurm`` submits
(tests/unit/test_launch_script.py).

``parallel=auto`` recipes are planned here as every rank will plan them (analytic costs, the same config): the
job must start exactly the GPUs the plan uses, in whole nodes, or it is refused in one line.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RECIPES_DIR, REPO_ROOT, compose, group_options, override_key, typed_config
from ..planner.fit import validate_run
from ..validation import ConfigError
from ..validation.cluster_fit import check_signal_window

LAUNCH_LINE = re.compile(r"^# Launch: python train\.py recipe=(?P<name>\S+)(?P<args>.*)$", re.MULTILINE)
ASSUMES_LINE = re.compile(
    r"^# Assumes: (?P<gpus>\d+) GPUs \((?P<nodes>\d+) nodes? x (?P<per_node>\d+)\), (?P<memory>\d+(?:\.\d+)?) GB "
    r"each\b.*\(cluster=(?P<cluster>[\w.-]+)\)\s*$",
    re.MULTILINE,
)
SLURM_TARGET = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
SUBMITIT_ONLY = "export SUBMITIT_EXECUTOR=slurm"  # what submitit's own job runner needs; train.py does not
FORMATS = ("auto", "sbatch", "torchrun")


@dataclass(frozen=True)
class Assumptions:
    """What a GPU recipe's header says it needs."""

    gpus: int
    nodes: int
    gpus_per_node: int
    memory_gb: float
    cluster: str
    line: str


@dataclass(frozen=True)
class RecipeHeader:
    name: str
    launch_args: list[str]  # the header's ``python train.py`` arguments after recipe=<name>
    assumptions: Assumptions | None  # None: a CPU recipe


def read_header(recipe: str) -> RecipeHeader:
    known = group_options("recipe")
    if recipe not in known:
        raise ConfigError(f"recipe={recipe} is not a known recipe (recipes/*.yaml); choose one of: {', '.join(known)}")
    text = (RECIPES_DIR / f"{recipe}.yaml").read_text()
    launch = LAUNCH_LINE.search(text)
    if launch is None or launch.group("name") != recipe:
        raise ConfigError(f"recipes/{recipe}.yaml has no header line `# Launch: python train.py recipe={recipe} ...`")
    found = ASSUMES_LINE.search(text)
    assumptions = None
    if found is not None:
        assumptions = Assumptions(
            int(found["gpus"]),
            int(found["nodes"]),
            int(found["per_node"]),
            float(found["memory"]),
            found["cluster"],
            found.group(0)[2:],
        )
    return RecipeHeader(recipe, shlex.split(launch.group("args")), assumptions)


def merged_overrides(*groups: list[str]) -> list[str]:
    """Overrides in order, a later ``key=value`` replacing an earlier one of the same key in place."""
    out: dict[str, str] = {}
    for group in groups:
        for arg in group:
            out.pop(override_key(arg), None)
            out[override_key(arg)] = arg
    return list(out.values())


@dataclass
class Job:
    """A recipe made concrete for one cluster: the train.py arguments every rank runs, and its shape."""

    recipe: RecipeHeader
    args: list[str]  # train.py's overrides (recipe first)
    devices: int  # ranks per node
    nodes: int
    cfg: object  # the composed config with its ``hydra`` node (the launcher's parameters)
    launcher_args: list[str]  # hydra/launcher=<preset> and hydra.* overrides: the job's sbatch settings
    notes: list[str] = field(default_factory=list)  # plan and assumption lines for the script's header


def compose_job(recipe: str, overrides: Sequence[str] = (), nodes: int | None = None, launcher: str = "slurm") -> Job:
    """The job of ``recipe`` (its header's arguments, then ``overrides``; ``nodes``: the nodes to run on),
    validated as the cluster will validate it, with ``hydra/launcher=<launcher>``'s parameters."""
    header = read_header(recipe)
    # hydra.launcher.* set the sbatch script; other hydra.* (hydra.run.dir, ...) are the ranks' own Hydra settings
    launcher_args = [arg for arg in overrides if override_key(arg).startswith("hydra.launcher.")]
    user = [arg for arg in overrides if arg not in launcher_args]
    if nodes is not None:
        user.append(f"trainer.num_nodes={nodes}")
    args = merged_overrides([f"recipe={recipe}"], header.launch_args, user)
    notes = [header.assumptions.line] if header.assumptions else []
    cfg = typed_config(compose(args))
    if cfg.parallel.mode == "auto" and cfg.cluster.device == "cuda":
        # the job's nodes are the plan's: plan for the cluster (the nodes given, or cluster.num_gpus), then size it
        if nodes is not None:
            args = merged_overrides(args, [f"cluster.num_gpus={nodes * int(cfg.trainer.devices)}"])
        planned_nodes, summary = planned_node_count(_validated([*args, "trainer.num_nodes=1"]))
        args = merged_overrides(args, [f"trainer.num_nodes={planned_nodes}"])
        notes.append(summary)
    cfg = _validated(args)
    launcher_args = [f"hydra/launcher={launcher}", *launcher_args]
    # the launcher's parameters, resolved against this job's trainer settings
    composed = compose([*args, *launcher_args, "hydra.job.name=train"], return_hydra_config=True)
    return Job(header, args, int(cfg.trainer.devices), int(cfg.trainer.num_nodes), composed, launcher_args, notes)


def _validated(args: list[str]):
    """Compose and validate ``args`` as on the cluster: as a dry run, since no rank starts on this machine (its
    devices and rendezvous are not checked); every other check -- the cluster preset's GPUs and memory against
    the layout's included -- runs."""
    cfg = typed_config(compose([*args, "trainer.dry_run=true"]))
    validate_run(cfg)
    return cfg


def planned_node_count(cfg) -> tuple[int, str]:
    """``parallel=auto`` on a GPU cluster: plan as every rank will (same config, analytic costs); the job must
    start exactly the plan's GPUs in whole nodes of ``trainer.devices``."""
    from ..planner import PlanningError, make_plan

    try:
        result = make_plan(cfg, progress=lambda *_: None)
    except PlanningError as error:
        raise ConfigError(f"parallel=auto found no feasible layout: {error}") from None
    evaluation = result.plan.evaluation
    used, per_node = int(evaluation.gpus), int(cfg.trainer.devices)
    if used % per_node:
        raise ConfigError(
            f"the plan for cluster.num_gpus={cfg.cluster.num_gpus} uses {used} GPUs, not a whole number of "
            f"{per_node}-GPU nodes (trainer.devices={per_node}), and every rank of the job must be in the plan; plan "
            "for another cluster size (nodes=<count>) or run the plan with trainer.dry_run=true only"
        )
    units = ", ".join(
        f"{name} {'colocated' if choice.colocated else f'{choice.dp}x{choice.tp}x{choice.pp}'}"
        for name, choice in sorted(evaluation.choices.items())
    )
    summary = (
        f"Plan (parallel=auto, as every rank computes it): {used} of {cfg.cluster.num_gpus} GPUs, {units} (dp x tp x "
        f"pp), predicted {evaluation.iteration_s:.2f} s per step"
    )
    return used // per_node, summary


def train_command(job: Job, python: str | None = None) -> list[str]:
    """``python <repo>/train.py <args>``: the interpreter that runs this tool (as submitit uses its own)."""
    return [python or sys.executable, str(REPO_ROOT / "train.py"), *job.args]


def launcher_parameters(cfg) -> tuple[str, dict]:
    """(submitit folder, sbatch parameters) of ``cfg.hydra.launcher``, named as the plugin hands them to
    submitit's AutoExecutor: its generic parameters, and the SLURM-specific ones as they are."""
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    if params.get("_target_") != SLURM_TARGET:
        raise ConfigError(
            f"hydra/launcher is {params.get('_target_')}, not the SLURM launcher; use hydra/launcher=slurm (or a "
            "preset of conf/hydra/launcher/ built on submitit_slurm)"
        )
    folder = params.pop("submitit_folder")
    for key in ("_target_", "max_num_timeout"):
        params.pop(key, None)
    return folder, {key: value for key, value in params.items() if value is not None}


def sbatch_text(cfg, command: str, folder: str) -> str:
    """The sbatch file submitit writes for ``cfg.hydra.launcher`` with ``command`` after its srun."""
    from submitit.auto.auto import AutoExecutor
    from submitit.slurm.slurm import SlurmExecutor

    class ScriptOnly(SlurmExecutor):
        """Writes scripts without submitting: no srun needed on this machine."""

        @classmethod
        def affinity(cls) -> int:
            return 2

    _, params = launcher_parameters(cfg)
    executor = ScriptOnly(folder=folder)
    generic = AutoExecutor._typed_parameters()  # as AutoExecutor: generic names converted, the rest as they are
    converted = executor._convert_parameters({k: v for k, v in params.items() if k in generic})
    converted.update({k: v for k, v in params.items() if k not in generic})
    executor.update_parameters(**converted)
    return executor._make_submission_file_text(command, uid="")


def sbatch_test_only(overrides: list[str]) -> str | None:
    """SLURM's own refusal of the sbatch script ``overrides`` (a ``hydra/launcher=<SLURM preset>`` run) would
    submit, from ``sbatch --test-only`` (nothing is queued); None where it would accept it."""
    import subprocess
    import tempfile

    cfg = compose([*overrides, "hydra.job.name=train"], return_hydra_config=True)
    with tempfile.TemporaryDirectory(prefix="sbatch-test-") as folder:
        script = Path(folder) / "job.sbatch"
        script.write_text(sbatch_text(cfg, "true", folder))
        try:
            result = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"sbatch --test-only did not answer ({error})"
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"sbatch --test-only exited {result.returncode}"


def sbatch_script(job: Job, folder: str | None = None, python: str | None = None) -> str:
    """The sbatch script of ``job``: the launcher's ``#SBATCH`` lines, then ``srun ... train.py <args>``."""
    t = job.cfg.trainer
    lead = float(job.cfg.hydra.launcher.signal_delay_s)
    check_signal_window(float(t.stop_grace_s), lead, f"hydra.launcher.signal_delay_s={lead:g}")
    # one folder for every job's logs, made now: SLURM opens --output's file when the job starts and does not
    # create its folder (a per-job "%j" folder, as submitit's, exists only where submitit makes it: a real
    # scheduler failed the by-hand script's job at once)
    folder = folder or str(REPO_ROOT / "outputs" / "slurm")
    Path(folder).mkdir(parents=True, exist_ok=True)
    text = sbatch_text(job.cfg, shlex.join(train_command(job, python)), folder)
    lines = [line for line in text.splitlines() if line != SUBMITIT_ONLY]
    header = [
        f"# recipe={job.recipe.name}: {job.nodes} node(s) x {job.devices} task(s), one task per GPU; "
        f"SIGTERM {lead:g} s before the time limit stops every rank with a checkpoint (trainer.stop_grace_s="
        f"{float(t.stop_grace_s):g})",
        *(f"# {note}" for note in job.notes),
        f"# submit: sbatch <this file>   (or: python train.py -m {shlex.join([*job.args, *job.launcher_args])})",
    ]
    return "\n".join([lines[0], *header, *lines[1:]]) + "\n"


def torchrun_command(job: Job, python: str | None = None) -> str:
    """The torchrun command of ``job``; with several nodes, the one every node runs (the rendezvous host and a
    job id shared by the nodes: base/launch_env.py names the run directory by it)."""
    command = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={job.devices}"]
    if job.nodes > 1:
        low = job.cfg.trainer.min_nodes
        # elastic (trainer.min_nodes): a round may have min_nodes to num_nodes nodes; each lost node costs a restart
        elastic = [f"--nnodes={low}:{job.nodes}", f"--max-restarts={job.nodes - low}"] if low else []
        command += [
            *(elastic or [f"--nnodes={job.nodes}"]),
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=$MASTER_ADDR:29500",
            f"--rdzv-id={job.recipe.name}-$JOB_ID",
        ]
    command += [str(REPO_ROOT / "train.py"), *job.args]
    text = " ".join(part if part.startswith("--rdzv") else shlex.quote(part) for part in command)
    lines = [f"# recipe={job.recipe.name}: {job.nodes} node(s) x {job.devices} rank(s)"]
    lines += [f"# {note}" for note in job.notes]
    if job.nodes > 1:
        lines.append("# run on every node, with MASTER_ADDR (the first node's address) and JOB_ID set alike on all")
    return "\n".join([*lines, text]) + "\n"


def launch_text(job: Job, fmt: str = "auto", python: str | None = None) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt}: allowed values are {', '.join(FORMATS)}")
    if fmt == "torchrun" or (fmt == "auto" and job.nodes == 1):
        return torchrun_command(job, python)
    return sbatch_script(job, python=python)
