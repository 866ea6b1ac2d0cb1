"""The memory side of the layout model (planner/evaluate.py ``LayoutModel``): each unit's fullest device under a
recompute policy and a shard mode, and the cheapest (shard, recompute) pair that fits."""

from __future__ import annotations

from ..parallel.units import SIDE_ENCODERS, SIDE_UNITS  # noqa: F401  (SIDE_ENCODERS re-exported)
from .memory import FSDP, OFFLOADED, split_shard
from .schedule_choice import splits_backward

AUTO_RECOMPUTE = ("none", "selective_op", "every_k", "full", "full_partitioned")  # least recomputation first
AUTO_SHARD = ("zero1", "zero2", "zero3")  # least traffic first
# The units beside the image encoder and generator (the audio tower, the video tower, the audio generator): each rides
# in the LLM unit's first / last stage or is a unit of its own, one pipeline stage (planner/audio_search.py).
AUDIO_UNITS = SIDE_UNITS


class LayoutMemory:
    """Mixed into LayoutModel (``self.c``: its CostModel, ``self.limit``, the caches, ``group_rows``)."""

    def unit_memory(
        self, name: str, choices: dict, S: int, m: int, policy: str, shard: str | None = None, schedule: str = "1f1b"
    ) -> float:
        """Bytes on the fullest device of unit ``name`` (the LLM's counts its colocated modules) under a
        recompute policy and a shard mode: the fuller of its first and last pipeline stage
        (planner/breakdown.py: model state, gathered FSDP2 parameters and autocast copies, in-flight
        activations, logits, the recompute transient, the runtime overhead) under ``schedule``."""
        from .breakdown import role_memory

        shard = self.c.shard_of(shard)
        key = (*self._memory_key(name, choices, S, m, policy, shard), schedule)
        cached = self._memory_cache.get(key)
        if cached is None:
            stages = choices[name].pp
            ends = {0, stages - 1}
            cached = max(role_memory(self, name, choices, S, m, policy, shard, p, schedule).total for p in ends)
            self._memory_cache[key] = cached
        return cached

    def _memory_key(self, name: str, choices: dict, S: int, m: int, policy: str, shard: str) -> tuple:
        """What a unit's memory depends on (the solver evaluates the same unit in many layouts;
        planner/breakdown.py ``role_memory``). The LLM's: its own choice, which modules ride on its end stages,
        and the stages from its first to the last (its first stage's in-flight microbatches), not the separate
        units' TP and DP. The others': their choice, the LLM's dp (their samples per slot) and the stage count."""
        llm, enc, gen = choices["llm"], choices.get("encoder"), choices.get("generator")
        if name == "llm":
            riders = (
                enc is not None and enc.colocated,
                gen is not None and gen.colocated,
                *(choices[n].colocated for n in AUDIO_UNITS if choices.get(n) is not None),
            )
            return (name, llm, riders, S - self.group_rows(choices)[0], m, policy, shard)
        return (name, choices[name], llm.dp, S, m, policy, shard)

    def memory_options(self, schedule: str = "1f1b") -> list[tuple[str, str]]:
        """(shard, recompute) pairs to try, cheapest first: ``planner.shard`` / ``planner.recompute`` or, under
        ``auto``, sharding before recomputation (FSDP2's traffic overlaps compute; recompute adds compute):
        zero1, zero2, zero3 without recompute, then each recompute policy with each shard mode. A schedule that
        splits its backward runs no FSDP2 shard mode (its W runs outside FSDP2's hooks: validation/layout.py)."""
        settings = self.c.settings
        shards = AUTO_SHARD if settings.shard == "auto" else (settings.shard,)
        if splits_backward(schedule):
            shards = tuple(s for s in shards if s not in FSDP)
        policies = AUTO_RECOMPUTE if settings.recompute == "auto" else (settings.recompute,)
        if settings.offload and settings.recompute == "auto":  # activations to the host: once nothing else fits
            policies = (*policies, "offload")
        options = [(shard, policy) for policy in policies for shard in shards]
        if settings.offload:  # the optimizer on the host: a step slower, tried once nothing else fits
            offloaded = [
                s + OFFLOADED for s in shards if s != "none" and (s == "zero1" or s == "zero3" or len(shards) == 1)
            ]
            options += [(shard, policy) for policy in policies for shard in offloaded]
        return options

    def recompute_policies(
        self, choices: dict, S: int, m: int, schedule: str = "1f1b"
    ) -> tuple[dict[str, str], dict[str, float], dict[str, str]]:
        """Each unit's recompute policy, memory and shard mode: the settings, or under ``auto`` the first
        option of ``memory_options`` that fits the device. A unit with one replica (data x context ranks: FSDP2
        shards over both) cannot shard: zero1. An expert-parallel LLM shards its dense parameters only (its
        experts are stepped whole on every replica: planner/memory.py ``unit_model_state``)."""
        policies, memory, shards = {}, {}, {}
        for name, choice in choices.items():
            if not choice.colocated:
                policies[name], memory[name], shards[name] = self.unit_fit(name, choices, S, m, schedule)
        return policies, memory, shards

    def unit_fit(self, name: str, choices: dict, S: int, m: int, schedule: str = "1f1b") -> tuple[str, float, str]:
        """One unit's (recompute policy, bytes per device, shard mode): ``recompute_policies`` for one unit."""
        key = (*self._memory_key(name, choices, S, m, "", ""), schedule)
        found = self._choice_cache.get(key)
        if found is None:
            choice, last = choices[name], None
            for shard, policy in self.memory_options(schedule):  # the device-resident options first: never skipped
                base, offloaded = split_shard(shard)
                if offloaded and (base in FSDP and choice.tp > 1 or choice.ep > 1):
                    continue  # what the runtime refuses (validation/offload.py): FSDP2's offload with TP, EP
                if not self._policy_runs(name, choice, policy):
                    continue
                if base in FSDP and choice.dp * choice.cp < 2:
                    shard = "zero1" + (OFFLOADED if offloaded else "")
                used = self.unit_memory(name, choices, S, m, policy, shard, schedule)
                if used > self.limit:
                    last = (policy, used, shard)  # what an infeasible unit reports: the last option over the limit
                elif not (offloaded or policy == "offload") or self._host_fits(
                    name, choices, S, m, policy, shard, used, schedule
                ):
                    found = (policy, used, shard)
                    break
            found = self._choice_cache[key] = found or last
        return found

    def _policy_runs(self, name: str, choice, policy: str) -> bool:
        """What validation/offload.py accepts: full_partitioned splits over tp > 1 without sequence parallelism
        (the planner offers both new policies for transformer units only: the U-Net's bytes are counted per
        policy it was measured under)."""
        if policy not in ("full_partitioned", "offload"):
            return True
        if self.c.work.units[name].counted_activation_bytes:
            return False
        return policy == "offload" or (self.c.split_tp(name, choice.tp) > 1 and not self.c.settings.sequence_parallel)

    def _host_fits(
        self, name: str, choices: dict, S: int, m: int, policy: str, shard: str, used: float, schedule: str = "1f1b"
    ) -> bool:
        """Does what an offloading unit moves to the host (its optimizer state; under recompute=offload the saved
        activations of its microbatches in flight) fit the host memory of a node, shared by the node's devices
        (``cluster.host_memory_per_node_gb``, to ``planner.memory_margin``)?"""
        kept = "none" if policy == "offload" else policy  # what the device would hold without moving anything
        moved = self.unit_memory(name, choices, S, m, kept, split_shard(shard)[0], schedule) - used
        hw = self.c.hw
        return moved * min(hw.per_node, self.devices) <= hw.host_memory * self.c.settings.memory_margin

    def _memory_reason(self, name: str, used: float) -> str:
        """Why a unit needing ``used`` bytes per device does not fit."""
        c = self.c
        return (
            f"{name} needs {used / 1e9:.1f} GB per device, over {self.limit / 1e9:.1f} GB "
            f"({c.settings.memory_margin:.0%} of {c.hw.memory_bytes / 1e9:.0f} GB)"
        )
