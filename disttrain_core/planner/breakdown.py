"""Memory of one rank role -- (unit, pipeline stage) of a layout -- item by item: what the planner's
feasibility test adds up (``LayoutModel.unit_memory`` is the fullest role of a unit), what
``tools/memory.py`` prints and what ``trainer.memory_report`` / ``trainer.dry_run`` compare with the
runtime. TP ranks and DP replicas of one stage hold the same amounts, so a role stands for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.units import SIDE_ENCODERS
from ..schedule.generators import V_SHAPED
from .memory import FSDP, ModelState, split_shard


@dataclass(frozen=True)
class RoleMemory:
    unit: str
    pp: int  # the unit's pipeline stage
    shard: str
    recompute: str
    in_flight: int  # microbatches whose activations the stage holds at once
    state: ModelState  # between steps (planner/memory.py)
    activations: float  # in-flight activations (colocated modules included)
    logits: float  # the last LLM stage's logits and loss temporaries
    recompute_transient: float  # one recomputed block's activations during its backward
    step_transient: float  # FSDP2's gathered parameters, autocast's weight copies
    overhead: float  # runtime context, fragmentation (cluster.runtime_overhead_gb)
    # FSDP2 frees the sharded gradients between steps (zero_grad sets them to None); they come back during
    # the backward, when activations go. At the fullest moment -- the last forward before the first
    # backward -- they are absent unless an earlier microbatch's backward already ran (m > in_flight).
    grads_absent_at_peak: float = 0.0

    @property
    def peak(self) -> float:
        """Bytes at the fullest moment of a step, without the runtime overhead."""
        state = self.state.total - self.grads_absent_at_peak
        return state + self.activations + self.logits + self.recompute_transient + self.step_transient

    @property
    def total(self) -> float:
        return self.peak + self.overhead

    def as_dict(self) -> dict:
        return {
            "unit": self.unit,
            "pp": self.pp,
            "shard": self.shard,
            "recompute": self.recompute,
            "in_flight": self.in_flight,
            "state": self.state.as_dict(),
            "activations": self.activations,
            "logits": self.logits,
            "recompute_transient": self.recompute_transient,
            "step_transient": self.step_transient,
            "grads_absent_at_peak": self.grads_absent_at_peak,
            "peak": self.peak,
            "overhead": self.overhead,
            "total": self.total,
        }


def in_flight(schedule: str, stages: int, stage: int, microbatches: int, vpp: int = 1) -> int:
    """Microbatches a pipeline stage holds activations for, in whole-rank shares (a rank's ``vpp`` chunks of
    one microbatch count one), the simulator's peaks (schedule/simulator.py ``peak_activations``; docs/
    SCHEDULES.md): all of them under GPipe; 2 stages - 1 under ZB-H2 (on every rank, as its list scheduling
    holds them); 2 stages + 1 half-rank chunks under DualPipeV, rounded up; 2 (stages - 1 - stage) + (vpp - 1)
    m + 1 chunks under breadth-first, at most every chunk; under 1F1B (and its interleaved, ZB-H1 and ZBV
    variants, approximately) the stages after it plus one. At most all of them."""
    m = microbatches
    if schedule == "gpipe":
        return m
    if schedule == "zb_h2":
        return min(2 * stages - 1, m)
    if schedule == "dualpipev":
        return min(stages + 1, m)
    if schedule == "breadth_first":
        chunks = min(2 * (stages - 1 - stage) + (vpp - 1) * m + 1, vpp * m)
        return -(-chunks // vpp)
    return max(1, min(stages - stage, m))


def role_memory(
    model,
    name: str,
    choices: dict,
    S: int,
    m: int,
    policy: str,
    shard: str,
    pp: int,
    schedule: str = "1f1b",
    hsdp_replicas: int = 1,
) -> RoleMemory:
    """The memory of stage ``pp`` of unit ``name`` (``model``: a planner.LayoutModel; ``choices``: the
    layout's UnitChoice per unit; ``S`` pipeline stages over all units, ``m`` microbatches per step)."""
    c, micro = model.c, model.micro
    B = micro * choices["llm"].dp
    llm = choices["llm"]
    r = model.group_rows(choices)[0]  # the encoder units' pipeline rows
    logits = 0.0
    if name in ("encoder", *SIDE_ENCODERS):  # the first rows (the audio and video towers: one stage)
        enc = choices[name]
        items = model.items(name, B / enc.dp)
        flight = in_flight(schedule, S, pp, m)
        state = c.state(name, enc.tp, enc.dp, enc.pp, shard, pp, hsdp_replicas)
        act = c.activation_bytes(name, enc.tp, items, policy) / enc.pp * flight
        recompute = c.recompute_transient_bytes(name, enc.tp, items, policy)
        step = c.step_transient_bytes(name, enc.tp, enc.pp, shard, flight, pp, pipelined=S > 1)
    elif name in ("generator", "audio_generator"):  # the last rows; pp > 1: the U-Net cut at level boundaries
        gen = choices[name]
        flight = in_flight(schedule, S, r + llm.pp + pp, m) if gen.pp > 1 else 1
        state = c.state(name, gen.tp, gen.dp, gen.pp, shard, pp, hsdp_replicas)
        act = c.activation_bytes(name, gen.tp, B / gen.dp, policy) / gen.pp * flight
        recompute = c.recompute_transient_bytes(name, gen.tp, B / gen.dp, policy)
        step = c.step_transient_bytes(name, gen.tp, gen.pp, shard, flight, pp, pipelined=S > 1)
    else:
        enc, gen = choices.get("encoder"), choices.get("generator")
        # context parallelism: 1/cp of every sequence's activations and logits; expert parallelism: 1/ep of
        # the experts (costs.py); modules colocated with the LLM run whole sequences on every CP rank
        flight = in_flight(schedule, S, r + pp, m, llm.vpp)
        # a V (zbv, dualpipev) places stages pp and 2 pp - 1 - pp of 2 pp on rank pp: the first and the last
        # (the embedding and the head, the colocated encoder and generator) both on rank 0
        v_shaped = schedule in V_SHAPED and llm.pp > 1
        first, last = pp == 0, pp == (0 if v_shaped else llm.pp - 1)
        if v_shaped:
            halves = [
                c.state("llm", llm.tp, llm.dp, 2 * llm.pp, shard, s, hsdp_replicas, llm.cp, llm.ep)
                for s in (pp, 2 * llm.pp - 1 - pp)
            ]
            state = type(halves[0])(*(a + b for a, b in zip(*map(_fields, halves), strict=True)))
        else:
            state = c.state("llm", llm.tp, llm.dp, llm.pp, shard, pp, hsdp_replicas, llm.cp, llm.ep)
        share = c.settings.llm_share(pp, llm.pp, c.work.units["llm"].layers)  # parallel.pp_split
        act = c.activation_bytes("llm", llm.tp, micro, policy, llm.cp) * share * flight
        # one block at a time: what recompute reruns, and ring attention's buffers in its backward
        recompute = c.recompute_transient_bytes("llm", llm.tp, micro, policy, llm.cp)
        recompute += c.attention_transient_bytes("llm", llm.tp, micro, llm.cp, llm.cp_mode, llm.cp_ulysses)
        step = c.step_transient_bytes("llm", llm.tp, llm.pp, shard, flight, pp, llm.ep, pipelined=S > 1)
        if last:
            logits = model.logits(micro, llm.cp, llm.tp)
        extra = []
        if enc is not None and enc.colocated and first:
            act += c.activation_bytes("encoder", llm.tp, model.images(micro), policy) * flight
            extra.append(("encoder", flight))
        for tower in SIDE_ENCODERS:
            if model.rides(tower, choices) and first:
                act += c.activation_bytes(tower, llm.tp, model.items(tower, micro), policy) * flight
                extra.append((tower, flight))
        if model.rides("audio_generator", choices) and last:
            act += c.activation_bytes("audio_generator", llm.tp, micro, policy)
            extra.append(("audio_generator", 1))
        if gen is not None and gen.colocated and last:
            act += c.activation_bytes("generator", llm.tp, micro, policy)
            extra.append(("generator", 1))
        for module, held in extra:
            colocated = c.state(module, llm.tp, llm.dp, 1, shard, 0, hsdp_replicas, llm.cp)
            state = type(state)(*(a + b for a, b in zip(_fields(state), _fields(colocated), strict=True)))
            step += c.step_transient_bytes(module, llm.tp, 1, shard, held, 0, pipelined=S > 1)
    absent = state.grads if split_shard(shard)[0] in FSDP and m <= flight else 0.0
    return RoleMemory(name, pp, shard, policy, flight, state, act, logits, recompute, step, c.hw.overhead_bytes, absent)


def _fields(state: ModelState) -> tuple[float, ...]:
    return (state.params, state.grads, state.master, state.moments, state.buffers)


def unit_roles(
    model, name: str, choices: dict, S: int, m: int, policy: str, shard: str, schedule: str = "1f1b", hsdp: int = 1
):
    """Every pipeline stage of a unit, as roles."""
    stages = choices[name].pp
    return [role_memory(model, name, choices, S, m, policy, shard, p, schedule, hsdp) for p in range(stages)]
