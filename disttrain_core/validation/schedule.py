"""Checks of the pipeline schedule a layout runs (``schedule.*`` against the layout and batch sizes), one
line each, before any process starts: the schedule is built and replayed here, so one that would deadlock
fails now."""

from __future__ import annotations

import os

from ..config import Config
from ..schedule.generators import V_SHAPED
from .common import ConfigError, _require

# Stages x microbatches of one step's pipeline schedule, which check_pipeline builds and replays (about 0.1 ms
# a slot): beyond this the check would take minutes, and such a batch is a typo.
MAX_PIPELINE_SLOTS = 65_536
# Samples in one microbatch slot (every LLM replica's micro-batch): the check routes each of them through the
# broker; beyond this a micro-batch is a typo (a 1M-sample micro-batch of 1-token rows is still a million rows).
MAX_SLOT_SAMPLES = 1 << 20


def _validate_hotspa_schedules(run) -> None:
    """Each hotspa strategy runs as its own rigid layout (its bucket's config): validate each one's schedule."""
    _require(
        run.cfg.parallel.pp_split is None,
        "parallel.pp_split is not built for parallel.mode=hotspa (its strategies switch pipeline sizes); unset it",
    )
    for bucket in run.buckets:
        validate_schedule_config(bucket.config, bucket.layout)


def _check_microbatch_sharing(cfg: Config, layout, samples: int) -> None:
    """Every unit's data-parallel replicas share a microbatch slot evenly."""
    llm = layout.llm
    for unit in layout.units:
        _require(
            samples % unit.dp == 0,
            f"a microbatch slot holds optim.micro_batch_size({cfg.optim.micro_batch_size}) x llm dp({llm.dp}) = "
            f"{samples} samples, which the {unit.name} unit's dp({unit.dp}) cannot share evenly; choose sizes so "
            f"{unit.dp} divides it",
        )


def _check_schedule_choice(cfg: Config, llm, rows: int, per_rank: int, micro: int) -> None:
    """A pipelined layout names a known schedule whose microbatches fit the batch sizes."""
    from ..schedule.generators import SCHEDULES

    s = cfg.schedule
    _require(
        s.name != "none" or s.csv,
        f"this layout has {rows} pipeline stages and needs a schedule: pick "
        f"schedule=<one of {', '.join(SCHEDULES)}> (1f1b is the usual choice)",
    )
    _require(
        s.csv is not None or s.name in SCHEDULES, f"schedule={s.name!r} is unknown; available: {', '.join(SCHEDULES)}"
    )
    slots = rows * max(per_rank, 1) * micro
    _require(
        slots <= MAX_PIPELINE_SLOTS,
        f"optim.global_batch_size={cfg.optim.global_batch_size} makes {micro} microbatches per step for "
        f"{rows * max(per_rank, 1)} pipeline stages ({slots} schedule slots; the schedule is built and replayed "
        f"before launch up to {MAX_PIPELINE_SLOTS}); raise optim.micro_batch_size or lower optim.global_batch_size",
    )
    _require(
        s.microbatches is None or s.microbatches == micro,
        f"schedule.microbatches={s.microbatches} disagrees with optim.global_batch_size("
        f"{cfg.optim.global_batch_size}) / (optim.micro_batch_size({cfg.optim.micro_batch_size}) x dp({llm.dp})) "
        f"= {micro}; leave schedule.microbatches unset or change the batch sizes",
    )


def _check_units_interleaved(cfg: Config, llm, per_rank: int) -> None:
    """Virtual stages of the LLM unit in a multi-unit pipeline: at least 2, and its blocks split into them."""
    s, p = cfg.schedule, cfg.parallel
    _require(s.vpp >= 2, f"schedule.vpp={s.vpp}: interleaved_1f1b needs at least 2 virtual stages per LLM rank")
    _require(
        p.mode != "manual" or p.units.llm.vpp in (1, s.vpp),
        f"parallel.units.llm.vpp={p.units.llm.vpp} disagrees with schedule.vpp={s.vpp}; set them equal",
    )
    stages, layers = llm.pp * per_rank, cfg.model.llm.n_layers
    _require(
        layers % stages == 0 or p.pp_split is not None,
        f"model.llm.n_layers={layers} cannot be split into the LLM's pipeline size ({llm.pp}) x virtual stages "
        f"({per_rank}) = {stages} equal stages; change parallel.units.llm.pp or schedule.vpp",
    )


def _check_single_unit_schedule(cfg: Config, llm, per_rank: int, micro: int) -> None:
    """The virtual stages, layer split or schedule file of a single-unit pipeline."""
    s = cfg.schedule
    if s.name in ("interleaved_1f1b", "breadth_first"):
        _require(s.vpp >= 2, f"schedule.vpp={s.vpp}: {s.name} needs at least 2 virtual stages per rank")
    if s.name == "interleaved_1f1b":
        _require(
            micro % llm.pp == 0 and micro >= llm.pp,
            f"interleaved_1f1b needs the microbatches per step ({micro}) to be a multiple of the pipeline size "
            f"({llm.pp}); raise optim.global_batch_size or lower optim.micro_batch_size",
        )
    elif not s.csv:
        _require(s.vpp == per_rank, f"schedule={s.name} places {per_rank} stage(s) per rank; got schedule.vpp={s.vpp}")
    if not s.csv:
        stages = llm.pp * per_rank
        layers = cfg.model.llm.n_layers
        _require(
            layers % stages == 0 or cfg.parallel.pp_split is not None,
            f"model.llm.n_layers={layers} cannot be split into pipeline size ({llm.pp}) x stages per rank "
            f"({per_rank}) = {stages} equal stages; change parallel.pp or schedule.vpp",
        )
    else:
        _require(os.path.isfile(s.csv), f"schedule.csv={s.csv!r}: no such file")


