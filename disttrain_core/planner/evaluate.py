"""The exact iteration-time and memory model of one layout (what both solvers optimize).

A layout is a choice per unit: the LLM's (tp, dp, pp, vpp, cp, ep); the encoder's and the
generator's (tp, dp, pp), or *colocated* inside the LLM's first / last stage. Following
DistTrain §5.1, with ``m`` microbatches of ``B = micro_batch x dp_llm`` samples and
per-stage forward+backward times ``T_s`` of the pipeline's stages in order
(encoder stages, LLM stages, generator stage):

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

from .costs import CostModel
from .memory import FSDP
from .stage_split import StageCosts, per_rank_times

AUTO_RECOMPUTE = ("none", "selective_op", "every_k", "full")  # least recomputation first
AUTO_SHARD = ("zero1", "zero2", "zero3")  # least traffic first


@dataclass(frozen=True)
class UnitChoice:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    colocated: bool = False
    cp: int = 1  # context parallelism (the LLM only): ranks sharing each sequence
    ep: int = 1  # expert parallelism (MoE LLMs only): data-parallel ranks sharing the experts; divides dp

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


class LayoutModel:
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
        """What ``unit`` counts its work in for ``samples`` samples: images (encoder), clips (audio tower),
        samples (LLM rows, generation targets)."""
        if unit in ("encoder", "audio_encoder"):
            return samples * self.w.units[unit].items_per_sample
        return samples

    def audio_time(self, unit: str, tp: int, samples: float, policy: str | None = None) -> float:
        """Seconds the audio tower (``audio_encoder``: on the LLM's first stage) or the audio generator
        (``audio_generator``: on its last) adds to that stage for ``samples`` samples (0 without one)."""
        return self.colocated_time(unit, tp, samples, policy) if unit in self.w.units else 0.0

    def pp_bw(self, gpus: int) -> float:
        return self.c.link_bw(gpus)

    def stage_time(self, unit: str, choice: UnitChoice, samples: float, bw: float, policy: str | None = None) -> float:
        """Seconds per microbatch of one stage of a separate unit (compute share + boundary p2p)."""
        items = self.items(unit, samples)
        compute = self.c.rank_compute(unit, choice.tp, items, choice.cp, choice.ep)
        compute *= self.c.recompute_factor(unit, policy) / choice.pp
        boundary = self.c.boundary_bytes(unit, samples) if unit != "generator" else 0.0
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
        return self.c.compute(unit, tp, items) * self.c.recompute_factor(unit, policy)

    # ------------------------------------------------------------------------ memory
    def unit_memory(self, name: str, choices: dict, S: int, m: int, policy: str, shard: str | None = None) -> float:
        """Bytes on the fullest device of unit ``name`` (the LLM's counts its colocated modules) under a
        recompute policy and a shard mode: the fuller of its first and last pipeline stage
        (planner/breakdown.py: model state, gathered FSDP2 parameters and autocast copies, in-flight
        activations, logits, the recompute transient, the runtime overhead)."""
        from .breakdown import role_memory

        shard = self.c.shard_of(shard)
        key = self._memory_key(name, choices, S, m, policy, shard)
        cached = self._memory_cache.get(key)
        if cached is None:
            stages = choices[name].pp
            ends = {0, stages - 1}
            cached = max(role_memory(self, name, choices, S, m, policy, shard, p).total for p in ends)
            self._memory_cache[key] = cached
        return cached

    @staticmethod
    def _memory_key(name: str, choices: dict, S: int, m: int, policy: str, shard: str) -> tuple:
        """What a unit's memory depends on (the solver evaluates the same unit in many layouts;
        planner/breakdown.py ``role_memory``). The LLM's: its own choice, which modules ride on its end stages,
        and the stages from its first to the last (its first stage's in-flight microbatches), not the separate
        units' TP and DP. The others': their choice, the LLM's dp (their samples per slot) and the stage count."""
        llm, enc, gen = choices["llm"], choices.get("encoder"), choices.get("generator")
        if name == "llm":
            before = enc.pp if enc is not None and not enc.colocated else 0
            riders = (enc is not None and enc.colocated, gen is not None and gen.colocated)
            return (name, llm, riders, S - before, m, policy, shard)
        return (name, choices[name], llm.dp, S, m, policy, shard)

    def memory_options(self) -> list[tuple[str, str]]:
        """(shard, recompute) pairs to try, cheapest first: ``planner.shard`` / ``planner.recompute`` or, under
        ``auto``, sharding before recomputation (FSDP2's traffic overlaps compute; recompute adds compute):
        zero1, zero2, zero3 without recompute, then each recompute policy with each shard mode."""
        settings = self.c.settings
        shards = AUTO_SHARD if settings.shard == "auto" else (settings.shard,)
        policies = AUTO_RECOMPUTE if settings.recompute == "auto" else (settings.recompute,)
        return [(shard, policy) for policy in policies for shard in shards]

    def recompute_policies(
        self, choices: dict, S: int, m: int
    ) -> tuple[dict[str, str], dict[str, float], dict[str, str]]:
        """Each unit's recompute policy, memory and shard mode: the settings, or under ``auto`` the first
        option of ``memory_options`` that fits the device. A unit with one replica (data x context ranks: FSDP2
        shards over both) cannot shard: zero1. An expert-parallel LLM shards its dense parameters only (its
        experts are stepped whole on every replica: planner/memory.py ``unit_model_state``)."""
        policies, memory, shards = {}, {}, {}
        for name, choice in choices.items():
            if not choice.colocated:
                policies[name], memory[name], shards[name] = self.unit_fit(name, choices, S, m)
        return policies, memory, shards

    def unit_fit(self, name: str, choices: dict, S: int, m: int) -> tuple[str, float, str]:
        """One unit's (recompute policy, bytes per device, shard mode): ``recompute_policies`` for one unit."""
        key = self._memory_key(name, choices, S, m, "", "")
        found = self._choice_cache.get(key)
        if found is None:
            choice = choices[name]
            for shard, policy in self.memory_options():
                if shard in FSDP and choice.dp * choice.cp < 2:
                    shard = "zero1"
                used = self.unit_memory(name, choices, S, m, policy, shard)
                if used <= self.limit:
                    break
            found = self._choice_cache[key] = (policy, used, shard)
        return found

    # -------------------------------------------------------------------- evaluation
    def evaluate(self, llm: UnitChoice, enc: UnitChoice | None, gen: UnitChoice | None) -> Evaluation:
        B = self.micro * llm.dp
        m = self.batch // B
        choices = {"llm": llm}
        if enc is not None:
            choices["encoder"] = enc
        if gen is not None:
            choices["generator"] = gen
        gpus = sum(ch.gpus for ch in choices.values())
        bw = self.pp_bw(gpus)

        problem = self._placement_problem(choices, gpus)
        if problem is not None:
            return Evaluation(float("inf"), False, gpus, m, [], {}, 0.0, problem, choices)

        S = (enc.pp if enc is not None and not enc.colocated else 0) + llm.pp
        S += gen.pp if gen is not None and not gen.colocated else 0
        policies, memory, shards = self.recompute_policies(choices, S, m)
        stages, split = self._pipeline_stages(llm, enc, gen, B, bw, policies)

        warmup = sum(t / (llm.vpp if name == "llm" else 1) for name, t in stages)
        steady = (m - 1) * max(t for _, t in stages)
        sync = self._sync_time(llm, enc, gen, m, shards)
        iteration = warmup + steady + sync
        if self.data_s_per_sample:
            iteration += self._data_time(choices, gpus)

        for name, used in memory.items():
            if used > self.limit:
                return Evaluation(
                    float("inf"),
                    False,
                    gpus,
                    m,
                    stages,
                    memory,
                    sync,
                    self._memory_reason(name, used),
                    choices,
                    policies,
                    shards,
                    split,
                )
        return Evaluation(iteration, True, gpus, m, stages, memory, sync, "", choices, policies, shards, split)

    def _placement_problem(self, choices: dict[str, UnitChoice], gpus: int) -> str | None:
        """Why the units cannot be placed (too many devices, or a TP group straddling nodes); None if they can."""
        if gpus > self.devices:
            return f"needs {gpus} devices, {self.devices} available"
        per_node = self.c.hw.per_node
        offset = 0
        for name in ("encoder", "llm", "generator"):
            ch = choices.get(name)
            if ch is None or ch.colocated:
                continue
            if ch.tp > per_node or (per_node % ch.tp == 0 and offset % ch.tp):
                return f"{name} TP groups of {ch.tp} would straddle nodes of {per_node}"
            offset += ch.gpus
        return None

    def _pipeline_stages(
        self,
        llm: UnitChoice,
        enc: UnitChoice | None,
        gen: UnitChoice | None,
        B: int,
        bw: float,
        policies: dict[str, str],
    ) -> tuple[list[tuple[str, float]], list[int]]:
        """(unit, forward+backward seconds per microbatch) of every pipeline stage, in pipeline order; the LLM's
        blocks per stage where parallel.pp_split is set (else [] and the blocks and head spread evenly)."""
        p_llm = policies["llm"]  # colocated modules recompute as the LLM unit does
        t_llm = self.stage_time("llm", llm, self.micro, bw, p_llm)
        first, last = self.llm_end_extras(llm, enc, gen, bw, p_llm)
        stages: list[tuple[str, float]] = []
        if enc is not None and not enc.colocated:
            t_enc = self.stage_time("encoder", enc, B / enc.dp, bw, policies["encoder"])
            stages += [("encoder", t_enc)] * enc.pp
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
        if gen is not None and not gen.colocated:
            t_gen = self.stage_time("generator", gen, B / gen.dp, bw, policies["generator"])
            stages += [("generator", t_gen)] * gen.pp
        return stages, split

    def llm_end_extras(
        self, llm: UnitChoice, enc: UnitChoice | None, gen: UnitChoice | None, bw: float, policy: str | None
    ) -> tuple[float, float]:
        """Seconds per microbatch the LLM's first and last stages run beyond their blocks: a colocated encoder
        and the audio tower; the audio generator, and a colocated generator or the send of the generation queries
        to the generator unit."""
        first = self.colocated_time("encoder", llm.tp, self.micro, policy) if enc is not None and enc.colocated else 0.0
        first += self.audio_time("audio_encoder", llm.tp, self.micro, policy)
        last = self.audio_time("audio_generator", llm.tp, self.micro, policy)
        if gen is not None and gen.colocated:
            last += self.colocated_time("generator", llm.tp, self.micro, policy)
        elif gen is not None:
            last += self.c.p2p_s(self.c.boundary_bytes("llm", self.micro), bw)
        return first, last

    def llm_stage_costs(self, llm: UnitChoice, first: float, last: float, policy: str | None) -> StageCosts:
        """Per block and per end (``first``, ``last``: the colocated modules' and sends' seconds), for
        planner/stage_split.py: the head's share of the LLM's compute (its FLOPs' share) sits on the last stage,
        never recomputed; the rest, recompute included, splits evenly over the blocks."""
        c, w = self.c, self.w.units["llm"]
        compute = c.rank_compute("llm", llm.tp, self.micro, llm.cp, llm.ep)
        whole = compute * c.recompute_factor("llm", policy)
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

    def unit_tail(self, name: str, ch: UnitChoice, dp: int, shard: str, m: int) -> float:
        """Data-parallel traffic and the optimizer step of one unit."""
        c = self.c
        sync = c.sync_s(name, ch.tp, dp, ch.pp, shard, m, ch.cp, ch.ep)
        return sync + c.optimizer_s(name, ch.tp, dp, ch.pp, ch.cp, ch.ep)

    def _sync_time(
        self, llm: UnitChoice, enc: UnitChoice | None, gen: UnitChoice | None, m: int, shards: dict[str, str]
    ) -> float:
        """The slowest unit's data-parallel traffic and optimizer step (colocated modules ride with the LLM's
        stages and reduce over its dp x cp ranks)."""
        llm_tail = self.unit_tail("llm", llm, llm.dp, shards["llm"], m)
        colocated = UnitChoice(tp=llm.tp, dp=llm.dp, cp=llm.cp)
        ends = {"first": 0.0, "last": 0.0}  # the modules riding on the LLM's first and last stages
        for name, end in (("audio_encoder", "first"), ("audio_generator", "last")):  # always there
            if name in self.w.units:
                ends[end] += self.unit_tail(name, colocated, llm.dp, shards["llm"], m)
        tails = []
        for name, ch, end in (("encoder", enc, "first"), ("generator", gen, "last")):
            if ch is None:
                continue
            if ch.colocated:
                ends[end] += self.unit_tail(name, colocated, llm.dp, shards["llm"], m)
            else:
                tails.append(self.unit_tail(name, ch, ch.dp, shards[name], m))
        extra = max(ends.values())  # the slower end's (with pp=1 one stage holds both: see docs/PLANNER.md "Limits")
        return max([llm_tail + extra, *tails])

    def _data_time(self, choices: dict[str, UnitChoice], gpus: int) -> float:
        """CPU preprocessing seconds per step: every rank of a multi-unit layout reads the whole global
        stream; a single unit's ranks read their replica's share (each pipeline stage and TP rank decodes it)."""
        llm = choices["llm"]
        single = all(ch.colocated for name, ch in choices.items() if name != "llm")
        decoded = self.batch * (llm.tp * llm.cp * llm.pp if single else gpus)
        return self.data_s_per_sample * decoded / self.data_cores

    def _memory_reason(self, name: str, used: float) -> str:
        """Why a unit needing ``used`` bytes per device does not fit."""
        c = self.c
        return (
            f"{name} needs {used / 1e9:.1f} GB per device, over {self.limit / 1e9:.1f} GB "
            f"({c.settings.memory_margin:.0%} of {c.hw.memory_bytes / 1e9:.0f} GB)"
        )

    def logits(self, samples: float, cp: int = 1, tp: int = 1) -> float:
        """Logits and loss temporaries of the last LLM stage: its 1/cp of each sequence's positions, or one chunk of
        model.loss_chunk positions of them (models/chunked_loss.py); 1/tp of the vocabulary (vocabulary-parallel
        head, models/vocab_parallel.py)."""
        positions = samples * self.w.seq_len / cp
        if self.w.loss_chunk > 0:
            positions = min(positions, self.w.loss_chunk)
        return positions * self.w.vocab / tp * (self.c.settings.act_bytes + 8)
