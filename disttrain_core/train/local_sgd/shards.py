"""How the processes of one local-SGD worker hold its model state: ``parallel.shard`` under
``parallel.mode=local_sgd``, the shard dimension of EDiT's 2-D mesh (docs/LOCAL_SGD.md).

* ``none``: the model replicated, torch DDP averaging inside the worker; each process syncs the parameters it
  owns (split by bytes) and broadcasts them inside the worker after a sync.
* ``zero1``: the model replicated, ZeRO-1's optimizer (parallel/zero.py) over the worker group: gradients
  reduce-scattered, fp32 masters and AdamW moments split over the worker's processes. Syncs run on the
  parameters as under ``none`` (an fp32 wire keeps them equal to the masters), then the masters are refreshed.
* ``zero2`` / ``zero3``: FSDP2 over the worker group (parallel/fsdp.py): parameters, gradients and optimizer
  state are shards, and each process syncs its shard of every parameter with the same shard of every other
  worker -- anchors and outer momentum are shards too, and nothing is broadcast after a sync.

In every mode the sync group joins the processes at one place in every worker: they hold the same shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...base.dtensor import local
from ...config import Config
from ...parallel.fsdp import FSDP_MODES, apply_fsdp
from ...parallel.plan import layout_shard
from ...parallel.recompute import BLOCKS
from ...parallel.zero import ZeroOneOptimizer
from ..engine import clip_by_norm
from ..state import model_entries, optimizer_entries, owned_by
from ..unit_engine import wire_dtype


class WorkerShards:
    def __init__(self, cfg: Config, device: torch.device, worker_group, worker: int, place: int, shard: int):
        """``worker_group``: the worker's processes (None: one process in all); ``place``: this process's
        index inside its worker of ``shard`` processes."""
        self.cfg, self.device = cfg, device
        self.group, self.worker, self.place, self.size = worker_group, worker, place, shard
        self.mode = layout_shard(cfg.parallel, "none")
        self.fsdp, self.zero1 = self.mode in FSDP_MODES, self.mode == "zero1"

    def apply(self, model: torch.nn.Module) -> bool:
        """Shard ``model`` (on meta) with FSDP2 over a 1-D mesh of the worker group; whether the gradients are
        summed by something other than DDP (FSDP2, ZeRO-1's optimizer)."""
        if not self.fsdp:
            return self.zero1
        from torch.distributed.device_mesh import DeviceMesh

        if self.group is None:  # one process: a mesh over the whole (single-rank) world
            mesh = DeviceMesh.from_group(dist.group.WORLD, self.device.type, mesh_dim_names=("shard",))
        else:
            first = self.worker * self.size
            ranks = torch.arange(first, first + self.size)
            mesh = DeviceMesh.from_group(self.group, self.device.type, mesh=ranks, mesh_dim_names=("shard",))
        apply_fsdp(model, mesh, self.mode, wire_dtype(self.cfg, self.device.type))
        return True

    def owners(self, named: dict[str, torch.nn.Parameter]) -> dict[str, int]:
        """The place that syncs each parameter: split by bytes over the worker (the same split on every process
        of every worker), or under FSDP2 this process for every parameter (its shard of it)."""
        if self.fsdp:
            return {name: self.place for name in named}
        return {name: place for place in range(self.size) for name in owned_by(dict(named), place, self.size)}

    def zero1_optimizer(self, model: torch.nn.Module, named_parameters) -> ZeroOneOptimizer:
        optimizer = ZeroOneOptimizer(
            named_parameters,
            self.cfg.optim,
            self.group,
            self.size,
            self.place,
            1,
            comm=self.cfg.parallel.comm,
            gather_dtype=wire_dtype(self.cfg, self.device.type),
            device=self.device,
        )
        optimizer.sync.install_forward_hooks([model], atomic=BLOCKS)  # each block waits for its gathers
        return optimizer

    def gradient_shards(self, named_parameters, optimizer) -> list[torch.Tensor]:
        """What this process sums over its sync group in a warm-up step: the whole gradients (DDP), its shard
        of each (FSDP2), or its master slices' gradients (ZeRO-1)."""
        if self.zero1:
            return [m.grad for m in optimizer.master_params()]
        return [local(p.grad) for _, p in named_parameters if p.grad is not None]

    def clip(self, named_parameters, optimizer, max_norm: float) -> torch.Tensor:
        """Sharded modes: the worker's gradient norm from each process's squares summed over the worker, and
        the clipping of this process's shards."""
        if self.zero1:
            squared, params = optimizer.grad_norm_squared().double(), optimizer.master_params()
        else:
            params = [p for _, p in named_parameters if p.grad is not None]
            squared = torch.zeros((), dtype=torch.float64, device=self.device)
            for param in params:
                squared += torch.linalg.vector_norm(local(param.grad), dtype=torch.float64).square()
        if self.size > 1:
            dist.all_reduce(squared, group=self.group)
        norm = squared.sqrt()
        clip_by_norm(params, norm, max_norm)
        return norm

    def checkpoint_entries(self, model, named_parameters, optimizer, rank: int, world: int, saving: bool) -> dict:
        """The worker's model and inner-optimizer state this process holds: replicated entries split by bytes
        over the worker when saving, sharded ones (FSDP2's DTensors, ZeRO-1's chunks) each process its own."""
        if self.zero1:  # the masters' chunks stand for the trainable parameters (parallel/zero.py)
            replicated = model_entries([model], skip={n for n, _ in named_parameters})
            shards = optimizer.checkpoint_state(rank, world, saving)
        else:
            replicated = {**model_entries([model]), **optimizer_entries(optimizer, named_parameters)}
            shards = {k: v for k, v in replicated.items() if isinstance(v, DTensor)}
            replicated = {k: v for k, v in replicated.items() if k not in shards}
        if saving:
            replicated = owned_by(replicated, self.place, self.size)
        return {**replicated, **shards}

    def like_parameter(self, param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Under FSDP2 an anchor (or outer momentum) is this process's shard of ``param``: checkpointed as a
        DTensor placed like it (a view of the shard, so a load writes into it), whole in the file."""
        if not self.fsdp:
            return shard
        return DTensor.from_local(
            shard, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