def check_pp_split(cfg: Config, stages: int) -> None:
    """parallel.pp_split: auto, or one block count per LLM pipeline stage, each at least 1, adding up to the
    LLM's blocks."""
    split, blocks = cfg.parallel.pp_split, cfg.model.llm.n_layers
    if split is None:
        return
    if isinstance(split, str):
        _require(
            split == "auto",
            f"parallel.pp_split={split!r}: use auto, null, or the blocks of each LLM stage, e.g. [1, 3]",
        )
        return
    _require(
        not isinstance(split, (bool, int, float)),
        f"parallel.pp_split={split!r}: use auto, null, or the blocks of each LLM stage, e.g. [1, 3]",
    )
    counts = list(split)
    _require(
        all(isinstance(count, int) and not isinstance(count, bool) for count in counts),
        f"parallel.pp_split={counts}: give whole block counts, one per LLM pipeline stage, e.g. [1, 3]",
    )
    _require(
        len(counts) == stages,
        f"parallel.pp_split has {len(counts)} entries but the LLM has {stages} pipeline stage(s) "
        "(pp x virtual stages per rank); give one block count per stage",
    )
    _require(
        min(counts) >= 1,
        f"parallel.pp_split={counts} leaves a stage without blocks; every LLM stage holds at least one block",
    )
    _require(
        sum(counts) == blocks,
        f"parallel.pp_split={counts} covers {sum(counts)} blocks but model.llm.n_layers={blocks}; "
        "the counts must add up to it",
    )


def check_planner_schedules(cfg: Config) -> None:
    """planner.schedules: one or more of the schedules the planner can cost (planner/schedule_choice.py)."""
    from ..schedule.generators import PLANNABLE

    names = list(cfg.planner.get("schedules", ()))
    unknown = [name for name in names if name not in PLANNABLE]
    _require(
        bool(names) and not unknown,
        f"planner.schedules={names}: "
        + (f"{', '.join(map(str, unknown))} cannot be planned" if unknown else "give at least one")
        + f"; choose among {', '.join(PLANNABLE)}, e.g. planner.schedules=[1f1b,interleaved_1f1b,zb_h1]",
    )


def validate_run_schedules(run) -> None:
    """The pipeline schedule of a resolved run (parallel/resolved.py): HotSPa's, one per bucket."""
    if run.buckets:
        _validate_hotspa_schedules(run)
    else:
        validate_schedule_config(run.cfg, run.layout)


def validate_schedule_config(cfg: Config, layout) -> None:
    """The pipeline schedule against the layout and batch sizes; the schedule is built and replayed here."""
    from ..parallel.plan import stages_per_rank

    s = cfg.schedule
    llm = layout.llm
    rows = sum(u.pp for u in layout.units)
    per_rank = stages_per_rank(cfg)
    # Samples per global microbatch: every LLM replica's micro-batch, together.
    samples = cfg.optim.micro_batch_size * llm.dp
    micro = cfg.optim.global_batch_size // samples
    _require(
        rows == 1 or samples <= MAX_SLOT_SAMPLES,
        f"optim.micro_batch_size={cfg.optim.micro_batch_size} x llm dp({llm.dp}) = {samples} samples per "
        f"microbatch (the pipeline check routes each; at most {MAX_SLOT_SAMPLES:,}); lower optim.micro_batch_size",
    )
    _check_microbatch_sharing(cfg, layout, samples)
    check_pp_split(cfg, llm.pp * per_rank)
    if rows == 1:
        _require(
            s.name == "none" and not s.csv,
            f"schedule={s.name} needs pipeline stages; set parallel.pp > 1 or use schedule=none",
        )
        return
    _check_schedule_choice(cfg, llm, rows, per_rank, micro)
    if len(layout.units) > 1:
        _require(
            (per_rank == 1 or s.name == "interleaved_1f1b") and not s.csv,
            f"schedule={s.name} places {'two stages per rank in a V' if s.name in V_SHAPED else 'its loops'} "
            "by rank, which a pipeline across units does not support; use gpipe, 1f1b, zb_h1, zb_h2, or "
            "interleaved_1f1b (virtual stages of the LLM unit)",
        )
        if s.name == "interleaved_1f1b":
            _check_units_interleaved(cfg, llm, per_rank)
        check_pipeline(cfg, layout, micro)
        return
    _check_single_unit_schedule(cfg, llm, per_rank, micro)
    check_pipeline(cfg, layout, micro)


def check_pipeline(cfg: Config, layout, microbatches: int) -> None:
    """Build the schedule the run will use and validate it with the layout's routing, including the replay
    of every rank's point-to-point posts under NCCL's rules: a schedule that would deadlock fails here."""
    from ..parallel.plan import pipeline_schedule, validate_pipeline
    from ..schedule.simulator import ScheduleError

    try:
        schedule = pipeline_schedule(cfg, layout, microbatches)
        validate_pipeline(layout, schedule, cfg.optim.micro_batch_size * layout.llm.dp)
    except (ScheduleError, ValueError) as error:
        raise ConfigError(f"schedule={cfg.schedule.csv or cfg.schedule.name}: {error}") from error
