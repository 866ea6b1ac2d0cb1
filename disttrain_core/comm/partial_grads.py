"""Gradients that each tensor-parallel rank holds as a partial sum.

Under sequence parallelism a norm weight (or a bias) of a block stack sees only its rank's ``S / tp`` rows of the
residual stream, so each TP rank's gradient for it is a partial sum, and the sum over the TP group is the
gradient (parallel/tensor_parallel.py ``sequence_parallel_partial_params`` names them). Every path that reduces
gradients completes them here first: ZeRO-1's bucketed reduce-scatter (comm/engine.py), FSDP2's optimizer
(parallel/fsdp.py) and HotSPa's hand-over of a strategy's gradients to the home strategy (train/hotspa.py).
Where partial sums of several ranks are added into one gradient instead, one TP rank's counts (``counted_on``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..base.dtensor import local


class PartialGradients:
    """The parameters of one rank whose gradients are partial sums over ``tp_group``."""

    def __init__(self, params: Iterable[nn.Parameter] = (), tp_group=None):
        self.params = [p for p in params if p.requires_grad]
        self.ids = {id(p) for p in self.params}
        self.tp_group = tp_group
        self.active = bool(self.ids) and tp_group is not None and dist.get_world_size(tp_group) > 1

    def __contains__(self, param: nn.Parameter) -> bool:
        return id(param) in self.ids

    def __bool__(self) -> bool:
        return bool(self.ids)

    def complete(self, param: nn.Parameter) -> None:
        """``param``'s gradient summed over the TP group, in place (nothing for a parameter not held partially)."""
        if self.active and id(param) in self.ids and param.grad is not None:
            dist.all_reduce(local(param.grad), group=self.tp_group)

    def complete_all(self) -> None:
        for param in self.params:
            self.complete(param)

    def complete_tensors(self, pairs: Iterable[tuple[nn.Parameter, torch.Tensor]], sum_tensors) -> None:
        """Of (parameter, gradient tensor) pairs, the gradients of partially held parameters summed over the TP
        group by ``sum_tensors(tensors, group)`` (one bucketed call, where gradients live apart from .grad)."""
        if self.active:
            tensors = [grad for param, grad in pairs if id(param) in self.ids]
            if tensors:
                sum_tensors(tensors, self.tp_group)

    def counted_on(self, param: nn.Parameter, tp_rank: int) -> bool:
        """Whether this TP rank adds ``param``'s gradient into a sum taken once over the TP ranks: all of them for
        a whole gradient (each holds a slice or a copy), only TP rank 0 for a partial sum already completed."""
        return id(param) not in self.ids or tp_rank == 0
