"""Reordering inside a global batch: DistTrain's intra- and inter-microbatch algorithms.

Only the *order* of the samples of one global batch changes; the set of samples each
optimizer step sees is the same, so synchronous training semantics are kept.

Layout of a global batch (docs/UNITS.md): ``M`` microbatch slots of ``B`` samples; DP
replica ``d`` of a unit with ``dp`` replicas owns the contiguous block ``[d B/dp, (d+1) B/dp)``
of every slot. Every unit's block boundaries fall on the *canonical grid* of ``G = lcm`` of
all units' DP sizes: ``G`` equal blocks of ``B / G`` samples per slot. Balancing the ``G``
grid groups balances every unit's replicas at once, and every unit derives the same
sample -> replica mapping from the one reordered order (no messages).

**Algorithm 2 (intra-microbatch, stragglers across DP groups).** Partition the ``n = M B``
samples into ``G`` groups of exactly ``n / G`` samples (the grid needs equal cardinality)
minimizing the largest group cost: largest cost first, each to the least-loaded group that
still has room (balanced LPT). ``brute_force_partition`` gives the optimum of the same
problem on small instances for checking (the greedy stays within 4/3 of it).

**Inside a group**, its samples are sorted by cost and dealt to the ``M`` slots in snake order
(0, 1, ..., M-1, M-1, ..., 0, ...): every slot gets a similar mix of heavy and light samples,
and because every group uses the same pattern, a slot's samples have similar ranks in every
group, so the replicas of a slot finish together. (Dealing the costliest samples into one
slot instead measured 15-20% slower on this CPU: very uneven microbatches.)

**Algorithm 3 (inter-microbatch, pipeline bubbles).** With slot costs ``c_k`` on the stage
whose work varies (the encoder's; the slot's slowest grid group) and a steady-phase period
``P`` of the rest of the pipeline (per slot), 1F1B on ``p`` stages runs the first slots'
forwards before any backward (warm-up) and drains the last ``p - 1`` (cool-down). The order:

1. the cheapest slot first: every stage waits for it to traverse the pipeline;
2. the next ``p - 1`` cheapest slots last, cheapest at the very end: they are the drain;
3. the middle by *best fit into the 1F1B intervals*: each interval of the steady phase is
   ``P`` long; the varying stage carries a debt ``D`` (its cumulative time so far minus
   ``P`` per slot: positive when it runs behind and the other stages idle, negative when it
   runs ahead and idles itself). The next slot is the remaining one whose cost is closest to
   ``P - D``, so the varying stage's cumulative time tracks the rest of the pipeline and
   neither side accumulates a bubble.

``order_slots_checked`` runs the schedule simulator on the result and on the arrival order and
keeps the better one (a few milliseconds per global batch), so reordering never makes a batch
slower in the model. ``tools/bench_reorder.py`` reports the gain.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np


def canonical_groups(dp_sizes: Sequence[int], samples_per_slot: int) -> int:
    """The grid every unit's replica blocks fall on: lcm of the DP sizes (must divide B)."""
    groups = 1
    for dp in dp_sizes:
        groups = groups * dp // math.gcd(groups, dp)
    if samples_per_slot % groups:
        raise ValueError(
            f"the DP sizes {list(dp_sizes)} have lcm {groups}, which does not divide the {samples_per_slot} "
            "samples of a microbatch slot"
        )
    return groups


def balanced_partition(costs: Sequence[float], groups: int) -> list[list[int]]:
    """Algorithm 2: ``groups`` groups of exactly ``len(costs) / groups`` indices, balanced LPT."""
    n = len(costs)
    if n % groups:
        raise ValueError(f"{n} samples cannot be split into {groups} equal groups")
    size = n // groups
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    heap = [(0.0, g) for g in range(groups)]  # (load, group): the least loaded open group on top
    members: list[list[int]] = [[] for _ in range(groups)]
    for i in order:
        load, g = heapq.heappop(heap)
        members[g].append(i)
        if len(members[g]) < size:
            heapq.heappush(heap, (load + costs[i], g))
    return members


def brute_force_partition(costs: Sequence[float], groups: int) -> float:
    """The optimal largest group cost of an equal-cardinality partition (small instances only)."""
    n = len(costs)
    size = n // groups
    best = math.inf

    def search(remaining: tuple[int, ...], worst: float) -> None:
        nonlocal best
        if worst >= best:
            return
        if not remaining:
            best = worst
            return
        first, rest = remaining[0], remaining[1:]  # the group holding the first remaining sample
        for others in itertools.combinations(rest, size - 1):
            load = costs[first] + sum(costs[i] for i in others)
            left = tuple(i for i in rest if i not in others)
            search(left, max(worst, load))

    search(tuple(range(n)), 0.0)
    return best


def group_loads(costs: Sequence[float], members: list[list[int]]) -> list[float]:
    return [sum(costs[i] for i in group) for group in members]


