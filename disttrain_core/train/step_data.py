"""The trainer's view of a step's data: the global batch's loss normalizers and this process's share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.batch import Batch
from .engine import GlobalCounts, to_device


class StepData:
    """Mixed into the Trainer (train/loop.py), whose attributes it reads."""

    def _global_counts(self, microbatches: list[Batch], trace=None) -> GlobalCounts:
        counts = to_device(  # host-side batch tensors: reading them synchronizes nothing
            torch.tensor(
                [
                    sum(mb.loss_tokens() for mb in microbatches),
                    sum(mb.gen_samples() for mb in microbatches),
                    sum(mb.size for mb in microbatches),
                    sum(int(mb.images.shape[0]) for mb in microbatches),
                ],
                dtype=torch.float64,
            ),
            self.fabric.device,
        )
        work = None
        group = self.engine.count_group(self.step + 1, self.count_group)
        if group is not None:  # one copy per data-parallel replica
            work = dist.all_reduce(counts, group=group, async_op=True)
        return GlobalCounts(counts, work, trace)

    def _local_microbatches(self, microbatches: list[Batch]) -> list[Batch]:
        """The samples this process works on: its unit replica's block of every global microbatch."""
        if not self.global_stream:
            return microbatches
        if self.packing:  # one Batch per bucket: HotSPa splits them per strategy, DDP per replica here
            if self.cfg.parallel.mode == "hotspa":
                return microbatches
            from ..data.packed_loader import replica_rows
            from ..data.packing import bucket_boundaries, microbatch_rows

            rows = [microbatch_rows(self.cfg.data.packing, c) for c in bucket_boundaries(self.cfg)]
            return replica_rows(microbatches, rows, self.layout.llm.dp, self.dp_rank)
        if self.broker is not None:
            self.broker.set_image_counts([mb.image_counts.tolist() for mb in microbatches])
        block = self.unit.block(self.dp_rank, self.slot_samples)
        return [mb.select(block) for mb in microbatches]
