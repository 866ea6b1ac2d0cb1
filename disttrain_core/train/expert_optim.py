"""The optimizer of the experts a rank holds under expert parallelism.

ZeRO-1 (parallel/zero.py) shards state over ranks that hold the same parameters; experts differ between
the ranks of an EP group, so they are kept out of its flat buffers and stepped here: each expert's gradient
is summed over the ranks holding the same experts (the unit's data-parallel replicas with the same EP
index, times the context-parallel ranks: ``dp x cp / ep`` of them) and AdamW runs on every one of them
(replicated state: the experts are already 1/ep of the expert parameters per rank). The ZeRO-1 optimizer
drives it (``ZeroOneOptimizer.experts``): one learning rate, one gradient norm, one checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base.dtensor import local
from ..comm.buckets import bucket_numel
from ..comm.engine import allreduce_tensors
from ..config import CommConfig, OptimConfig
from ..parallel.zero import adamw
from .state import adamw_entries, owned_by


class ExpertOptimizer:
    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        cfg: OptimConfig,
        group,
        replicas: int,
        index: int,
        comm: CommConfig | None = None,
    ):
        self.named_params = named_params
        self.bucket_numel = bucket_numel((comm or CommConfig()).bucket_mb)
        self.params = [p for _, p in named_params]
        self.group, self.replicas, self.index = group, replicas, index
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        self.inner = adamw(groups, cfg)

    def reduce_gradients(self) -> None:
        """Sum the expert gradients over the ranks holding the same experts (in parallel.comm.bucket_mb buckets)."""
        for p in self.params:
            if p.grad is None:  # an expert no token reached on any microbatch of this rank
                p.grad = torch.zeros_like(p)
        if self.group is not None and self.replicas > 1:  # a sum: the loss is already normalized globally
            # under tensor parallelism the experts are DTensors: each TP rank sums its own slices
            allreduce_tensors([local(p.grad) for p in self.params], self.group, self.bucket_numel, world=1)

    def grad_norm_squared(self) -> torch.Tensor:
        """This rank's share of the global squared norm: each expert is counted once over its replicas."""
        if not self.params:
            return torch.zeros(())
        return sum(local(p.grad).double().pow(2).sum() for p in self.params).float() / self.replicas

    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def checkpoint_state(self, saving: bool) -> dict:
        """``model.<expert>`` and its AdamW state; each of the replicas saves its share of the copies."""
        entries = {f"model.{name}": p.detach() for name, p in self.named_params}
        entries.update(adamw_entries(self.inner, self.named_params))
        return owned_by(entries, self.index, self.replicas) if saving else entries
