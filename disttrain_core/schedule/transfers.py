"""The point-to-point transfers of one pipeline step, planned before anything is posted.

Every rank runs the actions of one schedule row. Around each action it moves
tensors: before a forward it receives the activation of the previous stage,
before a backward the gradient of what it sent; after a forward it sends the
activation on, after a backward the input gradient back. A routing (the
communication broker, parallel/broker.py, or ``RowRouting`` when every row is
one rank) says which rows of a tensor go to which rank.

``plan_rank`` turns that into a ``Step`` per action: the batches of receives to
post before it (one per source rank) and the sends to post right after it (one
per target rank). The executor (executor.py) runs exactly this plan and the
validator replays every rank's plan under NCCL's rules (replay.py), so what is
checked before launch is what runs.

The rules that make the plan safe under NCCL (blocking sends, one FIFO stream
per communicator, one completion handle per ``batch_isend_irecv`` call):

* every ordered pair of ranks (source -> target) has a communicator of its own,
  carrying only that direction: a send never waits behind a receive, and a
  rank's traffic with one peer never waits behind another peer's;
* a rank receives from a source in the order the source sends (it receives
  earlier pieces early and keeps them until used), so each communicator's
  sends and receives match one to one, in order;
* sends are posted as soon as their tensor exists and waited for only at the
  end of the step; receives are waited for (on the GPU: a stream dependency)
  before the action that needs them.

Under these rules a rank can only wait for data another rank has yet to
compute, so a schedule deadlocks on NCCL only if its data flow does, which the
simulator rejects; the replay checks the plan itself.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Protocol

from .actions import Action, Kind, Schedule
from .simulator import ScheduleError

ACT, GRAD = "act", "grad"  # a forward activation travelling up, an input gradient travelling down


class Piece(Protocol):
    rank: int  # the peer
    rows: range  # rows of this side's tensor


class Routing(Protocol):
    """What the plan needs to know about who holds which rows (parallel/broker.py's CommBroker)."""

    def ranks_of_row(self, row: int) -> list[int]: ...

    def outgoing(self, kind: str, stage: int, k: int, rank: int) -> list[Piece]: ...

    def incoming(self, kind: str, stage: int, k: int, rank: int) -> list[Piece]: ...


@dataclass(frozen=True)
class RowPiece:
    rank: int
    rows: range


class RowRouting:
    """Every schedule row is one rank holding whole tensors (one pipeline, no data or tensor parallelism)."""

    def __init__(self, schedule: Schedule, rows: int = 1):
        self.schedule = schedule
        self.rows = rows  # rows of every boundary tensor (any positive number: only their count matters)

    def ranks_of_row(self, row: int) -> list[int]:
        return [row]

    def _peer(self, stage: int) -> int:
        return self.schedule.stage_to_rank[stage]

    def outgoing(self, kind: str, stage: int, k: int, rank: int) -> list[RowPiece]:
        target = stage + 1 if kind == ACT else stage - 1
        return [RowPiece(self._peer(target), range(self.rows))]

    def incoming(self, kind: str, stage: int, k: int, rank: int) -> list[RowPiece]:
        source = stage - 1 if kind == ACT else stage + 1
        return [RowPiece(self._peer(source), range(self.rows))]


@dataclass(frozen=True)
class Transfer:
    """One piece of one boundary tensor travelling from ``source`` to ``target``."""

    kind: str  # ACT or GRAD
    stage: int  # the stage that consumes it
    microbatch: int
    source: int
    target: int
    rows: range  # rows of the producer's tensor

    @property
    def key(self) -> tuple[str, int, int, int]:
        """How the consumer files it until used: (kind, stage, microbatch, source)."""
        return (self.kind, self.stage, self.microbatch, self.source)

    def __str__(self) -> str:
        what = "activation" if self.kind == ACT else "gradient"
        return f"{what} for stage {self.stage} microbatch {self.microbatch} ({self.source}->{self.target})"


@dataclass
class Step:
    action: Action
    receives: dict[int, list[Transfer]] = field(default_factory=dict)  # source rank -> batch, in its send order
    sends: list[Transfer] = field(default_factory=list)  # to other ranks, right after the action
    local: list[Transfer] = field(default_factory=list)  # to this rank's own next stage (no communication)


def produces(action: Action, last_stage: int, forward_only: frozenset[int] = frozenset()) -> tuple[str, int] | None:
    """(kind, consuming stage) of the tensor an action hands on, if any (no gradient to a forward-only stage)."""
    if action.kind == Kind.F and action.stage < last_stage:
        return ACT, action.stage + 1
    if action.kind in (Kind.B, Kind.I) and action.stage > 0 and action.stage - 1 not in forward_only:
        return GRAD, action.stage - 1
    return None


def needs(action: Action, last_stage: int) -> tuple[str, int, int] | None:
    """(kind, stage, microbatch) of the tensor an action consumes from another stage, if any."""
    if action.kind == Kind.F and action.stage > 0:
        return ACT, action.stage, action.microbatch
    if action.kind in (Kind.B, Kind.I) and action.stage < last_stage:
        return GRAD, action.stage, action.microbatch
    return None


def outgoing_transfers(schedule: Schedule, routing: Routing, action: Action, rank: int) -> list[Transfer]:
    made = produces(action, schedule.num_stages - 1, schedule.forward_only)
    if made is None:
        return []
    kind, target = made
    return [
        Transfer(kind, target, action.microbatch, rank, piece.rank, piece.rows)
        for piece in routing.outgoing(kind, action.stage, action.microbatch, rank)
    ]


def incoming_channels(schedule: Schedule, routing: Routing, row: int, rank: int) -> dict[int, deque[Transfer]]:
    """For each source rank, the transfers it will send ``rank`` this step, in its send order."""
    mine = set(schedule.stages_of(row))
    last = schedule.num_stages - 1
    neighbours = {schedule.stage_to_rank[s + d] for s in mine for d in (-1, 1) if 0 <= s + d <= last}
    channels: dict[int, deque[Transfer]] = defaultdict(deque)
    for peer_row in sorted(neighbours):
        actions = schedule.compute(peer_row)
        for peer in routing.ranks_of_row(peer_row):
            if peer == rank:
                continue
            for action in actions:
                made = produces(action, last, schedule.forward_only)
                if made is None or made[1] not in mine:
                    continue
                for transfer in outgoing_transfers(schedule, routing, action, peer):
                    if transfer.target == rank:
                        channels[peer].append(transfer)
    return channels


def plan_rank(
    schedule: Schedule, routing: Routing, row: int, rank: int, channels: dict[int, deque[Transfer]] | None = None
) -> list[Step]:
    """The steps of ``rank`` (running schedule ``row``) for one optimizer step."""
    last = schedule.num_stages - 1
    if channels is None:
        channels = incoming_channels(schedule, routing, row, rank)
    received: set[tuple[str, int, int, int]] = set()
    steps = []
    for action in schedule.compute(row):
        step = Step(action)
        wanted = needs(action, last)
        if wanted is not None:
            kind, stage, k = wanted
            for piece in routing.incoming(kind, stage, k, rank):
                key = (kind, stage, k, piece.rank)
                if piece.rank == rank or key in received:
                    continue
                batch = step.receives.setdefault(piece.rank, [])
                channel = channels[piece.rank]
                while True:  # everything the source sends before the piece needed now comes first
                    if not channel:
                        raise ScheduleError(
                            f"rank {rank} waits for {kind} of stage {stage} microbatch {k} that rank {piece.rank} "
                            "never sends"
                        )
                    transfer = channel.popleft()
                    batch.append(transfer)
                    received.add(transfer.key)
                    if transfer.key == key:
                        break
        for transfer in outgoing_transfers(schedule, routing, action, rank):
            (step.local if transfer.target == rank else step.sends).append(transfer)
        steps.append(step)
    return steps


def plan_all(schedule: Schedule, routing: Routing) -> dict[int, list[Step]]:
    """Every rank's plan, keyed by global rank (every transfer is listed once, by its source)."""
    channels: dict[int, dict[int, deque[Transfer]]] = defaultdict(lambda: defaultdict(deque))
    rows = {}
    for row in range(schedule.num_ranks):
        actions = schedule.compute(row)
        for rank in routing.ranks_of_row(row):
            rows[rank] = row
            for action in actions:
                for transfer in outgoing_transfers(schedule, routing, action, rank):
                    if transfer.target != rank:
                        channels[transfer.target][rank].append(transfer)
    return {rank: plan_rank(schedule, routing, row, rank, channels[rank]) for rank, row in rows.items()}


def channel_pairs(schedule: Schedule, routing: Routing) -> list[tuple[int, int]]:
    """Every (source, target) pair of ranks that exchanges a tensor, sorted: each gets a communicator."""
    pairs = set()
    for rank, steps in plan_all(schedule, routing).items():
        for step in steps:
            pairs.update((rank, t.target) for t in step.sends)
    return sorted(pairs)
