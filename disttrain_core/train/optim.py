"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch

from ..config import OptimConfig
from ..parallel.zero import adamw

OPTIMIZERS = ("adamw", "sgd")


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or torch SGD, ``optim.name=sgd``); matrices (and convolution kernels) decay, vectors (norms,
    biases) do not."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={cfg.name!r} is unknown; available: {list(OPTIMIZERS)}")
    decay = [p for _, p in params if p.requires_grad and p.ndim >= 2]
    no_decay = [p for _, p in params if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=True)
    return adamw(groups, cfg)


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``decay_steps``, flat after."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else max_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, decay_steps, cfg.min_lr_ratio)
    )


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put a schedule at ``step`` (``step`` calls of ``scheduler.step()`` since the start): the learning
    rate is a function of the step alone, so a resumed run needs no saved scheduler state."""
    scheduler.last_epoch = step
    rates = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates
