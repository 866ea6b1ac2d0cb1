"""Parallelism units: the encoders, the LLM backbone and the generators, each with
its own data, tensor and pipeline parallel sizes, joined by the broker.

A unit holds one or more model modules. The LLM unit always exists; the image
encoder (with its projector), the audio tower (``audio_encoder``), the image
generator and the audio generator each either form their own unit or are
*colocated* with the LLM unit (encoders then run in the LLM's first pipeline stage,
generators in its last, as Megatron-LM does).

Pipeline rows. Units run in data-flow order: the encoder units side by side (a
*branch group*: every encoder unit runs the same schedule rows, each on its own
modality, and all of them feed the LLM's first stage), then the LLM's stages, then
the generator units side by side (each fed the same generation queries by the LLM's
last stage). Units of one branch group have the same pipeline depth, so row ``r``
of the schedule is run by stage ``r`` of every unit of its group.

Ranks. Units take contiguous blocks of global ranks in data-flow order (encoder,
audio encoder, LLM, generator, audio generator). Inside a unit, tensor parallelism is
innermost, then context parallelism, then data parallelism, then pipeline stages
(Megatron's tp-cp-dp-pp order): ``rank = first + ((pp * dp_size + dp) * cp_size + cp) *
tp_size + tp``, so TP peers are neighbours (one node), CP peers next, and the replicas
of a stage are adjacent. The ``inner`` index ``cp * tp_size + tp`` numbers the ranks of
one replica of one stage: they all work on the same samples (TP on slices of the
weights, CP on slices of each sequence).

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
AUDIO_MODULES = ("audio_encoder", "audio_projector")
VIDEO_MODULES = ("video_encoder", "video_projector")
AUDIO_GENERATOR_MODULES = ("audio_generator_projector", "audio_generator")
LLM_MODULES = ("llm",)
GENERATOR_MODULES = ("generator_projector", "generator")
# Units that may run on processes of their own, and their modules. A branch group's units run side by side.
UNIT_MODULES = {
    "encoder": ENCODER_MODULES,
    "audio_encoder": AUDIO_MODULES,
    "video_encoder": VIDEO_MODULES,
    "llm": LLM_MODULES,
    "generator": GENERATOR_MODULES,
    "audio_generator": AUDIO_GENERATOR_MODULES,
}
ENCODER_UNITS = ("encoder", "audio_encoder", "video_encoder")
# The units of the modules beside the image encoder and generator: colocated with the LLM unit unless told not to.
SIDE_UNITS = ("audio_encoder", "video_encoder", "audio_generator")
SIDE_ENCODERS = ("audio_encoder", "video_encoder")
GENERATOR_UNITS = ("generator", "audio_generator")
UNIT_NAMES = tuple(UNIT_MODULES)


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
    offload: str = "none"  # none | optimizer: the optimizer's state and step on the host (parallel/offload.py)
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


def branch_groups(units: tuple[ParallelismUnit, ...]) -> list[list[int]]:
    """Unit indices in pipeline order, grouped: the encoder units, the LLM unit, the generator units (a unit
    named otherwise is a group of its own)."""
    groups: list[list[int]] = []
    for index, unit in enumerate(units):
        previous = units[groups[-1][0]].name if groups else None
        together = any(unit.name in g and previous in g for g in (ENCODER_UNITS, GENERATOR_UNITS))
        if together:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


@dataclass(frozen=True)
class UnitLayout:
    units: tuple[ParallelismUnit, ...]
    # pipeline row -> the (unit index, pp index) of every unit running it (several for a branch group)
    rows: tuple[tuple[tuple[int, int], ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        rows = []
        for group in branch_groups(self.units):
            depths = {self.units[u].pp for u in group}
            if len(depths) > 1:
                names = ", ".join(f"{self.units[u].name} pp={self.units[u].pp}" for u in group)
                raise ValueError(f"units side by side need the same pipeline depth ({names}): make them equal")
            rows += [tuple((u, p) for u in group) for p in range(depths.pop())]
        object.__setattr__(self, "rows", tuple(rows))

    @property
    def stages(self) -> tuple[tuple[int, int], ...]:
        """Pipeline row -> (unit index, pp index) of its first unit (the only one outside branch groups)."""
        return tuple(row[0] for row in self.rows)

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
        """The pipeline row ``rank`` runs."""
        unit = self.unit_of(rank)
        place = (self.units.index(unit), unit.coords(rank)[2])
        return next(r for r, row in enumerate(self.rows) if place in row)

    def stage_unit(self, stage: int) -> tuple[ParallelismUnit, int]:
        """(unit, pp index) of the first unit running pipeline row ``stage``."""
        return self.row_places(stage)[0]

    def row_places(self, row: int) -> list[tuple[ParallelismUnit, int]]:
        """(unit, pp index) of every unit running pipeline row ``row``."""
        return [(self.units[u], p) for u, p in self.rows[row]]

    def stage_ranks(self, stage: int) -> list[int]:
        return [
            unit.rank_at(d, i, pp)
            for unit, pp in self.row_places(stage)
            for d in range(unit.dp)
            for i in range(unit.inner)
        ]

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
    audio: tuple[str, ...] = (),
    offload: dict[str, str] | None = None,
) -> UnitLayout:
    """Units in data-flow order from per-unit (dp, tp, pp) sizes, (policy, every) recompute settings,
    (mode, hsdp_replicas) shard settings and context-parallel sizes (colocated modules take the LLM unit's).
    ``audio`` names the audio units on processes of their own (``audio_encoder``, ``audio_generator``); the
    colocated audio modules join the LLM unit afterwards (``with_audio_modules``)."""
    llm_modules = list(LLM_MODULES)
    before: list[str] = []
    after: list[str] = []
    if has_encoder:
        if colocate_encoder:
            llm_modules = list(ENCODER_MODULES) + llm_modules
        else:
            before.append("encoder")
    if has_generator:
        if colocate_generator:
            llm_modules += list(GENERATOR_MODULES)
        else:
            after.append("generator")
    before += [name for name in SIDE_ENCODERS if name in audio]
    after += [name for name in ("audio_generator",) if name in audio]
    plan = [(name, UNIT_MODULES[name]) for name in before]
    plan += [("llm", tuple(llm_modules))] + [(name, UNIT_MODULES[name]) for name in after]
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
                offload=(offload or {}).get(name, "none"),
                cp=(cp or {}).get(name, 1),
                ep=(ep or {}).get(name, 1),
            )
        )
        first += units[-1].size
    return UnitLayout(tuple(units))


def with_audio_modules(layout: UnitLayout, towers: tuple[str, ...], generator: bool) -> UnitLayout:
    """The layout with the audio and video towers (``towers``: model.audio_encoder, model.video_encoder, each with
    its projector) and the audio generator (with its projector) in the LLM unit, where they have no unit of their
    own: its first pipeline stage runs the towers on the clips and frames of the samples it embeds, its last the
    generator on the generation queries it computes."""
    towers = tuple(name for name in towers if not layout.has_unit(name))
    generator = generator and not layout.has_unit("audio_generator")
    units = []
    for unit in layout.units:
        if unit.name == "llm":
            at = unit.modules.index("llm")
            before = tuple(module for name in towers for module in UNIT_MODULES[name])
            after = AUDIO_GENERATOR_MODULES if generator else ()
            unit = replace(unit, modules=(*unit.modules[:at], *before, *unit.modules[at:], *after))
        units.append(unit)
    return UnitLayout(tuple(units))
