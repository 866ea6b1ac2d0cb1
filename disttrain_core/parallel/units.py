"""Parallelism units: the encoder, the LLM backbone and the generator, each with
its own data, tensor and pipeline parallel sizes, joined into one pipeline.

A unit holds one or more model modules. The LLM unit always exists; the image
encoder (with its projector) and the generator (with its projector) either form
their own units or are *colocated* with the LLM unit (the encoder then runs in the
LLM's first pipeline stage, the generator in its last, as Megatron-LM does). An
audio tower (model.audio_encoder) is always colocated: the LLM's first stage runs it; an audio generator
(model.audio_generator) too: the LLM's last stage runs it.

Ranks. Units take contiguous blocks of global ranks in data-flow order (encoder,
LLM, generator). Inside a unit, tensor parallelism is innermost, then context
parallelism, then data parallelism, then pipeline stages (Megatron's tp-cp-dp-pp order):
``rank = first + ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``, so TP peers are
neighbours (one node), CP peers next, and the replicas of a stage are adjacent. The
``inner`` index ``cp * tp_size + tp`` numbers the ranks of one replica of one stage: they all
work on the same samples (TP on slices of the weights, CP on slices of each sequence).

Samples. Each optimizer step's global batch is cut into ``M`` global microbatches of
``B = micro_batch_size x dp_llm`` samples; microbatch ``k`` flows through every stage
of every unit at pipeline slot ``k``. A unit with ``dp`` replicas gives replica ``d``
the contiguous block of samples ``[d B/dp, (d+1) B/dp)`` of each global microbatch,
so every unit computes every sample's owner without talking to anyone, and an
encoder replica's embeddings for a sample reach exactly the LLM replica that owns
that sample, whatever the two DP sizes (2 and 3 included).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

ENCODER_MODULES = ("encoder", "encoder_projector")
AUDIO_MODULES = ("audio_encoder", "audio_projector")  # always in the LLM unit's first stage (for now)
AUDIO_GENERATOR_MODULES = ("audio_generator_projector", "audio_generator")  # always in its last stage
LLM_MODULES = ("llm",)
GENERATOR_MODULES = ("generator_projector", "generator")


@dataclass(frozen=True)
class ParallelismUnit:
    name: str
    dp: int
    tp: int
    pp: int
    first_rank: int
    modules: tuple[str, ...]
    vpp: int = 1
    recompute: str = "none"  # parallel/recompute.py
    recompute_every: int = 2
    shard: str = "zero1"  # none | zero1 | zero2 | zero3 (parallel/fsdp.py)
    hsdp_replicas: int = 1
    cp: int = 1  # context parallelism: ring attention over slices of each sequence (LLM units only)
    # Expert parallelism (MoE LLM units): blocks of ep consecutive data-parallel replicas share the experts.
    ep: int = 1

    @property
    def inner(self) -> int:
        """Ranks per replica of one stage: tp x cp."""
        return self.tp * self.cp

    @property
    def fsdp(self) -> bool:
        """Sharded by FSDP2 (zero2 / zero3, HSDP included) rather than ZeRO-1 or DDP."""
        return self.shard in ("zero2", "zero3")

    @property
    def size(self) -> int:
        return self.dp * self.inner * self.pp

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    def rank(self, dp: int, tp: int, pp: int, cp: int = 0) -> int:
        return self.rank_at(dp, cp * self.tp + tp, pp)

    def rank_at(self, dp: int, inner: int, pp: int) -> int:
        """The rank at ``inner`` position (``cp * tp_size + tp``) of replica ``dp`` of stage ``pp``."""
        return self.first_rank + (pp * self.dp + dp) * self.inner + inner

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, tp, pp) of a global rank in this unit."""
        local = rank - self.first_rank
        return (local // self.inner) % self.dp, local % self.tp, local // (self.inner * self.dp)

    def inner_index(self, rank: int) -> int:
        return (rank - self.first_rank) % self.inner

    def cp_coord(self, rank: int) -> int:
        return self.inner_index(rank) // self.tp

    def block(self, dp: int, samples: int) -> range:
        """Samples of a global microbatch owned by replica ``dp``."""
        per = samples // self.dp
        return range(dp * per, (dp + 1) * per)


@dataclass(frozen=True)
class UnitLayout:
    units: tuple[ParallelismUnit, ...]
    stages: tuple[tuple[int, int], ...] = field(init=False)  # global stage -> (unit index, pp index)

    def __post_init__(self) -> None:
        stages = tuple((u, p) for u, unit in enumerate(self.units) for p in range(unit.pp))
        object.__setattr__(self, "stages", stages)

    @property
    def world_size(self) -> int:
        return sum(unit.size for unit in self.units)

    @property
    def llm(self) -> ParallelismUnit:
        return self.unit("llm")

    def unit(self, name: str) -> ParallelismUnit:
        return next(u for u in self.units if u.name == name)

    def trains_with_ddp(self) -> bool:
        """One unit without TP or PP and no sharding: the whole model under torch DDP (DataParallelEngine)."""
        unit = self.units[0]
        return len(self.units) == 1 and unit.pp == 1 and unit.inner == 1 and unit.shard == "none"

    def has_unit(self, name: str) -> bool:
        return any(u.name == name for u in self.units)

    def unit_of(self, rank: int) -> ParallelismUnit:
        return next(u for u in self.units if rank in u.ranks)

    def stage_of(self, rank: int) -> int:
        unit = self.unit_of(rank)
        return self.stages.index((self.units.index(unit), unit.coords(rank)[2]))

    def stage_unit(self, stage: int) -> tuple[ParallelismUnit, int]:
        unit_index, pp = self.stages[stage]
        return self.units[unit_index], pp

    def stage_ranks(self, stage: int) -> list[int]:
        unit, pp = self.stage_unit(stage)
        return [unit.rank_at(d, i, pp) for d in range(unit.dp) for i in range(unit.inner)]

    def describe(self) -> str:
        def sizes(u: ParallelismUnit) -> str:
            return f"dp={u.dp} tp={u.tp}{f' cp={u.cp}' if u.cp > 1 else ''} pp={u.pp}"

        return " | ".join(
            f"{u.name}[{'+'.join(u.modules)}] {sizes(u)} ranks {u.first_rank}-{u.ranks[-1]}" for u in self.units
        )


def build_layout(
    sizes: dict[str, tuple[int, int, int]],
    has_encoder: bool,
    has_generator: bool,
    colocate_encoder: bool,
    colocate_generator: bool,
    recompute: dict[str, tuple[str, int]] | None = None,
    shard: dict[str, tuple[str, int]] | None = None,
    cp: dict[str, int] | None = None,
    ep: dict[str, int] | None = None,
) -> UnitLayout:
    """Units in data-flow order from per-unit (dp, tp, pp) sizes, (policy, every) recompute settings,
    (mode, hsdp_replicas) shard settings and context-parallel sizes (colocated modules take the LLM unit's)."""
    llm_modules = list(LLM_MODULES)
    plan: list[tuple[str, tuple[str, ...]]] = []
    if has_encoder:
        if colocate_encoder:
            llm_modules = list(ENCODER_MODULES) + llm_modules
        else:
            plan.append(("encoder", ENCODER_MODULES))
    if has_generator and colocate_generator:
        llm_modules += list(GENERATOR_MODULES)
    plan.append(("llm", tuple(llm_modules)))
    if has_generator and not colocate_generator:
        plan.append(("generator", GENERATOR_MODULES))
    units, first = [], 0
    for name, modules in plan:
        dp, tp, pp = sizes[name]
        policy, every = (recompute or {}).get(name, ("none", 2))
        mode, replicas = (shard or {}).get(name, ("zero1", 1))
        units.append(
            ParallelismUnit(
                name,
                dp,
                tp,
                pp,
                first,
                modules,
                recompute=policy,
                recompute_every=every,
                shard=mode,
                hsdp_replicas=replicas,
                cp=(cp or {}).get(name, 1),
                ep=(ep or {}).get(name, 1),
            )
        )
        first += units[-1].size
    return UnitLayout(tuple(units))


def with_audio_modules(layout: UnitLayout, tower: bool, generator: bool) -> UnitLayout:
    """The layout with the audio tower (model.audio_encoder and its projector) and the audio generator (with its
    projector) in the LLM unit: its first pipeline stage runs the tower on the clips of the samples it embeds, its
    last the generator on the generation queries it computes."""
    units = []
    for unit in layout.units:
        if unit.name == "llm":
            at = unit.modules.index("llm")
            before = AUDIO_MODULES if tower else ()
            after = AUDIO_GENERATOR_MODULES if generator else ()
            unit = replace(unit, modules=(*unit.modules[:at], *before, *unit.modules[at:], *after))
        units.append(unit)
    return UnitLayout(tuple(units))
