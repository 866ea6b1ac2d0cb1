"""Two DTensor helpers every floor uses (comm/ buckets and sync, parallel/, train/): the local part of a
possibly tensor-parallel tensor, and whether a parameter is split over its tensor-parallel group."""

from __future__ import annotations

from torch.distributed.tensor import DTensor


def is_sharded(param) -> bool:
    """True for a parameter split over the TP group (a DTensor with a Shard placement)."""
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
