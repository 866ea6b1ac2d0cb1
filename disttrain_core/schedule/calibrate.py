"""Turn a measured timeline into simulator inputs, and compare the two.

Durations are the mean measured time of each (stage, action kind): that keeps
differences between stages (heterogeneous modules) and averages out per-step
noise. The point-to-point latency is the median delay between a dependency
finishing on one rank and the action that waited for it starting on another,
over the actions whose start that dependency determined.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .actions import Action, Kind, Schedule
from .simulator import Durations, SimulationResult, TimedAction, dependencies, simulate


def calibrate(schedule: Schedule, measured: list[TimedAction]) -> tuple[Durations, float]:
    by_kind: dict[tuple[int, Kind], list[float]] = defaultdict(list)
    for item in measured:
        by_kind[(item.action.stage, item.action.kind)].append(item.end - item.start)
    means = {key: statistics.fmean(values) for key, values in by_kind.items()}
    table = {str(item.action): means[(item.action.stage, item.action.kind)] for item in measured}

    end = {item.action: item for item in measured}
    splits = {(a.stage, a.microbatch) for a in end if a.kind == Kind.I}
    previous_end: dict[Action, float] = {}
    for rank in {item.rank for item in measured}:
        items = sorted((i for i in measured if i.rank == rank), key=lambda i: i.start)
        for before, after in zip(items, items[1:], strict=False):
            previous_end[after.action] = before.end
    delays = []
    for item in measured:
        for dep in dependencies(item.action, schedule.num_stages - 1):
            if dep.kind == Kind.B and (dep.stage, dep.microbatch) in splits:
                dep = Action(dep.stage, Kind.I, dep.microbatch)
            producer = end.get(dep)
            if producer is None or producer.rank == item.rank:
                continue
            if producer.end > previous_end.get(item.action, float("-inf")):  # this dependency gated the start
                delays.append(max(0.0, item.start - producer.end))
    p2p = statistics.median(delays) if delays else 0.0
    return Durations(table=table), p2p


def predict(schedule: Schedule, measured: list[TimedAction]) -> tuple[SimulationResult, float]:
    """Simulated result with calibrated durations, and the measured makespan."""
    durations, p2p = calibrate(schedule, measured)
    result = simulate(schedule, durations, p2p=p2p)
    span = max(i.end for i in measured) - min(i.start for i in measured)
    return result, span
