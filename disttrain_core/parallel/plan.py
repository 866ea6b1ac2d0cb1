"""From ``parallel.*`` to a unit layout (``units_of``), called once per run by ``resolve_run``
(parallel/resolved.py), whose result validation, the planner, the launcher and the trainer all read.

* ``ddp``: the whole model on every process (one unit, dp = world size).
* ``megatron``: one (dp, tp, pp) for the LLM. ``modality_stages=separate`` (the
  rigid baseline DistTrain describes): the encoder and the generator become extra
  pipeline stages with the LLM's dp and tp (small modules replicated inside the
  TP group). ``folded``: they run inside the LLM's first and last stage, as
  Megatron-LM's multimodal example does.
* ``hotspa``: a (dp, tp, pp, cp) strategy per length bucket of packed text (train/hotspa.py); the layout
  is the home strategy's, the one that holds the model state.
* ``local_sgd``: the whole model on every process, as ``ddp``; workers of ``parallel.local_sgd.shard_group``
  processes step alone between syncs (train/local_sgd/engine.py).
* ``manual``: ``parallel.units.{encoder,audio_encoder,llm,generator,audio_generator}`` each with its own
  dp/tp/pp, or ``colocate: true`` for an encoder or generator to fold it into the LLM unit (the audio
  units' default).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import Config, image_tokens
from .units import SIDE_ENCODERS, SIDE_UNITS, UnitLayout, branch_groups, build_layout, with_audio_modules

MODES = ("ddp", "megatron", "manual", "auto", "hotspa", "local_sgd")


def local_sgd_shard_group(cfg: Config) -> int:
    """Processes per local-SGD worker (``parallel.mode=local_sgd``): ``parallel.local_sgd.shard_group``, or
    ``trainer.devices`` (one worker per node)."""
    size = cfg.parallel.local_sgd.shard_group
    return int(cfg.trainer.devices) if size is None else int(size)


EDIT_METHODS = ("edit", "a_edit")


def local_sgd_features(ls) -> tuple[bool, bool, bool]:
    """(layer-wise sync, anomaly elimination, softmax weighting) of ``parallel.local_sgd``: each setting, or
    where it is null the method's default (on for edit and a_edit, off for diloco and post_local_sgd)."""
    default = ls.method in EDIT_METHODS

    def pick(value) -> bool:
        return default if value is None else bool(value)

    return pick(ls.layerwise), pick(ls.penalty.anomaly), pick(ls.penalty.weighting)


def world_size_of(cfg: Config) -> int:
    return cfg.trainer.devices * cfg.trainer.num_nodes


def layout_shard(p, default: str) -> str:
    """``parallel.shard`` of a ddp or megatron layout: the setting, its ``zero1=true`` alias, or ``default``."""
    if p.shard is not None:
        return p.shard
    return "zero1" if p.zero1 else default


def units_of(cfg: Config) -> UnitLayout:
    """The layout of one config. HotSPa's is its home strategy's, resolved with every bucket's by
    ``resolve_run``; ``auto`` has none until the planner chose one. The audio tower and generator join the LLM
    unit."""
    layout, m = _units_of(cfg), cfg.model
    towers = tuple(name for name in SIDE_ENCODERS if getattr(m, name) is not None)
    generator = m.audio_generator is not None
    return with_audio_modules(layout, towers, generator) if towers or generator else layout


def separate_audio_units(cfg: Config) -> tuple[str, ...]:
    """The audio units on processes of their own (``parallel.units.<name>.colocate=false``, manual layouts of a
    model with that module)."""
    if cfg.parallel.mode != "manual":
        return ()
    units, model = cfg.parallel.units, cfg.model
    return tuple(name for name in SIDE_UNITS if getattr(model, name) is not None and not getattr(units, name).colocate)


