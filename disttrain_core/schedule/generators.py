"""Schedule generators: GPipe, 1F1B, interleaved 1F1B (depth- and breadth-first), ZB-H1, ZB-H2, ZBV, DualPipeV.

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
* Breadth-first interleaved 1F1B (the Playbook's; Megatron's order with its microbatch
  group per virtual stage set to all m microbatches): every microbatch goes through
  chunk 0 before any enters chunk 1; warm-up (pp - r - 1) * 2 + (vpp - 1) * m. Same
  bubble as depth-first, more activations in flight (up to m * vpp on rank 0); what
  it buys is that each chunk's backwards run back to back, so a chunk's gradients
  are final -- and their data-parallel reduction can start -- after 1/vpp of the
  backward phase instead of at its end.
* ZB-H1 (zero bubble, same peak memory as 1F1B's first rank): the 1F1B order with
  each backward split into I (input gradient, on the critical path) and W (weight
  gradient, off it). Rank r keeps its W's r microbatches behind its I's, so the
  held-back W's fill the drain-phase waits; bubble (pp-1)(t_F+t_I-t_W) per rank.
* ZB-H2 (zero bubble for 2 pp - 1 activations): the same list scheduling as ZBV on one
  stage per rank with an activation budget of 2 pp - 1 microbatches: rank r warms up
  with 2 (pp - r) - 1 forwards, and the W's it holds back fill the drain, so every
  rank runs without an idle slot from its first action to its last (a parallelogram:
  consecutive steps tile when the optimizer step does not synchronize the ranks).
  Needs m >= 2 pp - 1 to fill the warm-up.
* DualPipeV (DeepSeek-V3's DualPipe cut in half; torch's ScheduleDualPipeV): the V
  placement, m >= 2 pp, in DualPipe's eight phases -- chunk-0 warm-up, F0 F1 pairs,
  I1 W1 F1 (zero bubble), the main F0&B1 / F1&B0 overlapped pairs, B1 F1&B0, B1 B0
  with half of them split, W B0, and the held-back W's. The F&B pairs are recorded in
  ``meta["overlap"]``: the simulator can time each pair as one overlapped unit (what
  DualPipe's bubble formula assumes); the executor runs the two in sequence.
* ZBV: built by list scheduling with unit durations on the V placement: a free
  rank runs a ready I first (it unblocks the previous stage), else a ready F within
  the activation budget (2 pp chunk activations = 1F1B's memory), else a pending W.
* Interleaved across units (``interleaved_units``): a multi-unit pipeline whose LLM
  unit holds ``vpp`` virtual stages per rank (LLM stage j on the unit's row j mod pp,
  the other units one stage per row), ordered by the same list scheduling with each
  I taken as the whole backward (B) and the W's dropped.
"""

from __future__ import annotations

from collections import deque

from .actions import Action, Kind, Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "breadth_first", "zb_h1", "zb_h2", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zb_h1", "zb_h2", "zbv", "dualpipev")  # run weight gradients (W) apart from the input's (I)
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank in a V
LOOPED = ("interleaved_1f1b", "breadth_first")  # schedule.vpp stages per rank in a loop
# What planner.schedules may name (planner/schedule_choice.py); not gpipe: 1F1B's bubble with every activation held
PLANNABLE = tuple(name for name in SCHEDULES if name != "gpipe")


def stages_per_rank(name: str, vpp: int) -> int:
    """Stages each rank holds under the named schedule (``vpp``: schedule.vpp)."""
    return vpp if name in LOOPED else 2 if name in V_SHAPED else 1


def min_microbatches(name: str, pp: int) -> int:
    """The fewest microbatches per step the named schedule runs on ``pp`` ranks (what its generator checks and
    the planner's candidates ask): breadth-first fills its loop with pp, ZB-H2 its warm-up with 2pp - 1, DualPipeV
    its two directions with 2pp."""
    return {"breadth_first": pp, "zb_h2": 2 * pp - 1, "dualpipev": 2 * pp}.get(name, 1)


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


def interleaved_1f1b(
    pp: int, microbatches: int, vpp: int, group: int | None = None, name: str = "interleaved_1f1b"
) -> Schedule:
    """Looped 1F1B: depth-first with ``group`` = pp (Megatron's default), breadth-first with ``group`` = m."""
    group = group or pp
    if microbatches % group:
        raise ValueError(f"interleaved 1F1B needs schedule.microbatches ({microbatches}) to be a multiple of pp ({pp})")
    total = microbatches * vpp

    def slot(step: int) -> tuple[int, int]:  # (chunk, microbatch) of a rank's step-th forward
        return (step // group) % vpp, (step // (group * vpp)) * group + step % group

    rows = []
    for rank in range(pp):
        forwards = [Action(c * pp + rank, Kind.F, k) for c, k in map(slot, range(total))]
        backwards = [Action((vpp - 1 - c) * pp + rank, Kind.B, k) for c, k in map(slot, range(total))]
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * group, total)
        row = forwards[:warmup]
        for i in range(total - warmup):
            row += [forwards[warmup + i], backwards[i]]
        rows.append(row + backwards[total - warmup :])
    placement = [s % pp for s in range(pp * vpp)]
    return Schedule(name, microbatches, placement, rows, meta={"vpp": vpp})


def breadth_first(pp: int, microbatches: int, vpp: int) -> Schedule:
    if microbatches < min_microbatches("breadth_first", pp):
        raise ValueError(
            f"breadth_first needs at least pp ({pp}) microbatches per step to fill the loop, got {microbatches}; "
            "raise optim.global_batch_size or lower optim.micro_batch_size"
        )
    return interleaved_1f1b(pp, microbatches, vpp, group=microbatches, name="breadth_first")


