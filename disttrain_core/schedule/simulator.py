"""Predict what a schedule does with given action durations.

Each rank runs its compute actions in list order; an action starts when its rank
is free and its dependencies are done (plus the point-to-point latency when a
dependency ran on another rank):

* ``F(s, k)`` needs ``F(s-1, k)``;
* ``B(s, k)`` / ``I(s, k)`` need ``F(s, k)`` and the input gradient from
  ``B/I(s+1, k)`` (the last stage starts backward from its own forward);
* ``W(s, k)`` needs ``I(s, k)``.

The result carries the makespan, per-rank busy/idle time, the bubble fraction
(idle time over total time, summed over ranks), each rank's idle time between its
own first and last action (``span_idle``: what a step costs a rank when consecutive
steps tile, i.e. when no optimizer-step barrier lines the ranks up -- ZB-H2's
zero bubble is this one), peak in-flight activations per rank (+1 at F, -1 at B, or
at W for split backward), the critical path, and the start/end of every action for
timeline pictures.

A schedule that lists overlapped forward/backward pairs (``meta["overlap"]``,
DualPipeV's F&B) runs each pair in sequence unless ``Durations.forward_backward``
gives the time of one overlapped pair: then the pair starts when both halves'
inputs are ready and both finish together after that time. An order that can never finish
raises :class:`ScheduleError` naming the actions every rank is stuck on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .actions import Action, Kind, Schedule


class ScheduleError(ValueError):
    pass


DurationFn = Callable[[Action], float]


@dataclass
class Durations:
    """Per-action durations; scalars for the whole pipeline, or per-stage/per-microbatch tables.

    ``forward``/``backward``/``backward_input``/``backward_weight`` are the time of one
    microbatch through one stage. ``per_stage`` and ``per_microbatch`` multiply them
    (heterogeneous modules, heterogeneous data). ``backward`` defaults to I + W.
    """

    forward: float = 1.0
    backward: float | None = None
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p: float = 0.0
    per_stage: list[float] | None = None
    per_microbatch: list[float] | None = None
    table: dict[str, float] = field(default_factory=dict)  # exact overrides by action string, e.g. {"0F1": 2.5}
    forward_backward: float | None = None  # one overlapped F&B pair (meta["overlap"]); None: in sequence

    def __call__(self, action: Action) -> float:
        exact = self.table.get(str(action))
        if exact is not None:
            return exact
        base = {
            Kind.F: self.forward,
            Kind.B: self.backward if self.backward is not None else self.backward_input + self.backward_weight,
            Kind.I: self.backward_input,
            Kind.W: self.backward_weight,
        }[action.kind]
        if self.per_stage is not None:
            base *= self.per_stage[action.stage]
        if self.per_microbatch is not None:
            base *= self.per_microbatch[action.microbatch]
        return base


@dataclass
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimulationResult:
    makespan: float
    busy: list[float]
    bubble_fraction: float
    bubble_fraction_per_rank: list[float]
    span_idle: list[float]
    peak_activations: list[int]
    critical_path: list[str]
    timeline: list[TimedAction]

    def summary(self) -> dict:
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "bubble_fraction_per_rank": self.bubble_fraction_per_rank,
            "span_idle": self.span_idle,
            "peak_activations": self.peak_activations,
            "busy": self.busy,
            "critical_path": self.critical_path,
        }


def dependencies(action: Action, last_stage: int) -> list[Action]:
    s, k = action.stage, action.microbatch
    if action.kind == Kind.F:
        return [Action(s - 1, Kind.F, k)] if s > 0 else []
    if action.kind in (Kind.B, Kind.I):
        return [Action(s, Kind.F, k)] + ([] if s == last_stage else [_grad_producer(s + 1, k)])
    if action.kind == Kind.W:
        return [Action(s, Kind.I, k)]
    return []


def _grad_producer(stage: int, microbatch: int) -> Action:
    # Resolved against the schedule: whichever of B or I that stage runs.
    return Action(stage, Kind.B, microbatch)


def _work_items(schedule: Schedule, durations: DurationFn) -> list[list[tuple[Action, ...]]]:
    """Each rank's compute in order, an overlapped pair as one item when its time is given."""
    fused = getattr(durations, "forward_backward", None) is not None
    pairs = {first: second for first, second in schedule.meta.get("overlap", ())} if fused else {}
    queues = []
    for rank in range(schedule.num_ranks):
        row, items, skip = schedule.compute(rank), [], False
        for index, action in enumerate(row):
            if skip:
                skip = False
                continue
            partner = pairs.get(action)
            skip = partner is not None and index + 1 < len(row) and row[index + 1] == partner
            items.append((action, partner) if skip else (action,))
        queues.append(items)
    return queues


