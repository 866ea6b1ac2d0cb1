"""Encoder work in the LLM pipeline's bubbles (Optimus, DistMM): a schedule in which the image encoder's
forwards and backwards are actions of their own, placed into the ranks' idle time.

Placement. The encoder's blocks are cut into one chunk per pipeline rank (Optimus's split placement, no
replicas): schedule stages ``0 .. P-1`` are the encoder's chunks, chunk ``r`` on rank ``r``, and stages
``P .. 2P-1`` are the base schedule's stages (LLM stage ``s`` on rank ``s``). The last chunk's embeddings reach
the LLM's first stage on rank 0 the way an interleaved schedule wraps from one loop of chunks into the next,
so the data flow stays a chain of stages and the executor, the transfer plan and the NCCL-rule replay run it
unchanged. A colocated encoder without bubble filling is the same work on rank 0 alone.

Order. Each rank keeps the base schedule's order of its LLM actions; each encoder chunk runs its forwards and
backwards in microbatch order. A timed list scheduler (the durations are given: the stage costs) inserts the
encoder's actions: whenever a rank is free it starts, among the actions ready then,

1. an encoder forward of a microbatch fewer than ``lead`` ahead of the LLM's first stage (it is on the way to
   being needed);
2. an encoder backward, when ``eager_backward`` (it frees that microbatch's encoder activations);
3. the rank's next LLM action;
4. an encoder backward, then an encoder forward (bubble filling).

Encoder chunks in flight on a rank are capped at P times the base schedule's peak on its first rank: as many
encoder activation bytes as the colocated schedule keeps there (a chunk is 1/P of the encoder; a chunk's
activations live longer than the colocated encoder's, from its forward until the gradient has come back
through the LLM and the later chunks). ``fill_bubbles`` tries six policies (``lead`` 0, 1 or 2, eager or not)
and keeps the one with the shortest step, then the fewest activations in flight. The list scheduler places each
action when its rank is free and its inputs have arrived, as the simulator times a schedule, so its own finish
time is the simulated step (tests/unit/test_bubble_fill.py holds them equal). On 54 cases (2-8 ranks, 1-4
microbatches per rank, the encoder 0.25-3 LLM stages, the last stage 1-2x the others) the six found the best
of twelve that also tried filling only where the filler ends before the LLM's next action is ready.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .actions import Action, Kind, Schedule
from .simulator import DurationFn, ScheduleError, dependencies, peak_activations

FILLABLE = ("gpipe", "1f1b")  # one stage per rank, whole backwards: the schedules whose bubbles this fills
LEADS = (0, 1, 2)  # how far encoder forwards may run ahead of the LLM's first stage: the policies tried


@dataclass(frozen=True)
class StageDurations:
    """Seconds (or any unit) of one microbatch's forward and full backward per schedule stage."""

    forward: list[float]
    backward: list[float]

    def __call__(self, action: Action) -> float:
        return self.forward[action.stage] if action.kind == Kind.F else self.backward[action.stage]


@dataclass(frozen=True)
class FillPolicy:
    lead: int
    eager_backward: bool


def fillable(base: Schedule) -> str | None:
    """Why ``base`` has no bubbles this can fill (None: it has)."""
    if base.num_ranks < 2:
        return "a one-stage pipeline has no bubbles to fill"
    if base.stage_to_rank != list(range(base.num_ranks)) or base.uses_split_backward() or base.forward_only:
        return (
            f"schedule {base.name!r} is not one stage per rank with whole backwards; bubble filling starts from "
            f"{' or '.join(FILLABLE)}"
        )
    return None


def fill_bubbles(base: Schedule, durations: DurationFn, p2p: float = 0.0, forward_only: int = 0) -> Schedule:
    """``base`` (gpipe or 1f1b over P ranks) with P encoder chunks placed ahead of its stages and their actions
    list-scheduled into its bubbles. ``durations`` covers the 2P stages of the result (encoder chunks first);
    the first ``forward_only`` chunks (frozen, nothing trainable before them) get no backward."""
    reason = fillable(base)
    if reason is not None:
        raise ScheduleError(reason)
    best, best_key = None, None
    for lead in LEADS:
        for eager in (False, True):
            schedule, makespan = _list_fill(base, durations, p2p, forward_only, FillPolicy(lead, eager))
            key = (makespan, max(peak_activations(schedule)))
            if best_key is None or key < best_key:
                best, best_key = schedule, key
    return best


