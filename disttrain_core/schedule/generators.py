"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZBV.

Placement: one stage per rank for GPipe, 1F1B and ZB-H1 (stage s on rank s);
``vpp`` stages per rank in a loop for interleaved 1F1B (stage s on rank s mod pp);
two stages per rank in a V for ZBV (stage s < pp on rank s, stage s >= pp on rank
2 pp - 1 - s, so the last stage sits on rank 0 next to the first).

* GPipe: all forwards, then all backwards (in-flight activations: all m).
* 1F1B: rank r runs pp - r - 1 warm-up forwards, then alternates one forward and
  one backward, then drains (in-flight: pp - r).
* Interleaved 1F1B (Megatron's depth-first order): microbatches in groups of pp go
  through chunk 0, then chunk 1, ...; rank r warms up with (pp - r - 1) * 2 +
  (vpp - 1) * pp forwards. Requires microbatches to be a multiple of pp.
* ZB-H1 (zero bubble, same peak memory as 1F1B's first rank): the 1F1B order with
  each backward split into I (input gradient, on the critical path) and W (weight
  gradient, off it). Rank r keeps its W's r microbatches behind its I's, so the
  held-back W's fill the drain-phase waits; bubble (pp-1)(t_F+t_I-t_W) per rank.
* ZBV: built by list scheduling with unit durations on the V placement: a free
  rank runs a ready I first (it unblocks the previous stage), else a ready F within
  the activation budget (2 pp chunk activations = 1F1B's memory), else a pending W.
* Interleaved across units (``interleaved_units``): a multi-unit pipeline whose LLM
  unit holds ``vpp`` virtual stages per rank (LLM stage j on the unit's row j mod pp,
  the other units one stage per row), ordered by the same list scheduling with each
  I taken as the whole backward (B) and the W's dropped.
"""

from __future__ import annotations

from .actions import Action, Kind, Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def gpipe(pp: int, microbatches: int) -> Schedule:
    rows = [
        [Action(r, Kind.F, k) for k in range(microbatches)] + [Action(r, Kind.B, k) for k in range(microbatches)]
        for r in range(pp)
    ]
    return Schedule("gpipe", microbatches, list(range(pp)), rows)


def _one_f_one_b_row(rank: int, pp: int, m: int, split: bool, w_delay: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    row = [Action(rank, Kind.F, k) for k in range(warmup)]
    backward = Kind.I if split else Kind.B
    pending_w: list[int] = []

    def do_backward(k: int) -> None:
        row.append(Action(rank, backward, k))
        if split:
            pending_w.append(k)
            if len(pending_w) > w_delay:
                row.append(Action(rank, Kind.W, pending_w.pop(0)))

    for i in range(m - warmup):
        row.append(Action(rank, Kind.F, warmup + i))
        do_backward(i)
    for k in range(m - warmup, m):
        do_backward(k)
    row += [Action(rank, Kind.W, k) for k in pending_w]
    return row


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    rows = [_one_f_one_b_row(r, pp, microbatches, split=False, w_delay=0) for r in range(pp)]
    return Schedule("1f1b", microbatches, list(range(pp)), rows)


def zb_h1(pp: int, microbatches: int) -> Schedule:
    rows = [_one_f_one_b_row(r, pp, microbatches, split=True, w_delay=r) for r in range(pp)]
    return Schedule("zb_h1", microbatches, list(range(pp)), rows)


def interleaved_1f1b(pp: int, microbatches: int, vpp: int) -> Schedule:
    if microbatches % pp:
        raise ValueError(f"interleaved 1F1B needs schedule.microbatches ({microbatches}) to be a multiple of pp ({pp})")
    total = microbatches * vpp

    def forward_of(step: int, rank: int) -> Action:
        chunk = (step // pp) % vpp
        microbatch = (step // (pp * vpp)) * pp + step % pp
        return Action(chunk * pp + rank, Kind.F, microbatch)

    def backward_of(step: int, rank: int) -> Action:
        chunk = vpp - 1 - (step // pp) % vpp
        microbatch = (step // (pp * vpp)) * pp + step % pp
        return Action(chunk * pp + rank, Kind.B, microbatch)

    rows = []
    for rank in range(pp):
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
        row = [forward_of(step, rank) for step in range(warmup)]
        for i in range(total - warmup):
            row += [forward_of(warmup + i, rank), backward_of(i, rank)]
        row += [backward_of(i, rank) for i in range(total - warmup, total)]
        rows.append(row)
    placement = [s % pp for s in range(pp * vpp)]
    return Schedule("interleaved_1f1b", microbatches, placement, rows, meta={"vpp": vpp})


def zbv(pp: int, microbatches: int) -> Schedule:
    placement = [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    rows = _list_schedule(placement, microbatches, budget=2 * pp)
    return Schedule("zbv", microbatches, placement, rows, meta={"vpp": 2})


def _list_schedule(placement: list[int], m: int, budget: int) -> list[list[Action]]:
    """Greedy unit-time list scheduling with split backward (see the module docstring)."""
    ranks = max(placement) + 1
    last = len(placement) - 1
    stages_of = [[s for s, r in enumerate(placement) if r == rank] for rank in range(ranks)]
    done: dict[Action, int] = {}  # action -> finish time
    next_f = {s: 0 for s in range(len(placement))}
    next_i = {s: 0 for s in range(len(placement))}
    pending_w: list[list[Action]] = [[] for _ in range(ranks)]
    held = [0] * ranks
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    total = 3 * m * len(placement)
    time = 0
    while sum(len(row) for row in rows) < total:
        started = []
        for rank in range(ranks):
            choice = None
            for stage in sorted(stages_of[rank], reverse=True):  # deeper stage first: unblocks sooner
                k = next_i[stage]
                if k < m and Action(stage, Kind.F, k) in done:
                    grad = Action(stage + 1, Kind.I, k)
                    if stage == last or done.get(grad, time + 1) <= time:
                        choice = Action(stage, Kind.I, k)
                        break
            if choice is None and held[rank] < budget:
                for stage in sorted(stages_of[rank], reverse=True):
                    k = next_f[stage]
                    if k < m and (stage == 0 or done.get(Action(stage - 1, Kind.F, k), time + 1) <= time):
                        choice = Action(stage, Kind.F, k)
                        break
            if choice is None and pending_w[rank]:
                choice = pending_w[rank].pop(0)
            if choice is not None:
                started.append((rank, choice))
        if not started and time > total * 4:
            raise RuntimeError("list scheduling made no progress")
        for rank, action in started:
            rows[rank].append(action)
            done[action] = time + 1
            if action.kind == Kind.F:
                next_f[action.stage] += 1
                held[rank] += 1
            elif action.kind == Kind.I:
                next_i[action.stage] += 1
                pending_w[rank].append(Action(action.stage, Kind.W, action.microbatch))
            else:
                held[rank] -= 1
        time += 1
    return rows


def interleaved_units(units: list[tuple[int, int]], microbatches: int) -> Schedule:
    """The schedule of a multi-unit pipeline, ``units`` = (pipeline rows, stages per row) per unit in data-flow
    order: a unit with ``v`` stages per row loops over its rows (stage j on row j mod rows) like interleaved 1F1B.
    Activation budget: one in flight per stage, 1F1B's first-rank memory counted in chunks."""
    placement, first = [], 0
    for rows, per_row in units:
        placement += [first + j % rows for j in range(rows * per_row)]
        first += rows
    split = _list_schedule(placement, microbatches, budget=len(placement))
    rows = [
        [Action(a.stage, Kind.B, a.microbatch) if a.kind == Kind.I else a for a in row if a.kind != Kind.W]
        for row in split
    ]
    vpp = max(per_row for _, per_row in units)
    return Schedule("interleaved_1f1b", microbatches, placement, rows, meta={"vpp": vpp})


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """The named schedule; raises ValueError with the fix for impossible requests."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is unknown; available: {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1:
        raise ValueError(f"pp={pp} and microbatches={microbatches} must be at least 1")
    if name == "interleaved_1f1b":
        if vpp < 2:
            raise ValueError("interleaved_1f1b needs schedule.vpp >= 2 (virtual stages per rank); use 1f1b for vpp=1")
        return interleaved_1f1b(pp, microbatches, vpp)
    if vpp not in (1, 2) or (vpp == 2 and name != "zbv"):
        raise ValueError(
            f"schedule={name} places {'2' if name == 'zbv' else '1'} stage(s) per rank; got schedule.vpp={vpp}"
        )
    if name == "zbv":
        return zbv(pp, microbatches)
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}[name](pp, microbatches)
