"""Megatron's sequence parallelism: the residual stream of a block stack split along the sequence over the TP group.

Between the tensor-parallel regions of a block (attention, feed-forward) each TP rank holds ``S / tp`` rows of
the residual stream, so the norms, the residual adds and what they save for backward shrink by ``tp``. Into a
region the normed rows are all-gathered (backward: the partial gradients reduce-scattered); out of it the
row-parallel layer's partial sums are reduce-scattered instead of all-reduced (backward: all-gathered). The
volume equals the all-reduces of plain TP, one all-reduce being a reduce-scatter plus an all-gather.

A sequence that ``tp`` does not divide (a ViT's patches plus its class token) is padded with zero rows to the
next multiple; the padding never enters attention or the feed-forward (the gathered rows are trimmed to the
true length first) and is dropped when the stack ends, so it receives no gradient.

The collectives run on the sequence-first layout (``[S, B, D]``), whose per-rank chunks are contiguous: gloo and
NCCL take only the concatenated dim-0 layout (reference/cpu-probe.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..base.torch_compat import all_gather_tensor, reduce_scatter_tensor


def _pad_to(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[1] == rows else F.pad(x, (0, 0, 0, rows - x.shape[1]))


def _all_gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[B, s, D] chunks -> [B, s * size, D], rank order."""
    local = x.transpose(0, 1).contiguous()
    out = local.new_empty((local.shape[0] * size, *local.shape[1:]))
    all_gather_tensor(out, local, group=group)
    # contiguous: layers reshaping a strided view would each copy (and save) it
    return out.transpose(0, 1).contiguous()


def _reduce_scatter(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[B, S, D] partial sums -> this rank's [B, S / size, D] chunk of their sum."""
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    reduce_scatter_tensor(out, full, group=group)
    return out.transpose(0, 1).contiguous()


def _chunk(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = x.shape[1] // size
    return x[:, rank * rows : (rank + 1) * rows]


class _Scatter(torch.autograd.Function):
    """Replicated [B, L, D] -> this rank's chunk of it padded to a multiple of the group; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, split):
        ctx.split, ctx.length = split, x.shape[1]
        # a copy, never a view: a view would keep the whole sequence's storage alive for as long as the chunk
        return _chunk(_pad_to(x, split.padded(x.shape[1])), split.rank, split.size).clone()

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        return _all_gather(grad, split.group, split.size)[:, : ctx.length], None


class _Gather(torch.autograd.Function):
    """Chunks -> the whole [B, L, D] (padding trimmed). Backward: the gradients reduce-scattered when each rank's
    is a partial sum (the column-parallel layers after it), else (``partial=False``: every rank computed the same
    whole gradient) this rank's chunk of it."""

    @staticmethod
    def forward(ctx, x, split, length, partial):
        ctx.split, ctx.partial = split, partial
        whole = _all_gather(x, split.group, split.size)
        return whole if whole.shape[1] == length else whole[:, :length].contiguous()

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        grad = _pad_to(grad, split.padded(grad.shape[1]))
        if ctx.partial:
            return _reduce_scatter(grad, split.group, split.size), None, None, None
        return _chunk(grad, split.rank, split.size).contiguous(), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Partial sums [B, L, D] (a row-parallel layer's) -> this rank's padded chunk of their sum; backward
    all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx, x, split):
        ctx.split, ctx.length = split, x.shape[1]
        return _reduce_scatter(_pad_to(x, split.padded(x.shape[1])), split.group, split.size)

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        return _all_gather(grad, split.group, split.size)[:, : ctx.length], None


class SequenceSplit:
    """One block stack's sequence split over a TP ``group``. ``scatter`` at the stack's entry records the true
    length that ``gather`` restores (every input of a stack has one length: model.seq_len / cp, or a ViT's
    tokens per image)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.length: int | None = None

    def padded(self, length: int) -> int:
        return -(-length // self.size) * self.size

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        self.length = x.shape[1]
        return _Scatter.apply(x, self)

    def gather(self, x: torch.Tensor, partial: bool = True) -> torch.Tensor:
        if self.length is None:
            raise RuntimeError("SequenceSplit.gather before scatter: the stack's entry sets the sequence length")
        return _Gather.apply(x, self, self.length, partial)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceScatter.apply(x, self)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """The stack's exit: the whole sequence again (every rank's gradient for it is the same)."""
        return self.gather(x, partial=False)
