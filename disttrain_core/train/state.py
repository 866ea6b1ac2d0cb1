"""What a checkpoint holds, by name: independent of wrappers, units, stages and sharding.

Keys: ``model.<parameter or persistent buffer name>`` (every parameter, frozen ones included) and
``optim.<parameter name>.exp_avg`` / ``exp_avg_sq`` / ``step`` for trainable parameters. Values
are the live tensors -- plain tensors (replicated: DCP writes one copy), DTensors (TP, FSDP2:
each rank its shard) or ZeRO-1 chunks (parallel/flat_chunks.py) -- so a load writes in place.

The model's fingerprint names the architecture: every parameter's and persistent buffer's name
and full shape. Any layout of one model has the same fingerprint; another model does not.
"""

from __future__ import annotations

import hashlib
import heapq

import torch
from torch import nn

from ..parallel.zero import MOMENTS


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers a state dict would hold (non-persistent ones -- rope tables, pixel statistics -- excluded)."""
    buffers = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                buffers[f"{prefix}.{name}" if prefix else name] = buffer
    return buffers


def model_entries(modules: list[nn.Module], skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    state = {}
    for module in modules:
        for name, param in module.named_parameters():
            if name not in skip:
                state[f"model.{name}"] = param.detach()
        for name, buffer in persistent_buffers(module).items():
            state[f"model.{name}"] = buffer
    return state


def adamw_entries(optimizer: torch.optim.Optimizer, named_params: list[tuple[str, nn.Parameter]]) -> dict:
    """A torch AdamW's state (whole or DTensor parameters) by parameter name; created (zero moments, step 0)
    where no step has run yet, as AdamW's first step would, so it can be saved and loaded into."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    state = {}
    for name, param in named_params:
        if id(param) not in groups:
            continue
        entry = optimizer.state.get(param)
        if not entry:
            group = groups[id(param)]
            on_device = group.get("fused") or group.get("capturable")
            entry = optimizer.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu"),
                **{key: torch.zeros_like(param, memory_format=torch.preserve_format) for key in MOMENTS},
            }
        for key in (*MOMENTS, "step"):
            state[f"optim.{name}.{key}"] = entry[key]
    return state


def optimizer_entries(optimizer: torch.optim.Optimizer, named_params: list[tuple[str, nn.Parameter]]) -> dict:
    """AdamW's state (:func:`adamw_entries`), or torch SGD's momentum buffers as ``optim.<name>.momentum_buffer``
    (none without momentum). A zero buffer made before the first step gives that step what torch's own first
    step gives (the gradient itself, dampening 0)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return adamw_entries(optimizer, named_params)
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    state = {}
    for name, param in named_params:
        group = groups.get(id(param))
        if group is None or not group["momentum"]:
            continue
        entry = optimizer.state[param]
        if entry.get("momentum_buffer") is None:
            entry["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state[f"optim.{name}.momentum_buffer"] = entry["momentum_buffer"]
    return state


def owned_by(entries: dict, index: int, count: int) -> dict:
    """The entries replica ``index`` of ``count`` identical replicas saves: replicated tensors split by bytes
    (largest first, each to the least loaded replica; the same on every replica), so each tensor is
    staged and written once instead of on every replica."""
    if count <= 1:
        return entries
    loads = [(0, r) for r in range(count)]
    keep = {}
    for key in sorted(entries, key=lambda k: (-_nbytes(entries[k]), k)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + _nbytes(entries[key]), owner))
        if owner == index:
            keep[key] = entries[key]
    return keep


def _nbytes(value) -> int:
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.numel() * local.element_size()


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 (16 hex digits) of every parameter's and persistent buffer's name and shape (works on meta)."""
    lines = [f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters()]
    lines += [f"{n}:{tuple(b.shape)}" for n, b in persistent_buffers(model).items()]
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:16]
