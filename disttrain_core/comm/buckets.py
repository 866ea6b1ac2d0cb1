"""Flat, bucketed buffers of one rank's parameters (the layout ZeRO-1 shards).

A ``FlatBuckets`` lays a list of parameters end to end, grouped into *buckets*
in the order autograd is expected to make their gradients ready: the reverse
of definition order, the heuristic PyTorch DDP and Megatron-LM use. Each bucket
is padded to a multiple of the data-parallel size ``dp`` and cut into ``dp``
equal slices; replica ``r`` owns slice ``r`` of *every* bucket. A bucket is
therefore a complete unit of communication: its gradients can be
reduce-scattered as soon as they are all ready, and its parameters all-gathered
on their own, without waiting for the rest of the model.

This replica's shard (what ZeRO-1 keeps fp32 master weights and Adam moments
for) is the concatenation of its slices, bucket after bucket. With one bucket
the layout is plain "flat buffer cut in dp pieces".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..base.dtensor import is_sharded, local


@dataclass(frozen=True)
class Bucket:
    index: int  # position in readiness order (0: gradients ready first)
    members: tuple[int, ...]  # parameter indices, laid out in this order
    offset: int  # start inside the padded flat buffer
    numel: int  # parameter elements (without padding)
    padded: int  # a multiple of dp
    shard_offset: int  # start of this replica's slice inside the shard
    shard_size: int  # padded // dp

    def full(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.padded]

    def slice_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        start = self.offset + rank * self.shard_size
        return flat[start : start + self.shard_size]

    def shard(self, shard: torch.Tensor) -> torch.Tensor:
        return shard[self.shard_offset : self.shard_offset + self.shard_size]


def bucket_numel(bucket_mb: float) -> float:
    """Elements of fp32 per bucket for ``parallel.comm.bucket_mb`` (0: one bucket, ``inf``)."""
    return bucket_mb * 2**20 / 4 if bucket_mb > 0 else math.inf


GRADED = (1 / 8, 1 / 4, 1 / 2)  # sizes, in bucket sizes, of the buckets holding the first-used parameters


def plan_buckets(sizes: list[int], bucket_numel: float, dp: int, graded: bool = False) -> list[Bucket]:
    """Group parameters (by element count, in definition order) into readiness-ordered buckets.

    A bucket closes once it holds at least ``bucket_numel`` elements; ``inf`` gives one bucket.

    ``graded``: the parameters defined first -- the first the forward needs and the last whose
    gradients are ready -- go into smaller buckets of 1/8, 1/4 and 1/2 of the size (in definition
    order). Their all-gather is what the first layer waits for after a step, and their reduce-scatter
    is what the step waits for after backward; with full-size buckets both waits are a whole bucket.
    """
    head: list[list[int]] = []  # definition-order groups for the first-used parameters
    start = 0
    if graded and math.isfinite(bucket_numel):
        for fraction in GRADED:
            group, count = [], 0
            while start < len(sizes) and count < fraction * bucket_numel:
                group.append(start)
                count += sizes[start]
                start += 1
            if group:
                head.append(group)
    buckets: list[Bucket] = []
    members: list[int] = []
    count = offset = shard_offset = 0

    def close() -> None:
        nonlocal members, count, offset, shard_offset
        padded = math.ceil(max(count, 1) / dp) * dp
        bucket = Bucket(len(buckets), tuple(members), offset, count, padded, shard_offset, padded // dp)
        buckets.append(bucket)
        offset += padded
        shard_offset += padded // dp
        members, count = [], 0

    for index in reversed(range(start, len(sizes))):
        members.append(index)
        count += sizes[index]
        if count >= bucket_numel:
            close()
    if members or not (buckets or head):
        close()
    for group in reversed(head):  # readiness order: the group defined last is ready first
        members, count = list(reversed(group)), sum(sizes[i] for i in group)
        close()
    return buckets


def _rebind_dtensor(param, local: torch.Tensor) -> None:
    """Make the DTensor parameter ``param`` hold ``local`` (a view of a flat buffer) as its shard, in place:
    the same Python object (optimizers and hooks keep their references) with new contents. Setting
    ``param._local_tensor.data`` does the same in eager mode, but TorchDynamo cannot trace a DTensor whose
    inner tensor was re-pointed that way (trainer.compile fails while faking it, torch 2.13); a DTensor built
    from the view and swapped in traces like any other parameter."""
    from torch.distributed.tensor import DTensor

    rebuilt = DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    torch.utils.swap_tensors(param, torch.nn.Parameter(rebuilt, requires_grad=param.requires_grad))


class FlatBuckets:
    """One flat, bucketed fp32 layout of a list of (possibly tensor-parallel) parameters.

    ``bind`` makes the parameters and their gradients *views* into two flat buffers laid out this way
    (Megatron's distributed-optimizer layout): the all-gather of updated slices lands in the parameters
    and the reduce-scatter of gradients lands in this replica's slice of the gradient buffer, which is
    also its master shards' gradient -- no copies, no second buffer. ``masters`` holds one fp32 master
    tensor per bucket (this replica's slice), the parameters of the optimizer.
    """

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        dp: int,
        rank: int,
        tp: int,
        bucket_numel: float = math.inf,
        device: torch.device | None = None,
        graded: bool = False,
    ):
        self.params = params
        self.dp, self.rank = dp, rank
        self.locals = [local(p) for _, p in params]
        self.buckets = plan_buckets([t.numel() for t in self.locals], bucket_numel, dp, graded)
        self.offsets = [0] * len(params)
        self.bucket_of = [0] * len(params)
        for bucket in self.buckets:
            position = bucket.offset
            for index in bucket.members:
                self.offsets[index] = position
                self.bucket_of[index] = bucket.index
                position += self.locals[index].numel()
        last = self.buckets[-1]
        self.padded = last.offset + last.padded
        self.shard_numel = last.shard_offset + last.shard_size
        self.device = device or (self.locals[0].device if self.locals else torch.device("cpu"))
        full = self.gather_params()
        self.masters = [torch.nn.Parameter(b.slice_of(full, rank).clone()) for b in self.buckets]
        # Elements replicated over the TP group are held by every TP rank: in the global gradient norm they
        # count 1/tp times. Kept as (bucket, start, stop, weight) ranges of this replica's slices, not as a
        # buffer the size of the shard.
        self.norm_ranges: list[tuple[int, int, int, float]] = []
        if tp > 1:
            for index, ((_, param), tensor, offset) in enumerate(zip(params, self.locals, self.offsets, strict=True)):
                if is_sharded(param):
                    continue
                bucket = self.buckets[self.bucket_of[index]]
                own = bucket.offset + rank * bucket.shard_size
                start, stop = max(offset, own), min(offset + tensor.numel(), own + bucket.shard_size)
                if start < stop:
                    self.norm_ranges.append((bucket.index, start - own, stop - own, 1.0 / tp))

    # ----------------------------------------------------------- layout maps
    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This replica's slices of a full flat buffer, bucket after bucket (a copy)."""
        return torch.cat([b.slice_of(full, self.rank) for b in self.buckets]).clone()

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """Inverse of ``shard_of`` over replicas: ``gathered`` is every replica's shard, ``[dp * shard_numel]``."""
        per_rank = gathered.view(self.dp, self.shard_numel)
        full = torch.zeros(self.padded, dtype=gathered.dtype, device=gathered.device)
        for b in self.buckets:
            b.full(full).view(self.dp, b.shard_size).copy_(per_rank[:, b.shard_offset : b.shard_offset + b.shard_size])
        return full

    def parameter_slice(self, full: torch.Tensor, index: int) -> torch.Tensor:
        tensor = self.locals[index]
        return full[self.offsets[index] : self.offsets[index] + tensor.numel()].view_as(tensor)

    def master_shard(self) -> torch.Tensor:
        """The master values of this replica as one shard (bucket after bucket; a copy)."""
        return torch.cat([m.detach() for m in self.masters])

    def squared_grad_norm(self) -> torch.Tensor:
        """This replica's share of the global squared gradient norm (fp64), TP-replicated elements weighted."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for master in self.masters:
            if master.grad is not None:
                total += torch.linalg.vector_norm(master.grad, dtype=torch.float64).square()
        for index, start, stop, weight in self.norm_ranges:
            grad = self.masters[index].grad
            if grad is not None:
                total += (weight - 1.0) * torch.linalg.vector_norm(grad[start:stop], dtype=torch.float64).square()
        return total

    # --------------------------------------------------------------- copies
    def gather_params(self) -> torch.Tensor:
        """The parameters' current values as a full flat fp32 buffer (a new one)."""
        full = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for index, tensor in enumerate(self.locals):
                self.parameter_slice(full, index).copy_(tensor.detach())
        return full

    def bind(self, param_flat: torch.Tensor | None, grad_flat: torch.Tensor) -> None:
        """Make the parameters (when ``param_flat`` is given: it must hold their values) and their gradients
        views into the flat buffers, and each master's gradient this replica's slice of ``grad_flat``.
        Gradients then accumulate in place and are zeroed, never set to None."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for index, (_, param) in enumerate(self.params):
                grad = self.parameter_slice(grad_flat, index)
                if param_flat is not None:
                    view = self.parameter_slice(param_flat, index)
                    if isinstance(param, DTensor):
                        _rebind_dtensor(param, view)
                    else:
                        param.data = view
                if isinstance(param, DTensor):
                    param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
                else:
                    param.grad = grad
            self.locals = [local(p) for _, p in self.params]
        for bucket, master in zip(self.buckets, self.masters, strict=True):
            master.grad = bucket.slice_of(grad_flat, self.rank)

    def write_back(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy the bucket's part of a full flat buffer into the parameters (when they are not views of it)."""
        with torch.no_grad():
            for index in bucket.members:
                self.locals[index].copy_(self.parameter_slice(flat, index))
