"""Who created this process, and so who creates the training processes.

Four ways a job starts, told apart from the environment before anything is launched:

* ``local``: ``python train.py`` on a machine (or one task per node of a SLURM allocation,
  ``srun --ntasks-per-node=1``): train.py starts ``trainer.devices`` processes itself, through
  Fabric's spawn launcher (``trainer.max_restarts=0``) or torch's elastic agent (restarts).
  Those children carry ``DISTTRAIN_LAUNCHER`` and are told their cluster environment
  explicitly, so an inherited ``SLURM_*`` never makes each of them believe it is rank 0.
* ``torchrun``: every process is a rank (``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` from the agent).
* ``slurm``: ``srun`` started one task per rank (``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS``, ``SLURM_NODELIST``).
* a SLURM batch step (``sbatch`` without ``srun``) with more tasks than one: refused with the
  command to type instead, since its other tasks would never start.

The process count is checked against ``trainer.devices x trainer.num_nodes``, and under SLURM
the tasks per node against ``trainer.devices`` (the planner assumes that node layout).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

MARK = "DISTTRAIN_LAUNCHER"  # set in the processes train.py starts: spawn | elastic


class LaunchError(ValueError):
    """The processes found disagree with the config (one line, raised before anything starts)."""


@dataclass(frozen=True)
class LaunchEnvironment:
    # local | node (srun, one task per node: spawns that node's ranks) | torchrun | slurm (a task per rank) |
    # sbatch (a batch step without srun) | spawned (a child of train.py)
    kind: str
    world_size: int  # processes of the job already created (1 for local: train.py creates them)
    rank: int
    local_rank: int
    node_rank: int
    job_id: str | None  # the scheduler's job identity: one run directory and one producer per job

    @property
    def external(self) -> bool:
        """Every rank already exists (torchrun or srun): train.py spawns nothing."""
        return self.kind in ("torchrun", "slurm")

    @property
    def job_scoped(self) -> bool:
        """Several processes of one job run train.py: they share one run directory named by the job."""
        return self.external or self.kind == "node"


def _int(environ: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        raise LaunchError(f"{name}={environ.get(name)!r} is not an integer") from None


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (e.g. ``2(x3),1``) expanded to one count per node."""
    counts = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise LaunchError(f"SLURM_TASKS_PER_NODE={text!r} is not in SLURM's format")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    env = os.environ if environ is None else environ
    if env.get(MARK):
        return LaunchEnvironment(
            "spawned",
            _int(env, "WORLD_SIZE", 1),
            _int(env, "RANK", 0),
            _int(env, "LOCAL_RANK"),
            _int(env, "NODE_RANK"),
            env.get("DISTTRAIN_JOB_ID"),
        )
    if "TORCHELASTIC_RUN_ID" in env:
        run_id = env["TORCHELASTIC_RUN_ID"]
        # Without --rdzv-id every local worker still shares the agent as parent (one node only: checked).
        job = run_id if run_id not in ("", "none") else f"torchrun-{os.getppid()}"
        return LaunchEnvironment(
            "torchrun",
            _int(env, "WORLD_SIZE", 1),
            _int(env, "RANK"),
            _int(env, "LOCAL_RANK"),
            _int(env, "GROUP_RANK"),
            job,
        )
    ntasks = _int(env, "SLURM_NTASKS", 1)
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    under_srun = step is not None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    job = f"{job}.{step}" if job and under_srun else job
    if (
        ntasks > 1
        and under_srun
        and ntasks == _int(env, "SLURM_NNODES", 0)
        and _int(env, "SLURM_NTASKS_PER_NODE", 1) == 1
    ):
        # one task per node: this task is its node's launcher and spawns trainer.devices ranks
        node = _int(env, "SLURM_NODEID")
        return LaunchEnvironment("node", 1, node, 0, node, job)
    if ntasks > 1 and under_srun:
        return LaunchEnvironment(
            "slurm",
            ntasks,
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_LOCALID"),
            _int(env, "SLURM_NODEID"),
            job,
        )
    if ntasks > 1 and job:
        return LaunchEnvironment("sbatch", ntasks, 0, 0, 0, job)
    return LaunchEnvironment("local", 1, 0, 0, _int(env, "NODE_RANK"), job)


def requeued(environ: Mapping[str, str] | None = None) -> int:
    """How many times SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 on a first run or elsewhere)."""
    return _int(os.environ if environ is None else environ, "SLURM_RESTART_COUNT")


