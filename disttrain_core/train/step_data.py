"""The trainer's view of a step's data: the global batch's loss normalizers and this process's share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.batch import Batch
from ..parallel.item_balance import replica_items
from .engine import GlobalCounts, to_device


class StepData:
    """Mixed into the Trainer (train/loop.py), whose attributes it reads."""

    def _global_counts(self, microbatches: list[Batch], trace=None) -> GlobalCounts:
        """The loss normalizers of this step: the tokens, generation samples, sequences, images, clips and frame
        groups of the samples
        the loss is normalized over -- the global batch, or (local SGD after its warm-up) one worker's share."""
        step = self.step + 1
        group = None
        summary = self._summary()
        if summary is not None:  # this process received only its block, and the whole step's summary
            if self.engine.loss_replicas(step) is not None:  # local SGD, which reads no producer (validation)
                raise RuntimeError(
                    "a loss over some replicas' samples needs every sample: data.producer.per_rank=false"
                )
            totals = summary.totals()
            return GlobalCounts(to_device(torch.tensor(totals, dtype=torch.float64), self.fabric.device), None, trace)
        if self.global_stream:  # every process holds the whole step: count the normalizing replicas' samples here
            replicas = self.engine.loss_replicas(step)
            if replicas is not None:
                if self.replica_group is not None:  # a local-SGD worker of a fault-tolerant job: its share
                    microbatches = self.replica_group.share(microbatches)
                microbatches = [mb for replica in replicas for mb in self._replica_share(microbatches, replica)]
        else:  # each replica read its own samples: sum over the processes whose samples normalize the loss
            group = self.engine.count_group(step, self.count_group)
        counts = to_device(  # host-side batch tensors: reading them synchronizes nothing
            torch.tensor(
                [
                    sum(mb.loss_tokens() for mb in microbatches),
                    sum(mb.gen_samples() for mb in microbatches),
                    sum(mb.size for mb in microbatches),
                    sum(int(mb.images.shape[0]) for mb in microbatches),
                    sum(int(mb.audio.shape[0]) for mb in microbatches),
                    sum(int(mb.video.shape[0]) for mb in microbatches),
                ],
                dtype=torch.float64,
            ),
            self.fabric.device,
        )
        work = None
        if group is not None:  # one copy per data-parallel replica
            work = dist.all_reduce(counts, group=group, async_op=True)
        return GlobalCounts(counts, work, trace)

    def _summary(self):
        """The producer's StepSummary of this step when this process received only its own block (else None)."""
        return getattr(self.loader, "summary", None) if self.producer else None

    def _local_microbatches(self, microbatches: list[Batch]) -> list[Batch]:
        """The samples this process works on: its unit replica's block of every global microbatch (with every
        replica's item counts under parallel.rebalance_items)."""
        return self._with_replica_items(self._share_of_step(microbatches))

    def _with_replica_items(self, local: list[Batch]) -> list[Batch]:
        """parallel.rebalance_items: each microbatch's images, clips and frame groups per replica of this process's
        unit (from the broker's per-sample counts of the step), which the balanced encodes plan from."""
        if not self.cfg.parallel.rebalance_items or self.broker is None:
            return local
        blocks = [self.unit.block(r, self.slot_samples) for r in range(self.unit.dp)]
        for k, mb in enumerate(local):
            mb.replica_items = replica_items(self.broker.counts, k, blocks)
        return local

    def _share_of_step(self, microbatches: list[Batch]) -> list[Batch]:
        summary = self._summary()
        if summary is not None:  # the producer sent this block only
            if self.broker is not None:
                counts = (summary.image_counts, summary.clip_counts, summary.group_counts)
                self.broker.set_counts(*(c.tolist() for c in counts))
            return microbatches
        if not self.global_stream:
            return microbatches
        if self.replica_group is not None:  # a fault-tolerant job: this replica group's microbatches of the step
            microbatches = self.replica_group.share(microbatches)
        if self.packing and self.cfg.parallel.mode == "hotspa":  # HotSPa splits the buckets per strategy
            return microbatches
        if self.broker is not None:
            self.broker.count_items(microbatches)
        return self._replica_share(microbatches, self.dp_rank)

    def _replica_share(self, microbatches: list[Batch], replica: int) -> list[Batch]:
        """Data-parallel replica ``replica``'s share of a step read whole: its rows of every packed bucket, or
        its unit's block of every microbatch slot."""
        if self.packing:  # one Batch per bucket
            from ..data.packed_loader import replica_rows
            from ..data.packing import bucket_boundaries, microbatch_rows

            rows = [microbatch_rows(self.cfg.data.packing, c) for c in bucket_boundaries(self.cfg)]
            return replica_rows(microbatches, rows, self.layout.llm.dp, replica)
        block = self.unit.block(replica, self.slot_samples)
        return [mb.select(block) for mb in microbatches]
