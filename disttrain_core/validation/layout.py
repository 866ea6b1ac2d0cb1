"""Checks of the parallel layout (before any process starts); its pipeline schedule: schedule.py."""

from __future__ import annotations

from ..comm.context_modes import MODES as CP_MODES
from ..comm.context_modes import ulysses_degree
from ..config import Config
from ..parallel.units import UNIT_NAMES
from ..schedule.generators import SPLIT_BACKWARD
from .bubble_fill import check_bubble_fill, check_fill_split_alone
from .common import ConfigError, _require, world_size
from .float8 import check_float8_layout
from .item_balance import check_item_balance
from .offload import check_unit_offload, check_unit_saved_activations, validate_offload_settings
from .unit_shapes import validate_moe_unit, validate_unit_pp, validate_unit_tp

COLOCATABLE = tuple(name for name in UNIT_NAMES if name != "llm")
MAX_PARALLEL_SIZE = 65_536  # dp, tp or pp beyond this (and the world size) is a typo


def reads_global_stream(layout) -> bool:
    """Several units read the one canonical sample stream; a single unit splits shards by replica."""
    return len(layout.units) > 1


def _unit_formula(units) -> str:
    return " + ".join(
        f"{u.name} dp({u.dp}) x tp({u.tp}){f' x cp({u.cp})' if u.cp > 1 else ''} x pp({u.pp})" for u in units
    )


def _validate_context_settings(cfg: Config) -> None:
    """The context- and expert-parallel sizes, before the layout is resolved (ddp layouts divide the world by cp)."""
    p = cfg.parallel
    _require(p.cp >= 1, f"parallel.cp={p.cp}: use 1 (no context parallelism) or more")
    _require(
        p.cp_mode in (*CP_MODES, "auto"),
        f"parallel.cp_mode={p.cp_mode!r}: allowed values are {', '.join(CP_MODES)}, auto",
    )
    _require(p.cp_ulysses >= 0, f"parallel.cp_ulysses={p.cp_ulysses}: use 0 (chosen) or a divisor of cp")
    for name in UNIT_NAMES:
        cp = getattr(p.units, name).cp
        _require(cp >= 1, f"parallel.units.{name}.cp={cp}: use 1 (no context parallelism) or more")
        _require(
            name == "llm" or cp == 1,
            f"parallel.units.{name}.cp={cp}: context parallelism splits the LLM's sequences only; set "
            f"parallel.units.{name}.cp=1 (and give the unit more dp instead)",
        )
    for name in COLOCATABLE:
        ep = getattr(p.units, name).ep
        _require(ep == 1, f"parallel.units.{name}.ep={ep}: expert parallelism applies to the LLM's MoE blocks; set 1")
    for where, ep in (("parallel.ep", p.ep), ("parallel.units.llm.ep", p.units.llm.ep)):
        _require(ep >= 1, f"{where}={ep}: use 1 (no expert parallelism) or more")
        _require(
            ep == 1 or cfg.model.llm.moe is not None,
            f"{where}={ep} needs a mixture-of-experts model (model.llm.moe); this model is dense: set {where}=1",
        )
    _require(
        p.mode != "manual" or p.ep == 1,
        f"parallel.ep={p.ep} sets ddp and megatron layouts; this layout has units: set parallel.units.llm.ep",
    )
    _require(
        p.mode != "manual" or p.cp == 1,
        f"parallel.cp={p.cp} sets ddp and megatron layouts; this layout has units: set parallel.units.llm.cp",
    )
    if p.mode == "ddp":
        _require(
            p.tp == 1 and p.pp == 1,
            f"parallel.tp={p.tp}, parallel.pp={p.pp}: parallel.mode=ddp (parallel={p.name}) keeps the whole model on "
            "every process and would ignore them; for tensor or pipeline parallelism use parallel.mode=megatron "
            "(e.g. parallel=megatron_tp2, or parallel.mode=megatron parallel.dp=2 parallel.tp=2)",
        )
        world = world_size(cfg)
        _require(
            world % p.cp == 0,
            f"parallel.cp={p.cp} does not divide trainer.devices x trainer.num_nodes = {world} processes; the "
            "data-parallel size is processes / cp",
        )