def simulate(schedule: Schedule, durations: DurationFn, p2p: float = 0.0) -> SimulationResult:
    ranks = schedule.num_ranks
    last_stage = schedule.num_stages - 1
    queues = _work_items(schedule, durations)
    splits = {(a.stage, a.microbatch) for row in queues for item in row for a in item if a.kind == Kind.I}
    finish: dict[Action, float] = {}
    cause: dict[Action, Action | None] = {}
    placed: dict[Action, int] = {}
    free = [0.0] * ranks
    last_on_rank: list[Action | None] = [None] * ranks
    pointer = [0] * ranks
    timeline: list[TimedAction] = []

    def resolve(dep: Action) -> Action:
        if dep.kind == Kind.B and (dep.stage, dep.microbatch) in splits:
            return Action(dep.stage, Kind.I, dep.microbatch)
        return dep

    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for rank in range(ranks):
            while pointer[rank] < len(queues[rank]):
                item = queues[rank][pointer[rank]]
                deps = [resolve(d) for action in item for d in dependencies(action, last_stage) if d not in item]
                if any(d not in finish for d in deps):
                    break
                start, why = free[rank], last_on_rank[rank]
                for dep in deps:
                    ready = finish[dep] + (p2p if placed[dep] != rank else 0.0)
                    if ready > start:
                        start, why = ready, dep
                times = [durations(action) for action in item]
                end = start + (durations.forward_backward if len(item) == 2 else times[0])
                begin = start
                for action, share in zip(item, times, strict=True):  # a pair's interval split in proportion
                    finish[action], cause[action], placed[action] = end, why, rank
                    stop = begin + (end - start) * share / sum(times) if sum(times) else end
                    timeline.append(TimedAction(rank, action, begin, stop))
                    begin = stop
                free[rank], last_on_rank[rank] = end, item[-1]
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(queues[r][pointer[r]][0]) for r in range(ranks) if pointer[r] < len(queues[r])]
            raise ScheduleError(f"schedule {schedule.name!r} deadlocks: every rank waits ({', '.join(stuck)})")

    makespan = max(free) if timeline else 0.0
    busy = [sum(t.end - t.start for t in timeline if t.rank == r) for r in range(ranks)]
    per_rank = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    bubble = 1.0 - sum(busy) / (ranks * makespan) if makespan else 0.0
    return SimulationResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        bubble_fraction_per_rank=per_rank,
        span_idle=_span_idle(timeline, busy),
        peak_activations=peak_activations(schedule),
        critical_path=_critical_path(finish, cause, placed),
        timeline=sorted(timeline, key=lambda t: (t.rank, t.start)),
    )


def _span_idle(timeline: list[TimedAction], busy: list[float]) -> list[float]:
    spans = [[float("inf"), 0.0] for _ in busy]
    for t in timeline:
        spans[t.rank] = [min(spans[t.rank][0], t.start), max(spans[t.rank][1], t.end)]
    return [max(end - start - work, 0.0) if work else 0.0 for (start, end), work in zip(spans, busy, strict=True)]


def peak_activations(schedule: Schedule) -> list[int]:
    """Most (stage, microbatch) activations held at once on each rank, in list order."""
    peaks = []
    for rank in range(schedule.num_ranks):
        held = peak = 0
        split = {(a.stage, a.microbatch) for a in schedule.compute(rank) if a.kind == Kind.I}
        for action in schedule.compute(rank):
            if action.kind == Kind.F and action.stage in schedule.forward_only:
                peak = max(peak, held + 1)  # kept only while it runs: nothing is saved for a backward
            elif action.kind == Kind.F:
                held += 1
                peak = max(peak, held)
            elif action.kind == Kind.B or (action.kind == Kind.W and (action.stage, action.microbatch) in split):
                held -= 1
        peaks.append(peak)
    return peaks


def _critical_path(finish: dict, cause: dict, placed: dict) -> list[str]:
    if not finish:
        return []
    node = max(finish, key=finish.get)
    path = []
    while node is not None:
        path.append(f"r{placed[node]}:{node}")
        node = cause[node]
    return path[::-1]
