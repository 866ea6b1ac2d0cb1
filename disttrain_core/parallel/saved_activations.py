"""Where a block's saved activations wait for its backward, beyond keeping or recomputing them
(parallel/recompute.py): ``offload`` moves them to host memory, ``full_partitioned`` recomputes and keeps each
block's input split over the tensor-parallel group (ZeRO-R's partitioned activation checkpoints, seed 002). Both
are ``torch.autograd.graph.saved_tensors_hooks``: autograd hands every tensor it saves to ``pack`` and asks
``unpack`` for it in the backward.

``offload`` (``HostOffload``), per block forward:

* every saved tensor except the block's parameters (their storage is the module's: nothing to free) is copied to
  host memory a storage at a time (several saved views of one storage cost one copy; a DTensor's local tensor is
  copied and its placement rebuilt on the way back) -- on CUDA into pinned memory on a side stream that first
  waits for the compute stream, the device storage released to the allocator once the block's forward has ended
  and that copy is done (``record_stream``), so the copies overlap the next block's forward and the compute stream
  never waits for the host;
* in the backward, the first unpack of a block's tensors also starts copying the previous block's back on the
  side stream (its backward is next), so those copies overlap this block's backward; a tensor not prefetched is
  copied back on the compute stream when asked for (after its copy out is complete: an event, no host sync).
  Only autograd holds a copied-back tensor: it goes when the backward is done with it.

On the device then live one block's restored tensors and the next block's prefetched ones, and the copies of the
block whose forward just ran (planner/activation_costs.py counts two blocks). On a CPU the host is the device: the
hooks still copy (tests check which tensors move and that results are bit-equal), nothing is freed.

``full_partitioned`` (``TpPartition``) wraps the full-recompute checkpoint: torch's non-reentrant checkpoint saves
the block's inputs (all it keeps) through the hooks active around it, so each TP rank keeps 1/tp of each input that
carries a gradient (the hidden states, replicated over the TP group without sequence parallelism; the tables and
masks every block shares stay whole, one copy for all) and the recompute all-gathers them on the TP group first
-- every rank of the group recomputes the same block at the same point of its backward, so the
gathers match. With sequence parallelism the inputs are split already (validation refuses the policy there).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ..base.torch_compat import all_gather_tensor


def _storage(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor parameter (tensor parallelism): its shard's storage
    return local.untyped_storage().data_ptr()


class _Saved:
    """One offloaded storage (every saved tensor of a block that views it shares it): its bytes on the host, the
    event its copy there completes on (CUDA), its device copy while prefetched and not yet handed to autograd
    (``back``, ``ready``: the event it completes on), and afterwards a weak reference to that copy (``handed``: a
    second saved view of the storage reuses it while autograd still holds it, and nothing here keeps it alive)."""

    __slots__ = ("host", "done", "back", "ready", "handed")

    def __init__(self, host, done) -> None:
        self.host, self.done, self.back, self.ready, self.handed = host, done, None, None, None


class _Block:
    """The offloaded storages of one block forward; ``previous``: the block that ran just before it in the same
    stage forward (its backward comes next), until this block's backward starts copying it back."""

    __slots__ = ("index", "saved", "previous", "live")

    def __init__(self, index: int, previous) -> None:
        self.index, self.saved, self.previous = index, {}, previous
        # While the block's forward runs, the device storages copied so far: held so that none is freed and its
        # address reused by a later tensor of the same forward (the address keys ``saved``).
        self.live: list | None = []


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as one flat byte tensor (a view: no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(storage_bytes: torch.Tensor, t_meta: tuple) -> torch.Tensor:
    """The tensor ``t_meta`` described over the bytes ``storage_bytes`` (another copy of its storage)."""
    dtype, offset, shape, stride = t_meta
    return torch.empty(0, dtype=dtype, device=storage_bytes.device).set_(
        storage_bytes.untyped_storage(), offset, shape, stride
    )


class HostOffload:
    """``parallel.recompute=offload`` for the blocks of one stage (one instance per stage module). A block's saved
    tensors are moved a storage at a time: several saved views of one storage (a projection's output and its
    reshaped heads) cost one copy, and what the device frees is what was copied."""

    def __init__(self) -> None:
        self.moved_bytes = 0  # bytes copied to the host in forwards so far (tests compare the memory model)
        self._stream = None
        self._last: _Block | None = None

    def wrap(self, block: nn.Module, index: int) -> None:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, **kw):
            last = self._last
            current = _Block(index, last if last is not None and last.index == index - 1 else None)
            keep = {_storage(p) for p in block.parameters()}
            with saved_tensors_hooks(functools.partial(self._pack, current, keep), self._unpack):
                out = inner(*args, **kw)
            current.live = None  # the copied storages may go once their copies are done
            self._last = current
            return out

        block.forward = forward
        block._offload = True

    def _side(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, block: _Block, keep: set[int], t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.layout != torch.strided or t.is_meta:
            return t  # a weight (held by the module anyway), or nothing to copy
        if isinstance(t, DTensor):  # tensor parallelism's saved inputs: the local tensor moves, the placement stays
            inner = self._pack(block, keep, t._local_tensor)
            if not isinstance(inner, tuple):
                return t
            return (*inner[:4], (t.device_mesh, t.placements, t.shape, t.stride()))
        if type(t) is not torch.Tensor or _storage(t) in keep:
            return t
        key = (_storage(t), t._version)  # written since an earlier view of it was copied: copied again
        meta = (t.dtype, t.storage_offset(), t.shape, t.stride())
        saved = block.saved.get(key)
        if saved is None:
            source = _bytes_of(t)
            saved = block.saved[key] = self._copy_out(source)
            block.live.append(source)
        return (block, saved, t.device, meta, None)

    def _copy_out(self, source: torch.Tensor) -> _Saved:
        self.moved_bytes += source.numel()
        if source.device.type != "cuda":  # the host is the device: a copy, nothing freed
            return _Saved(source.clone(), None)
        side, compute = self._side(source.device), torch.cuda.current_stream(source.device)
        side.wait_stream(compute)  # the storage is written
        host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        source.record_stream(side)  # the allocator reuses the storage only after the copy
        return _Saved(host, done)

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        block, saved, device, meta, placed = packed
        previous, block.previous = block.previous, None
        if previous is not None:  # this block's backward began: the block before it is next
            self._prefetch(previous, device)
        local = _view(self._device_copy(saved, device), meta)
        if placed is None:
            return local
        mesh, placements, shape, stride = placed
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _device_copy(self, saved: _Saved, device: torch.device) -> torch.Tensor:
        """The storage's bytes on the device, for autograd (which alone keeps them from now on)."""
        if device.type != "cuda":
            return saved.host
        compute = torch.cuda.current_stream(device)
        back = saved.handed() if saved.handed is not None else None
        if back is not None:
            return back
        if saved.back is not None:  # prefetched on the side stream: the compute stream waits for it
            back, saved.back = saved.back, None
            compute.wait_event(saved.ready)
            back.record_stream(compute)
        else:  # copied back now, after its copy out (an event, no host wait)
            compute.wait_event(saved.done)
            back = saved.host.to(device, non_blocking=True)
        saved.handed = weakref.ref(back)
        return back

    def _prefetch(self, block: _Block, device: torch.device) -> None:
        pending, block.saved = block.saved, {}  # held on by the packed tensors autograd keeps
        if device.type != "cuda":
            return
        side = self._side(device)
        with torch.cuda.stream(side):
            for saved in pending.values():
                if saved.back is not None or (saved.handed is not None and saved.handed() is not None):
                    continue
                side.wait_event(saved.done)
                saved.back = saved.host.to(device, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(side)


class TpPartition:
    """The pack and unpack hooks of ``parallel.recompute=full_partitioned`` over one TP group."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.kept_bytes = 0  # bytes of input shards kept so far (tests)

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if not t.requires_grad or t.numel() % self.size or isinstance(t, nn.Parameter):
            return t  # a table or mask shared by every block (rotary angles, document bounds): kept once, whole
        shard = t.detach().reshape(-1).chunk(self.size)[self.rank].clone()
        self.kept_bytes += shard.numel() * shard.element_size()
        return (shard, t.shape)

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        shard, shape = packed
        full = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        all_gather_tensor(full, shard, group=self.group)
        return full.view(shape)