def order_slots(slot_costs: Sequence[float], stages: int, period: float | None = None) -> list[int]:
    """Algorithm 3: the order in which to run the slots on a ``stages``-deep 1F1B pipeline.

    ``period`` is the steady-phase time per slot of the rest of the pipeline (default: the mean
    slot cost)."""
    m = len(slot_costs)
    ranked = sorted(range(m), key=lambda k: (slot_costs[k], k))
    if m <= 2 or stages <= 1:
        return ranked
    period = float(np.mean(slot_costs)) if period is None else period
    first = ranked[0]
    tail_count = min(stages - 1, m - 1)
    tail = ranked[1 : 1 + tail_count]
    middle = set(ranked[1 + tail_count :])
    order = [first]
    debt = slot_costs[first] - period  # how far the varying stage runs ahead (< 0) or behind (> 0)
    while middle:
        target = period - debt
        k = min(middle, key=lambda k: (abs(slot_costs[k] - target), k))
        middle.remove(k)
        order.append(k)
        debt += slot_costs[k] - period
    return [*order, *reversed(tail)]


def simulated_makespan(slot_costs: Sequence[float], order: Sequence[int], stages: int, period: float) -> float:
    """1F1B makespan with the slots' costs on the first stage and ``period`` on the others
    (forward 1/3, backward 2/3 of a stage's time), from the schedule simulator."""
    from ..schedule.actions import Kind
    from ..schedule.generators import build_schedule
    from ..schedule.simulator import simulate

    if stages <= 1:
        return float(sum(slot_costs))

    def duration(action) -> float:
        base = slot_costs[order[action.microbatch]] if action.stage == 0 else period
        return base / 3 if action.kind == Kind.F else 2 * base / 3

    return simulate(build_schedule("1f1b", stages, len(order)), duration).makespan


def order_slots_checked(slot_costs: Sequence[float], stages: int, period: float | None = None) -> list[int]:
    """Algorithm 3, kept only when the simulator says it beats the arrival order."""
    period = float(np.mean(slot_costs)) if period is None else period
    ordered = order_slots(slot_costs, stages, period)
    arrival = list(range(len(slot_costs)))
    if simulated_makespan(slot_costs, ordered, stages, period) <= simulated_makespan(
        slot_costs, arrival, stages, period
    ):
        return ordered
    return arrival


def arrange(
    costs: Sequence[float],
    slots: int,
    samples_per_slot: int,
    groups: int,
    stages: int = 1,
    intra: bool = True,
    inter: bool = True,
    period: float | None = None,
) -> list[int]:
    """The new order of a global batch's sample indices (a permutation of ``range(len(costs))``).

    Position ``k * B + g * (B / G) + j`` holds the ``j``-th sample of grid group ``g`` in slot ``k``.
    """
    n = len(costs)
    if n != slots * samples_per_slot:
        raise ValueError(f"{n} samples do not fill {slots} slots of {samples_per_slot}")
    per_group_slot = samples_per_slot // groups
    if intra:
        members = balanced_partition(costs, groups)
    else:  # arrival order: slot k, group g holds the consecutive block the broker would give it
        members = [[] for _ in range(groups)]
        for k in range(slots):
            for g in range(groups):
                start = k * samples_per_slot + g * per_group_slot
                members[g].extend(range(start, start + per_group_slot))
    # Deal each group's samples to the slots in snake order of cost (slot 0, 1, ..., M-1, M-1, ..., 0,
    # ...): every slot gets a similar mix, and since all groups use the same pattern, the samples of
    # one slot in different groups have similar ranks -- replicas finish a slot together.
    table = np.empty((slots, groups, per_group_slot), dtype=np.int64)
    snake = [k if (r // slots) % 2 == 0 else slots - 1 - k for r in range(slots * per_group_slot) for k in [r % slots]]
    for g, group in enumerate(members):
        if intra:
            ordered = sorted(group, key=lambda i: (-costs[i], i))
            filled = [0] * slots
            for sample, slot in zip(ordered, snake, strict=True):
                table[slot, g, filled[slot]] = sample
                filled[slot] += 1
        else:  # as they came
            table[:, g, :] = np.array(group, dtype=np.int64).reshape(slots, per_group_slot)
    slot_cost = [max(sum(costs[i] for i in table[k, g]) for g in range(groups)) for k in range(slots)]
    order = order_slots_checked(slot_cost, stages, period) if inter else list(range(slots))
    return [int(i) for i in table[order].reshape(-1)]


def slot_costs(costs: Sequence[float], order: Sequence[int], slots: int, groups: int) -> list[float]:
    """Cost of each slot of an arranged batch: its slowest grid group (replicas wait for each other)."""
    table = np.asarray([costs[i] for i in order], dtype=float).reshape(slots, groups, -1)
    return table.sum(axis=2).max(axis=1).tolist()
