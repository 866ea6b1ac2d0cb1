"""Two collectives as autograd functions, for activations a group of ranks shares (tensor- and
context-parallel groups): ``sum_gradient`` (identity forward, the gradient summed over the group in backward:
each rank saw part of the uses) and ``sum_over_group`` (the value summed in forward, each part's gradient the
sum's in backward). Megatron calls them "copy to" and "reduce from" the tensor-parallel region."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_gradient(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` unchanged; its gradient all-reduced over ``group`` in backward."""
    return _SumGradient.apply(x, group)


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` all-reduced over ``group``; the gradient passed through unchanged to every part."""
    return _SumOverGroup.apply(x, group)
