"""``parallel.mode=hotspa``: the strategies, their buckets and the home; every strategy is then checked as the
megatron layout it runs as (validation/layout.py). Whether each strategy holds its bucket's rows in memory is
the planner's check (planner/fit.py)."""

from __future__ import annotations

from ..config import Config
from ..schedule.generators import LOOPED, V_SHAPED
from .common import ConfigError, _require
from .layout import check_layout, validate_layout_settings


def _check_hotspa_settings(cfg: Config) -> None:
    """What hot switching runs at all: packed text, a text-only dense Llama, one stage per rank."""
    h = cfg.parallel.hotspa
    _require(
        cfg.data.packing.enabled,
        "parallel.mode=hotspa runs packed variable-length text: add data=longtail_text (or data.packing.enabled=true)",
    )
    _require(
        h.order in ("min_switch", "given"), f"parallel.hotspa.order={h.order!r}: allowed values are min_switch, given"
    )
    _require(
        cfg.model.encoder is None and cfg.model.generator is None,
        f"parallel.mode=hotspa switches a text-only Llama; model={cfg.model.name} has an image encoder or "
        "generator: use a text-only model (model=llama_tiny)",
    )
    _require(
        cfg.schedule.name not in LOOPED + V_SHAPED,
        f"schedule={cfg.schedule.name}: hot switching assumes one pipeline stage per rank; use 1f1b, gpipe or zb_h1",
    )
    _require(cfg.model.llm.moe is None, "parallel.mode=hotspa: MoE models are not switched yet; use a dense Llama")
    _require(
        not cfg.trainer.record_timeline,
        "trainer.record_timeline compares one pipeline schedule with its prediction; a HotSPa step runs one per "
        "bucket: unset it (perf/switch_fraction reports the switching share)",
    )
    _require(
        h.profile is None or list(h.strategies) == ["auto"],
        f"parallel.hotspa.profile={h.profile} is read by parallel.hotspa.strategies=[auto] only; the strategies "
        f"{list(h.strategies)} are given: drop the profile or set the strategies to [auto]",
    )


def validate_hotspa(cfg: Config) -> None:
    """The strategies, their buckets and the home; every strategy's settings are then checked as the megatron
    layout it runs as (heads divisible by tp, layers by pp, rows by cp, ...): its resolved layout by
    ``check_hotspa_layouts``."""
    from ..parallel.hotspa_layout import (
        bucket_boundaries,
        bucket_recompute,
        bucket_strategies,
        parse_strategies,
        strategy_config,
    )
    from ..parallel.plan import world_size_of
    from .local_sgd import validate_optimizer

    validate_optimizer(cfg)
    h = cfg.parallel.hotspa
    _check_hotspa_settings(cfg)
    if list(h.strategies) == ["auto"]:  # train.py chooses buckets and strategies before launch
        _require(
            h.recompute is None,
            "parallel.hotspa.recompute sets a policy per bucket, but strategies=[auto] chooses the buckets (with "
            "parallel.recompute for all): unset it",
        )
        _require(
            h.home is None,
            f"parallel.hotspa.home={h.home!r} names a strategy, but strategies=[auto] chooses them: unset home",
        )
        return
    buckets = bucket_boundaries(cfg)
    _require(
        len(h.strategies) == len(buckets),
        f"parallel.hotspa.strategies has {len(h.strategies)} strategies for {len(buckets)} buckets "
        f"(data.packing.buckets={buckets}): give one strategy per bucket",
    )
    try:
        parsed = parse_strategies(cfg)
    except ValueError as error:
        raise ConfigError(f"parallel.hotspa: {error}") from None
    world = world_size_of(cfg)
    for text, s in zip(h.strategies, parsed, strict=True):
        _require(
            s.world == world,
            f"parallel.hotspa.strategies: {text} uses {s.world} processes but the run has {world} "
            f"(trainer.devices x trainer.num_nodes): every strategy spans all of them",
        )
    try:
        strategies, capacities, home = bucket_strategies(cfg)
    except ValueError as error:
        raise ConfigError(f"parallel.hotspa: {error}") from None
    _require(
        home in [s.name for s in strategies],
        f"parallel.hotspa.home={h.home!r} is none of the strategies {[s.name for s in strategies]}",
    )
    if h.recompute is not None:
        from ..parallel.recompute import POLICIES

        _require(
            len(h.recompute) == len(buckets),
            f"parallel.hotspa.recompute has {len(h.recompute)} policies for {len(buckets)} buckets: give one per "
            "bucket, or leave it null for parallel.recompute everywhere",
        )
        bad = [p for p in h.recompute if p not in POLICIES]
        _require(not bad, f"parallel.hotspa.recompute: {bad[0]!r} is not one of {', '.join(POLICIES)}" if bad else "")
    for k, (strategy, capacity) in enumerate(zip(strategies, capacities, strict=True)):
        try:
            validate_layout_settings(strategy_config(cfg, strategy, capacity, bucket_recompute(cfg, k)))
        except ConfigError as error:
            raise ConfigError(f"parallel.hotspa strategy {strategy.name} (bucket of {capacity}): {error}") from None


def check_hotspa_layouts(run) -> None:
    """Every bucket's resolved layout (parallel/resolved.py ``Bucket``), checked as the megatron layout it runs
    as; ``validate_hotspa`` has passed."""
    for bucket in run.buckets:
        try:
            check_layout(bucket.config, bucket.layout)
        except ConfigError as error:
            raise ConfigError(
                f"parallel.hotspa strategy {bucket.strategy.name} (bucket of {bucket.capacity}): {error}"
            ) from None
