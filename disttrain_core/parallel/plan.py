"""From ``parallel.*`` to a unit layout, the same way everywhere (validation, the
trainer, the tools).

* ``ddp``: the whole model on every process (one unit, dp = world size).
* ``megatron``: one (dp, tp, pp) for the LLM. ``modality_stages=separate`` (the
  rigid baseline DistTrain describes): the encoder and the generator become extra
  pipeline stages with the LLM's dp and tp (small modules replicated inside the
  TP group). ``folded``: they run inside the LLM's first and last stage, as
  Megatron-LM's multimodal example does.
* ``manual``: ``parallel.units.{encoder,llm,generator}`` each with its own
  dp/tp/pp, or ``colocate: true`` for the encoder or generator to fold it into the
  LLM unit.
"""

from __future__ import annotations

from ..config import Config
from .units import UnitLayout, build_layout

MODES = ("ddp", "megatron", "manual", "auto")


def world_size_of(cfg: Config) -> int:
    return cfg.trainer.devices * cfg.trainer.num_nodes


def resolve_units(cfg: Config) -> UnitLayout:
    p, model = cfg.parallel, cfg.model
    has_encoder, has_generator = model.encoder is not None, model.generator is not None
    if p.mode == "ddp":
        sizes = {"llm": (world_size_of(cfg), 1, 1)}
        return build_layout(sizes, has_encoder, has_generator, True, True)
    if p.mode == "megatron":
        folded = p.modality_stages == "folded"
        extra = 0 if folded else int(has_encoder) + int(has_generator)
        dp = p.dp if p.dp > 0 else max(1, world_size_of(cfg) // (p.tp * (p.pp + extra)))
        sizes = {"encoder": (dp, p.tp, 1), "llm": (dp, p.tp, p.pp), "generator": (dp, p.tp, 1)}
        return build_layout(sizes, has_encoder, has_generator, folded, folded)
    if p.mode == "manual":
        units = p.units
        sizes = {
            name: (u.dp, u.tp, u.pp)
            for name, u in (("encoder", units.encoder), ("llm", units.llm), ("generator", units.generator))
        }
        return build_layout(sizes, has_encoder, has_generator, units.encoder.colocate, units.generator.colocate)
    if p.mode == "auto":
        raise ValueError("parallel.mode=auto is resolved into units by the planner before anything is built")
    raise ValueError(f"parallel.mode={p.mode!r}: allowed values are {', '.join(MODES)}")


def stages_per_rank(cfg: Config) -> int:
    return {"interleaved_1f1b": cfg.schedule.vpp, "zbv": 2}.get(cfg.schedule.name, 1)


def build_pipeline(cfg: Config, layout: UnitLayout, microbatches: int):
    """The schedule over the layout's pipeline rows, its broker, and which rows each unit runs.

    One unit: its pipeline ranks are the rows and may hold several (virtual) stages each
    (interleaved, V). Several units: one row and one stage per pipeline stage of every unit,
    in data-flow order.
    """
    from ..schedule.actions import Schedule
    from ..schedule.generators import build_schedule
    from ..schedule.validate import validate_schedule

    rows = sum(unit.pp for unit in layout.units)
    if cfg.schedule.csv:
        schedule = Schedule.from_csv(cfg.schedule.csv, num_microbatches=microbatches)
        if schedule.num_ranks != rows:
            raise ValueError(
                f"schedule.csv has {schedule.num_ranks} rank rows but the layout has {rows} pipeline stages"
            )
    elif rows == 1:
        schedule = build_schedule("1f1b", 1, microbatches)  # one stage: forward and backward per microbatch
    else:
        vpp = cfg.schedule.vpp if len(layout.units) == 1 else 1
        schedule = build_schedule(cfg.schedule.name, rows, microbatches, vpp)
    validate_schedule(schedule)
    broker, rows_of_units = pipeline_broker(layout, schedule, cfg.optim.micro_batch_size * layout.llm.dp)
    return schedule, broker, rows_of_units


def pipeline_broker(layout: UnitLayout, schedule, samples_per_microbatch: int):
    """The broker for a schedule over a layout, and the schedule rows of each unit."""
    from .broker import CommBroker

    rows = schedule.num_ranks
    if len(layout.units) == 1:
        unit = layout.units[0]
        row_places = [(unit, row) for row in range(rows)]
        stage_places = [(unit, schedule.stage_to_rank[s]) for s in range(schedule.num_stages)]
        rows_of_units = {unit.name: list(range(rows))}
    else:
        row_places = [layout.stage_unit(row) for row in range(rows)]
        stage_places = row_places
        rows_of_units, row = {}, 0
        for unit in layout.units:
            rows_of_units[unit.name] = list(range(row, row + unit.pp))
            row += unit.pp
    image_rows = [unit.name == "encoder" for unit, _ in stage_places]
    return CommBroker(stage_places, row_places, image_rows, samples_per_microbatch), rows_of_units
