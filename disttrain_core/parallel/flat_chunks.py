"""Flattened ranges of parameters as checkpoint chunks (the distributed optimizer's layout, in DCP).

ZeRO-1 cuts its flat buffers into equal slices per data-parallel replica, so a replica owns a
contiguous range of a parameter's *flattened* elements that starts and ends anywhere, mid-row
included. Megatron saves such state as flattened 1-D chunks with offsets; here the same range
is described exactly as a few boxes of the parameter's own shape: a contiguous range of a
row-major tensor is the union of at most ``2 * ndim - 1`` boxes (a partial first row, whole rows,
a partial last row, recursively), each contiguous in memory. Placed at the tensor-parallel
block's offset inside the full parameter, the boxes are the local shards of a
``ShardedTensor``, the torch.distributed.checkpoint type that carries arbitrary chunks (a
DTensor describes only even splits). Saved this way, any layout -- DDP, FSDP2, another ZeRO-1
data-parallel size, other stages -- reads the state by intersecting chunks, and no rank ever
holds more than its own slice.

torch marks ShardedTensor deprecated in favour of DTensor; DCP still reads and writes it, and
Megatron's ``torch_dist`` checkpoints rely on it the same way. Its FutureWarning is silenced for
these calls only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first flat index


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes covering flat elements ``[start, stop)`` of a row-major tensor of ``shape``, in order.

    Each box is ``(offsets, sizes, flat_start)``; its elements are contiguous in flat order, starting at
    ``flat_start``."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        base = first * inner
        return [((first, *o), (1, *s), base + f) for o, s, f in range_boxes(shape[1:], start - base, stop - base)]
    boxes: list[Box] = []
    whole_from, whole_to = -(-start // inner), stop // inner
    if start % inner:
        boxes += range_boxes(shape, start, whole_from * inner)
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from, *shape[1:]), whole_from * inner))
    if stop % inner:
        boxes += range_boxes(shape, whole_to * inner, stop)
    return boxes


def subtract(box: tuple[tuple[int, ...], tuple[int, ...]], cut: tuple[tuple[int, ...], tuple[int, ...]]):
    """``box`` minus ``cut`` as disjoint boxes (offsets, sizes)."""
    offsets, sizes = list(box[0]), list(box[1])
    pieces = []
    for dim in range(len(offsets)):
        low, high = offsets[dim], offsets[dim] + sizes[dim]
        cut_low, cut_high = max(low, cut[0][dim]), min(high, cut[0][dim] + cut[1][dim])
        if cut_low >= cut_high:  # no overlap: the box stays whole (minus what was split off already)
            return pieces + [(tuple(offsets), tuple(sizes))]
        if low < cut_low:
            pieces.append((tuple(offsets), tuple(sizes[:dim] + [cut_low - low] + sizes[dim + 1 :])))
        if cut_high < high:
            pieces.append(
                (
                    tuple(offsets[:dim] + [cut_high] + offsets[dim + 1 :]),
                    tuple(sizes[:dim] + [high - cut_high] + sizes[dim + 1 :]),
                )
            )
        offsets[dim], sizes[dim] = cut_low, cut_high - cut_low
    return pieces  # the rest was entirely inside the cut


@contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def sharded_chunks(pieces: list[tuple[tuple[int, ...], torch.Tensor]], size: torch.Size, rank: int, world: int):
    """A ShardedTensor (or, for one piece that is the whole tensor, that tensor) of global ``size`` whose local
    shards are ``pieces`` ((offsets, tensor) pairs; the
    tensors are used as they are, so loading writes into them).

    torch checks that a ShardedTensor's metadata covers the whole tensor; what other ranks hold is not
    needed for checkpointing, so the rest of the tensor is described as held elsewhere (DCP plans only
    local shards; what each rank writes or reads is exactly ``pieces``)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(size):  # the whole tensor: a plain one will do
        return pieces[0][1]
    device = pieces[0][1].device if pieces else torch.device("cpu")
    here = f"rank:{rank}/{device}"
    shards = [Shard(t, ShardMetadata(list(o), list(t.shape), here)) for o, t in pieces]
    rest = [((0,) * len(size), tuple(size))]
    for offsets, tensor in pieces:
        rest = [piece for box in rest for piece in subtract(box, (tuple(offsets), tuple(tensor.shape)))]
    elsewhere = f"rank:{(rank + 1) % max(world, 1)}/{device}"
    if rest and world < 2:
        raise ValueError(f"a single process must hold the whole tensor of size {tuple(size)}")
    metadata = ShardedTensorMetadata(
        [s.metadata for s in shards] + [ShardMetadata(list(o), list(s), elsewhere) for o, s in rest],
        torch.Size(size),
        TensorProperties(dtype=pieces[0][1].dtype if pieces else torch.float32),
    )
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)
