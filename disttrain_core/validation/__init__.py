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

``validate_config`` checks the settings, resolves the run once (parallel/resolved.py ``resolve_run``) and
checks the layout in it; it returns the ``ResolvedRun`` everything after it reads.
"""

from __future__ import annotations

from ..config import Config
from ..config.parallel import reads_whole_steps
from .bubble_fill import check_fill_mode
from .cluster_fit import launches_elsewhere, validate_cluster_fit
from .common import (
    ConfigError,
    externally_launched,
    resolve_accelerator,
    resolve_backend,
    world_size,
)
from .fault_tolerance import check_fault_tolerance, check_replan
from .float8 import check_float8_device
from .hotspa import check_hotspa_layouts, validate_hotspa
from .layout import check_layout, reads_global_stream, validate_layout_settings
from .local_sgd import validate_optimizer
from .producer import check_producer_pool
from .sampling import check_sampling, check_sampling_layout, check_trackers
from .schedule import check_pipeline, check_planner_schedules, validate_run_schedules, validate_schedule_config
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
    "ConfigError",
    "check_pipeline",
    "externally_launched",
    "check_layout",
    "launches_elsewhere",
    "reads_global_stream",
    "resolve_accelerator",
    "resolve_backend",
    "validate_cluster",
    "validate_cluster_fit",
    "validate_config",
    "validate_data",
    "validate_device_contract",
    "validate_hotspa",
    "validate_layout_settings",
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


def validate_config(cfg: Config, container: dict | None = None, plan: dict | None = None, schedules: bool = True):
    """Raise ConfigError on the first problem found; return the run resolved (parallel/resolved.py), or None
    while the planner has yet to choose the layout (parallel=auto, HotSPa's strategies=[auto]).
    ``container``: the plain dict ``cfg`` was typed from; ``plan``: the planner's choice, recorded in the run.
    ``schedules=False`` skips building and replaying the pipeline schedule (seconds for a plan of a thousand GPUs):
    the closure over the planner's plans (tools/compositions.py), which checks every other rule."""
    from ..parallel.resolved import resolve_run

    unread = {"data.path"} if cfg.data.blend and cfg.data.format == "hf" else set()  # a blend reads its sources
    missing = [key for key in missing_keys(cfg) if not key.startswith("paths.") and key not in unread]
    if missing:
        raise ConfigError(f"{missing[0]} is required but not set; add {missing[0]}=<value> to the command line")
    validate_model(cfg)
    validate_device_contract(cfg)
    check_float8_device(cfg)
    check_trackers(cfg)
    check_sampling(cfg)
    # the cluster and planner settings first: later checks read them
    validate_cluster(cfg)
    validate_planner(cfg)
    check_planner_schedules(cfg)
    check_replan(cfg, planned=plan is not None)
    check_fill_mode(cfg)  # before the planner could run
    mode = cfg.parallel.mode
    hotspa = mode == "hotspa"
    if mode != "auto":  # the layout is checked once the planner has chosen it
        validate_trainer(cfg)
        if hotspa:  # every strategy is checked as the megatron layout it runs as
            validate_hotspa(cfg)
        else:
            validate_layout_settings(cfg)
    planned = mode == "auto" or (hotspa and list(cfg.parallel.hotspa.strategies) == ["auto"])
    run = None if planned else resolve_run(cfg, container, plan)
    if run is not None:
        check_sampling_layout(cfg, run.layout)
        if hotspa:
            check_hotspa_layouts(run)
        else:
            check_layout(cfg, run.layout)
            check_fault_tolerance(cfg, run.layout)
            check_producer_pool(cfg, run.layout)
            validate_optimizer(cfg, run.layout)
    dp = 1 if run is None else run.layout.llm.dp
    validate_data(cfg, 1 if run is None or reads_global_stream(run.layout) or reads_whole_steps(cfg) else dp)
    validate_optim(cfg, dp)
    if mode == "auto":  # the planner's memory model and the sharded optimizers it chooses from are AdamW's
        validate_optimizer(cfg)
    if run is not None and schedules:
        validate_run_schedules(run)
    # last: the node shape of a GPU cluster preset (its memory is the planner's check: planner/fit.py)
    validate_cluster_fit(cfg)
    return run
