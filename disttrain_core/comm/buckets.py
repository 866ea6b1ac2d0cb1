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

from ..dtensor import is_sharded, local


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


class FlatBuckets:
    """One flat, bucketed fp32 view of a list of (possibly tensor-parallel) parameters."""

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
        weights = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for (_, param), tensor, offset in zip(params, self.locals, self.offsets, strict=True):
            # Elements replicated over the TP group are held by every TP rank: count them 1/tp times.
            weights[offset : offset + tensor.numel()] = 1.0 if is_sharded(param) else 1.0 / tp
        self.master = torch.nn.Parameter(self.shard_of(self.gather_params()))
        self.norm_weight = self.shard_of(weights)
        self.norm_scale = self.norm_weight.sqrt()  # squared norm = || grad * sqrt(weight) ||^2
        # Padding has weight 0 but always a zero gradient, so "all ones" may ignore it.
        self.unit_norm_weight = bool(((self.norm_weight == 1) | (self.norm_weight == 0)).all())

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

    # --------------------------------------------------------------- copies
    def gather_params(self) -> torch.Tensor:
        """The parameters' current values as a full flat fp32 buffer."""
        full = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for index, tensor in enumerate(self.locals):
                self.parameter_slice(full, index).copy_(tensor.detach())
        return full

    def fill_grads(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy the bucket's parameter gradients into its part of ``flat`` (zeros where a gradient is None)."""
        for index in bucket.members:
            grad = self.params[index][1].grad
            target = self.parameter_slice(flat, index)
            if grad is None:
                target.zero_()
            else:
                target.copy_(local(grad).detach())

    def write_back(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy the bucket's part of a full flat buffer into the parameters."""
        with torch.no_grad():
            for index in bucket.members:
                self.locals[index].copy_(self.parameter_slice(flat, index))
