"""One run, resolved once: ``resolve_run`` turns a validated config into a ``ResolvedRun``.

The launcher calls it once per ``launch()``, after composition, validation of the settings and (for
``parallel=auto`` or HotSPa's ``strategies=[auto]``) the planner's choice, and hands the object to
every consumer: validation checks the layout in it, the planner's memory fit reads it, the launcher
pickles it to the ranks, and the trainer and engines build from it. Nothing below resolves units again.

It holds:
* the typed config and the plain container it came from (what the ranks get; None where a tool or the
  argument check resolved a composed config that is not launched);
* the accelerator, process-group backend, precision and determinism made concrete for this machine;
* the unit layout: every unit with its dp/tp/pp/cp/ep, shard mode, recompute policy and ranks;
* HotSPa's buckets: per length bucket its strategy, capacity, recompute policy, the config its engine is
  built from and that config's layout (the run's layout is the home strategy's);
* the plan, when the planner chose the layout (the ``parallel`` section it wrote).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..config import Config, determinism, resolve_accelerator, resolve_backend, training_precision, typed_config
from .units import UnitLayout


@dataclass(frozen=True)
class Bucket:
    """One length bucket of ``parallel.mode=hotspa``: the strategy that runs it, as a rigid layout."""

    strategy: Any  # parallel.switch_plan.Strategy
    capacity: int
    recompute: str
    config: Config
    layout: UnitLayout


@dataclass(frozen=True)
class ResolvedRun:
    cfg: Config
    container: dict | None
    accelerator: str
    backend: str
    precision: str
    deterministic: bool | str
    layout: UnitLayout
    buckets: tuple[Bucket, ...] = ()
    home: str | None = None  # hotspa: the strategy that holds the model state and runs the optimizer
    plan: dict | None = None  # the parallel section the planner chose (parallel=auto, hotspa strategies=[auto])

    @property
    def home_bucket(self) -> int:
        """The last bucket run by the home strategy: it runs last in a step and owns the optimizer."""
        return max(i for i, bucket in enumerate(self.buckets) if bucket.strategy.name == self.home)

    def with_container(self, container: dict) -> ResolvedRun:
        """The same run with settings outside the layout changed (a producer's address, a restart's resume):
        the layout stays, so the parallel section must too."""
        from omegaconf import OmegaConf

        before = self.container["parallel"] if self.container else OmegaConf.to_container(self.cfg.parallel)
        if container["parallel"] != before:
            raise ValueError("a resolved run's parallel section cannot change; resolve the new config instead")
        return replace(self, cfg=typed_config(container), container=container)


def resolve_units(cfg: Config) -> UnitLayout:
    """The unit layout of one (non-HotSPa, planned) config; ``resolve_run`` is the caller."""
    from .plan import units_of

    return units_of(cfg)


# What a layout with pipeline stages runs when no schedule is named: Megatron-LM's and TorchTitan's default.
DEFAULT_PIPELINE_SCHEDULE = "1f1b"


def defaulted_schedule(cfg: Config, layout: UnitLayout) -> bool:
    """Whether ``layout`` has pipeline stages (several units in a chain, or pp > 1) and ``cfg`` names no schedule
    (schedule=none without a schedule.csv): such a run gets ``DEFAULT_PIPELINE_SCHEDULE``."""
    return cfg.schedule.name == "none" and not cfg.schedule.csv and sum(u.pp for u in layout.units) > 1


def _with_pipeline_schedule(cfg: Config, container: dict | None, layout: UnitLayout) -> tuple[Config, dict | None]:
    if not defaulted_schedule(cfg, layout):
        return cfg, container
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(cfg, {"schedule": {"name": DEFAULT_PIPELINE_SCHEDULE}})
    if container is not None:
        container = {**container, "schedule": {**container["schedule"], "name": DEFAULT_PIPELINE_SCHEDULE}}
    return cfg, container


def config_layout(cfg: Config) -> UnitLayout:
    """The layout of a config that is not being launched (a tool's, a candidate the planner weighs): its units,
    or for HotSPa its home strategy's."""
    return resolve_run(cfg).layout if cfg.parallel.mode == "hotspa" else resolve_units(cfg)


def _buckets(cfg: Config) -> tuple[tuple[Bucket, ...], str]:
    from .hotspa_layout import bucket_recompute, bucket_strategies, strategy_config

    strategies, capacities, home = bucket_strategies(cfg)
    buckets = []
    for k, (strategy, capacity) in enumerate(zip(strategies, capacities, strict=True)):
        recompute = bucket_recompute(cfg, k)
        scfg = strategy_config(cfg, strategy, capacity, recompute)
        buckets.append(Bucket(strategy, int(capacity), recompute, scfg, resolve_units(scfg)))
    return tuple(buckets), home


def resolve_run(cfg: Config, container: dict | None = None, plan: dict | None = None) -> ResolvedRun:
    """The run ``cfg`` describes, resolved (``container``: the plain dict ``cfg`` was typed from, which the
    launcher hands to the ranks)."""
    if cfg.parallel.mode == "auto":
        raise ValueError("parallel.mode=auto is resolved into units by the planner before the run is resolved")
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    buckets, home = (), None
    if cfg.parallel.mode == "hotspa":
        buckets, home = _buckets(cfg)
        layout = next(b.layout for b in reversed(buckets) if b.strategy.name == home)
    else:
        layout = resolve_units(cfg)
        cfg, container = _with_pipeline_schedule(cfg, container, layout)
    return ResolvedRun(
        cfg=cfg,
        container=container,
        accelerator=accelerator,
        backend=resolve_backend(cfg.trainer.backend, accelerator),
        precision=training_precision(cfg.trainer.precision, accelerator),
        deterministic=determinism(cfg.trainer.deterministic, accelerator),
        layout=layout,
        buckets=buckets,
        home=home,
        plan=plan,
    )
