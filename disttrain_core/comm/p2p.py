"""Point-to-point transfers that honour NCCL's contract on every backend.

NCCL and gloo disagree on what ``dist.batch_isend_irecv`` returns: gloo gives
one handle per operation, NCCL runs the call as one group and returns a single
handle for all of it, and a received tensor holds its data only once that
handle has been waited on. Code that files handles by position (``works[:n]``
are the sends) therefore works on gloo and reads unwritten buffers on NCCL.
The rule here: wait on *every* handle a call returns before reading anything it
received, and put sends and receives that must not wait for each other in
different calls on different communicators (``Channels``).

``DISTTRAIN_STRICT_P2P=1`` makes gloo behave like NCCL in the way that matters
to a caller: ``post`` returns one handle per call, receive buffers are filled
with NaN when posted, and the data lands only when that handle is waited on.
The test suite runs with it (tests/conftest.py), so a regression to per-operation
handles fails on a CPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import flight

STRICT_ENV = "DISTTRAIN_STRICT_P2P"


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "0") == "1"


class CoalescedWork:
    """One handle for a whole call, as NCCL returns it: received data lands when it is waited on."""

    def __init__(self, works: list, landings: list[tuple[torch.Tensor, torch.Tensor]]):
        self.works = works
        self.landings = landings  # (staging buffer the transfer writes, the caller's buffer)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            work.wait()
        with torch.no_grad():  # the caller may already have made the buffer a leaf that requires grad
            for staging, target in self.landings:
                target.copy_(staging)
        self.landings = []
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class RecordedWork:
    """A handle of ``post``'s: the call's flight records complete when the last of its handles is waited on."""

    __slots__ = ("work", "call")

    def __init__(self, work, call: list) -> None:
        self.work, self.call = work, call  # call: [handles not yet waited on, records]

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            done = self.work.wait() if timeout is None else self.work.wait(timeout)
        except BaseException as error:
            for op in self.call[1]:
                op.failed(error)
            raise
        self.call[0] -= 1
        if self.call[0] == 0:
            for op in self.call[1]:
                op.waited_on_stream() if self.call[2] else op.completed()
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _record(ops: list[dist.P2POp]) -> list:
    return [
        flight.record(
            "recv" if op.op is dist.irecv else "send",
            group=op.group,
            peers=op.peer,
            nbytes=op.tensor.numel() * op.tensor.element_size(),
        )
        for op in ops
    ]


def _tracked(works: list, records: list, on_device: bool = False) -> list:
    """``on_device``: CUDA tensors, whose ``wait()`` only orders the stream (the record then says so)."""
    call = [len(works), records, on_device]
    return [RecordedWork(work, call) for work in works]


def post(ops: list[dist.P2POp]) -> list:
    """Start ``ops`` (one communicator per call); wait on every returned handle before using a receive."""
    if not ops:
        return []
    records = _record(ops)
    if not strict():
        return _tracked(dist.batch_isend_irecv(ops), records, ops[0].tensor.device.type == "cuda")
    staged, landings = [], []
    for op in ops:
        if op.op is dist.irecv:
            staging = torch.empty_like(op.tensor)
            landings.append((staging, op.tensor))
            if op.tensor.is_floating_point():
                op.tensor.fill_(float("nan"))  # what a reader that skipped the wait would see
            op = dist.P2POp(dist.irecv, staging, op.peer, op.group, op.tag)
        staged.append(op)
    return _tracked([CoalescedWork(dist.batch_isend_irecv(staged), landings)], records, ops[0].tensor.is_cuda)


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


class Channels:
    """A communicator for each direction of each pair of ranks that exchange tensors.

    Every process must create the same channels in the same order (``pairs`` sorted, identical on every
    rank), members or not, as ``dist.new_group`` requires. Each channel then carries one ordered stream
    of tensors from its source to its target: no send waits behind a receive or behind another peer's
    traffic. The channels are warmed up with one tiny transfer each, in the same global order on every
    rank, so NCCL creates their communicators (a blocking, collective step) here and not at a first
    send inside a step, where two ranks could each block creating a different one.
    """

    def __init__(self, pairs: list[tuple[int, int]], rank: int, device: torch.device, timeout: timedelta | None = None):
        self.rank = rank
        self.groups: dict[tuple[int, int], object] = {}
        for source, target in pairs:
            group = dist.new_group([source, target], timeout=timeout)
            if rank in (source, target):
                self.groups[(source, target)] = group
        probe = torch.zeros(1, device=device)
        for source, target in pairs:
            if rank == source:
                wait_all(post([dist.P2POp(dist.isend, probe, target, self.groups[(source, target)])]))
            elif rank == target:
                wait_all(post([dist.P2POp(dist.irecv, probe, source, self.groups[(source, target)])]))

    def send(self, tensor: torch.Tensor, target: int) -> list:
        return post([dist.P2POp(dist.isend, tensor, target, self.groups[(self.rank, target)])])

    def receive(self, buffers: list[torch.Tensor], source: int) -> list:
        group = self.groups[(source, self.rank)]
        return post([dist.P2POp(dist.irecv, buffer, source, group) for buffer in buffers])
