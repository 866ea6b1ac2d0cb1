"""Whether a run fits its devices' memory, by the planner's memory model (planner/breakdown.py): the checks the
launcher runs after ``validate_config`` (validation/ checks a config's settings and layout; memory is the
planner's). ``validate_run`` is both, in order: what train.py, the SLURM renderer and the producer check
before any process starts.

* ``check_state_fits``: a model whose training state cannot fit ``cluster.memory_per_device_gb`` on the run's
  processes in any layout (built on the meta device);
* ``check_memory``: on a GPU cluster preset, every rank role of a configured layout within the preset's usable
  memory;
* ``check_strategies_fit``: every HotSPa strategy holds its bucket's rows.
"""

from __future__ import annotations

from ..config import Config
from ..validation import ConfigError, validate_config, world_size
from ..validation.cluster_fit import cluster_label

GB = 1e9


def validate_run(cfg: Config, container: dict | None = None, plan: dict | None = None, schedules: bool = True):
    """Every check before launch: the config's (validation/), which resolves the run, and then the memory
    fit's (this module). Returns the ``ResolvedRun`` (parallel/resolved.py), or None while the planner has yet
    to choose the layout. ``schedules``: as validate_config's."""
    run = validate_config(cfg, container, plan, schedules)
    if run is not None:
        check_fits(run)
    return run


def check_fits(run) -> None:
    """The memory checks of a validated, resolved run; raises ConfigError with one line."""
    if run.buckets:
        check_strategies_fit(run)
    elif run.cfg.cluster.device == "cuda":
        check_memory(run.cfg, run.layout)


def check_state_fits(cfg: Config) -> None:
    """A model whose training state cannot fit the processes' memory (cluster.memory_per_device_gb each) in any
    layout fails before launch in one line, not minutes later when a process is killed for memory. Builds the
    model on the meta device: train.py calls it after validate_config (parallel=auto: the planner checks)."""
    if cfg.parallel.mode == "auto":
        return
    from .api import check_model_fits
    from .costs import PlanningError

    try:
        check_model_fits(cfg, world_size(cfg))
    except PlanningError as error:
        raise ConfigError(str(error)) from None
    except (ValueError, TypeError, OverflowError, RuntimeError):
        return  # a model the meta-device count cannot build: the later checks name what is wrong with it


def fullest_role(cfg: Config, layout):
    """The rank role (planner/breakdown.py ``RoleMemory``) of ``cfg``'s resolved ``layout`` with the most bytes at
    its fullest moment, and the usable bytes per device (``planner.memory_margin`` of
    ``cluster.memory_per_device_gb``)."""
    from .api import config_roles

    roles, _ = config_roles(cfg, layout)
    usable = float(cfg.cluster.memory_per_device_gb) * GB * float(cfg.planner.memory_margin)
    return max(roles, key=lambda role: role.total), usable


def check_memory(cfg: Config, layout) -> None:
    """Every rank role's bytes by the planner's memory model within the preset's usable device memory."""
    try:
        role, usable = fullest_role(cfg, layout)
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError, RuntimeError):
        return  # a layout the memory model cannot describe: the layout checks have named what is wrong
    if role.total <= usable:
        return
    c = cfg.cluster
    raise ConfigError(
        f"the {role.unit} pp{role.pp} ranks need {role.total / GB:.1f} GB per GPU (memory model: shard={role.shard}, "
        f"recompute={role.recompute}, {role.in_flight} microbatch(es) in flight) but {cluster_label(cfg)} has "
        f"cluster.memory_per_device_gb={c.memory_per_device_gb:g} ({usable / GB:.1f} GB usable at "
        f"planner.memory_margin={cfg.planner.memory_margin:g}); use GPUs with more memory, more recompute or "
        "sharding, or more pipeline / tensor parallelism (python tools/memory.py ... prints every role)"
    )


def strategy_memory(
    cfg: Config, strategy, capacity: int, recompute: str | None = None, shard: str = "zero1", layout=None
):
    """The planner's evaluation (planner/evaluate.py, analytic costs) of one strategy holding rows of
    ``capacity`` tokens: ``.feasible``, ``.memory["llm"]`` (bytes on its fullest device), ``.reason``.
    ``layout``: the strategy's resolved layout (a run's bucket); None: a candidate's, resolved here."""
    from ..parallel.hotspa_layout import strategy_config
    from .api import build_layout_model, choices_of_config

    policy = recompute or cfg.parallel.recompute
    scfg = strategy_config(
        cfg, strategy, capacity, recompute, extra={"planner": {"cost": "analytic", "recompute": policy, "shard": shard}}
    )
    # the run's processes per node (a tensor-parallel group is placed as the run places it)
    scfg.cluster.gpus_per_node = int(cfg.trainer.devices)
    scfg.cluster.num_gpus = strategy.world
    for key in ("peak_flops_fp32", "peak_flops_bf16"):  # memory does not depend on speed: any value serves
        if scfg.cluster[key] is None:
            scfg.cluster[key] = 1e12
    model = build_layout_model(scfg, devices=strategy.world, progress=lambda *_: None)
    return model.evaluate(*choices_of_config(scfg, layout))


def check_strategies_fit(run) -> None:
    """Every strategy holds its bucket's rows in ``cluster.memory_per_device_gb`` (the planner's memory model,
    with its bucket's recompute policy and ZeRO-1), or the run is refused in one line naming both."""
    cfg = run.cfg
    for bucket in run.buckets:
        strategy, capacity = bucket.strategy, bucket.capacity
        try:
            ev = strategy_memory(cfg, strategy, capacity, recompute=bucket.recompute, layout=bucket.layout)
        except ValueError as error:  # the planner's own refusals (cluster settings, shapes): one line
            raise ConfigError(f"parallel.hotspa strategy {strategy.name}: {error}") from None
        if not ev.feasible:
            raise ConfigError(
                f"parallel.hotspa strategy {strategy.name} cannot hold its bucket of {capacity}-token rows within "
                f"cluster.memory_per_device_gb={cfg.cluster.memory_per_device_gb:g} ({ev.reason}): give that bucket "
                "more tp, pp or cp, recompute (parallel.hotspa.recompute), or raise the memory limit"
            )