def _validate_context_unit(cfg: Config, unit) -> None:
    """Context parallelism of a resolved LLM unit against the model and the other settings."""
    where = f"the {unit.name} unit (cp={unit.cp})"
    seq = cfg.model.seq_len
    _require(
        seq >= 2 * unit.cp,
        f"{where}: model.seq_len={seq} cannot be cut into 2 x cp = {2 * unit.cp} zig-zag chunks; lower cp",
    )
    _require(
        unit.hsdp_replicas == 1,
        f"{where}: hsdp_replicas={unit.hsdp_replicas}; HSDP's replicate x shard mesh is built over data-parallel "
        "ranks only: with context parallelism use shard=zero1, or zero2/zero3 sharded over all data x context "
        "ranks (hsdp_replicas=1)",
    )
    _require(
        not cfg.parallel.comm.tp_overlap,
        f"{where}: parallel.comm.tp_overlap=true splits sequences over the TP group as well; use "
        "parallel.comm.tp_overlap=false with cp",
    )
    if cfg.parallel.cp_mode != "auto":  # auto is resolved at launch (launch/entry.py), then checked here
        heads, kv_heads = cfg.model.llm.n_heads // unit.tp, max(1, cfg.model.llm.n_kv_heads // unit.tp)
        try:
            ulysses_degree(cfg.parallel.cp_mode, unit.cp, cfg.parallel.cp_ulysses, heads, kv_heads)
        except ValueError as error:
            raise ConfigError(f"{where}: {error}") from None
    _require(
        cfg.model.document_attention != "flex",
        f"{where}: model.document_attention=flex; ring attention computes each block with its own kernel (the "
        "same-document runs, or a mask): use model.document_attention=auto (runs) or dense",
    )


def _validate_shard_settings(p) -> None:
    """Names and combinations of the shard settings, before the layout is resolved."""
    from ..parallel.fsdp import SHARD_MODES

    settings = [("parallel", p)] + [(f"parallel.units.{n}", getattr(p.units, n)) for n in UNIT_NAMES]
    for where, s in settings:
        if s.shard is not None:
            _require(s.shard in SHARD_MODES, f"{where}.shard={s.shard!r}: allowed values are {', '.join(SHARD_MODES)}")
        _require(s.hsdp_replicas >= 1, f"{where}.hsdp_replicas={s.hsdp_replicas}: use 1 (no HSDP) or more")
    _require(
        not (p.zero1 and p.shard not in (None, "zero1")),
        f"parallel.zero1=true is an alias of parallel.shard=zero1 but parallel.shard={p.shard}; drop one of them",
    )
    if p.mode == "manual":
        _require(
            p.shard is None and not p.zero1 and p.hsdp_replicas == 1,
            "parallel.shard / parallel.zero1 / parallel.hsdp_replicas set every unit of a ddp or megatron layout; "
            "this layout has units: set parallel.units.<encoder|llm|generator>.shard",
        )
        for name in COLOCATABLE:
            unit = getattr(p.units, name)
            _require(
                not (unit.colocate and (unit.shard != "zero1" or unit.hsdp_replicas != 1)),
                f"parallel.units.{name}.shard={unit.shard}: the {name} is colocated with the LLM and shards as "
                f"the LLM unit does; set parallel.units.llm.shard={unit.shard} and leave the {name}'s at zero1",
            )
    elif p.mode == "megatron":
        _require(
            p.shard != "none",
            "parallel.shard=none (DDP) needs a ddp layout; megatron layouts shard at least zero1: use "
            "parallel.shard=zero1, zero2 or zero3",
        )


def _check_sizes_fit(cfg: Config) -> None:
    """No parallel size is absurdly large: building such a layout (a list per pipeline stage) would exhaust
    memory for a typo like parallel.pp=10**18 before the process count is compared (which names the sizes)."""
    p, world = cfg.parallel, world_size(cfg)
    limit = max(world, MAX_PARALLEL_SIZE)
    sizes = [("parallel.dp", p.dp), ("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.cp", p.cp)]
    for name in UNIT_NAMES:
        unit = getattr(p.units, name)
        sizes += [(f"parallel.units.{name}.{size}", getattr(unit, size)) for size in ("dp", "tp", "pp", "cp")]
    for where, value in sizes:
        _require(
            value <= limit,
            f"{where}={value} is more than {limit}; the layout must fit the trainer.devices x trainer.num_nodes = "
            f"{world} process(es)",
        )


