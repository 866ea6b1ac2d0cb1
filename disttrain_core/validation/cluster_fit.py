"""A run's needs against the GPU cluster preset it names (``cluster=h100_80g`` ...), and whether this command
starts the ranks here at all.

A GPU recipe is written for a cluster: its layout needs ``trainer.devices`` GPUs on each of
``trainer.num_nodes`` nodes. When the cluster preset says otherwise -- fewer GPUs, fewer per node -- the run is
refused before launch in one line naming both numbers, instead of failing to schedule on the cluster. Whether
each rank role fits the preset's memory is the planner's check (planner/fit.py), run after this one. On CPU
clusters (``cluster.device=cpu``) the preset describes this machine and the ranks are processes: nothing is
checked here.

Local-machine facts (CUDA devices here, a rendezvous in the environment) are not this process's business when
it only plans (``trainer.dry_run=true``) or hands the job to a scheduler through Hydra's SLURM launcher
(``-m hydra/launcher=slurm``): ``launches_elsewhere``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..config import CONF_DIR, Config, override_key
from .common import ConfigError, world_size

SLURM_LAUNCHER = "submitit_slurm"  # the hydra-submitit-launcher plugin's SLURM launcher


def scheduler_launcher(argv: Sequence[str] | None = None) -> str | None:
    """The SLURM launcher a ``train.py -m ... hydra/launcher=<name>`` command submits its jobs with: the
    plugin's ``submitit_slurm`` or a preset of conf/hydra/launcher/ built on it. None otherwise (no ``-m``:
    Hydra runs the job here whatever the launcher)."""
    args = list(sys.argv[1:] if argv is None else argv)
    multirun = "-m" in args or "--multirun" in args or "hydra.mode=MULTIRUN" in args
    choice = None
    for arg in args:
        if "=" in arg and override_key(arg) == "hydra/launcher":
            choice = arg.split("=", 1)[1]
    if not multirun or choice is None:
        return None
    return choice if _builds_on_slurm(choice) else None


def _builds_on_slurm(choice: str, depth: int = 0) -> bool:
    """``choice`` is the plugin's SLURM launcher or a preset whose defaults lead to it."""
    from omegaconf import OmegaConf

    if choice == SLURM_LAUNCHER:
        return True
    preset = CONF_DIR / "hydra" / "launcher" / f"{choice}.yaml"
    if depth > 8 or not preset.is_file():
        return False
    defaults = OmegaConf.load(preset).get("defaults") or []
    return any(isinstance(entry, str) and _builds_on_slurm(entry.strip(), depth + 1) for entry in defaults)


def launches_elsewhere(cfg: Config) -> bool:
    """This process starts no rank on this machine: a dry run, or a submission to a scheduler."""
    return bool(cfg.trainer.dry_run) or scheduler_launcher() is not None


def cluster_label(cfg: Config) -> str:
    return f"cluster={cfg.cluster.name}"


def check_node_shape(cfg: Config) -> None:
    """The job's GPUs (``trainer.devices`` per node x ``trainer.num_nodes``) against the preset's."""
    c, t = cfg.cluster, cfg.trainer
    world = world_size(cfg)
    if t.devices > c.gpus_per_node:
        raise ConfigError(
            f"the run needs {t.devices} GPUs per node (trainer.devices={t.devices}) but {cluster_label(cfg)} has "
            f"cluster.gpus_per_node={c.gpus_per_node}; lower trainer.devices (and raise trainer.num_nodes) or pick "
            "a cluster preset with larger nodes"
        )
    if world > c.num_gpus:
        raise ConfigError(
            f"the run needs {world} GPUs (trainer.devices={t.devices} x trainer.num_nodes={t.num_nodes}) but "
            f"{cluster_label(cfg)} has cluster.num_gpus={c.num_gpus}; use a cluster with at least {world} GPUs "
            f"(cluster.num_gpus={world}) or a smaller layout"
        )


def validate_cluster_fit(cfg: Config) -> None:
    """A GPU cluster preset that contradicts the run's needs fails here (called by validate_config)."""
    if cfg.cluster.device != "cuda":
        return
    check_node_shape(cfg)


def check_signal_window(stop_grace_s: float, signal_lead_s: float, where: str) -> None:
    """SLURM's SIGTERM must come before the time limit by more than the ranks may take to stop after it
    (trainer.stop_grace_s, train/stop.py), so a stop's checkpoint is written before SLURM kills the job."""
    if signal_lead_s <= stop_grace_s:
        raise ConfigError(
            f"{where}: SLURM signals {signal_lead_s:g} s before the time limit but trainer.stop_grace_s="
            f"{stop_grace_s:g} lets a stopping rank take longer; raise the signal's lead above {stop_grace_s:g} s "
            "or lower trainer.stop_grace_s"
        )
