"""Semantic checks of a composed config, run before any process starts.

Each problem raises :class:`ConfigError` with one line that names the bad
value and says how to fix it. Type and unknown-key errors are caught earlier,
by the schema, when Hydra composes the config.

The checks live in ``common`` (errors, resolution helpers, ``${...}`` references), ``numbers`` (one
table of bounds for every numeric setting, checked before anything divides by one), ``settings``
(model, optimizer, trainer, device, cluster), ``data`` (shards, generation, the producer), ``layout``
(parallel layout and pipeline schedule), ``hotspa`` (HotSPa's strategies) and ``cluster_fit`` (a run's GPUs
against the GPU cluster preset it names; whether this command starts ranks on this machine at all). Whether
a run fits its devices' memory is the planner's check (planner/fit.py ``validate_run``: this, then that).
"""

from __future__ import annotations

from ..config import Config
from .cluster_fit import launches_elsewhere, validate_cluster_fit
from .common import (
    CPU_PROCESSES_PER_CORE,
    ConfigError,
    externally_launched,
    resolve_accelerator,
    resolve_backend,
    world_size,
)
from .hotspa import validate_hotspa
from .layout import layout_of, reads_global_stream, validate_layout
from .schedule import check_pipeline, validate_schedule_config
from .settings import (
    validate_cluster,
    validate_data,
    validate_device_contract,
    validate_model,
    validate_optim,
    validate_planner,
    validate_trainer,
)

__all__ = [
    "CPU_PROCESSES_PER_CORE",
    "ConfigError",
    "check_pipeline",
    "externally_launched",
    "launches_elsewhere",
    "layout_of",
    "reads_global_stream",
    "resolve_accelerator",
    "resolve_backend",
    "validate_cluster",
    "validate_cluster_fit",
    "validate_config",
    "validate_data",
    "validate_device_contract",
    "validate_hotspa",
    "validate_layout",
    "validate_model",
    "validate_optim",
    "validate_planner",
    "validate_schedule_config",
    "validate_trainer",
    "world_size",
]


def missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted names of mandatory values (``???``) nobody set."""
    from omegaconf import DictConfig, OmegaConf

    out = []
    for key in node:
        name = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            out.append(name)
        else:
            value = node._get_node(key)
            if isinstance(value, DictConfig) and not value._is_none():
                out.extend(missing_keys(value, name + "."))
    return out


def validate_config(cfg: Config) -> None:
    """Raise ConfigError on the first problem found."""
    missing = [key for key in missing_keys(cfg) if not key.startswith("paths.")]
    if missing:
        raise ConfigError(f"{missing[0]} is required but not set; add {missing[0]}=<value> to the command line")
    validate_model(cfg)
    validate_device_contract(cfg)
    # the cluster and planner settings first: later checks read them
    validate_cluster(cfg)
    validate_planner(cfg)
    auto = cfg.parallel.mode == "auto"  # the layout is checked once the planner has chosen it
    if not auto:
        validate_trainer(cfg)
        if cfg.parallel.mode == "hotspa":  # every strategy is checked as the megatron layout it runs as
            validate_hotspa(cfg)
        else:
            validate_layout(cfg)
    validate_data(cfg)
    validate_optim(cfg)
    if auto:  # the planner's memory model and the sharded optimizers it chooses from are AdamW's
        from .local_sgd import validate_optimizer

        validate_optimizer(cfg)
    if not auto:
        validate_schedule_config(cfg)
    # last: the node shape of a GPU cluster preset (its memory is the planner's check: planner/fit.py)
    validate_cluster_fit(cfg)
