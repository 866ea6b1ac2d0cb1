"""Checks of packed variable-length text (``data.packing``) and of HotSPa layouts (``parallel.mode=hotspa``):
one line each, before any process starts."""

from __future__ import annotations

from ..config import Config
from .common import ConfigError, _require


def validate_packing(cfg: Config) -> None:
    from ..data.packed_loader import SOURCES
    from ..data.packing import check_boundaries

    pk = cfg.data.packing
    _require(pk.source in SOURCES, f"data.packing.source={pk.source!r}: allowed values are {', '.join(SOURCES)}")
    if pk.source == "corpus":
        from ..data.corpus import corpus_files

        _require(
            pk.corpus is not None,
            "data.packing.source=corpus reads data.packing.corpus: set it to a .jsonl file, a directory of them, or "
            "webdataset shards (data.packing.corpus=${paths.data_dir}/synthetic_laion for the embedded shards)",
        )
        try:
            corpus_files(str(pk.corpus))
        except ValueError as error:
            raise ConfigError(f"data.packing.corpus: {error}") from None
    _require(pk.documents_per_step >= 1, f"data.packing.documents_per_step={pk.documents_per_step}: use 1 or more")
    _require(
        pk.length_scale > 0,
        f"data.packing.length_scale={pk.length_scale}: use a positive factor (1/32 draws 32K-context lengths for "
        "a 1K context)",
    )
    _require(pk.rows_per_microbatch >= 1, f"data.packing.rows_per_microbatch={pk.rows_per_microbatch}: use 1 or more")
    _require(
        pk.tokens_per_microbatch is None or pk.tokens_per_microbatch >= 1,
        f"data.packing.tokens_per_microbatch={pk.tokens_per_microbatch}: use a positive token budget, or null for "
        "data.packing.rows_per_microbatch rows per microbatch",
    )
    if pk.buckets is not None:
        try:
            check_boundaries(list(pk.buckets))
        except ValueError as error:
            raise ConfigError(f"data.packing.buckets: {error}") from None
        _require(
            max(pk.buckets) <= cfg.model.seq_len,
            f"data.packing.buckets={list(pk.buckets)} reach beyond model.seq_len={cfg.model.seq_len} (the rotary "
            f"table's length): set model.seq_len={max(pk.buckets)} or lower the last bucket",
        )
    _require(
        cfg.model.encoder is None and cfg.model.generator is None,
        f"data.packing packs text documents; model={cfg.model.name} has an image encoder or generator: use a "
        "text-only model (model=llama_tiny) or data=synthetic_laion",
    )
    _require(
        cfg.data.producer.address is None,
        "data.packing builds its steps in the trainers; unset data.producer.address",
    )
    mode = cfg.parallel.mode
    _require(
        mode in ("ddp", "hotspa", "local_sgd"),
        f"data.packing runs with parallel.mode=ddp, hotspa or local_sgd (packed rows of several lengths); "
        f"parallel.mode={mode}: "
        "express a static tp/pp/cp layout as parallel=hotspa with one strategy per bucket",
    )
    _require(
        not cfg.parallel.comm.tp_overlap,
        "parallel.comm.tp_overlap does not run packed documents (its sequence split ignores document masks)",
    )


def validate_hotspa(cfg: Config) -> None:
    """The strategies, their buckets and the home; every strategy is then checked as the megatron layout it
    runs as (heads divisible by tp, layers by pp, rows by cp, ...)."""
    from ..parallel.hotspa_layout import (
        bucket_boundaries,
        bucket_recompute,
        bucket_strategies,
        parse_strategies,
        strategy_config,
    )
    from ..parallel.plan import world_size_of
    from .layout import validate_layout

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
        cfg.schedule.name not in ("interleaved_1f1b", "zbv"),
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
            validate_layout(strategy_config(cfg, strategy, capacity, bucket_recompute(cfg, k)))
        except ConfigError as error:
            raise ConfigError(f"parallel.hotspa strategy {strategy.name} (bucket of {capacity}): {error}") from None
    check_strategies_fit(cfg)


def strategy_memory(cfg: Config, strategy, capacity: int, recompute: str | None = None, shard: str = "zero1"):
    """The planner's evaluation (planner/evaluate.py, analytic costs) of one strategy holding rows of
    ``capacity`` tokens: ``.feasible``, ``.memory["llm"]`` (bytes on its fullest device), ``.reason``."""
    from omegaconf import OmegaConf

    from ..parallel.hotspa_layout import strategy_config
    from ..planner import build_layout_model, choices_of_config

    scfg = strategy_config(cfg, strategy, capacity, recompute)
    policy = recompute or cfg.parallel.recompute
    scfg = OmegaConf.merge(scfg, {"planner": {"cost": "analytic", "recompute": policy, "shard": shard}})
    # the run's processes per node (a tensor-parallel group is placed as the run places it)
    scfg.cluster.gpus_per_node = int(cfg.trainer.devices)
    scfg.cluster.num_gpus = strategy.world
    for key in ("peak_flops_fp32", "peak_flops_bf16"):  # memory does not depend on speed: any value serves
        if scfg.cluster[key] is None:
            scfg.cluster[key] = 1e12
    model = build_layout_model(scfg, devices=strategy.world, progress=lambda *_: None)
    return model.evaluate(*choices_of_config(scfg))


def check_strategies_fit(cfg: Config) -> None:
    """Every strategy holds its bucket's rows in ``cluster.memory_per_device_gb`` (the planner's memory model,
    with its bucket's recompute policy and ZeRO-1), or the run is refused in one line naming both."""
    from ..parallel.hotspa_layout import bucket_recompute, bucket_strategies

    strategies, capacities, _ = bucket_strategies(cfg)
    for k, (strategy, capacity) in enumerate(zip(strategies, capacities, strict=True)):
        try:
            ev = strategy_memory(cfg, strategy, capacity, recompute=bucket_recompute(cfg, k))
        except ValueError as error:  # the planner's own refusals (cluster settings, shapes): one line
            raise ConfigError(f"parallel.hotspa strategy {strategy.name}: {error}") from None
        if not ev.feasible:
            raise ConfigError(
                f"parallel.hotspa strategy {strategy.name} cannot hold its bucket of {capacity}-token rows within "
                f"cluster.memory_per_device_gb={cfg.cluster.memory_per_device_gb:g} ({ev.reason}): give that bucket "
                "more tp, pp or cp, recompute (parallel.hotspa.recompute), or raise the memory limit"
            )
