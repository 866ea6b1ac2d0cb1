"""Replay every rank's point-to-point posts under NCCL's rules, to find deadlocks before launch.

gloo forgives what NCCL does not. Under NCCL (and so here):

* a ``batch_isend_irecv`` call is one group with one completion: it is done
  only when every send and receive in it has met its match on the peer, and
  waiting for any part of it waits for all of it;
* a send does not complete until the peer has posted the matching receive
  (NCCL sends block; gloo buffers them);
* each rank's calls on one communicator run one after another, in the order
  they were posted (one FIFO stream per communicator);
* the k-th send from A to B on a communicator meets the k-th receive from A at
  B on that communicator, whatever the two carry;
* a call can start only once the computation posted before it has run (its
  sends read that computation's output).

A rank's program is a list of ``Post``, ``Wait`` and ``Compute`` items in the
order the executor issues them. ``replay`` runs all programs until nothing can
move and raises ``ScheduleError`` if some rank is left waiting, naming where
each stuck rank is and what it waits for; it also rejects a communicator whose
k-th send and k-th receive are different transfers (data would land in the
wrong buffer).

``executor_programs`` turns the transfer plans (transfers.py) into the programs
the executor runs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from .actions import Action
from .simulator import ScheduleError
from .transfers import Step, Transfer


@dataclass
class Call:
    """One ``batch_isend_irecv`` call: operations on a single communicator."""

    rank: int
    communicator: Hashable
    sends: list[Transfer] = field(default_factory=list)
    receives: list[Transfer] = field(default_factory=list)
    started: bool = False
    done: bool = False
    after_compute: int = 0  # compute items of this rank that must have run before the call starts


@dataclass(frozen=True)
class Post:
    call: Call


@dataclass(frozen=True)
class Wait:
    call: Call


@dataclass(frozen=True)
class Compute:
    action: Action


Item = Post | Wait | Compute


def executor_programs(plans: dict[int, list[Step]]) -> dict[int, list[Item]]:
    """The executor's post order: per step, one receive call per source (each on the source->rank
    communicator) and a wait for each, the action, then one send call per target (on rank->target);
    at the end of the step a wait for every send."""
    programs: dict[int, list[Item]] = {}
    for rank, steps in plans.items():
        items: list[Item] = []
        sends: list[Call] = []
        for step in steps:
            calls = [Call(rank, (source, rank), receives=list(batch)) for source, batch in step.receives.items()]
            items += [Post(call) for call in calls] + [Wait(call) for call in calls]
            items.append(Compute(step.action))
            for transfer in step.sends:
                call = Call(rank, (rank, transfer.target), sends=[transfer])
                items.append(Post(call))
                sends.append(call)
        items += [Wait(call) for call in sends]
        programs[rank] = items
    return programs


def _match(programs: dict[int, list[Item]]) -> dict[int, Call]:
    """id(call) -> the call holding the peer operation of each of its operations, checking the order."""
    sends: dict[tuple, list[tuple[Transfer, Call]]] = defaultdict(list)
    receives: dict[tuple, list[tuple[Transfer, Call]]] = defaultdict(list)
    for items in programs.values():
        for item in items:
            if isinstance(item, Post):
                call = item.call
                for t in call.sends:
                    sends[(call.communicator, t.source, t.target)].append((t, call))
                for t in call.receives:
                    receives[(call.communicator, t.source, t.target)].append((t, call))
    partners: dict[int, list[Call]] = defaultdict(list)
    for channel in set(sends) | set(receives):
        out, into = sends.get(channel, []), receives.get(channel, [])
        communicator, source, target = channel
        if len(out) != len(into):
            raise ScheduleError(
                f"rank {source} sends {len(out)} tensor(s) to rank {target} on communicator {communicator} "
                f"but rank {target} posts {len(into)} receive(s)"
            )
        for (sent, send_call), (expected, receive_call) in zip(out, into, strict=True):
            if (sent.kind, sent.stage, sent.microbatch, len(sent.rows)) != (
                expected.kind,
                expected.stage,
                expected.microbatch,
                len(expected.rows),
            ):
                raise ScheduleError(
                    f"on communicator {communicator} rank {target} receives {sent} into the buffer for {expected}"
                )
            partners[id(send_call)].append(receive_call)
            partners[id(receive_call)].append(send_call)
    return partners


def replay(programs: dict[int, list[Item]], what: str = "schedule") -> None:
    """Raise ScheduleError if the programs cannot all finish under NCCL's rules."""
    partners = _match(programs)
    position = {rank: 0 for rank in programs}  # next item of the rank's compute stream
    computed = {rank: 0 for rank in programs}
    queues: dict[tuple[int, Hashable], deque[Call]] = defaultdict(deque)
    for rank, items in programs.items():
        compute_before = 0
        for item in items:
            if isinstance(item, Post):
                item.call.after_compute = compute_before
                queues[(rank, item.call.communicator)].append(item.call)
            elif isinstance(item, Compute):
                compute_before += 1
    progress = True
    while progress:
        progress = False
        for rank, items in programs.items():  # compute streams
            while position[rank] < len(items):
                item = items[position[rank]]
                if isinstance(item, Wait) and not item.call.done:
                    break
                if isinstance(item, Compute):
                    computed[rank] += 1
                position[rank] += 1
                progress = True
        for queue in queues.values():  # communicator streams: the head call starts, then completes
            while queue:
                head = queue[0]
                if not head.started:
                    if computed[head.rank] < head.after_compute:
                        break
                    head.started = progress = True
                if not all(peer.started for peer in partners[id(head)]):
                    break
                head.done = progress = True
                queue.popleft()
    stuck = {rank: items[position[rank]] for rank, items in programs.items() if position[rank] < len(items)}
    if stuck:
        raise ScheduleError(f"{what} deadlocks under NCCL's point-to-point rules: " + _describe(stuck, programs))


def _describe(stuck: dict[int, Item], programs: dict[int, list[Item]]) -> str:
    parts = []
    for rank, item in sorted(stuck.items())[:4]:
        before = [i.action for i in programs[rank][: programs[rank].index(item)] if isinstance(i, Compute)]
        where = f"after {before[-1]}" if before else "before its first action"
        if isinstance(item, Wait):
            waiting = item.call.receives or item.call.sends
            parts.append(f"rank {rank} ({where}) waits for {waiting[0]}")
        else:
            parts.append(f"rank {rank} ({where}) is stuck")
    more = len(stuck) - len(parts)
    return "; ".join(parts) + (f"; and {more} more rank(s)" if more > 0 else "")
