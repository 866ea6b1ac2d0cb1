"""Engines: how one optimizer step's forward and backward run on this process.

* ``DataParallelEngine``: the whole model on every process, DDP (through
  Fabric) averaging gradients on the last microbatch.
* ``UnitEngine`` (train/unit_engine.py): every other layout -- pipeline stages,
  tensor parallelism, disaggregated units -- with ZeRO-1.

Both see the same microbatches and the same global loss normalization, so their
results agree with a single process. Model and optimizer state are saved *by
parameter name* as full tensors, so a checkpoint written with one layout loads
into another.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from lightning_fabric import Fabric

from ..comm.buckets import bucket_numel
from ..comm.engine import allreduce_gradients
from ..config import Config
from ..data.batch import Batch
from ..data.tokenizer import Tokenizer
from ..models import build_model, materialize
from ..schedule.executor import StepRecord
from .optim import build_optimizer, load_optimizer_state_by_name, optimizer_state_by_name


class GlobalCounts:
    """The global batch's loss tokens, generation samples, sequences and images.

    Reduced over the data-parallel replicas asynchronously: the reduction is waited for only when the
    first loss is normalized, so it never queues a step's start behind parameter gathers still on the
    wire. Calling it returns ``(n_tokens, n_gen)``, the loss normalizers.
    """

    def __init__(self, values: torch.Tensor, work=None, trace=None):
        self.values, self.work, self.trace = values, work, trace
        self.normalizers: tuple[float, float] | None = None

    def __call__(self) -> tuple[float, float]:
        if self.normalizers is None:  # one wait and one device-to-host copy per step
            started = time.perf_counter()
            if self.work is not None:
                self.work.wait()
                self.work = None
            if self.trace is not None:
                self.trace.compute("wait: batch counts", started, time.perf_counter())
            self.normalizers = (max(float(self.values[0]), 1.0), max(float(self.values[1]), 1.0))
        return self.normalizers


class Engine:
    named_parameters: list[tuple[str, torch.nn.Parameter]]
    optimizer: object | None = None

    def build_optimizer(self):
        """Plain AdamW over this process's parameters (the unit engine shards it: ZeRO-1)."""
        self.optimizer = build_optimizer(self.named_parameters, self.cfg.optim)
        return self.optimizer

    def optimizer_state(self) -> dict:
        """Optimizer state keyed by parameter name (a collective for sharded engines: call on every rank)."""
        return optimizer_state_by_name(self.optimizer, self.named_parameters)

    def load_optimizer_state(self, state: dict) -> None:
        load_optimizer_state_by_name(self.optimizer, self.named_parameters, state)

    def forward_backward(self, microbatches: list[Batch], counts: GlobalCounts, record: bool = False) -> StepRecord:
        """Forward and backward of every microbatch; losses are normalized by ``counts()``."""

    def after_backward(self) -> None:
        """Make gradients global (sum over data-parallel replicas) if the engine has not already."""

    def synchronize(self) -> None:
        """Finish communication still in flight that writes parameters (overlapped gathers)."""

    def close(self) -> None:
        """Stop background communication (threads, hooks) at the end of training."""

    def clip_gradients(self, max_norm: float) -> float:
        """Clip to ``max_norm`` (inf: no clipping); returns the global norm before clipping."""
        raise NotImplementedError

    def model_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters:
                if name not in state:
                    raise KeyError(f"checkpoint has no parameter {name!r}")
                param.copy_(state[name])


def _loss(out: dict, n_tokens: float, n_gen: float, weight: float, scale: float = 1.0) -> torch.Tensor:
    loss = out["lm_loss_sum"] / n_tokens
    if "gen_loss_sum" in out:
        loss = loss + weight * out["gen_loss_sum"] / n_gen
    return loss * scale


def _global_norm(params: list[torch.nn.Parameter], groups: list) -> float:
    """L2 norm of all gradients; squared partial norms are summed over ``groups`` (disjoint shards)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    local = torch.nn.utils.get_total_norm(grads, foreach=True).float() if grads else torch.zeros((), device=device)
    if groups:
        squared = local.pow(2)
        for group in groups:
            dist.all_reduce(squared, group=group)
        return math.sqrt(float(squared))
    return float(local)


def _scale_grads(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    if math.isfinite(max_norm) and norm > max_norm:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))


class DataParallelEngine(Engine):
    """The whole model on every process; PyTorch DDP averages gradients on the last microbatch.

    The model is wrapped with DDP directly rather than through ``fabric.setup_module``: Fabric's
    wrapper casts every floating-point *input* to bf16 under bf16-mixed, which would quantize the
    diffusion noise targets; here only the forward runs under autocast.
    """

    def __init__(self, cfg: Config, fabric: Fabric, tokenizer: Tokenizer):
        self.cfg, self.fabric = cfg, fabric
        self.raw_model = build_model(cfg.model, tokenizer, device="meta")
        materialize(self.raw_model, fabric.device, seed=cfg.trainer.seed, std=cfg.model.init_std)
        module = torch.compile(self.raw_model) if cfg.trainer.compile else self.raw_model
        self.model = module
        comm = cfg.parallel.comm
        # DDP overlaps its bucketed all-reduces with backward. Without overlap (or skipping communication
        # for a compute-only benchmark) every microbatch runs under no_sync and after_backward reduces.
        self.ddp_sync = comm.overlap_grad_reduce and not comm.skip_collectives
        self.bucket_numel = bucket_numel(comm.bucket_mb)
        if fabric.world_size > 1:
            device_ids = [fabric.device.index] if fabric.device.type == "cuda" else None
            bucket_mb = comm.bucket_mb if comm.bucket_mb > 0 else 1e6
            self.model = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=device_ids, bucket_cap_mb=bucket_mb
            )
        self.autocast = fabric.autocast if cfg.trainer.precision != "32" else nullcontext
        self.named_parameters = [(n, p) for n, p in self.raw_model.named_parameters() if p.requires_grad]

    def forward_backward(self, microbatches, counts, record=False) -> StepRecord:
        sums = {"lm_loss_sum": 0.0, "gen_loss_sum": 0.0}
        # DDP averages gradients over processes; scale so the result is the global-batch gradient.
        scale = float(self.fabric.world_size)
        for index, microbatch in enumerate(microbatches):
            last = index == len(microbatches) - 1 and self.ddp_sync
            sync = self.model.no_sync() if self.fabric.world_size > 1 and not last else nullcontext()
            with sync:
                with self.autocast():
                    out = self.model(microbatch.to(self.fabric.device))
                _loss(out, *counts(), self.cfg.model.gen_loss_weight, scale=scale).backward()
            for name in sums:
                if name in out:
                    sums[name] += float(out[name].detach())
        if self.fabric.world_size > 1:  # every process logs global-batch losses
            totals = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.fabric.device)
            dist.all_reduce(totals)
            sums = dict(zip(sums, totals.tolist(), strict=True))
        return StepRecord(sums=sums)

    def after_backward(self) -> None:
        comm = self.cfg.parallel.comm
        if self.fabric.world_size > 1 and not self.ddp_sync and not comm.skip_collectives:
            params = [p for _, p in self.named_parameters]
            allreduce_gradients(params, None, self.bucket_numel, self.fabric.world_size)

    def clip_gradients(self, max_norm: float) -> float:
        params = [p for _, p in self.named_parameters]
        norm = _global_norm(params, [])  # DDP gradients are already identical on every process
        _scale_grads(params, norm, max_norm)
        return norm
