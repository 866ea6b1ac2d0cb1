"""Turn a measured timeline into simulator inputs, and compare the two.

Durations are the mean measured time of each (stage, action kind): that keeps
differences between stages (heterogeneous modules) and averages out per-step
noise. The point-to-point latency is the median delay between a dependency
finishing on one rank and the action that waited for it starting on another,
over the actions whose start that dependency determined.

Two uses: *in-sample* (:func:`predict`: a step simulated with its own measured
durations -- it checks the dependency and placement model, not a forecast) and
*held-out* (:func:`fit` on the steps of one schedule, :func:`predict_from` another
schedule of the same stages: its durations come from the first one's, a whole
backward B from a split one's I + W).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from .actions import Action, Kind, Schedule
from .simulator import Durations, SimulationResult, TimedAction, dependencies, simulate


@dataclass
class Calibration:
    """What the measured steps of one schedule say about its stages."""

    schedule: str
    num_stages: int
    means: dict[tuple[int, Kind], float]  # mean measured duration per (stage, kind)
    p2p: float  # median point-to-point latency, seconds


def stage_kind_means(measured: list[TimedAction]) -> dict[tuple[int, Kind], float]:
    by_kind: dict[tuple[int, Kind], list[float]] = defaultdict(list)
    for item in measured:
        by_kind[(item.action.stage, item.action.kind)].append(item.end - item.start)
    return {key: statistics.fmean(values) for key, values in by_kind.items()}


def p2p_delays(schedule: Schedule, measured: list[TimedAction]) -> list[float]:
    """Per cross-rank dependency that gated an action's start: the delay from its end to that start."""
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
    return delays


def calibrate(schedule: Schedule, measured: list[TimedAction]) -> tuple[Durations, float]:
    """In-sample durations (and p2p latency) of ``schedule`` from one of its own measured steps."""
    calibration = fit(schedule, [measured])
    return transferred(schedule, calibration), calibration.p2p


def predict(schedule: Schedule, measured: list[TimedAction]) -> tuple[SimulationResult, float]:
    """In-sample: the step simulated with its own calibrated durations, and the measured makespan."""
    durations, p2p = calibrate(schedule, measured)
    result = simulate(schedule, durations, p2p=p2p)
    return result, makespan(measured)


def makespan(measured: list[TimedAction]) -> float:
    return max(i.end for i in measured) - min(i.start for i in measured)


def fit(schedule: Schedule, steps: list[list[TimedAction]]) -> Calibration:
    """One schedule's measured steps pooled: mean duration per (stage, kind), median p2p latency."""
    pooled = [item for step in steps for item in step]
    delays = [d for step in steps for d in p2p_delays(schedule, step)]
    p2p = statistics.median(delays) if delays else 0.0
    return Calibration(schedule.name, schedule.num_stages, stage_kind_means(pooled), p2p)


def transferred(schedule: Schedule, calibration: Calibration) -> Durations:
    """Durations of ``schedule``'s actions from another schedule's calibration over the same stages: an action
    kind measured there keeps its mean; a whole backward (B) is the I + W measured there. Raises ValueError for
    what cannot be derived: other stages, or I / W from a schedule that ran whole backwards only."""
    if schedule.num_stages != calibration.num_stages:
        raise ValueError(
            f"{calibration.schedule} ran {calibration.num_stages} stages and {schedule.name} runs "
            f"{schedule.num_stages}: their stages hold different layers; calibrate on a schedule with "
            f"{schedule.num_stages} stages"
        )
    means, table = calibration.means, {}
    for rank in range(schedule.num_ranks):
        for action in schedule.compute(rank):
            key = (action.stage, action.kind)
            if key in means:
                table[str(action)] = means[key]
            elif action.kind == Kind.B and (action.stage, Kind.I) in means and (action.stage, Kind.W) in means:
                table[str(action)] = means[(action.stage, Kind.I)] + means[(action.stage, Kind.W)]
            else:
                raise ValueError(
                    f"{calibration.schedule} measured no {action.kind.value} on stage {action.stage}, which "
                    f"{schedule.name} runs (a split backward cannot be derived from a whole one)"
                )
    return Durations(table=table)


def predict_from(schedule: Schedule, calibration: Calibration) -> SimulationResult:
    """Held-out: ``schedule`` simulated with durations and latency calibrated on another schedule's steps."""
    return simulate(schedule, transferred(schedule, calibration), p2p=calibration.p2p)
