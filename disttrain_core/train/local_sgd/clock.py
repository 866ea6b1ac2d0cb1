"""A-EDiT's sync points (``parallel.local_sgd.method=a_edit``): a sync when ``sync_interval_s`` seconds have
passed, agreed without a collective across workers between syncs (docs/LOCAL_SGD.md)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ...config import Config


class TimedSyncs:
    """A-EDiT's sync points (``method=a_edit``). After a sync every worker leaves at about the same moment and
    fixes its next deadline, ``sync_interval_s`` later, on its own clock; it then trains alone -- no collective
    across workers, so a fast worker takes more steps than a slow one -- and joins the next sync after the step
    that passes the deadline (the processes of one worker agree on that step over a host-side group of the
    worker). At the sync one small host-side all-reduce over every process tells everyone each worker's step
    and whether a rank was signalled; from it every process decides alike whether to checkpoint (a worker passed
    a multiple of trainer.checkpoint.every_n_steps), to stop, or to end the run (the workers' steps add up to
    workers x trainer.max_steps: the synchronous run's samples). Rank 0 logs every sync to
    ``local_sgd_rounds.jsonl``. The public implementation all-reduces the clock before every step, which keeps
    the workers in lock-step; this follows the paper."""

    def __init__(self, engine, cfg: Config, timeout: timedelta | None):
        self.engine = engine
        self.interval = float(cfg.parallel.local_sgd.sync_interval_s)
        self.every = int(cfg.trainer.checkpoint.every_n_steps)
        self.step_weight = float(cfg.parallel.local_sgd.step_weight)
        self.stop_at = engine.stop_at  # the run's samples: workers x this many steps
        workers, shard = engine.workers, engine.shard
        self.steps = [engine.warmup] * workers  # each worker's step at the last sync
        self.steps_tensor = torch.zeros(workers + 1, dtype=torch.int64)  # checkpointed: the steps, the syncs
        self.share = 1.0 / workers  # worker 0's share of the steps between the last two syncs
        self.over = False
        self.flags = {"checkpoint": False, "stop": False}
        self.deadline: float | None = None
        self.started = time.perf_counter()
        self.rounds = 0
        self.log_path = Path(cfg.paths.output_dir) / "local_sgd_rounds.jsonl"
        self.everyone = self.mine = None
        if dist.is_initialized() and engine.fabric.world_size > 1:
            self.everyone = dist.new_group(backend="gloo", timeout=timeout)
            for w in range(workers):  # every rank creates every group, in one order
                group = dist.new_group(list(range(w * shard, (w + 1) * shard)), backend="gloo", timeout=timeout)
                if w == engine.worker:
                    self.mine = group
        self._flag = torch.zeros(1, dtype=torch.int32)

    def begin(self) -> None:
        if self.deadline is None:
            self.deadline = time.perf_counter() + self.interval
            self.started = time.perf_counter()
            # resumed from a warm-up checkpoint: the first sync counts the steps taken after the warm-up
            self.steps = [max(s, self.engine.warmup) for s in self.steps]

    def due(self) -> bool:
        due = time.perf_counter() >= self.deadline
        if self.engine.shard > 1:  # the worker's processes sync after the same step
            self._flag.fill_(int(due))
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.mine)
            due = bool(self._flag.item())
        return due

    def agree(self) -> None:
        """The sync's agreement: every worker's step and any rank's stop request, then the decisions."""
        engine = self.engine
        vector = torch.zeros(engine.workers + 1, dtype=torch.int64)
        if engine.place == 0:
            vector[engine.worker] = engine.step
        request = engine.stop_request
        vector[-1] = int(request is not None and request.signal_name is not None)
        if self.everyone is not None:
            dist.all_reduce(vector, group=self.everyone)
        previous, self.steps = self.steps, [int(v) for v in vector[:-1]]
        taken = [now - before for now, before in zip(self.steps, previous, strict=True)]
        shares = [t / max(1, sum(taken)) for t in taken]
        self.share = shares[0]
        if self.step_weight > 0:  # the sync that follows weights the workers by these steps too
            engine.outer.shares = shares
            engine.outer.share_ratio = self.step_weight
        self.flags["checkpoint"] = bool(self.every) and any(
            now // self.every > before // self.every for now, before in zip(self.steps, previous, strict=True)
        )
        self.flags["stop"] = bool(vector[-1])
        self.over = sum(self.steps) >= engine.workers * self.stop_at
        now = time.perf_counter()
        self.rounds += 1
        if engine.fabric.global_rank == 0:
            entry = {
                "sync": self.rounds,
                "steps": self.steps,
                "taken": taken,
                "seconds": round(now - self.started, 4),
                "checkpoint": self.flags["checkpoint"],
                "stop": self.flags["stop"],
                "over": self.over,
            }
            with self.log_path.open("a") as out:
                out.write(json.dumps(entry) + "\n")
        self.started, self.deadline = now, now + self.interval

    def take(self, flag: str) -> bool:
        value, self.flags[flag] = self.flags[flag], False
        return value

    def state(self, step: int) -> torch.Tensor:
        """What a checkpoint keeps: each worker's step at the last sync (during the warm-up everyone's ``step``)
        and the number of syncs so far."""
        steps = list(self.steps) if not self.engine.synchronous(step) else [step] * self.engine.workers
        self.steps_tensor.copy_(torch.tensor([*steps, self.rounds], dtype=torch.int64))
        return self.steps_tensor

    def loaded(self) -> None:
        values = [int(v) for v in self.steps_tensor]
        self.steps, self.rounds = values[:-1], values[-1]
        # a checkpoint of a finished run (resume=auto after the end): nothing more to train
        self.over = self.rounds > 0 and sum(self.steps) >= self.engine.workers * self.stop_at
