"""An emulated slow process for benchmarks (``trainer.straggler``): a rank in ``ranks`` takes ``factor`` times
as long per step as it otherwise would.

After the optimizer step the rank works for (factor - 1) x the CPU time its training thread used in the step
(``time.thread_time``; trainer.threads_per_rank=1, checked before launch, so every operator's arithmetic runs
in that thread). Not counted: time spent waiting for other ranks, and the communication library's own
threads (gloo's copies and reductions) -- a slower processor would slow those as well, but multiplying them
would charge a synchronous run's communication to the straggler twice.

The delay is busy work -- small matrix products until the thread has used that much more CPU time (its own
clock, so a core shared with other processes stretches the delay as it stretches the step) -- not a sleep:
on an emulated node
pinned to one core (tools/netem_cluster.py ``pin=true``) a sleeping process would lend its core to nothing,
but a busy one holds it as slower compute would, and torch releases the GIL inside each product so the
rank's communication threads keep running. ``probability`` < 1 makes the slowdown random per step (drawn
from ``seed``, the rank and the step, the same in every run).

On CUDA the thread's CPU time is the host's work only: the emulation is meant for CPU runs.
"""

from __future__ import annotations

import random
import time

import torch


class Straggler:
    def __init__(self, cfg, rank: int):
        self.rank, self.seed = rank, int(cfg.seed)
        self.factor, self.probability = float(cfg.factor), float(cfg.probability)
        self.active = rank in list(cfg.ranks) and self.factor > 1 and self.probability > 0
        self._cpu = 0.0
        self._work = torch.ones(32, 32) if self.active else None
        self.delayed_s = 0.0  # total busy time added (for reports)

    def start(self) -> None:
        if self.active:
            self._cpu = time.thread_time()

    def slow(self, step: int) -> bool:
        if not self.active:
            return False
        return self.probability >= 1 or random.Random(f"{self.seed}:{self.rank}:{step}").random() < self.probability

    def delay(self, step: int) -> float:
        """Busy-work for (factor - 1) x this step's CPU time if ``step`` is slow here; returns the seconds."""
        if not self.slow(step):
            return 0.0
        extra = (self.factor - 1.0) * (time.thread_time() - self._cpu)
        until = time.thread_time() + extra
        while time.thread_time() < until:
            torch.mm(self._work, self._work)
        self.delayed_s += extra
        return extra