def _validate_unit_shard(unit, schedule_name: str, key: str) -> None:
    """A unit's shard mode against its sizes and the pipeline schedule (``key``: the setting that sets it,
    ``parallel.shard`` or ``parallel.units.<unit>.shard``)."""
    where = f"the {unit.name} unit (shard={unit.shard}, dp={unit.dp}, tp={unit.tp}, pp={unit.pp})"
    if unit.shard == "none":
        _require(
            unit.tp == 1 and unit.pp == 1,
            f"{where}: shard=none (DDP) needs a pure data-parallel unit; with tp or pp use {key}=zero1, zero2 or zero3",
        )
    if unit.hsdp_replicas > 1:
        _require(
            unit.fsdp,
            f"{where}: hsdp_replicas={unit.hsdp_replicas} needs {key}=zero2 or zero3 (HSDP is FSDP2 over a "
            "replicate x shard mesh)",
        )
        _require(
            unit.dp % unit.hsdp_replicas == 0,
            f"{where}: hsdp_replicas={unit.hsdp_replicas} does not divide the unit's dp={unit.dp}; choose a "
            "divisor of dp",
        )
    if unit.fsdp:
        _require(
            unit.dp * unit.cp // unit.hsdp_replicas >= 2,
            f"{where}: {unit.shard} shards over the unit's data-parallel (and context-parallel) ranks and this unit "
            f"has {unit.dp * unit.cp // unit.hsdp_replicas} per shard group; raise dp (or lower hsdp_replicas) or "
            "use shard=zero1",
        )
        _require(
            schedule_name not in SPLIT_BACKWARD,
            f"{where}: schedule={schedule_name} runs weight gradients outside FSDP2's backward hooks; use "
            "schedule=1f1b (or gpipe, interleaved_1f1b, breadth_first) with zero2/zero3, or shard=zero1 with "
            "zero-bubble",
        )


def _validate_mode_and_units(cfg: Config) -> None:
    """The mode (and its own validator), the optimizer, and the basic sizes of the units."""
    from ..parallel.plan import MODES
    from .local_sgd import validate_local_sgd, validate_optimizer

    p = cfg.parallel
    _require(p.mode in MODES, f"parallel.mode={p.mode!r}: allowed values are {', '.join(MODES)}")
    validate_optimizer(cfg)
    _require(p.mode != "hotspa", "parallel.mode=hotspa: its strategies are checked by validation/hotspa.py")
    if p.mode == "local_sgd":
        validate_local_sgd(cfg)
    _require(
        p.modality_stages in ("separate", "folded"),
        f"parallel.modality_stages={p.modality_stages!r}: allowed values are separate and folded",
    )
    _require(p.dp == -1 or p.dp >= 1, f"parallel.dp={p.dp}: use -1 (derive from the world size) or a positive size")
    for name in UNIT_NAMES:
        u = getattr(p.units, name)
        _require(
            min(u.dp, u.tp, u.pp, u.vpp) >= 1,
            f"parallel.units.{name}: dp={u.dp} tp={u.tp} pp={u.pp} vpp={u.vpp}; each must be at least 1 (a unit "
            "needs devices to run on: give it some, or colocate=true to run it inside the LLM unit)",
        )
        _require(
            name == "llm" or u.vpp == 1,
            f"parallel.units.{name}.vpp={u.vpp}: virtual pipeline stages are the LLM unit's (with "
            f"schedule=interleaved_1f1b); set parallel.units.{name}.vpp=1",
        )
    _require(
        not p.units.llm.colocate,
        "parallel.units.llm.colocate: only the encoders or the generators can be colocated (with the LLM)",
    )


def _validate_recompute_settings(p) -> None:
    """Names and values of the recompute settings, and where a layout with units sets them."""
    from ..parallel.recompute import POLICIES

    settings = [("parallel", p)] + [(f"parallel.units.{n}", getattr(p.units, n)) for n in UNIT_NAMES]
    for where, s in settings:
        _require(
            s.recompute in POLICIES,
            f"{where}.recompute={s.recompute!r}: allowed values are {', '.join(POLICIES)}",
        )
        _require(s.recompute_every >= 1, f"{where}.recompute_every={s.recompute_every}: use 1 or more")
    if p.mode == "manual":
        _require(
            p.recompute == "none",
            f"parallel.recompute={p.recompute} sets every unit of a ddp or megatron layout; this layout has units: "
            "set parallel.units.<encoder|llm|generator>.recompute",
        )
        for name in COLOCATABLE:
            unit = getattr(p.units, name)
            _require(
                not (unit.colocate and unit.recompute != "none"),
                f"parallel.units.{name}.recompute={unit.recompute}: the {name} is colocated with the LLM and "
                "recomputes as the LLM unit does; set parallel.units.llm.recompute",
            )


def _validate_comm_settings(p) -> None:
    """The gradient bucket size and the collectives' implementation."""
    _require(
        p.comm.bucket_mb >= 0,
        f"parallel.comm.bucket_mb={p.comm.bucket_mb}: use a positive size in MB (25 is DDP's default) or 0 for one "
        "bucket",
    )
    _require(
        p.comm.collectives in ("auto", "ring", "native"),
        f"parallel.comm.collectives={p.comm.collectives!r}: allowed values are auto, ring and native",
    )


