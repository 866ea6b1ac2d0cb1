"""The process groups of a unit layout (train/unit_engine.py): each rank's data-parallel, tensor-parallel,
context-parallel, HSDP and expert groups. Every rank creates every group, in one order (torch's rule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..parallel.units import UnitLayout


@dataclass
class UnitGroups:
    data_parallel: object | None  # this rank's replicas of the same (unit, tp, pp) position
    tensor_parallel: object | None
    data_parallel_comm: object | None = None  # the same members, for the background ring collectives
    hsdp_replicate: object | None = None  # HSDP: the replicas of this rank's shard position
    hsdp_shard: object | None = None  # HSDP: the ranks that share one copy of the state
    context_parallel: object | None = None  # the ranks holding the other slices of this rank's sequences
    # parallel.cp_mode=hybrid: this rank's all-to-all ranks (consecutive CP ranks) and its ring (the CP ranks with
    # its index among those)
    context_ulysses: object | None = None
    context_ring: object | None = None
    # Gradients are summed over data x context ranks (each CP rank's loss covers its own positions); without
    # context parallelism the data-parallel group itself.
    gradient: object | None = None
    gradient_comm: object | None = None  # the same members, for the background ring collectives
    expert_parallel: object | None = None  # MoE, ep > 1: the replicas sharing this rank's token exchange
    expert_data: object | None = None  # the ranks holding the same experts (gradients summed over them)
    expert_members: tuple[int, ...] = ()


def build_unit_groups(
    layout: UnitLayout, rank: int, timeout=None, comm_groups: bool = False, cp_ulysses: int = 1
) -> UnitGroups:
    """Every process creates every group, in the same order (gloo needs it); ``cp_ulysses``: the hybrid
    context-parallel mode's all-to-all size (1: no hybrid groups)."""
    groups = _data_and_tensor_groups(layout, rank, timeout, comm_groups)
    for unit in layout.units:
        if unit.cp == 1:
            continue
        for pp in range(unit.pp):
            for tp in range(unit.tp):
                members = [unit.rank(d, tp, pp, c) for d in range(unit.dp) for c in range(unit.cp)]
                group = dist.new_group(members, timeout=timeout)
                extra = dist.new_group(members, timeout=timeout) if comm_groups else None
                if rank in members:
                    groups.gradient, groups.gradient_comm = group, extra
                for d in range(unit.dp):
                    members = [unit.rank(d, tp, pp, c) for c in range(unit.cp)]
                    group = dist.new_group(members, timeout=timeout)
                    if rank in members:
                        groups.context_parallel = group
                    if 1 < cp_ulysses < unit.cp:
                        _hybrid_groups(members, cp_ulysses, rank, timeout, groups)
    if layout.unit_of(rank).cp == 1:
        groups.gradient, groups.gradient_comm = groups.data_parallel, groups.data_parallel_comm
    _expert_groups(layout, rank, timeout, groups)
    return groups


def _hybrid_groups(members: list[int], ulysses: int, rank: int, timeout, groups: UnitGroups) -> None:
    """One CP group's all-to-all groups (``ulysses`` consecutive members) and rings (every ``ulysses``-th)."""
    for start in range(0, len(members), ulysses):
        group = dist.new_group(members[start : start + ulysses], timeout=timeout)
        if rank in members[start : start + ulysses]:
            groups.context_ulysses = group
    for index in range(ulysses):
        group = dist.new_group(members[index::ulysses], timeout=timeout)
        if rank in members[index::ulysses]:
            groups.context_ring = group


def _expert_groups(layout: UnitLayout, rank: int, timeout, groups: UnitGroups) -> None:
    """Expert parallelism: blocks of ep consecutive data-parallel replicas exchange tokens; the replicas
    with the same position in their block (and every context-parallel rank) hold the same experts."""
    for unit in layout.units:
        if unit.ep == 1:
            continue
        for pp in range(unit.pp):
            for inner in range(unit.inner):
                replicas = [unit.rank_at(d, inner, pp) for d in range(unit.dp)]
                for block in range(unit.dp // unit.ep):
                    members = replicas[block * unit.ep : (block + 1) * unit.ep]
                    group = dist.new_group(members, timeout=timeout)
                    if rank in members:
                        groups.expert_parallel = group
            for tp in range(unit.tp):
                for position in range(unit.ep):
                    members = sorted(
                        unit.rank(d, tp, pp, c) for d in range(position, unit.dp, unit.ep) for c in range(unit.cp)
                    )
                    group = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
                    if rank in members:
                        groups.expert_data, groups.expert_members = group, tuple(members)


def _data_and_tensor_groups(layout: UnitLayout, rank: int, timeout, comm_groups: bool) -> UnitGroups:
    dp_group = tp_group = comm_group = replicate_group = shard_group = None
    for unit in layout.units:
        for pp in range(unit.pp):
            for inner in range(unit.inner):
                members = [unit.rank_at(d, inner, pp) for d in range(unit.dp)]
                group = dist.new_group(members, timeout=timeout) if unit.dp > 1 else None
                extra = dist.new_group(members, timeout=timeout) if unit.dp > 1 and comm_groups else None
                if rank in members:
                    dp_group, comm_group = group, extra
                replicas = unit.hsdp_replicas
                if replicas > 1:  # replica r holds data-parallel positions [r S, (r + 1) S)
                    per = unit.dp // replicas
                    for r in range(replicas):
                        group = dist.new_group(members[r * per : (r + 1) * per], timeout=timeout)
                        if rank in members[r * per : (r + 1) * per]:
                            shard_group = group
                    for s in range(per):
                        group = dist.new_group(members[s::per], timeout=timeout)
                        if rank in members[s::per]:
                            replicate_group = group
            for dp in range(unit.dp):
                for cp in range(unit.cp):
                    members = [unit.rank(dp, t, pp, cp) for t in range(unit.tp)]
                    group = dist.new_group(members, timeout=timeout) if unit.tp > 1 else None
                    if rank in members:
                        tp_group = group
    return UnitGroups(dp_group, tp_group, comm_group, replicate_group, shard_group)
