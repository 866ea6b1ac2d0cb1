"""The composition of a run: which parallelism features it combines, whatever their sizes.

``composition_of(run)`` reads a resolved run (parallel/resolved.py) and names what the runtime must get right
together: the units present and where each module runs (a unit of its own, or folded into the LLM unit's first /
last stage), per unit the dimensions larger than one (dp, tp, pp, vpp, cp, ep and HSDP replicas), its shard
mode, recompute policy and Megatron sequence parallelism (with tp); the pipeline schedule, chunked loss, item
rebalancing and forward-only frozen stages; and the precision policy. Two runs with the same composition differ
only in sizes (tp 2 or tp 8, pp 2 or pp 40). The planner (the closure over its plans: tools/compositions.py,
tests/unit/test_compositions.py) and the runtime (rank 0's first lines and ``composition.json`` in the run
directory) call this one function.

Precision policies: ``fp32``; ``bf16-autocast`` (fp32 parameters and masters, bf16 matmuls); ``fsdp2-bf16-params``
(an FSDP2 unit gathers and computes with bf16 parameters, reduces fp32 gradients into fp32 masters:
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, parallel/fsdp.py); ``+fp8`` with torchao's float8
linears.

**Facts.** A composition is proven (parallel/proven.py) when each of its facts is one that a proven run trains:

* ``graph``  -- the units in pipeline order with what is folded into them, and the schedule;
* ``unit``   -- one unit: its dimensions > 1, shard mode, sequence parallelism, and the schedule family it runs
  under (``none``, ``pipelined`` for gpipe / 1f1b / interleaved and breadth-first 1F1B, ``zero-bubble`` for
  zb_h1 / zb_h2 / zbv / dualpipev, whose backward is split in two);
* ``context`` -- a context-parallel mode other than the ring (parallel.cp_mode), whichever unit shape runs it: the
  mode replaces only the attention core inside the CP group (parallel/context_parallel.py);
* ``offload`` -- the optimizer on the host (parallel.offload) under a shard mode, whatever the unit's shape;
* ``recompute`` -- a recompute policy with what the replayed blocks must redo (tp + sp collectives, the shard
  mode's gathers), whichever unit runs it: the wrappers are the same for every block family (parallel/recompute.py);
* ``join``   -- two adjacent units through the broker: the sender's dp / tp, the receiver's dp / tp / cp;
* ``precision`` -- the precision policy with each shard mode it meets;
* ``engine`` -- HotSPa's switching or local SGD's outer loop; their layouts (each bucket's strategy, the shard
  group's) count as units.

Why facts and not whole compositions: units meet only at the broker, which routes samples by the two units'
replica and inner (tp, cp) sizes whatever the payload (parallel/broker.py), and the schedule's rows; a unit's
shard mode, recompute and sequence parallelism act inside its own process groups. So a unit proven inside one
run is proven beside any neighbours it joins through a proven join. Whole compositions would not fit: the
planner's 162 plans over tools/regime.py's and tools/bench_planner.py's grids use 39 distinct ones, most with
three or four units, whose replicas need 12-20 processes each (a run here is capped at 4 per core).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.generators import LOOPED, SPLIT_BACKWARD, V_SHAPED
from .bubble_plan import forward_only_chunks
from .plan import frozen_rows
from .units import ENCODER_UNITS, UNIT_MODULES, UnitLayout

DIMS = ("dp", "tp", "pp", "vpp", "cp", "ep", "hsdp")
# Module name -> the unit it belongs to (a folded module names the unit it would otherwise be)
_MODULE_UNIT = {module: unit for unit, modules in UNIT_MODULES.items() for module in modules}
INTERLEAVED = LOOPED + V_SHAPED  # schedules whose ranks hold schedule.vpp stages each
ZERO_BUBBLE = SPLIT_BACKWARD  # schedules that split a backward into input and weight gradients


@dataclass(frozen=True)
class UnitPart:
    """One unit of a composition: its name, the units folded into it, its dimensions > 1, shard, recompute."""

    name: str
    folded: tuple[str, ...]
    dims: tuple[str, ...]
    shard: str
    recompute: str
    sp: bool = False  # Megatron sequence parallelism (tp > 1 only)
    context: str = ""  # with cp: how its ranks attend when not by the ring (parallel.cp_mode: allgather, ...)
    offload: bool = False  # parallel.offload=optimizer: the optimizer's state and step on the host

    @property
    def label(self) -> str:
        return "+".join((self.name, *self.folded))

    @property
    def text(self) -> str:
        tail = ("|sp" if self.sp else "") + (f"|{self.context}" if self.context else "") + ("|offload" * self.offload)
        return f"{self.label}({','.join(self.dims) or '-'}|{self.shard}|{self.recompute}{tail})"

    def has(self, *dims: str) -> tuple[str, ...]:
        return tuple(d for d in self.dims if d in dims)


@dataclass(frozen=True)
class Composition:
    engine: str  # units | ddp | hotspa | local_sgd
    units: tuple[UnitPart, ...]  # hotspa: the home strategy's
    schedule: str  # the pipeline schedule (none without stages)
    features: tuple[str, ...]  # chunked-loss, tp-overlap, rebalance-items, bubble-fill, forward-only
    precision: str  # fp32 | bf16-autocast | fsdp2-bf16-params, +fp8
    # hotspa: every bucket strategy's units and the schedule family they run under
    buckets: tuple[tuple[tuple[UnitPart, ...], str], ...] = ()

    @property
    def layout(self) -> str:
        """The key without its precision."""
        units = " > ".join(part.text for part in self.units)
        if self.buckets:
            units = "[" + " ; ".join(" > ".join(part.text for part in parts) for parts, _ in self.buckets) + "]"
        extra = " ".join((self.schedule, *self.features))
        return f"{self.engine}: {units} / {extra}"

    @property
    def key(self) -> str:
        return f"{self.layout} / {self.precision}"

    @property
    def family(self) -> str:
        return schedule_family(self.schedule)

    def facts(self) -> tuple[str, ...]:
        """What a proven run must have trained for this composition to be proven (module doc), in order."""
        shards = sorted({part.shard for part in self.units})
        precision = tuple(f"precision: {self.precision}/{shard}" for shard in shards)
        if self.engine in ("hotspa", "local_sgd"):  # the engine, and each layout it runs (hotspa: per bucket)
            out = [f"engine: {self.engine} {' '.join(self.features)}".rstrip()]
            for parts, family in self.buckets or ((self.units, self.family),):
                out += [fact for part in parts for fact in _unit_facts(part, family)]
            return tuple(dict.fromkeys(out + list(precision)))
        graph = f"graph: {' > '.join(part.label for part in self.units)} / {self.schedule} {' '.join(self.features)}"
        out = [graph.rstrip()]
        out += [fact for part in self.units for fact in _unit_facts(part, self.family)]
        llm = next((i for i, part in enumerate(self.units) if part.name == "llm"), None)
        for i, part in enumerate(self.units):
            if llm is None or i == llm:
                continue
            side = "encoder-side" if part.name in ENCODER_UNITS else "generator-side"
            mine = ",".join(part.has("dp", "tp")) or "-"
            theirs = ",".join(self.units[llm].has("dp", "tp", "cp")) or "-"
            pair = f"{side}({mine}) -> llm({theirs})" if side == "encoder-side" else f"llm({theirs}) -> {side}({mine})"
            out.append(f"join: {pair}")
        return tuple(dict.fromkeys(out + list(precision)))


def schedule_family(schedule: str) -> str:
    if schedule == "none":
        return "none"
    return "zero-bubble" if schedule in ZERO_BUBBLE else "pipelined"


def _unit_facts(part: UnitPart, family: str) -> list[str]:
    """The unit fact of one unit and, when it recomputes, its recompute fact."""
    sp = " sp" if part.sp else ""
    out = [f"unit: {part.label}({','.join(part.dims) or '-'}|{part.shard}{sp}) / {family}"]
    if part.recompute != "none":
        policy = "every_k" if part.recompute.startswith("every_") else part.recompute
        tp = "tp+sp" if part.sp else ("tp" if "tp" in part.dims else "no-tp")
        out.append(f"recompute: {policy} / {tp} {part.shard}")
    if part.context:  # the attention core is the CP group's own: proven by any run of the mode
        out.append(f"context: {part.context}")
    if part.offload:  # the optimizer's placement, per shard mode's optimizer (parallel/offload.py, FSDP2's policy)
        out.append(f"offload: {part.shard}")
    return out


def _dims(unit, vpp: int) -> tuple[str, ...]:
    sizes = {
        "dp": unit.dp,
        "tp": unit.tp,
        "pp": unit.pp,
        "vpp": vpp,
        "cp": unit.cp,
        "ep": unit.ep,
        "hsdp": unit.hsdp_replicas,
    }
    return tuple(d for d in DIMS if sizes[d] > 1)


def unit_parts(layout: UnitLayout, vpp: int, sequence_parallel: bool, cp_mode: str = "ring") -> tuple[UnitPart, ...]:
    """The composition's units of one layout (``vpp``: virtual stages per LLM pipeline rank; ``cp_mode``:
    parallel.cp_mode, named by a unit with cp > 1 unless it is the ring)."""
    parts = []
    for unit in layout.units:
        folded = tuple(dict.fromkeys(_MODULE_UNIT[m] for m in unit.modules if _MODULE_UNIT[m] != unit.name))
        recompute = unit.recompute if unit.recompute != "every_k" else f"every_{unit.recompute_every}"
        shard = "ddp" if layout.trains_with_ddp() else unit.shard
        dims = _dims(unit, vpp if unit.name == "llm" else 1)
        context = cp_mode if unit.cp > 1 and cp_mode != "ring" else ""
        offload = getattr(unit, "offload", "none") == "optimizer"
        parts.append(
            UnitPart(unit.name, folded, dims, shard, recompute, sequence_parallel and unit.tp > 1, context, offload)
        )
    return tuple(parts)


def precision_policy(cfg, precision: str, layout: UnitLayout, accelerator: str) -> str:
    """The precision policy of a run (module doc)."""
    from ..config import wire_format

    if precision != "bf16-mixed":
        policy = "fp32"
    elif any(u.fsdp for u in layout.units) and wire_format(cfg, accelerator) == "bf16":
        policy = "fsdp2-bf16-params"
    else:
        policy = "bf16-autocast"
    return policy + ("+fp8" if cfg.model.get("float8", "none") != "none" else "")


def composition_of(run) -> Composition:
    """The composition of a resolved run (``parallel.resolved.ResolvedRun``)."""
    cfg, layout = run.cfg, run.layout
    mode = cfg.parallel.mode
    vpp = int(cfg.schedule.vpp) if cfg.schedule.name in INTERLEAVED else 1
    engine = {"hotspa": "hotspa", "local_sgd": "local_sgd"}.get(mode, "ddp" if layout.trains_with_ddp() else "units")
    sp = bool(cfg.parallel.sequence_parallel)
    cp_mode = cfg.parallel.get("cp_mode", "ring")
    buckets = tuple(
        dict.fromkeys(
            (unit_parts(b.layout, 1, sp, cp_mode), schedule_family(b.config.schedule.name))
            for b in sorted(run.buckets, key=lambda b: b.strategy.name)
        )
    )
    features = []
    if any(u.tp > 1 for u in layout.units) and sp and cfg.parallel.comm.tp_overlap:
        features.append("tp-overlap")
    if int(cfg.model.get("loss_chunk", 0) or 0) > 0:
        features.append("chunked-loss")
    if cfg.parallel.get("rebalance_items", False):  # the encoders' items spread over their replicas
        features.append("rebalance-items")
    fill = bool(cfg.schedule.get("fill_bubbles", False)) and len(layout.rows) > 1
    if fill:  # the colocated encoder's chunks in the pipeline's bubbles (parallel/bubble_plan.py)
        features.append("bubble-fill")
    frozen = forward_only_chunks(cfg.model, len(layout.rows)) if fill else frozen_rows(cfg.model, layout)
    if len(layout.rows) > 1 and frozen:  # frozen leading stages run forwards only
        features.append("forward-only")
    return Composition(
        engine=engine,
        units=unit_parts(layout, vpp, sp, cp_mode),
        schedule=cfg.schedule.name if len(layout.rows) > 1 or vpp > 1 else "none",
        features=tuple(features),
        precision=precision_policy(cfg, run.precision, layout, run.accelerator),
        buckets=buckets,
    )


def composition_of_config(cfg) -> Composition:
    """The composition of a composed (non-auto) config, resolved here."""
    from .resolved import resolve_run

    return composition_of(resolve_run(cfg))