def _list_fill(
    base: Schedule, durations: DurationFn, p2p: float, forward_only: int, policy: FillPolicy
) -> tuple[Schedule, float]:
    """The filled schedule under ``policy`` and its step time (each action at the earliest its rank and inputs
    allow: what the simulator gives this order)."""
    ranks, m = base.num_ranks, base.num_microbatches
    last = 2 * ranks - 1
    queues = {
        "llm": [deque(Action(a.stage + ranks, a.kind, a.microbatch) for a in base.compute(r)) for r in range(ranks)],
        "enc_b": [
            deque(Action(r, Kind.B, k) for k in range(m)) if r >= forward_only else deque() for r in range(ranks)
        ],
        "enc_f": [deque(Action(r, Kind.F, k) for k in range(m)) for r in range(ranks)],
    }
    budget = min(m, ranks * peak_activations(base)[0])  # chunks of 1/P: the colocated first rank's encoder bytes
    finish: dict[Action, float] = {}
    where: dict[Action, int] = {}
    free = [0.0] * ranks
    held = [0] * ranks
    fed = 0  # forwards of the LLM's first stage placed so far
    rows: list[list[Action]] = [[] for _ in range(ranks)]

    arrival: dict[Action, float] = {}  # when an action's inputs are all there (fixed once they are)

    def ready(action: Action, rank: int) -> float | None:
        inputs = arrival.get(action)
        if inputs is None:
            deps = dependencies(action, last)
            if any(dep not in finish for dep in deps):
                return None
            inputs = arrival[action] = max(
                (finish[dep] + (p2p if where[dep] != rank else 0.0) for dep in deps), default=0.0
            )
        return max(free[rank], inputs)

    remaining = sum(len(q) for lists in queues.values() for q in lists)
    choices: list = [None] * ranks
    stale = set(range(ranks))  # ranks whose next choice may have changed: a neighbour's action feeds theirs
    while remaining:
        for rank in stale:
            choices[rank] = _choose(rank, queues, ready, policy, held[rank] < budget, fed)
        pick = None
        for rank, choice in enumerate(choices):
            if choice is not None and (pick is None or choice[0] < pick[0]):
                pick = (choice[0], rank, choice[1])
        if pick is None:
            stuck = [str(q[0]) for lists in queues.values() for q in lists if q]
            raise ScheduleError(f"bubble filling of {base.name!r} made no progress ({', '.join(stuck)})")
        start, rank, action = pick
        for lists in queues.values():
            if lists[rank] and lists[rank][0] == action:
                lists[rank].popleft()
        finish[action], where[action] = start + durations(action), rank
        free[rank] = finish[action]
        rows[rank].append(action)
        remaining -= 1
        if action.stage < ranks and action.stage >= forward_only:
            held[rank] += 1 if action.kind == Kind.F else -1
        first_llm_forward = action.stage == ranks and action.kind == Kind.F
        fed += first_llm_forward
        stale = set(range(ranks)) if first_llm_forward else {rank, (rank + 1) % ranks, (rank - 1) % ranks}
    meta = {"encoder_stages": ranks, "base": base.name, "forward_only": tuple(range(forward_only))}
    meta["fill_policy"] = (policy.lead, policy.eager_backward)
    return Schedule(f"{base.name}+fill", m, list(range(ranks)) * 2, rows, meta), max(free)


def _choose(rank, queues, ready, policy: FillPolicy, room: bool, fed: int):
    """(start, action) this rank runs next under ``policy``, or None when nothing it holds can start yet."""
    llm = queues["llm"][rank][0] if queues["llm"][rank] else None
    back = queues["enc_b"][rank][0] if queues["enc_b"][rank] else None
    fore = queues["enc_f"][rank][0] if queues["enc_f"][rank] and room else None
    times = {a: ready(a, rank) for a in (llm, back, fore) if a is not None}
    times = {a: t for a, t in times.items() if t is not None}
    if not times:
        return None
    now = min(times.values())
    urgent = fore is not None and times.get(fore) == now and fore.microbatch < fed + policy.lead
    order = [fore] if urgent else []
    order += [back] if policy.eager_backward else []
    order += [llm, back, fore]
    return next((now, a) for a in order if a is not None and times.get(a) == now)


def balance_blocks(loads: list[float], per_block: float, blocks: int) -> tuple[int, ...]:
    """Blocks per chunk: each rank's chunk keeps one (the first embeds, the last projects), then each further block
    goes to the rank whose load (its other work plus its chunk so far) is least, the lower rank on ties."""
    counts, load = [1] * len(loads), [x + per_block for x in loads]
    for _ in range(blocks - len(loads)):
        lightest = min(range(len(loads)), key=lambda r: (load[r], r))
        counts[lightest] += 1
        load[lightest] += per_block
    return tuple(counts)
