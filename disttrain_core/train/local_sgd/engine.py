"""Local SGD: workers train alone between syncs (``parallel.mode=local_sgd``, docs/LOCAL_SGD.md).

The processes form a 2-D mesh: a *worker* is ``shard_group`` consecutive processes that train one model
replica together (DDP inside the worker, or sharded: ``parallel.shard=zero1|zero2|zero3``,
train/local_sgd/shards.py), and a *sync group* joins the processes at the same place in every worker. The
first ``warmup_steps`` steps are synchronous data parallelism (each worker's sum, then a sum over the sync
group, the loss normalized by the global batch). After them each worker steps alone on its
own samples (its loss normalized by its own tokens), and every ``sync_every`` steps the workers sync:

* each process syncs only the parameters it *owns* -- the worker's parameters split by bytes over its
  ``shard_group`` processes, as ZeRO-1 splits optimizer state; under FSDP2 its shard of every parameter -- so
  each parameter crosses the sync group once per worker, not once per process;
* pseudo-gradient of worker m: ``anchor - theta_m`` (``anchor``: the parameters of the last sync), averaged over
  the sync group;
* ``diloco``: ``anchor <- OuterSGD(anchor, grad = mean pseudo-gradient)`` with torch SGD (``outer_lr``,
  ``outer_momentum``, Nesterov), DiLoCo's outer step; ``post_local_sgd``: ``anchor <- mean theta_m`` (plain
  averaging: outer lr 1, no momentum);
* the owner broadcasts the new anchor inside its worker and every process sets its parameters to it.

``layerwise`` (EDiT's layer-wise sync): the same operations, decoder block by decoder block during the next
forward, each block's reduction in flight while the previous block computes (train/local_sgd/sync.py).
``edit`` is ``diloco`` with layer-wise sync and EDiT's penalty on unless set off; ``a_edit`` is ``edit`` synced
when ``sync_interval_s`` seconds have passed instead of every ``sync_every`` steps: its workers take different
numbers of steps, and the loop's agreements (stop, checkpoint, end of run) move to its syncs
(train/local_sgd/clock.py).

The anchors and the outer momentum exist only for owned parameters (or shards): besides the model and the inner
optimizer, a process holds 1/shard_group of one extra model copy (2/shard_group with momentum).
"""

from __future__ import annotations

import json
import logging
import random
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_fabric import Fabric

from ...comm.engine import allreduce_tensors
from ...config import Config
from ...data.tokenizer import Tokenizer
from ...models.llama import DecoderBlock
from ...parallel.plan import local_sgd_features, local_sgd_shard_group
from ..engine import DataParallelEngine
from .clock import TimedSyncs
from .penalty import Penalty
from .shards import WorkerShards
from .sync import OuterSync

log = logging.getLogger(__name__)


def mesh_groups(world: int, shard: int, rank: int, timeout: timedelta | None = None):
    """(this rank's worker group, its sync group, worker index, index inside the worker). Every rank creates
    every group, in one order (a group built only by its members can hang later, docs/COMM.md)."""
    workers = world // shard
    mine = sync = None
    for w in range(workers):
        group = dist.new_group(list(range(w * shard, (w + 1) * shard)), timeout=timeout)
        if rank // shard == w:
            mine = group
    for j in range(shard):
        group = dist.new_group([w * shard + j for w in range(workers)], timeout=timeout)
        if rank % shard == j:
            sync = group
    return mine, sync, rank // shard, rank % shard