def _units_of(cfg: Config) -> UnitLayout:
    p, model = cfg.parallel, cfg.model
    has_encoder, has_generator = model.encoder is not None, model.generator is not None
    same = {name: (p.recompute, p.recompute_every) for name in ("encoder", "llm", "generator")}
    if p.mode == "local_sgd":  # the whole model in every worker: DDP or FSDP2 inside it (train/local_sgd/engine.py)
        world = world_size_of(cfg)
        sizes = {"llm": (world, 1, 1)}
        shard = layout_shard(p, "none")
        # sharded: state over a worker's processes, replicated over the workers, as HSDP with a replica per worker
        replicas = max(1, world // local_sgd_shard_group(cfg)) if shard != "none" else 1
        return build_layout(sizes, has_encoder, has_generator, True, True, same, {"llm": (shard, replicas)}, {}, {})
    if p.mode == "ddp":
        sizes = {"llm": (world_size_of(cfg) // p.cp, 1, 1)}
        shard = {"llm": (layout_shard(p, "none" if p.cp == 1 and p.ep == 1 else "zero1"), p.hsdp_replicas)}
        offload = {"llm": p.offload}
        return build_layout(
            sizes, has_encoder, has_generator, True, True, same, shard, {"llm": p.cp}, {"llm": p.ep}, offload=offload
        )
    if p.mode == "megatron":
        folded = p.modality_stages == "folded"
        extra = 0 if folded else int(has_encoder) + int(has_generator)
        dp = p.dp if p.dp > 0 else max(1, world_size_of(cfg) // (p.tp * p.cp * (p.pp + extra)))
        # Every stage of the rigid layout has dp x tp x cp processes: the modality stages, which do not split
        # sequences, take the LLM's CP ranks as extra data-parallel replicas.
        sizes = {"encoder": (dp * p.cp, p.tp, 1), "llm": (dp, p.tp, p.pp), "generator": (dp * p.cp, p.tp, 1)}
        shard = {name: (layout_shard(p, "zero1"), p.hsdp_replicas) for name in sizes}
        offload = dict.fromkeys(sizes, p.offload)
        return build_layout(
            sizes,
            has_encoder,
            has_generator,
            folded,
            folded,
            same,
            shard,
            {"llm": p.cp},
            {"llm": p.ep},
            offload=offload,
        )
    if p.mode == "manual":
        audio = separate_audio_units(cfg)
        names = ("encoder", "llm", "generator", *audio)
        units = {name: getattr(p.units, name) for name in names}
        sizes = {name: (u.dp, u.tp, u.pp) for name, u in units.items()}
        recompute = {name: (u.recompute, u.recompute_every) for name, u in units.items()}
        shard = {name: (u.shard, u.hsdp_replicas) for name, u in units.items()}
        cp = {name: u.cp for name, u in units.items()}
        ep = {name: u.ep for name, u in units.items()}
        colocate = (p.units.encoder.colocate, p.units.generator.colocate)
        offload = {name: u.offload for name, u in units.items()}
        return build_layout(sizes, has_encoder, has_generator, *colocate, recompute, shard, cp, ep, audio, offload)
    if p.mode == "hotspa":
        raise ValueError("parallel.mode=hotspa: its layouts (one per bucket) are resolved by resolve_run")
    if p.mode == "auto":
        raise ValueError("parallel.mode=auto is resolved into units by the planner before anything is built")
    raise ValueError(f"parallel.mode={p.mode!r}: allowed values are {', '.join(MODES)}")


def stages_per_rank(cfg: Config) -> int:
    from ..schedule.generators import stages_per_rank as per_rank

    return per_rank(cfg.schedule.name, cfg.schedule.vpp)


def pipeline_schedule(cfg: Config, layout: UnitLayout, microbatches: int):
    """The schedule over the layout's pipeline rows.

    One unit: its pipeline ranks are the rows and may hold several (virtual) stages each
    (interleaved, V). Several units: one row per pipeline stage of every unit, in data-flow order, and
    one stage per row but the LLM's under interleaved_1f1b (``schedule.vpp`` stages per LLM row).
    """
    from ..schedule.actions import Schedule, drop_backward
    from ..schedule.generators import build_schedule, interleaved_units

    rows = len(layout.rows)
    if cfg.schedule.csv:
        schedule = Schedule.from_csv(cfg.schedule.csv, num_microbatches=microbatches)
        if schedule.num_ranks != rows:
            raise ValueError(
                f"schedule.csv has {schedule.num_ranks} rank rows but the layout has {rows} pipeline stages"
            )
        return schedule
    if rows == 1:
        return build_schedule("1f1b", 1, microbatches)  # one stage: forward and backward per microbatch
    if cfg.schedule.fill_bubbles:  # the colocated encoder's chunks in the LLM's bubbles (parallel/bubble_plan.py)
        from .bubble_plan import filled_schedule

        return filled_schedule(cfg, rows, microbatches)
    if len(layout.units) > 1 and cfg.schedule.name == "interleaved_1f1b":
        vpp = cfg.schedule.vpp
        groups = [[layout.units[u] for u in group] for group in branch_groups(layout.units)]
        units = [(group[0].pp, vpp if group[0].name == "llm" else 1) for group in groups]
        schedule = interleaved_units(units, microbatches)
    else:
        vpp = cfg.schedule.vpp if len(layout.units) == 1 else 1
        schedule = build_schedule(cfg.schedule.name, rows, microbatches, vpp)
    return drop_backward(schedule, forward_only_stages(cfg.model, layout, schedule))


def frozen_rows(model, layout: UnitLayout) -> int:
    """The leading pipeline rows whose every unit holds only frozen modules (model.freeze: a frozen encoder unit
    before a trainable LLM), ended by the first row with a trainable module; 0 when every row is frozen (nothing
    trains: the schedule stays whole)."""
    count = 0
    for places in layout.rows:
        modules = {m for u, _ in places for m in layout.units[u].modules if getattr(model, m, None) is not None}
        if not modules or not all(getattr(model.freeze, m) for m in modules):
            break
        count += 1
    return 0 if count == len(layout.rows) else count


def forward_only_stages(model, layout: UnitLayout, schedule) -> int:
    """How many leading stages run forwards only: those of the ``frozen_rows``. Their backward would compute
    nothing (parallel/stages.py gives them no trainable input)."""
    stages = sorted(s for row in range(frozen_rows(model, layout)) for s in schedule.stages_of(row))
    return len(stages) if stages == list(range(len(stages))) else 0


def validate_pipeline(layout: UnitLayout, schedule, samples_per_microbatch: int) -> None:
    """``validate_schedule`` with the layout's routing: the data flow, and every rank's point-to-point
    posts replayed under NCCL's rules (schedule/replay.py). Raises ScheduleError.

    The replay runs on the layout with every unit's data-parallel size divided by their greatest common
    divisor g: the samples of a microbatch then fall into g blocks that no transfer crosses, so the
    layout is g identical, independent copies of the reduced one (1072 GPUs in 18 stages replay as 67).
    """
    from ..schedule.validate import validate_schedule

    g = math.gcd(*(unit.dp for unit in layout.units))
    units, first = [], 0
    for unit in layout.units:
        units.append(replace(unit, dp=unit.dp // g, first_rank=first))
        first += units[-1].size
    reduced = UnitLayout(tuple(units))
    broker, _ = pipeline_broker(reduced, schedule, samples_per_microbatch // g)
    validate_schedule(schedule, broker)


def build_pipeline(cfg: Config, layout: UnitLayout, microbatches: int):
    """The schedule over the layout's pipeline rows (validated), its broker, and which rows each unit runs."""
    schedule = pipeline_schedule(cfg, layout, microbatches)
    samples = cfg.optim.micro_batch_size * layout.llm.dp
    validate_pipeline(layout, schedule, samples)
    broker, rows_of_units = pipeline_broker(layout, schedule, samples, tokens_per_item(cfg))
    return schedule, broker, rows_of_units


def tokens_per_item(cfg: Config) -> dict[str, int]:
    """Embedding rows per image (the patches, or the resampler's queries: config/model.py image_tokens), per clip
    and per video frame group that an encoder unit's last stage sends the LLM."""
    from ..data.audio import audio_tokens

    model, out = cfg.model, {}
    if model.encoder is not None:
        out["encoder"] = image_tokens(model)
    if model.audio_encoder is not None:
        out["audio_encoder"] = audio_tokens(model.audio_encoder)
    if model.video_encoder is not None:
        out["video_encoder"] = (model.video_encoder.image_size // model.video_encoder.patch_size) ** 2
    return out


def _row_kind(unit, pp: int, per_item: dict[str, int]):
    from .broker import SAMPLE_ROWS, RowKind

    counts = {"encoder": "image", "audio_encoder": "clip", "video_encoder": "group"}.get(unit.name)
    if counts is None:
        return SAMPLE_ROWS
    return RowKind(counts, per_item.get(unit.name, 1) if pp == unit.pp - 1 else 1)


def pipeline_broker(layout: UnitLayout, schedule, samples_per_microbatch: int, per_item: dict[str, int] | None = None):
    """The broker for a schedule over a layout, and the schedule rows of each unit; ``per_item``: the embedding
    rows per image / clip of the encoder units (``tokens_per_item``; 1 where only row counts matter)."""
    from .broker import CommBroker

    rows = schedule.num_ranks
    if len(layout.units) == 1:
        unit = layout.units[0]
        row_places = [[(unit, row)] for row in range(rows)]
        rows_of_units = {unit.name: list(range(rows))}
    else:
        row_places = [layout.row_places(row) for row in range(rows)]
        rows_of_units = {}
        for row, places in enumerate(layout.rows):
            for u, _ in places:
                rows_of_units.setdefault(layout.units[u].name, []).append(row)
    stage_places = [row_places[schedule.stage_to_rank[s]] for s in range(schedule.num_stages)]
    chunks = schedule.meta.get("encoder_stages", 0)  # schedule.fill_bubbles: the encoder's chunks come first
    if chunks:
        from .bubble_plan import encoder_unit

        encoder = encoder_unit(layout.units[0])  # the LLM unit's places, rows counted per image
        stage_places = [[(encoder, s)] for s in range(chunks)] + stage_places[chunks:]
    row_kinds = []
    for s in range(schedule.num_stages):
        after = stage_places[s + 1] if s + 1 < schedule.num_stages else []
        sections = after if len(after) > 1 and len(stage_places[s]) == 1 else stage_places[s]
        row_kinds.append([_row_kind(unit, pp, per_item or {}) for unit, pp in sections])
    broker = CommBroker(stage_places, row_places, row_kinds, samples_per_microbatch)
    # Until a step sets the real counts: one image, clip and frame group per sample, so every piece that can ever
    # travel does.
    ones = [[1] * samples_per_microbatch for _ in range(schedule.num_microbatches)]
    broker.set_counts(ones, ones, ones)
    return broker, rows_of_units
