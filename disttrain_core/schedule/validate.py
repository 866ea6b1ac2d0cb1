"""Check a schedule before anything runs it.

Catches: actions on a rank that does not hold their stage, microbatches or
stages out of range, missing or duplicated actions (every (stage, microbatch)
needs exactly one F and either one B or one I plus one W), a W before its I or
a backward before its forward on the same rank, and deadlocks -- orders in which
some rank waits forever: in the data flow (the simulator with unit durations),
and in the executor's point-to-point posts replayed rank by rank under NCCL's
rules (replay.py), with the routing of the layout that will run it.
"""

from __future__ import annotations

from collections import Counter

from .actions import Kind, Schedule
from .replay import executor_programs, replay
from .simulator import ScheduleError, simulate
from .transfers import Routing, RowRouting, plan_all


def validate_schedule(schedule: Schedule, routing: Routing | None = None) -> None:
    """Raise ScheduleError naming the first problem. ``routing``: who holds which rows (the broker of the
    layout); by default every schedule row is one rank."""
    stages, m = schedule.num_stages, schedule.num_microbatches
    if len(schedule.actions) != max(schedule.stage_to_rank, default=-1) + 1:
        raise ScheduleError(
            f"schedule {schedule.name!r}: {len(schedule.actions)} rank rows but stages are placed on "
            f"{max(schedule.stage_to_rank) + 1} ranks"
        )
    counts: Counter = Counter()
    for rank in range(schedule.num_ranks):
        seen: set = set()
        for action in schedule.compute(rank):
            where = f"schedule {schedule.name!r}, rank {rank}, action {action}"
            if not 0 <= action.stage < stages or not 0 <= action.microbatch < m:
                raise ScheduleError(f"{where}: stage must be in [0, {stages}) and microbatch in [0, {m})")
            if schedule.stage_to_rank[action.stage] != rank:
                raise ScheduleError(
                    f"{where}: stage {action.stage} lives on rank {schedule.stage_to_rank[action.stage]}"
                )
            key = (action.stage, action.microbatch)
            if action.kind in (Kind.B, Kind.I) and (key, Kind.F) not in seen:
                raise ScheduleError(f"{where}: backward before the forward of the same microbatch on this rank")
            if action.kind == Kind.W and (key, Kind.I) not in seen:
                raise ScheduleError(f"{where}: W before its I")
            seen.add((key, action.kind))
            counts[(action.stage, action.kind, action.microbatch)] += 1
    for stage in range(stages):
        for k in range(m):
            f, b, i, w = (counts[(stage, kind, k)] for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
            name = f"stage {stage} microbatch {k}"
            if f != 1:
                raise ScheduleError(f"schedule {schedule.name!r}: {name} has {f} forwards (needs exactly 1)")
            if stage in schedule.forward_only:
                if b or i or w:
                    raise ScheduleError(f"schedule {schedule.name!r}: {name} is forward-only but has a backward")
            elif not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                raise ScheduleError(
                    f"schedule {schedule.name!r}: {name} has B={b} I={i} W={w}; needs one B, or one I and one W"
                )
    simulate(schedule, lambda action: 1.0)  # raises ScheduleError on a data-flow deadlock
    plans = plan_all(schedule, routing or RowRouting(schedule))
    replay(executor_programs(plans), what=f"schedule {schedule.name!r}")
