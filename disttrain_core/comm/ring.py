"""Ring collectives built from point-to-point transfers, and a thread that drives them.

NCCL runs its ring reduce-scatter and all-gather on a stream of its own. Gloo's
versions are general-purpose: measured on two emulated nodes at 1 Gbit/s, a
24 MB reduce-scatter took as long as an all-reduce of the same buffer (it moves
twice the bytes a ring needs) and an all-gather running beside a matmul slowed
the matmul by 40% (docs/performance/overlap.md). The ring here moves exactly
``(n - 1) / n`` of the buffer per rank, in ``n - 1`` steps of one send and one
receive.

On CPU a ring is progressed by ``CommStream``: one background thread per
process group, the analogue of a dedicated CUDA communication stream. Jobs run
in submission order -- the same order on every rank, which is what makes the
point-to-point transfers match -- and return a ``Handle`` to wait on. The thread
owns its process group: nothing else may use it.

The flight recorder (flight.py) records each job when it is submitted, started and completed on
the thread; the transfers of each step are recorded by ``post``.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..base.torch_compat import all_gather_tensor, reduce_scatter_tensor
from . import flight
from .p2p import post


class Ring:
    """A process group seen as a ring: this rank, its neighbours (global ranks) and the group size."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, into: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
        """Start sending ``send`` to the next rank and receiving a tensor like it from the previous one
        (into ``into`` when given: contiguous, like ``send``)."""
        buffer = torch.empty_like(send) if into is None else into
        ops = [
            dist.P2POp(dist.isend, send.contiguous(), self.next, group=self.group),
            dist.P2POp(dist.irecv, buffer, self.prev, group=self.group),
        ]
        return buffer, post(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def ring_gather(
    ring: Ring,
    chunk: torch.Tensor,
    consume: Callable[[torch.Tensor, int], None],
    destination: Callable[[int], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """All-gather chunks around the ring, calling ``consume(chunk, owner)`` on each while the next travels.

    ``destination(owner)``: where to receive ``owner``'s chunk (saves a copy when the caller keeps it).
    """
    chunks: list[torch.Tensor | None] = [None] * ring.size
    current = chunk.contiguous()
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        chunks[owner] = current
        if step < ring.size - 1:
            following = (owner - 1) % ring.size
            incoming, works = ring.exchange(current, None if destination is None else destination(following))
        consume(current, owner)
        if step < ring.size - 1:
            _wait(works)
            current = incoming
    return chunks


def ring_reduce_scatter(
    ring: Ring, contribution: Callable[[int], torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum ``contribution(block)`` over the ring and return this rank's block of the sum (in ``out``
    when given).

    At step ``i`` a rank adds its contribution to block ``rank - i - 1`` to the partial sum received
    from its predecessor and passes it on; the block completed at the last step is its own.
    """
    partial, works = None, None
    for step in range(ring.size):
        block = (ring.rank - step - 1) % ring.size
        mine = contribution(block)  # computed while the previous partial sum travels
        last = step == ring.size - 1
        if works is not None:
            _wait(works)
            mine = torch.add(mine, partial, out=out) if last and out is not None else mine + partial
        if not last:
            partial, works = ring.exchange(mine)
        elif out is not None and mine.data_ptr() != out.data_ptr():
            return out.copy_(mine)  # one rank: nothing was added
        else:
            return mine
    raise AssertionError("unreachable")


class Handle:
    """A job submitted to a ``CommStream``: ``wait()`` blocks until it ran (and re-raises its error)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started: float | None = None  # perf_counter when the stream began running it

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"background collective failed: {self.error}") from self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class CommStream:
    """One background thread running communication jobs in submission order."""

    def __init__(self, name: str = "comm-stream"):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> Handle:
        handle = Handle()
        self.jobs.put((job, handle))
        return handle

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, handle = item
            handle.started = time.perf_counter()
            try:
                job()
            except BaseException as error:  # handed to whoever waits for the job
                handle.error = error
            handle.done.set()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


class RingCollectives:
    """Reduce-scatter and all-gather of flat buffers over a dedicated process group, on a ``CommStream``."""

    # The background thread needs the GIL for a few microseconds between transfers, and the training
    # thread needs it back between operators. With CPython's default 5 ms switch interval either can
    # stall the other for milliseconds at a time: measured on two emulated nodes, a matmul loop beside
    # a ring all-gather ran 25% slower at 5 ms and 3% slower at 0.2 ms (docs/performance/overlap.md).
    SWITCH_INTERVAL_S = 0.0002

    def __init__(self, group):
        self.ring = Ring(group)
        self.stream = CommStream(f"comm-stream-{self.ring.rank}")
        self.previous_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self.previous_switch_interval, self.SWITCH_INTERVAL_S))

    def reduce_scatter(self, output: torch.Tensor, source: torch.Tensor, async_op: bool = True):
        """``output`` (this rank's slice) = sum over ranks of its slice of ``source``."""
        size = output.numel()
        ring = self.ring
        op = flight.record("ring_reduce_scatter", group=ring.group, nbytes=source.numel() * source.element_size())

        def job() -> None:
            op.started()
            ring_reduce_scatter(ring, lambda block: source[block * size : (block + 1) * size], out=output)
            op.completed()

        return self._finish(self.stream.submit(job), async_op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = True):
        """``output`` = every rank's ``shard`` end to end, in rank order."""
        size = shard.numel()
        ring = self.ring
        op = flight.record("ring_all_gather", group=ring.group, nbytes=output.numel() * output.element_size())

        def job() -> None:
            op.started()
            own = output[ring.rank * size : (ring.rank + 1) * size]
            if own.data_ptr() != shard.data_ptr():  # ZeRO-1 gathers in place: the shard is already there
                own.copy_(shard)
            ring_gather(ring, shard, lambda *_: None, lambda owner: output[owner * size : (owner + 1) * size])
            op.completed()

        return self._finish(self.stream.submit(job), async_op)

    @staticmethod
    def _finish(handle: Handle, async_op: bool):
        if async_op:
            return handle
        handle.wait()
        return None

    def close(self) -> None:
        self.stream.close()
        sys.setswitchinterval(self.previous_switch_interval)


class NativeCollectives:
    """The process group's own asynchronous collectives (NCCL: its communication stream)."""

    def __init__(self, group):
        self.group = group

    def reduce_scatter(self, output, source, async_op: bool = True):
        return reduce_scatter_tensor(output, source, group=self.group, async_op=async_op)

    def all_gather(self, output, shard, async_op: bool = True):
        return all_gather_tensor(output, shard, group=self.group, async_op=async_op)

    def close(self) -> None:
        pass