def check(
    environment: LaunchEnvironment,
    devices: int,
    num_nodes: int,
    max_restarts: int = 0,
    environ: Mapping[str, str] | None = None,
):
    """Raise LaunchError when the processes found cannot run ``devices x num_nodes`` ranks."""
    env = os.environ if environ is None else environ
    world = devices * num_nodes
    if max_restarts > 0 and (environment.job_scoped or num_nodes > 1):
        raise LaunchError(
            f"trainer.max_restarts={max_restarts} restarts the ranks train.py starts on one machine; under "
            f"torchrun, srun or several nodes restarts belong to torchrun --max-restarts or the scheduler's "
            "requeue (with trainer.resume=auto): set trainer.max_restarts=0"
        )
    if environment.kind == "sbatch":
        raise LaunchError(
            f"this is a SLURM batch step with SLURM_NTASKS={environment.world_size} but no srun: only one task "
            f"runs here; start the ranks with `srun python train.py ...` (one task per rank, or "
            f"--ntasks-per-node=1 and train.py spawns trainer.devices={devices} per node)"
        )
    if environment.kind == "local":
        slurm_nodes = _int(env, "SLURM_NNODES", 0)
        if "SLURM_STEP_ID" in env and slurm_nodes and slurm_nodes != num_nodes:
            raise LaunchError(
                f"srun started one task on each of SLURM_NNODES={slurm_nodes} nodes but trainer.num_nodes="
                f"{num_nodes}; set trainer.num_nodes={slurm_nodes}"
            )
        return
    if environment.kind == "node":
        nodes = _int(env, "SLURM_NNODES", 1)
        if nodes != num_nodes:
            raise LaunchError(
                f"srun started one task on each of SLURM_NNODES={nodes} nodes but trainer.num_nodes={num_nodes}; "
                f"set trainer.num_nodes={nodes}"
            )
        return
    if not environment.external:
        return
    if environment.world_size != world:
        source = "WORLD_SIZE (torchrun)" if environment.kind == "torchrun" else "SLURM_NTASKS (srun)"
        raise LaunchError(
            f"{source}={environment.world_size} processes, but trainer.devices={devices} x trainer.num_nodes="
            f"{num_nodes} = {world}; make them agree (e.g. trainer.devices={environment.world_size // num_nodes} "
            f"or launch {world} processes)"
        )
    if environment.kind == "slurm" and "SLURM_NTASKS_PER_NODE" not in env:
        raise LaunchError(
            f"srun started {environment.world_size} tasks without --ntasks-per-node: use "
            f"srun --ntasks-per-node={devices} (trainer.devices) so each node runs the same number of ranks"
        )
    if environment.kind == "slurm" and "SLURM_TASKS_PER_NODE" in env:
        placed = tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        if any(count != devices for count in placed):
            raise LaunchError(
                f"SLURM placed {env['SLURM_TASKS_PER_NODE']} tasks per node but trainer.devices={devices}: the "
                f"planner assumes {devices} ranks on every node; use srun --ntasks-per-node={devices}"
            )
    if environment.kind == "torchrun":
        if num_nodes > 1 and env.get("TORCHELASTIC_RUN_ID", "none") in ("", "none"):
            raise LaunchError(
                "torchrun over several nodes needs --rdzv-id=<job id>: it names the job's one run directory"
            )
        local = _int(env, "LOCAL_WORLD_SIZE", devices)
        if local != devices:
            raise LaunchError(f"torchrun --nproc-per-node={local} but trainer.devices={devices}; make them agree")


def elastic_nodes(
    environment: LaunchEnvironment, num_nodes: int, min_nodes: int | None, environ: Mapping[str, str] | None = None
) -> int:
    """The nodes this run trains on: ``num_nodes``, or under elastic torchrun (``trainer.min_nodes``; torchrun
    --nnodes=min_nodes:num_nodes) the nodes of this rendezvous round, WORLD_SIZE / LOCAL_WORLD_SIZE."""
    if min_nodes is None:
        return num_nodes
    if not 1 <= min_nodes <= num_nodes:
        raise LaunchError(
            f"trainer.min_nodes={min_nodes}: use null (not elastic) or 1 to trainer.num_nodes={num_nodes}"
        )
    if environment.kind != "torchrun":
        raise LaunchError(
            f"trainer.min_nodes={min_nodes} makes the job elastic, which only torchrun --nnodes={min_nodes}:{num_nodes}"
            f" does (this process was started by {environment.kind}); launch with torchrun or set trainer.min_nodes="
            "null"
        )
    env = os.environ if environ is None else environ
    local = _int(env, "LOCAL_WORLD_SIZE", 1)
    nodes, uneven = divmod(environment.world_size, local)
    if uneven or not min_nodes <= nodes <= num_nodes:
        raise LaunchError(
            f"torchrun's round has WORLD_SIZE={environment.world_size} processes, {local} per node, but an elastic "
            f"job takes {min_nodes} to {num_nodes} nodes (trainer.min_nodes, trainer.num_nodes) of the same size; "
            f"launch with torchrun --nnodes={min_nodes}:{num_nodes} --nproc-per-node={local}"
        )
    return nodes


def cluster_environment(environment: LaunchEnvironment):
    """The Fabric cluster environment for this process, named explicitly (never auto-detected)."""
    from lightning_fabric.plugins.environments import (
        LightningEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if environment.kind == "slurm":
        return SLURMEnvironment(auto_requeue=False)
    if environment.kind == "torchrun" or os.environ.get(MARK) == "elastic":
        return TorchElasticEnvironment()
    return LightningEnvironment()


def node_rendezvous(environment: LaunchEnvironment) -> dict[str, str]:
    """For a node launcher under srun: its node rank, and rank 0's address and port from SLURM's variables
    (the first host of ``SLURM_NODELIST``; a port derived from the job id, as Lightning does)."""
    from lightning_fabric.plugins.environments import SLURMEnvironment

    slurm = SLURMEnvironment(auto_requeue=False)
    return {
        "NODE_RANK": str(environment.node_rank),
        "MASTER_ADDR": slurm.main_address,
        "MASTER_PORT": str(slurm.main_port),
    }
