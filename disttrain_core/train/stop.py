"""Stopping at an agreed step when asked to (preemption, Ctrl-C).

SIGTERM (a scheduler's preemption notice, or the launcher forwarding its own) or SIGINT on
any rank sets a flag in that rank. After every optimizer step the ranks reduce the flag
(MAX, one integer on a host-side gloo group of its own, so it never waits behind training's
collectives or synchronizes a device); when any rank was signalled, every rank learns it at
the same step, saves a checkpoint there and returns from the loop normally: the job exits 0
and ``trainer.resume=auto`` continues exactly. Repeated signals are one request.

The flag is not a deadline: a rank stuck inside a collective never reaches the next check.
``trainer.stop_grace_s`` after the first signal the process records its flight recorder and
exits with status 143 (the launcher or the scheduler's SIGKILL would end it anyway; this way
the ring is on disk). Give it more than a checkpoint save takes; SLURM's ``--signal`` should
leave at least as much before the job's time limit (recipes/README.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, group, grace_s: float, on_signal=None):
        self.group, self.grace_s, self.on_signal = group, grace_s, on_signal
        self.signal_name: str | None = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._timer: threading.Timer | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        first = self.signal_name is None
        self.signal_name = signal.Signals(signum).name
        if not first:
            return
        if self.on_signal is not None:
            self.on_signal(f"signal {self.signal_name}")
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if self.on_signal is not None:
            self.on_signal(f"no clean stop {self.grace_s:.0f} s after {self.signal_name} (trainer.stop_grace_s)")
        log.error("no clean stop within trainer.stop_grace_s=%.0f s after %s: exiting", self.grace_s, self.signal_name)
        os._exit(128 + signal.SIGTERM)

    def agreed(self) -> bool:
        """Whether any rank was signalled (a collective on ``group``: every rank calls it after every step)."""
        self._flag.fill_(1 if self.signal_name else 0)
        if self.group is not None:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag.item())

    def close(self) -> None:
        """After the loop (the stop checkpoint written): no deadline, the previous handlers back."""
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