def _validate_interleave_modes(p, layout) -> None:
    """parallel.comm.interleave_modes: known modes, a block size, and a layout that trains with ZeRO-1."""
    from ..comm.engine import MODES

    unknown = [mode for mode in p.comm.interleave_modes if mode not in MODES]
    _require(
        not unknown,
        f"parallel.comm.interleave_modes: unknown mode(s) {unknown}; allowed: {', '.join(MODES)}",
    )
    _require(
        p.comm.interleave_block >= 1,
        f"parallel.comm.interleave_block={p.comm.interleave_block}: use a positive number of steps",
    )
    _require(
        not layout.trains_with_ddp() and not any(u.fsdp for u in layout.units),
        "parallel.comm.interleave_modes switches ZeRO-1's collectives; this layout trains with DDP or FSDP2. "
        "Use parallel=zero1 (or shard=zero1 on every unit)",
    )


def _validate_unit(cfg: Config, unit) -> None:
    """One resolved unit against the model and the other settings."""
    if unit.cp > 1:
        _validate_context_unit(cfg, unit)
    if cfg.parallel.mode != "local_sgd":  # its workers' sharding is checked by validate_local_sgd
        key = f"parallel.units.{unit.name}.shard" if cfg.parallel.mode == "manual" else "parallel.shard"
        _validate_unit_shard(unit, cfg.schedule.name, key)
        check_unit_offload(unit, key.replace(".shard", ".offload"))
    check_unit_saved_activations(cfg, unit, _recompute_key(cfg, unit))
    where = f"parallel {unit.name} unit"
    if "llm" in unit.modules and cfg.model.llm.moe is not None:
        validate_moe_unit(cfg, unit)
    if unit.tp > 1:
        validate_unit_tp(cfg, unit, where)
    validate_unit_pp(cfg, unit, where)


def _recompute_key(cfg: Config, unit) -> str:
    """The setting that set a resolved unit's recompute policy."""
    mode = cfg.parallel.mode
    if mode == "manual":
        return f"parallel.units.{unit.name}.recompute"
    return "parallel.hotspa.recompute" if mode == "hotspa" and cfg.parallel.hotspa.recompute else "parallel.recompute"


def check_layout(cfg: Config, layout) -> None:
    """The resolved layout (parallel/resolved.py): interleaved collectives, process count, then each
    unit. ``validate_layout_settings`` has passed."""
    p = cfg.parallel
    world = world_size(cfg)
    if p.comm.interleave_modes:
        _validate_interleave_modes(p, layout)
    _require(
        layout.world_size == world,
        f"the layout needs {_unit_formula(layout.units)} = {layout.world_size} processes but trainer.devices"
        f"({cfg.trainer.devices}) x trainer.num_nodes({cfg.trainer.num_nodes}) = {world}; make them equal",
    )
    for unit in layout.units:
        _validate_unit(cfg, unit)
    if p.rebalance_items:
        check_item_balance(cfg, layout)
    if cfg.schedule.fill_bubbles:
        check_bubble_fill(cfg, layout)
    else:
        check_fill_split_alone(cfg)
    check_float8_layout(cfg, layout)
    _require(
        p.sequence_parallel or not p.comm.tp_overlap,
        "parallel.comm.tp_overlap=true chunks sequence parallelism, which parallel.sequence_parallel=false turns "
        "off: unset one of them",
    )
    _require(
        not (cfg.trainer.compile and p.comm.tp_overlap and any(unit.tp > 1 for unit in layout.units)),
        "trainer.compile=true with parallel.comm.tp_overlap=true is not built: the chunked sequence-parallel blocks "
        "issue all-gathers and reduce-scatters between their matmuls, which are not traced; unset one of them "
        "(compile with plain tensor parallelism works)",
    )


def validate_layout_settings(cfg: Config) -> None:
    """The parallel settings, before the layout is resolved: mode and units, then per-setting checks (what
    resolving needs: sizes at least 1 that fit the processes)."""
    p = cfg.parallel
    _validate_mode_and_units(cfg)
    _validate_recompute_settings(p)
    _validate_shard_settings(p)
    validate_offload_settings(cfg)
    _validate_context_settings(cfg)
    _require(min(p.tp, p.pp) >= 1, f"parallel.tp={p.tp} and parallel.pp={p.pp} must be at least 1")
    _check_sizes_fit(cfg)
    _validate_comm_settings(p)
    vpp, schedule = p.units.llm.vpp, cfg.schedule
    _require(
        vpp == 1 or p.mode != "manual" or (schedule.name == "interleaved_1f1b" and schedule.vpp == vpp),
        f"parallel.units.llm.vpp={vpp}: virtual LLM stages run under schedule=interleaved_1f1b with as many "
        f"per rank: add schedule=interleaved_1f1b schedule.vpp={vpp}",
    )
