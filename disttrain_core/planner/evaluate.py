"""The exact iteration-time and memory model of one layout (what both solvers optimize).

A layout is a choice per unit: the LLM's (tp, dp, pp, vpp, cp, ep); the encoder's and the
generator's (tp, dp, pp), the audio tower's and the audio generator's (tp, dp; one stage), each
or *colocated* inside the LLM's first / last stage. Following DistTrain §5.1, with ``m``
microbatches of ``B = micro_batch x dp_llm`` samples and per-stage forward+backward times
``T_s`` of the pipeline's rows in order (encoder rows, LLM stages, generator rows; units side
by side in one row -- the image encoder and the audio tower, the two generators -- take the
slower one's time, parallel/units.py):

    T_iter = sum_s T_s  [LLM part / vpp]  +  (m - 1) * max_s T_s  +  max_unit (sync + optimizer)

The first term is warm-up plus cool-down (one microbatch through every stage; virtual
stages shorten the LLM's share), the second the 1F1B steady phase, the last the ZeRO-1
gradient/parameter traffic and the AdamW step after the last backward. A stage's time
is its share of the unit's compute for its replica's samples plus the point-to-point
transfer of its boundary tensor (forward activation + backward gradient).

Memory per device is checked on the stages that hold the most: each unit's first stage
(in 1F1B stage ``r`` of ``S`` keeps ``min(S - r, m)`` microbatches in flight) and the
LLM's last stage (logits). Units take contiguous device blocks in data-flow order; a
tensor-parallel group must not straddle a node boundary.

The LLM's context parallelism (cp ranks per replica share its samples, each holding 1/cp of every
sequence) multiplies its devices per stage to tp x cp x dp without changing ``B`` or ``m``; expert
parallelism (ep ranks of the data-parallel group share the experts) changes no device count. Both act
through the cost model (planner/costs.py ``rank_compute``, memory and data-parallel terms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.units import ENCODER_UNITS, GENERATOR_UNITS, UNIT_NAMES
from ..schedule.bubble_fill import FILLABLE
from .costs import CostModel, offload_s
from .layout_memory import AUDIO_UNITS, AUTO_RECOMPUTE, AUTO_SHARD, SIDE_ENCODERS, LayoutMemory  # noqa: F401
from .memory import split_shard
from .schedule_choice import candidates, filled_pipeline_s, pipeline_s
from .stage_split import StageCosts, per_rank_times


@dataclass(frozen=True)
class UnitChoice:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    colocated: bool = False
    cp: int = 1  # context parallelism (the LLM only): ranks sharing each sequence
    ep: int = 1  # expert parallelism (MoE LLMs only): data-parallel ranks sharing the experts; divides dp
    cp_mode: str = "ring"  # how the cp ranks attend (parallel.cp_mode): ring | allgather | ulysses | hybrid
    cp_ulysses: int = 1  # hybrid: ranks per all-to-all (parallel.cp_ulysses)

    @property
    def gpus(self) -> int:
        return 0 if self.colocated else self.tp * self.cp * self.dp * self.pp

    def as_dict(self) -> dict:
        if self.colocated:
            return {"colocated": True, "gpus": 0}
        return {
            "gpus": self.gpus,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "cp": self.cp,
            "ep": self.ep,
            **({"cp_mode": self.cp_mode, "cp_ulysses": self.cp_ulysses} if self.cp > 1 else {}),
        }


COLOCATED = UnitChoice(colocated=True)


@dataclass
class Evaluation:
    iteration_s: float
    feasible: bool
    gpus: int
    microbatches: int
    stage_times: list[tuple[str, float]]  # (unit, forward+backward seconds per microbatch), pipeline order
    memory: dict[str, float]  # bytes on the fullest device of each unit (colocated modules counted in the LLM)
    sync_s: float
    reason: str = ""  # why infeasible
    choices: dict[str, UnitChoice] = field(default_factory=dict)
    recompute: dict[str, str] = field(default_factory=dict)  # unit -> policy (colocated modules: the LLM's)
    shard: dict[str, str] = field(default_factory=dict)  # unit -> shard mode (colocated modules: the LLM's)
    llm_split: list[int] = field(default_factory=list)  # blocks per LLM stage when parallel.pp_split is set
    schedule: str = "1f1b"  # the pipeline schedule it runs under (none: one stage; planner/schedule_choice.py)


class LayoutModel(LayoutMemory):
    """Evaluates layouts for one workload, cost model, batch and device count."""

    def __init__(self, costs: CostModel, global_batch: int, micro_batch: int, devices: int):
        self.c, self.batch, self.micro, self.devices = costs, global_batch, micro_batch, devices
        self.limit = costs.hw.memory_bytes * costs.settings.memory_margin
        self.w = costs.work
        # CPU only: preprocessing runs on the training machine's cores (set by the planner from a
        # measurement of the data); its CPU time per step is spread over the cores.
        self.data_s_per_sample = 0.0
        self.data_cores = 1
        self._memory_cache: dict[tuple, float] = {}
        self._choice_cache: dict[tuple, tuple[str, float, str]] = {}  # recompute_policies, per unit

    # -------------------------------------------------------------------- unit terms
    def images(self, samples: float) -> float:
        enc = self.w.get("encoder")
        return samples * (enc.items_per_sample if enc else 0.0)

    def items(self, unit: str, samples: float) -> float:
        """What ``unit`` counts its work in for ``samples`` samples: images (encoder), clips (audio tower), frame
        groups (video tower), samples (LLM rows, generation targets)."""
        if unit in ("encoder", *SIDE_ENCODERS):
            return samples * self.w.units[unit].items_per_sample
        return samples

    def audio_time(self, unit: str, tp: int, samples: float, policy: str | None = None) -> float:
        """Seconds the audio tower (``audio_encoder``: on the LLM's first stage) or the audio generator
        (``audio_generator``: on its last) adds to that stage for ``samples`` samples (0 without one)."""
        return self.colocated_time(unit, tp, samples, policy) if unit in self.w.units else 0.0

    def pp_bw(self, gpus: int) -> float:
        return self.c.link_bw(gpus)

    def rides(self, name: str, choices: dict) -> bool:
        """Does the audio module ``name`` (audio_encoder, audio_generator) run in the LLM unit: the model has it
        and the layout gives it no unit of its own."""
        choice = choices.get(name)
        return name in self.w.units and (choice is None or choice.colocated)

    @staticmethod
    def separate(choices: dict, *names: str) -> list[tuple[str, UnitChoice]]:
        """(name, choice) of the units among ``names`` on devices of their own."""
        return [(n, choices[n]) for n in names if choices.get(n) is not None and not choices[n].colocated]

    def group_rows(self, choices: dict) -> tuple[int, int]:
        """Pipeline rows of the encoder units and of the generator units (units side by side share rows)."""
        enc = [ch.pp for _, ch in self.separate(choices, *ENCODER_UNITS)]
        gen = [ch.pp for _, ch in self.separate(choices, *GENERATOR_UNITS)]
        return max(enc, default=0), max(gen, default=0)

    def stage_time(self, unit: str, choice: UnitChoice, samples: float, bw: float, policy: str | None = None) -> float:
        """Seconds per microbatch of one stage of a separate unit (compute share + boundary p2p)."""
        items = self.items(unit, samples)
        compute = self.c.rank_compute(unit, choice.tp, items, choice.cp, choice.ep, choice.cp_mode, choice.cp_ulysses)
        compute *= self.c.recompute_factor(unit, policy) / choice.pp
        compute = self.c.saved_activation_s(unit, policy, compute, choice.tp, items, choice.cp, 1.0 / choice.pp)
        boundary = self.c.boundary_bytes(unit, samples) if unit not in GENERATOR_UNITS else 0.0
        if unit == "generator":  # between its own stages (the U-Net's state at a level boundary)
            boundary = self.c.generator_cut_bytes(choice.pp, samples)
        if unit == "llm" and choice.pp > 1:
            boundary = max(boundary, self.llm_boundary_bytes(samples, choice.cp))
        return compute + self.c.p2p_s(boundary, bw)

    def llm_boundary_bytes(self, samples: float, cp: int = 1) -> float:
        """Hidden states an LLM rank sends to the next stage: its 1/cp of each sequence."""
        return samples * self.w.seq_len / cp * self.w.llm_dim * self.c.settings.act_bytes

    def colocated_time(self, unit: str, tp: int, samples: float, policy: str | None = None) -> float:
        items = self.items(unit, samples)
        compute = self.c.compute(unit, tp, items) * self.c.recompute_factor(unit, policy)
        return self.c.saved_activation_s(unit, policy, compute, tp, items)

    # -------------------------------------------------------------------- evaluation
    def evaluate(
        self, llm: UnitChoice, enc: UnitChoice | None, gen: UnitChoice | None, audio: dict | None = None
    ) -> Evaluation:
        """One layout; ``audio``: the audio units' choices (absent or COLOCATED: in the LLM unit)."""
        B = self.micro * llm.dp
        m = self.batch // B
        choices = {"llm": llm}
        if enc is not None:
            choices["encoder"] = enc
        if gen is not None:
            choices["generator"] = gen
        choices.update({name: ch for name, ch in (audio or {}).items() if ch is not None and name in self.w.units})
        gpus = sum(ch.gpus for ch in choices.values())
        bw = self.pp_bw(gpus)

        problem = self._placement_problem(choices, gpus)
        if problem is not None:
            return Evaluation(float("inf"), False, gpus, m, [], {}, 0.0, problem, choices)

        before, after = self.group_rows(choices)
        S = before + llm.pp + after
        allowed = self.c.settings.schedules
        schedules = candidates(allowed, llm.vpp, S == llm.pp, S, m) if S > 1 else ["1f1b"]
        if not schedules:  # what the settings allow cannot run this layout: 1F1B's costs, flagged
            return self._under(choices, gpus, m, B, bw, S, "1f1b", f"no schedule of {list(allowed)} runs it")
        found = [self._under(choices, gpus, m, B, bw, S, schedule) for schedule in schedules]
        return min(found, key=lambda e: (not e.feasible, e.iteration_s))

    def _under(
        self, choices: dict, gpus: int, m: int, B: float, bw: float, S: int, schedule: str, problem: str = ""
    ) -> Evaluation:
        """The layout ``choices`` run under ``schedule`` (``problem``: a reason it cannot be, found already)."""
        policies, memory, shards = self.recompute_policies(choices, S, m, schedule)
        stages, split = self._pipeline_stages(choices, B, bw, policies)
        sync = self._sync_time(choices, m, shards, S > 1)
        iteration = self._pipeline_s(choices, schedule, stages, m, S, policies["llm"]) + sync
        if self.data_s_per_sample:
            iteration += self._data_time(choices, gpus)
        over = next((name for name, used in memory.items() if used > self.limit), None)
        reason = problem or (self._memory_reason(over, memory[over]) if over is not None else "")
        feasible = not reason
        return Evaluation(
            iteration if feasible else float("inf"),
            feasible,
            gpus,
            m,
            stages,
            memory,
            sync,
            reason,
            choices,
            policies,
            shards,
            split,
            schedule if S > 1 else "none",
        )

    def _pipeline_s(self, choices: dict, schedule: str, stages: list, m: int, S: int, policy: str | None) -> float:
        """The pipeline's seconds; with schedule.fill_bubbles the colocated encoder's in chunks in the bubbles."""
        llm, enc = choices["llm"], choices.get("encoder")
        split = self.c.settings.fill_split
        fill = split is not None and enc is not None and enc.colocated and S == llm.pp == len(split)
        if not fill or schedule not in FILLABLE:
            return pipeline_s(schedule, stages, llm.vpp, m)
        encoder_s = self.colocated_time("encoder", llm.tp, self.micro, policy)
        return filled_pipeline_s(schedule, stages, encoder_s, m, split)

    def _placement_problem(self, choices: dict[str, UnitChoice], gpus: int) -> str | None:
        """Why the units cannot be placed (too many devices, a TP group straddling nodes, units side by side of
        different depths); None if they can."""
        if gpus > self.devices:
            return f"needs {gpus} devices, {self.devices} available"
        for group in (ENCODER_UNITS, GENERATOR_UNITS):
            side = self.separate(choices, *group)
            if len(side) > 1 and any(ch.pp != 1 for _, ch in side):
                return f"{' and '.join(n for n, _ in side)} side by side run one pipeline stage each"
        per_node = self.c.hw.per_node
        offset = 0
        for name in UNIT_NAMES:  # the units' device blocks, in data-flow order
            ch = choices.get(name)
            if ch is None or ch.colocated:
                continue
            if ch.tp > per_node or (per_node % ch.tp == 0 and offset % ch.tp):
                return f"{name} TP groups of {ch.tp} would straddle nodes of {per_node}"
            offset += ch.gpus
        return None

    def _group_stages(self, choices: dict, names: tuple[str, ...], B: int, bw: float, policies: dict) -> list:
        """(unit, seconds) of the pipeline rows of a group of units side by side: each row the slowest unit's."""
        rows: list[tuple[str, float]] = []
        for name, ch in self.separate(choices, *names):
            t = self.stage_time(name, ch, B / ch.dp, bw, policies[name])
            for row in range(ch.pp):
                if row == len(rows):
                    rows.append((name, t))
                elif t > rows[row][1]:
                    rows[row] = (name, t)
        return rows

    def _pipeline_stages(
        self, choices: dict, B: int, bw: float, policies: dict[str, str]
    ) -> tuple[list[tuple[str, float]], list[int]]:
        """(unit, forward+backward seconds per microbatch) of every pipeline stage, in pipeline order; the LLM's
        blocks per stage where parallel.pp_split is set (else [] and the blocks and head spread evenly)."""
        llm, enc, gen = choices["llm"], choices.get("encoder"), choices.get("generator")
        p_llm = policies["llm"]  # colocated modules recompute as the LLM unit does
        t_llm = self.stage_time("llm", llm, self.micro, bw, p_llm)
        first, last = self.llm_end_extras(llm, enc, gen, bw, p_llm, choices)
        stages = self._group_stages(choices, ENCODER_UNITS, B, bw, policies)
        costs = self.llm_stage_costs(llm, first, last, p_llm) if self.c.settings.pp_split is not None else None
        split = self.llm_split(llm, costs)
        if split:
            each = t_llm - costs.whole / llm.pp  # the boundary send every stage makes
            llm_times = [t + each for t in per_rank_times(costs.stage_times(split), llm.pp)]
        else:
            llm_times = [t_llm] * llm.pp
            llm_times[0] += first
            llm_times[-1] += last
        stages += [("llm", t) for t in llm_times]
        stages += self._group_stages(choices, GENERATOR_UNITS, B, bw, policies)
        return stages, split

    def llm_end_extras(
        self,
        llm: UnitChoice,
        enc: UnitChoice | None,
        gen: UnitChoice | None,
        bw: float,
        policy: str | None,
        choices: dict | None = None,
    ) -> tuple[float, float]:
        """Seconds per microbatch the LLM's first and last stages run beyond their blocks: a colocated encoder
        and audio tower; a colocated generator and audio generator, and one send of the generation queries to each
        generator unit. ``choices``: the layout's (the audio units' placement; without: in the LLM unit)."""
        choices = choices or {}
        first = self.colocated_time("encoder", llm.tp, self.micro, policy) if enc is not None and enc.colocated else 0.0
        for name in SIDE_ENCODERS:
            if self.rides(name, choices):
                first += self.audio_time(name, llm.tp, self.micro, policy)
        last = 0.0
        if self.rides("audio_generator", choices):
            last += self.audio_time("audio_generator", llm.tp, self.micro, policy)
        if gen is not None and gen.colocated:
            last += self.colocated_time("generator", llm.tp, self.micro, policy)
        sends = (gen is not None and not gen.colocated) + len(self.separate(choices, "audio_generator"))
        if sends:
            last += sends * self.c.p2p_s(self.c.boundary_bytes("llm", self.micro), bw)
        return first, last

    def llm_stage_costs(self, llm: UnitChoice, first: float, last: float, policy: str | None) -> StageCosts:
        """Per block and per end (``first``, ``last``: the colocated modules' and sends' seconds), for
        planner/stage_split.py: the head's share of the LLM's compute (its FLOPs' share) sits on the last stage,
        never recomputed; the rest, recompute included, splits evenly over the blocks."""
        c, w = self.c, self.w.units["llm"]
        compute = c.rank_compute("llm", llm.tp, self.micro, llm.cp, llm.ep, llm.cp_mode, llm.cp_ulysses)
        whole = c.saved_activation_s(
            "llm", policy, compute * c.recompute_factor("llm", policy), llm.tp, self.micro, llm.cp
        )
        head = compute * (w.flops_head / w.train_flops if w.train_flops else 0.0)
        return StageCosts((whole - head) / w.layers, first, last + head, w.layers, whole)

    def llm_split(self, llm: UnitChoice, costs: StageCosts | None) -> list[int]:
        """Blocks per LLM stage under parallel.pp_split: [] when unset (or a manual split of another stage count:
        that layout cannot run it and validation says so), balanced over ``costs`` for ``auto``."""
        wanted, stages = self.c.settings.pp_split, llm.pp * llm.vpp
        if wanted == "auto":
            return costs.best(stages)
        if isinstance(wanted, tuple) and len(wanted) == stages:
            return list(wanted)
        return []

    def unit_tail(self, name: str, ch: UnitChoice, dp: int, shard: str, m: int, pipelined: bool = False) -> float:
        """Data-parallel traffic and the optimizer step of one unit (``pipelined``: more than one schedule stage)."""
        c = self.c
        sync = c.sync_s(name, ch.tp, dp, ch.pp, shard, m, ch.cp, ch.ep, pipelined)
        if split_shard(shard)[1]:  # the optimizer on the host: its step and the copies there and back
            return sync + offload_s(c, name, ch.tp, dp, ch.pp, shard, m, ch.cp, pipelined)
        return sync + c.optimizer_s(name, ch.tp, dp, ch.pp, ch.cp, ch.ep)

    def _sync_time(self, choices: dict, m: int, shards: dict[str, str], pipelined: bool = False) -> float:
        """The slowest unit's data-parallel traffic and optimizer step (colocated modules ride with the LLM's
        stages and reduce over its dp x cp ranks)."""
        llm = choices["llm"]
        llm_tail = self.unit_tail("llm", llm, llm.dp, shards["llm"], m, pipelined)
        colocated = UnitChoice(tp=llm.tp, dp=llm.dp, cp=llm.cp, cp_mode=llm.cp_mode, cp_ulysses=llm.cp_ulysses)
        ends = {"first": 0.0, "last": 0.0}  # the modules riding on the LLM's first and last stages
        for name, end in (("audio_encoder", "first"), ("video_encoder", "first"), ("audio_generator", "last")):
            if self.rides(name, choices):
                ends[end] += self.unit_tail(name, colocated, llm.dp, shards["llm"], m, pipelined)
        tails = []
        sides = [(n, "first") for n in ENCODER_UNITS] + [(n, "last") for n in GENERATOR_UNITS]
        for name, end in sides:
            ch = choices.get(name)
            if ch is None or (name in AUDIO_UNITS and ch.colocated):  # a riding audio module: counted above
                continue
            if ch.colocated:
                ends[end] += self.unit_tail(name, colocated, llm.dp, shards["llm"], m, pipelined)
            else:
                tails.append(self.unit_tail(name, ch, ch.dp, shards[name], m, pipelined))
        extra = max(ends.values())  # the slower end's (with pp=1 one stage holds both: see docs/PLANNER.md "Limits")
        return max([llm_tail + extra, *tails])

    def _data_time(self, choices: dict[str, UnitChoice], gpus: int) -> float:
        """CPU preprocessing seconds per step: every rank of a multi-unit layout reads the whole global
        stream; a single unit's ranks read their replica's share (each pipeline stage and TP rank decodes it)."""
        llm = choices["llm"]
        single = all(ch.colocated for name, ch in choices.items() if name != "llm")
        decoded = self.batch * (llm.tp * llm.cp * llm.pp if single else gpus)
        return self.data_s_per_sample * decoded / self.data_cores

    def logits(self, samples: float, cp: int = 1, tp: int = 1) -> float:
        """Logits and loss temporaries of the last LLM stage: its 1/cp of each sequence's positions, or one chunk of
        model.loss_chunk positions of them (models/chunked_loss.py); 1/tp of the vocabulary (vocabulary-parallel
        head, models/vocab_parallel.py)."""
        positions = samples * self.w.seq_len / cp
        if self.w.loss_chunk > 0:
            positions = min(positions, self.w.loss_chunk)
        return positions * self.w.vocab / tp * (self.c.settings.act_bytes + 8)
