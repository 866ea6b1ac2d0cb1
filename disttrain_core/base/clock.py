"""When device work ran, without waiting for the device on the hot path.

On a CPU an operation runs when the host issues it, so a ``time.perf_counter()``
reading before and after it times it. On a GPU the host only queues kernels and
runs ahead; a host timestamp says when work was queued, not when it ran, and a
``torch.cuda.synchronize()`` to make it true would also wait for the
communication streams and throw away the overlap being measured. There a stamp
is a CUDA event recorded on the current stream, and it is read only later, at a
point that synchronizes anyway (a logging step, a recorded timeline).

``stamp()`` returns a float (CPU) or an event (CUDA); ``seconds(stamp)`` gives
the time on the host's ``perf_counter`` clock, using an anchor taken by
``anchor()`` -- the one call here that synchronizes, meant for steps being
recorded. ``elapsed(start, end)`` needs no anchor.
"""

from __future__ import annotations

import time

import torch

Stamp = float | torch.cuda.Event


class DeviceClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def stamp(self) -> Stamp:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def anchor(self) -> float:
        """Tie device time to host time (synchronizes the device); returns the host time of the anchor."""
        if not self.cuda:
            return time.perf_counter()
        torch.cuda.synchronize(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        self._anchor = (event, time.perf_counter())
        return self._anchor[1]

    def seconds(self, stamp: Stamp) -> float:
        """The host-clock time of ``stamp`` (waits for its event on a GPU)."""
        if isinstance(stamp, float):
            return stamp
        if self._anchor is None:
            raise RuntimeError("DeviceClock.seconds: call anchor() before the stamps to convert")
        stamp.synchronize()
        event, host = self._anchor
        return host + event.elapsed_time(stamp) / 1e3

    @staticmethod
    def elapsed(start: Stamp, end: Stamp) -> float:
        """Seconds from ``start`` to ``end`` (waits for ``end`` on a GPU)."""
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
