"""Stopping at an agreed step when asked to (preemption, Ctrl-C).

SIGTERM (a scheduler's preemption notice, or the launcher forwarding its own) or SIGINT on
any rank sets a flag in that rank. After every optimizer step the ranks reduce the flags
(MAX, one integer on a host-side gloo group of its own, so it never waits behind training's
collectives or synchronizes a device; asynchronously, read one step later); when any rank was
signalled, every rank learns it after the same step, saves a checkpoint there and returns from
the loop normally: the job exits 0 and ``trainer.resume=auto`` continues exactly. Repeated SIGTERMs are
one request; a second SIGINT (Ctrl-C twice) exits at once. (A-EDiT's workers take different numbers of
steps and agree only at their syncs: it reduces the flags there instead, train/local_sgd/clock.py.)

The flag is not a deadline. ``trainer.stop_grace_s`` after the handler ran, a process that has
not ended records its flight recorder and exits with status 143. The handler runs when the main
thread is in Python: a rank blocked inside a collective runs it only when the collective
returns or times out (``trainer.dist_timeout_s``). Give the grace more than a step and a
checkpoint save take; SLURM's ``--signal`` should leave at least as much before the job's time
limit (docs/FAULTS.md).
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
    """Installed at the very start of a training process (before the model is built: a signal during
    start-up is a stop request too); ``attach`` gives it its group once the process group exists."""

    def __init__(self, grace_s: float, on_signal=None):
        self.grace_s, self.on_signal = grace_s, on_signal
        self.group = None
        self.signal_name: str | None = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending = None  # the reduction started after the previous step
        self._timer: threading.Timer | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def attach(self, group) -> None:
        self.group = group

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:  # Ctrl-C twice: stop now
            if self.on_signal is not None:
                self.on_signal("signal SIGINT, twice")
            os._exit(128 + signum)
        first = self.signal_name is None
        if first or signum == signal.SIGINT:
            self.signal_name = name
        if not first:
            return  # SIGTERM again (a scheduler signals every process, the launcher forwards): one request
        if self.on_signal is not None:
            self.on_signal(f"signal {name}")
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if self.on_signal is not None:
            self.on_signal(f"no clean stop {self.grace_s:.0f} s after {self.signal_name} (trainer.stop_grace_s)")
        log.error("no clean stop within trainer.stop_grace_s=%.0f s after %s: exiting", self.grace_s, self.signal_name)
        os._exit(128 + signal.SIGTERM)

    def agreed(self) -> bool:
        """Whether the ranks agreed to stop now (a collective on ``group``: every rank calls it after every
        step). The flags of step n are reduced asynchronously while step n+1 runs and read after it, so the
        check never waits for the slowest host; every rank stops after the same step, one step after the
        signal's."""
        local = 1 if self.signal_name else 0
        if self.group is None:
            return bool(local)
        decided = False
        if self._pending is not None:
            self._pending.wait()
            decided = bool(self._flag.item())
        if decided:
            self._pending = None
            return True
        self._flag.fill_(local)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def close(self) -> None:
        """After the loop (the stop checkpoint written): the last reduction finished, no deadline, the
        previous handlers back."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
