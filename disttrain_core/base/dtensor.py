"""DTensor helpers every floor uses (comm/ buckets and sync, parallel/, train/): the local part of a
possibly tensor-parallel tensor and where it sits, and whether a parameter is split over its tensor-parallel group."""

from __future__ import annotations

from torch.distributed.tensor import DTensor


def is_sharded(param) -> bool:
    """True for a parameter split over the TP group (a DTensor with a Shard placement)."""
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_block(param):
    """``(local tensor, its offset in the full tensor)``: a DTensor's local shard, else the whole tensor."""
    if not isinstance(param, DTensor):
        return param, (0,) * param.ndim
    from .torch_compat import local_shape_and_offset

    _, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(offset)
