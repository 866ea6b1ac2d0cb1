"""A differentiable all-to-all with uneven splits, for expert parallelism.

Each rank sends block ``d`` of its rows to rank ``d`` of the group and receives, in group-rank order,
the blocks the others address to it; the block sizes may differ per pair and may be zero. The backward
pass is the same exchange in reverse: the gradient of the rows a rank received goes back to the rank
that sent them, with the split sizes swapped.

What the backends accept (measured on torch 2.13 CPU, gloo, 2 and 3 processes, float32/float64/bf16/int64):

* ``dist.all_to_all_single`` with ``input_split_sizes``/``output_split_sizes`` works with uneven splits on
  gloo, including zero-row blocks, a rank that sends and receives nothing, and subgroups; no padding is
  needed. (The list form ``dist.all_to_all`` does not: gloo demands equal tensor sizes.)
* A non-contiguous *input* raises ``ValueError: Tensors must be contiguous``. A non-contiguous *output*
  (a column slice of a larger buffer) is accepted silently and ends up holding wrong data. Both buffers
  are therefore made contiguous here.
* NCCL (documented behaviour, not measured here) accepts the same uneven splits on CUDA tensors and runs
  the exchange on its communication stream; the split sizes are host lists on either backend, so the
  caller pays one host sync to learn how many rows it will receive (``exchange_counts``).

``torch.distributed.nn.functional.all_to_all_single`` is not used: its backward gives wrong gradients on
gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Non-differentiable uneven all-to-all of ``rows`` (split along dim 0) into a fresh contiguous buffer."""
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))  # new_empty: contiguous, as gloo needs
    dist.all_to_all_single(out, rows, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """``send_counts`` [group size, ...] (int64, row ``d``: what this rank sends to rank ``d``) -> what
    every rank sends to this one, row ``s`` from rank ``s``. Equal splits, so no sizes are needed first."""
    send_counts = send_counts.contiguous()
    out = torch.empty_like(send_counts)
    dist.all_to_all_single(out, send_counts, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Uneven all-to-all whose gradient is the reverse exchange. Every rank of ``group`` must call it,
    and its backward, in the same order (autograd does, when every rank runs the same graph)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> torch.Tensor:
    """Send ``rows[sum(send_splits[:d]) : sum(send_splits[:d+1])]`` to group rank ``d``; return the rows
    received, concatenated in source-rank order (``recv_splits[s]`` from rank ``s``). Differentiable."""
    if len(send_splits) != len(recv_splits) or sum(send_splits) != rows.shape[0]:
        raise ValueError(
            f"all_to_all: send_splits {send_splits} must sum to the {rows.shape[0]} rows sent and have one entry per "
            f"rank, like recv_splits {recv_splits}"
        )
    return AllToAll.apply(rows, list(send_splits), list(recv_splits), group)