class LocalSgdEngine(DataParallelEngine):
    def __init__(self, cfg: Config, fabric: Fabric, tokenizer: Tokenizer, unit, timeout: timedelta | None = None):
        ls = cfg.parallel.local_sgd
        world, rank = fabric.world_size, fabric.global_rank
        self.shard = local_sgd_shard_group(cfg)
        self.workers = world // self.shard
        if world > 1:
            worker_group, self.sync_group, self.worker, self.place = mesh_groups(world, self.shard, rank, timeout)
        else:
            worker_group, self.sync_group, self.worker, self.place = None, None, 0, 0
        self.worker_group = worker_group
        # inside a worker: none (DDP), zero1, zero2 or zero3 (train/local_sgd/shards.py)
        self.shards = WorkerShards(cfg, fabric.device, worker_group, self.worker, self.place, self.shard)
        self.fsdp, self.zero1 = self.shards.fsdp, self.shards.zero1
        super().__init__(cfg, fabric, tokenizer, unit, group=worker_group if world > 1 else None)
        self.warmup, self.every, self.method = int(ls.warmup_steps), int(ls.sync_every), ls.method
        self.step = 0  # optimizer steps taken (checkpointed: a resumed run knows where the next sync is)
        self._step_tensor = torch.zeros((), dtype=torch.int64)
        self.parameter = dict(self.named_parameters)
        self.owner_of = self.shards.owners(self.parameter)  # who syncs what inside a worker
        post = self.method == "post_local_sgd"  # plain averaging: outer lr 1, no momentum
        momentum = 0.0 if post else float(ls.outer_momentum)
        outer = {
            "lr": 1.0 if post else float(ls.outer_lr),
            "momentum": momentum,
            "nesterov": bool(ls.outer_nesterov and momentum > 0),
        }
        self.layerwise, anomaly, weighting = local_sgd_features(ls)  # null: the method's default
        blocks = sum(isinstance(m, DecoderBlock) for m in self.raw_model.modules())  # sync units: blocks + the rest
        self.outer = OuterSync(
            self.raw_model,
            self.named_parameters,
            self.owner_of,
            self.place,
            self.worker * self.shard,
            self.sync_group,
            worker_group,
            self.workers,
            self.shard,
            outer,
            self.layerwise,
            penalty=Penalty(ls.penalty, 1 + blocks, self.workers, anomaly, weighting),
            worker=self.worker,
            offload=bool(ls.offload),
            sharded=self.fsdp,
        )
        self.spikes = ls.spikes
        self.ft_workers = None  # trainer.fault_tolerance: train/fault_tolerance/workers.py syncs the workers
        self._penalty_tensor = torch.zeros(len(self.outer.units), 3 * self.workers, dtype=torch.float64)
        # rank 0 writes every sync's verdicts (norms, anomalous workers, weights, injected spikes) here
        self.verdict_log = Path(cfg.paths.output_dir) / "local_sgd_syncs.jsonl" if self.outer.penalty else None
        self.spiked_since_sync: set[int] = set()
        self.syncs = self.anomalous_logged = self.rollbacks_logged = 0  # since the last log
        self.sync_step, self.sync_spikes = 0, []
        self.steps_logged = self.local_steps_logged = 0  # steps (local ones) since the last log
        stop = cfg.trainer.exit_after_step
        self.stop_at = cfg.trainer.max_steps if stop is None else min(cfg.trainer.max_steps, stop)
        self.timed = self.method == "a_edit"
        self.clock = TimedSyncs(self, cfg, timeout) if self.timed else None
        log.info(
            "local_sgd: %s, %d workers x %d processes, warmup %d steps, sync every %s",
            self.method,
            self.workers,
            self.shard,
            self.warmup,
            f"{ls.sync_interval_s} s" if self.timed else f"{self.every} steps",
        )

    def shard_model(self, model: torch.nn.Module) -> bool:
        """FSDP2 over the worker's processes (zero2, zero3), or ZeRO-1's optimizer reducing the gradients."""
        return self.shards.apply(model)

    # ------------------------------------------------------------------ the step
    def synchronous(self, step: int) -> bool:
        """Step ``step`` (1-based) is a warm-up step: synchronous data parallelism over every process."""
        return step <= self.warmup

    def count_group(self, step: int, default):
        if self.synchronous(step):
            return default
        return self.worker_group if self.shard > 1 else None

    def loss_replicas(self, step: int) -> range | None:
        if self.synchronous(step):
            return None
        return range(self.worker * self.shard, (self.worker + 1) * self.shard)  # the worker's processes

    def spiked(self, step: int, worker: int) -> bool:
        """parallel.local_sgd.spikes: does ``worker`` scale its loss on local step ``step``?"""
        s = self.spikes
        if worker not in s.workers or self.synchronous(step) or step < s.start_step or s.probability <= 0:
            return False
        return random.Random(f"{s.seed}:{worker}:{step}").random() < s.probability

    def forward_backward(self, microbatches, counts, record=False):
        step = self.step + 1
        # Loss sums are reduced over the processes whose tokens normalize them.
        self.loss_group = None if self.synchronous(step) else self.worker_group
        self.loss_multiplier = float(self.spikes.scale) if self.spiked(step, self.worker) else 1.0
        if self.timed and not self.synchronous(step):
            self.clock.begin()  # the first interval starts with the first local step
        self.spiked_since_sync |= {w for w in range(self.workers) if self.spiked(step, w)}
        return super().forward_backward(microbatches, counts, record)

    def loss_sums(self, microbatches) -> torch.Tensor:
        """Validation of the synced model: during the warm-up the parameters (the same in every worker), after it
        the last sync's (the anchors, put in place for the evaluation: train/local_sgd/sync.py ``anchored``; the
        trainer's ``synchronize`` completes a pending layer-wise sync first). Every process evaluates its own
        share of the held-out batch and the sums add over every process."""
        group, self.loss_group = self.loss_group, None
        try:
            if self.step <= self.warmup:
                return super().loss_sums(microbatches)
            with self.outer.anchored():
                return super().loss_sums(microbatches)
        finally:
            self.loss_group = group

    def build_optimizer(self):
        """The inner optimizer: torch's (over whole parameters, or FSDP2's shards), or ZeRO-1's over the worker
        group (its fp32 master shards and moments split over the worker's processes)."""
        if not self.zero1:
            return super().build_optimizer()
        self.optimizer = self.shards.zero1_optimizer(self.raw_model, self.named_parameters)
        return self.optimizer

    def last_backward(self) -> None:
        if self.zero1:  # reduce-scatter each gradient bucket as soon as the last backward completes it
            self.optimizer.sync.arm()

    def after_backward(self) -> None:
        if self.zero1:
            self.optimizer.reduce_gradients()  # the worker's sum, each process its slice
            self._refresh_masters()  # a layer-wise sync completed in this step's forward
        else:
            super().after_backward()  # the worker's sum (DDP; FSDP2 reduce-scattered in the backward)
        if self.synchronous(self.step + 1) and self.workers > 1:
            # a sum over the workers (sharded: of each process's shard, the same shard in every worker)
            grads = self.shards.gradient_shards(self.named_parameters, self.optimizer)
            allreduce_tensors(grads, self.sync_group, self.bucket_numel, 1)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        if not (self.fsdp or self.zero1):
            return super().clip_gradients(max_norm)
        return self.shards.clip(self.named_parameters, self.optimizer, max_norm)

    def _refresh_masters(self) -> None:
        """ZeRO-1: after a sync set the parameters, its fp32 master shards take their values (fp32 wire, so
        the parameters hold the masters' values exactly: validation/local_sgd.py)."""
        if self.zero1 and self.outer.applied:
            self.outer.applied = False
            self.optimizer.sync_master_from_params()

    def after_step(self) -> None:
        super().after_step()
        self.step += 1
        self.steps_logged += 1
        self.local_steps_logged += int(not self.synchronous(self.step))
        if self.step <= self.warmup:
            if self.step == self.warmup:  # the synchronous parameters are the first anchor
                if self.zero1:  # the step's updated parameters, gathered
                    self.optimizer.wait_params()
                self.outer.set_anchors()
            return
        if self.timed:  # A-EDiT: when the interval since the last sync has passed on this worker's clock
            if self.clock.due():
                self.clock.agree()
                self.sync()
        elif (self.step - self.warmup) % self.every == 0:
            self.sync()

    def sync(self) -> None:
        """The outer step (train/local_sgd/sync.py): now, or unit by unit in the next forward (layer-wise)."""
        if self.zero1:  # the step's updated parameters, gathered (in the background with overlap) before use
            self.optimizer.wait_params()
        self._write_verdicts()  # of the previous sync (a layer-wise one completes in the forward after it)
        self.sync_step, self.sync_spikes = self.step, sorted(self.spiked_since_sync)
        self.spiked_since_sync = set()
        last = self.clock.over if self.timed else self.step >= self.stop_at
        if self.layerwise and not last:  # the run's last sync has no next forward to overlap with: at once
            self.outer.sync_in_next_forward()
        elif self.ft_workers is not None:  # trainer.fault_tolerance: workers are replica groups (no ZeRO-1)
            self.ft_workers.sync(self)
        else:
            self.outer.sync_now()
            self._refresh_masters()
        self.syncs += 1

    def _write_verdicts(self) -> None:
        verdicts, self.outer.verdicts = self.outer.verdicts, []
        for verdict in verdicts:
            self.anomalous_logged += sum(verdict["anomalous"])
            self.rollbacks_logged += int(not any(verdict["weights"]))
        if not verdicts or self.verdict_log is None or self.fabric.global_rank != 0:
            return
        with self.verdict_log.open("a") as out:
            for verdict in verdicts:
                out.write(json.dumps({"step": self.sync_step, "spiked": self.sync_spikes, **verdict}) + "\n")

    def synchronize(self) -> None:
        if self.zero1:
            self.optimizer.wait_params()
        self.outer.finish()  # a layer-wise sync still pending: before a checkpoint, at the end
        self._refresh_masters()
        self._write_verdicts()

    def close(self) -> None:
        if self.zero1:
            self.optimizer.close()

    def window_metrics(self, seconds: float, steps: int) -> dict[str, float]:
        syncs, self.syncs = self.syncs, 0
        metrics = {"local_sgd/syncs": float(syncs)}
        if self.outer.penalty is not None:  # (worker, unit) pairs judged anomalous, units rolled back
            metrics["local_sgd/anomalous"] = float(self.anomalous_logged)
            metrics["local_sgd/rollbacks"] = float(self.rollbacks_logged)
            self.anomalous_logged = self.rollbacks_logged = 0
        return metrics

    def whole_run_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """After warm-up the counts are worker 0's. Every worker takes global_batch / workers samples per step, so
        samples and padded tokens per second scale exactly by the workers; labelled tokens and FLOPs (images,
        caption lengths) are worker 0's times the workers, an estimate (docs/LOCAL_SGD.md)."""
        local, window = self.local_steps_logged, max(1, self.steps_logged)
        self.local_steps_logged = self.steps_logged = 0
        if not local or self.workers == 1:
            return metrics
        # A-EDiT: worker 0's share of the local steps all workers took between the last two syncs
        share = self.clock.share if self.timed else 1.0 / self.workers
        # counted: (window - local) global batches + local batches of one worker; done: window global batches
        factor = window / (window - local + local * share)
        out = dict(metrics)
        for key in (
            "perf/samples_per_s",
            "perf/tokens_per_s",
            "perf/loss_tokens_per_s",
            "perf/tflops_per_device",
            "perf/mfu",
        ):
            if key in out:
                out[key] = metrics[key] * factor
        return out

    def host_reads(self, step: int) -> bool:
        """Whether step ``step`` may read values on the host (trainer.sync_debug leaves it unchecked): a sync
        step with the penalty (its norms are read to judge them; the step after, with layer-wise sync), and
        every A-EDiT step after warm-up (each may end in a sync agreed on host-side values)."""
        if self.synchronous(step):
            return False
        if self.timed:
            return True
        local = step - self.warmup
        due = local % self.every == 0 or (self.layerwise and local > 1 and (local - 1) % self.every == 0)
        return self.outer.penalty is not None and due

    # ------------------------------------- the loop's agreements (A-EDiT: at syncs only)
    def _local(self, step: int) -> bool:
        return self.timed and not self.synchronous(step)

    def keep_going(self, step: int, stop_at: int) -> bool:
        if not self.timed or stop_at <= self.warmup:
            return step < stop_at
        return not self.clock.over

    def checkpoint_due(self, step: int, every: int) -> bool:
        return self.clock.take("checkpoint") if self._local(step) else super().checkpoint_due(step, every)

    def stop_agreed(self, stop_request) -> bool:
        return self.clock.take("stop") if self._local(self.step) else stop_request.agreed()

    def checkpoint_step(self, step: int) -> int:
        return self.clock.steps[0] if self._local(step) else step

    def resumed_step(self, step: int) -> int:
        return self.step if self.timed else step

    # ------------------------------------------------------------ checkpoints
    def _prefix(self) -> str:
        """Worker 0's state is the checkpoint's ``model.*`` / ``optim.*`` (what rank 0 logs, what an export
        reads); worker w > 0 keeps its own under ``local_sgd.worker<w>.``."""
        return "" if self.worker == 0 else f"local_sgd.worker{self.worker}."

    def checkpoint_state(self, saving: bool) -> dict:
        self.synchronize()  # a checkpoint holds synced parameters, never a sync half applied
        prefix = self._prefix()
        f = self.fabric
        mine = self.shards.checkpoint_entries(
            self.raw_model, self.named_parameters, self.optimizer, f.global_rank, f.world_size, saving
        )
        state = {prefix + key: value for key, value in mine.items()}
        # The anchors and the outer momentum: the same in every worker; worker 0's owners write them.
        like = self.shards.like_parameter  # FSDP2: a DTensor of the shard, placed like the parameter
        shared: dict[str, torch.Tensor] = {
            f"local_sgd.anchor.{n}": like(self.parameter[n], a.detach()) for n, a in self.outer.anchors.items()
        }
        for name, buffer in self.outer.momentum_buffers().items():
            shared[f"local_sgd.outer.{name}.momentum_buffer"] = like(self.parameter[name], buffer)
        self._step_tensor.fill_(self.step)
        if self.timed:
            self.clock.state(self.step)
        if self.outer.penalty is not None:
            self._penalty_tensor.copy_(torch.tensor(self.outer.penalty.state(), dtype=torch.float64))
        if not saving or self.worker == 0:
            state.update(shared)
            if not saving or self.fabric.global_rank == 0:
                state["local_sgd.step"] = self._step_tensor
                if self.timed:  # each worker's step at the sync the checkpoint was taken at
                    state["local_sgd.worker_steps"] = self.clock.steps_tensor
                if self.outer.penalty is not None:  # the detectors: the same on every process
                    state["local_sgd.penalty"] = self._penalty_tensor
        return state

    def checkpoint_loaded(self, absent: list[str]) -> None:
        missing = [key for key in absent if key.startswith("local_sgd.")]
        if missing:
            raise ValueError(
                f"the checkpoint has no {missing[0]}: it was written by another local-SGD mesh or another mode; "
                f"resume with the same parallel.local_sgd.shard_group and process count ({self.workers} workers "
                f"x {self.shard})"
            )
        if self.zero1:  # step counters in place; the parameters gathered from the loaded masters
            self.optimizer.checkpoint_loaded()
        self.step = int(self._step_tensor)
        if self.timed:
            self.clock.loaded()
            self.step = self.clock.steps[self.worker]
        if self.outer.penalty is not None:
            self.outer.penalty.load(self._penalty_tensor.tolist())
