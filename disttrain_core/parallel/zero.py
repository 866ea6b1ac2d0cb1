"""ZeRO stage 1: AdamW whose states live on 1/dp of the data-parallel replicas each.

This rank's (local, possibly tensor-parallel) parameters are laid end to end in two
flat fp32 buffers -- weights that decay, and vectors that do not -- each padded to a
multiple of the unit's data-parallel size and cut into ``dp`` equal shards. A step:

1. reduce-scatter (sum) the flat gradients: replica ``r`` receives the summed
   gradient of shard ``r`` only;
2. AdamW on the shard: the fp32 master copy of shard ``r`` and its two moments
   are all this replica stores -- 12 bytes per parameter spread over ``dp`` replicas
   instead of on each (the "1/dp" of optimizer state);
3. all-gather the updated shards and copy them back into the parameters.

Parameters stay fp32 (the master weights); ``bf16-mixed`` runs the compute in
bf16 under autocast. The gradient norm for clipping comes from the reduced shards:
each element counts once over the world (TP-replicated elements are weighted by
1/tp because every TP rank holds them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import OptimConfig
from .tensor_parallel import is_sharded, local


class _FlatGroup:
    """One flat buffer (decay or no-decay) of this rank's parameters and its shard."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], dp: int, rank: int, tp: int):
        self.params = params
        self.locals = [local(p) for _, p in params]
        numel = sum(t.numel() for t in self.locals)
        self.padded = math.ceil(max(numel, 1) / dp) * dp
        self.shard_size = self.padded // dp
        self.shard = range(rank * self.shard_size, (rank + 1) * self.shard_size)
        device = self.locals[0].device if self.locals else torch.device("cpu")
        flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        weights = torch.zeros(self.padded, dtype=torch.float32, device=device)
        offset = 0
        self.offsets = []
        for (_, param), tensor in zip(params, self.locals, strict=True):
            self.offsets.append(offset)
            flat[offset : offset + tensor.numel()] = tensor.detach().reshape(-1).float()
            weights[offset : offset + tensor.numel()] = 1.0 if is_sharded(param) else 1.0 / tp
            offset += tensor.numel()
        self.numel = numel
        self.master = torch.nn.Parameter(flat[self.shard.start : self.shard.stop].clone())
        self.norm_weight = weights[self.shard.start : self.shard.stop].clone()

    def flat_grads(self) -> torch.Tensor:
        device = self.master.device
        flat = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for param, tensor, offset in zip((p for _, p in self.params), self.locals, self.offsets, strict=True):
            if param.grad is not None:
                flat[offset : offset + tensor.numel()] = local(param.grad).reshape(-1).float()
        return flat

    def write_back(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for tensor, offset in zip(self.locals, self.offsets, strict=True):
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor).to(tensor.dtype))