def zb_h2(pp: int, microbatches: int) -> Schedule:
    if microbatches < min_microbatches("zb_h2", pp):
        raise ValueError(
            f"zb_h2 needs at least 2 x pp - 1 = {2 * pp - 1} microbatches per step to fill its warm-up, got "
            f"{microbatches}; raise optim.global_batch_size, lower optim.micro_batch_size, or use zb_h1"
        )
    rows = _list_schedule(list(range(pp)), microbatches, budget=2 * pp - 1)
    return Schedule("zb_h2", microbatches, list(range(pp)), rows)


def dualpipev(pp: int, microbatches: int) -> Schedule:
    m = microbatches
    if m < min_microbatches("dualpipev", pp):
        raise ValueError(
            f"dualpipev needs at least 2 x pp = {2 * pp} microbatches per step, got {m}; raise "
            "optim.global_batch_size or lower optim.micro_batch_size"
        )
    placement = [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    rows, overlap = [], []
    for rank in range(pp):
        row, pairs = _dualpipev_row(rank, pp, m)
        rows.append(row)
        overlap += pairs
    return Schedule("dualpipev", m, placement, rows, meta={"vpp": 2, "overlap": overlap})


def _dualpipev_row(r: int, pp: int, m: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """Rank r's DualPipeV order; chunk 0 is stage r (down the V), chunk 1 stage 2 pp - 1 - r (back up)."""
    stage, forwards, backwards = (r, 2 * pp - 1 - r), [0, 0], [0, 0]
    row: list[Action] = []
    held_w: list[Action] = []
    pairs: list[tuple[Action, Action]] = []

    def f(chunk: int) -> Action:
        row.append(Action(stage[chunk], Kind.F, forwards[chunk]))
        forwards[chunk] += 1
        return row[-1]

    def b(chunk: int, split: bool = False) -> Action:
        row.append(Action(stage[chunk], Kind.I if split else Kind.B, backwards[chunk]))
        backwards[chunk] += 1
        if split:
            held_w.append(Action(stage[chunk], Kind.W, row[-1].microbatch))
        return row[-1]

    def w() -> None:
        row.append(held_w.pop(0))

    for _ in range(2 * (pp - r - 1)):  # 1: chunk-0 warm-up
        f(0)
    for _ in range(r + 1):  # 2: both chunks
        f(0)
        f(1)
    for _ in range(pp - r - 1):  # 3: I1 W1 F1, zero bubble
        b(1, split=True)
        w()
        f(1)
    for _ in range(m - 2 * pp + r + 1):  # 4: main, F0&B1 then F1&B0
        pairs.append((f(0), b(1)))
        pairs.append((f(1), b(0)))
    for _ in range(pp - r - 1):  # 5: B1, F1&B0
        b(1)
        pairs.append((f(1), b(0)))
    split = False
    for i in range(r + 1):  # 6: B1 B0, the second half split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        b(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        b(0, split)
    for _ in range(pp - r - 1):  # 7: W, B0 split
        w()
        b(0, split=True)
    for _ in range(r + 1):  # 8: the held-back W's
        w()
    return row, pairs


def zbv(pp: int, microbatches: int) -> Schedule:
    placement = [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    rows = _list_schedule(placement, microbatches, budget=2 * pp)
    return Schedule("zbv", microbatches, placement, rows, meta={"vpp": 2})


def _list_schedule(placement: list[int], m: int, budget: int) -> list[list[Action]]:
    """Greedy unit-time list scheduling with split backward (see the module docstring)."""
    ranks = max(placement) + 1
    last = len(placement) - 1
    stages_of = [sorted((s for s, r in enumerate(placement) if r == rank), reverse=True) for rank in range(ranks)]
    done: dict[Action, int] = {}  # action -> finish time
    next_f = {s: 0 for s in range(len(placement))}
    next_i = {s: 0 for s in range(len(placement))}
    pending_w: list[deque[Action]] = [deque() for _ in range(ranks)]
    held = [0] * ranks
    rows: list[list[Action]] = [[] for _ in range(ranks)]
    total = 3 * m * len(placement)
    time = placed = 0
    while placed < total:
        started = []
        for rank in range(ranks):
            choice = None
            for stage in stages_of[rank]:  # deeper stage first: unblocks sooner
                k = next_i[stage]
                if k < m and Action(stage, Kind.F, k) in done:
                    grad = Action(stage + 1, Kind.I, k)
                    if stage == last or done.get(grad, time + 1) <= time:
                        choice = Action(stage, Kind.I, k)
                        break
            if choice is None and held[rank] < budget:
                for stage in stages_of[rank]:
                    k = next_f[stage]
                    if k < m and (stage == 0 or done.get(Action(stage - 1, Kind.F, k), time + 1) <= time):
                        choice = Action(stage, Kind.F, k)
                        break
            if choice is None and pending_w[rank]:
                choice = pending_w[rank].popleft()
            if choice is not None:
                started.append((rank, choice))
        if not started and time > total * 4:
            raise RuntimeError("list scheduling made no progress")
        placed += len(started)
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
    if name in LOOPED:
        if vpp < 2:
            raise ValueError(f"{name} needs schedule.vpp >= 2 (virtual stages per rank); use 1f1b for vpp=1")
        return (interleaved_1f1b if name == "interleaved_1f1b" else breadth_first)(pp, microbatches, vpp)
    if vpp not in (1, stages_per_rank(name, vpp)):  # the V-shaped ones place 2 whatever vpp=1 asks
        raise ValueError(
            f"schedule={name} places {stages_per_rank(name, vpp)} stage(s) per rank; got schedule.vpp={vpp}"
        )
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_h2": zb_h2, "zbv": zbv, "dualpipev": dualpipev}
    return builders[name](pp, microbatches)