class ZeroOneOptimizer:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        cfg: OptimConfig,
        dp_group,
        dp: int,
        dp_rank: int,
        tp: int,
    ):
        self.group, self.dp, self.dp_rank = dp_group, dp, dp_rank
        decay = [(n, p) for n, p in named_params if p.requires_grad and p.ndim >= 2]
        no_decay = [(n, p) for n, p in named_params if p.requires_grad and p.ndim < 2]
        self.flats = {"decay": _FlatGroup(decay, dp, dp_rank, tp), "no_decay": _FlatGroup(no_decay, dp, dp_rank, tp)}
        groups = [
            {"params": [self.flats["decay"].master], "weight_decay": cfg.weight_decay, "name": "decay"},
            {"params": [self.flats["no_decay"].master], "weight_decay": 0.0, "name": "no_decay"},
        ]
        self.inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
        self.params = [p for _, p in named_params if p.requires_grad]

    @property
    def param_groups(self):
        return self.inner.param_groups

    def reduce_gradients(self) -> None:
        """Sum gradients over the replicas; keep this replica's shard as the master gradient."""
        for flat in self.flats.values():
            grads = flat.flat_grads()
            if self.dp > 1:
                shard = torch.empty(flat.shard_size, dtype=grads.dtype, device=grads.device)
                dist.reduce_scatter_single(shard, grads, group=self.group)
            else:
                shard = grads
            flat.master.grad = shard

    def grad_norm_squared(self) -> torch.Tensor:
        """This rank's share of the global squared gradient norm (sum it over the world)."""
        total = torch.zeros((), dtype=torch.float64, device=self.flats["decay"].master.device)
        for flat in self.flats.values():
            if flat.master.grad is not None:
                total += (flat.master.grad.double().pow(2) * flat.norm_weight.double()).sum()
        return total

    def scale_gradients(self, factor: float) -> None:
        for flat in self.flats.values():
            if flat.master.grad is not None:
                flat.master.grad.mul_(factor)

    def step(self) -> None:
        self.inner.step()
        for flat in self.flats.values():
            if self.dp > 1:
                full = torch.empty(flat.padded, dtype=torch.float32, device=flat.master.device)
                dist.all_gather_into_tensor(full, flat.master.detach().contiguous(), group=self.group)
            else:
                full = flat.master.detach()
            flat.write_back(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master shard + moments)."""
        total = 0
        for flat in self.flats.values():
            total += flat.master.numel() * flat.master.element_size()
            for value in self.inner.state.get(flat.master, {}).values():
                if torch.is_tensor(value) and value.numel() > 1:
                    total += value.numel() * value.element_size()
        return total

    def sync_master_from_params(self) -> None:
        """Refresh the fp32 master shards after parameters were loaded from a checkpoint."""
        with torch.no_grad():
            for flat in self.flats.values():
                full = torch.zeros(flat.padded, dtype=torch.float32, device=flat.master.device)
                for tensor, offset in zip(flat.locals, flat.offsets, strict=True):
                    full[offset : offset + tensor.numel()] = tensor.detach().reshape(-1).float()
                flat.master.copy_(full[flat.shard.start : flat.shard.stop])

    # --------------------------------------------------------- by-name state
    # Saved like a plain AdamW's state keyed by parameter name (full, un-sharded
    # tensors), so it loads into any layout -- ZeRO or not, any dp, tp or pp.
    def _gather(self, shard: torch.Tensor, flat: _FlatGroup) -> torch.Tensor:
        if self.dp == 1:
            return shard.detach()
        full = torch.empty(flat.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.detach().contiguous(), group=self.group)
        return full

    def state_by_name(self) -> dict:
        """Collective over the data-parallel and tensor-parallel groups; every rank must call it."""
        from torch.distributed.tensor import DTensor

        state: dict = {}
        groups = {g["name"]: {k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups}
        for flat in self.flats.values():
            inner = self.inner.state.get(flat.master, {})
            if not inner:
                continue
            moments = {key: self._gather(inner[key], flat) for key in ("exp_avg", "exp_avg_sq")}
            for (name, param), tensor, offset in zip(flat.params, flat.locals, flat.offsets, strict=True):
                entry = {"step": inner["step"].detach().clone()}
                for key, full in moments.items():
                    part = full[offset : offset + tensor.numel()].view_as(tensor).clone()
                    if isinstance(param, DTensor):
                        part = DTensor.from_local(part, param.device_mesh, param.placements).full_tensor()
                    entry[key] = part
                state[name] = entry
        return {"state": state, "groups": groups}

    def load_state_by_name(self, saved: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        self.sync_master_from_params()
        for group in self.inner.param_groups:
            group.update({k: v for k, v in saved["groups"].get(group["name"], {}).items() if k != "params"})
        for flat in self.flats.values():
            moments = {
                key: torch.zeros(flat.padded, dtype=torch.float32, device=flat.master.device)
                for key in ("exp_avg", "exp_avg_sq")
            }
            step = None
            for (name, param), tensor, offset in zip(flat.params, flat.locals, flat.offsets, strict=True):
                entry = saved["state"].get(name)
                if entry is None:
                    continue
                step = entry["step"]
                for key, full in moments.items():
                    value = entry[key].to(flat.master.device)
                    if isinstance(param, DTensor):
                        value = distribute_tensor(value, param.device_mesh, param.placements).to_local()
                    full[offset : offset + tensor.numel()] = value.reshape(-1).float()
            if step is not None:
                self.inner.state[flat.master] = {
                    "step": torch.as_tensor(step, dtype=torch.float32).clone(),
                    **{key: full[flat.shard.start : flat.shard.stop].clone() for key, full in moments.items()},
                }
