"""The general engine: parallelism units joined into one pipeline.

This process belongs to one unit (encoder, LLM, or generator) and runs the
stage(s) of that unit's pipeline rank with its tensor-parallel group. The schedule's
executor moves activations and gradients between stages (inside a unit, and across
units through the communication broker), gradients are reduce-scattered over the unit's
data-parallel replicas by ZeRO-1, and the gradient norm is summed over the world.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from lightning_fabric import Fabric

from ..comm.engine import MODES
from ..comm.item_balance import BalanceLedger
from ..comm.p2p import Channels
from ..comm.partial_grads import PartialGradients
from ..comm.trace import CommTrace
from ..config import Config, training_precision, wire_format
from ..data.tokenizer import Tokenizer
from ..models.moe import moe_layers
from ..parallel.broker import CommBroker
from ..parallel.context_parallel import context_mode
from ..parallel.expert_parallel import configure_moe
from ..parallel.fsdp import FsdpStepSync, ShardedOptimizer, apply_fsdp, fsdp_modules, unit_meshes
from ..parallel.item_balance import EncoderBalance
from ..parallel.recompute import BLOCKS
from ..parallel.stages import build_rank_stages, fields_read
from ..parallel.tensor_parallel import sequence_parallel_partial_params
from ..parallel.units import ParallelismUnit, UnitLayout
from ..parallel.zero import ZeroOneOptimizer
from ..schedule.actions import Schedule
from ..schedule.executor import PipelineExecutor, StepRecord
from ..schedule.transfers import channel_pairs
from .engine import Engine, batch_to_device, clip_by_norm, import_pretrained
from .state import adamw_entries, model_entries, owned_by
from .unit_groups import build_unit_groups

log = logging.getLogger(__name__)


def wire_dtype(cfg: Config, device_type: str) -> torch.dtype:
    """``parallel.comm.wire_dtype`` resolved (config.wire_format) as a torch dtype."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[wire_format(cfg, device_type)]


def _loss(out: dict, n_tokens: torch.Tensor, n_gen: torch.Tensor, weight: float) -> torch.Tensor:
    loss = 0.0
    if "lm_loss_sum" in out:
        loss = out["lm_loss_sum"] / n_tokens
    if "gen_loss_sum" in out:
        loss = loss + weight * out["gen_loss_sum"] / n_gen
    return loss


class UnitEngine(Engine):
    def __init__(
        self,
        cfg: Config,
        fabric: Fabric,
        tokenizer: Tokenizer,
        layout: UnitLayout,
        schedule: Schedule,
        broker: CommBroker,
        rows_of_units: dict[str, list[int]],
        timeout=None,
    ):
        self.cfg, self.fabric, self.layout, self.schedule, self.broker = cfg, fabric, layout, schedule, broker
        rank = fabric.global_rank
        self.unit: ParallelismUnit = layout.unit_of(rank)
        self.dp_rank, self.tp_rank, self.pp_rank = self.unit.coords(rank)
        self.cp_rank = self.unit.cp_coord(rank)
        comm = cfg.parallel.comm
        ring = dist.is_initialized() and (
            comm.collectives == "ring" or (comm.collectives == "auto" and dist.get_backend() == "gloo")
        )
        self.cp_mode, cp_ulysses = context_mode(cfg, layout)
        self.groups = build_unit_groups(layout, rank, timeout, comm_groups=ring, cp_ulysses=cp_ulysses)
        # The schedule row this process runs and the (possibly several, virtual) stages on it.
        self.row = rows_of_units[self.unit.name][self.pp_rank]
        self.wire_dtype = wire_dtype(cfg, fabric.device.type)
        mesh = self._build_stages(tokenizer, rows_of_units)
        self.balance_ledger = None
        if cfg.parallel.rebalance_items and self.unit.dp > 1:  # each stage's encodes spread over its replicas
            self.balance_ledger = BalanceLedger()
            balance = EncoderBalance(self.groups.data_parallel, self.dp_rank, self.balance_ledger)
            for stage in self.stages.values():
                stage.item_balance = balance
        import_pretrained(cfg, tokenizer, [stage.model for stage in self.stages.values()])
        # MoE aux terms: balanced over the ranks that share a global microbatch's tokens (data x context),
        # averaged over the step's microbatches (gradients are summed over those ranks).
        configure_moe(self.models(), self.groups.gradient, 1.0 / schedule.num_microbatches)
        partial = [p for module in self.stages.values() for p in sequence_parallel_partial_params(module.model)]
        # sequence-parallel norms: summed over TP (comm/partial_grads.py)
        self.partial_grads = PartialGradients(partial if mesh is not None else (), self.groups.tensor_parallel)
        self.trace = CommTrace(fabric.device) if comm.trace else None
        self.named_parameters = [
            (name, p)
            for module in self.stages.values()
            for name, p in module.model.named_parameters()
            if p.requires_grad
        ]
        mixed = training_precision(cfg.trainer.precision, fabric.device.type) != "32"
        autocast: Callable = fabric.autocast if mixed else nullcontext
        # One autocast region around the whole step (the executor's per-forward regions nest inside it):
        # autocast caches each weight's bf16 cast until the outermost region ends, so every in-flight
        # microbatch shares one copy instead of saving its own (planner/memory.py counts one).
        self.step_autocast = autocast
        # One communicator per direction of every pair of ranks that exchange tensors (comm/p2p.py); created
        # by every process in the same order.
        channels = None
        if dist.is_initialized():
            channels = Channels(channel_pairs(schedule, broker), rank, fabric.device, timeout)
        self.executor = PipelineExecutor(
            schedule,
            self.stages,
            self.row,
            rank,
            broker,
            channels,
            fabric.device,
            boundary_dtype=self.wire_dtype,
            autocast=autocast,
        )
        if cfg.trainer.fault_tolerance.enabled:  # a replica group's share of a step varies with its quorum
            from ..parallel.plan import pipeline_schedule

            self.executor.schedule_for = lambda count: pipeline_schedule(cfg, layout, count)
        self.optimizer: ZeroOneOptimizer | ShardedOptimizer | None = None

    def _build_stages(self, tokenizer: Tokenizer, rows_of_units: dict[str, list[int]]):
        """This process's (virtual) stages of its unit, tensor-parallel, sharded and context-parallel as the unit
        says; returns the tensor-parallel mesh (None without TP)."""
        cfg, fabric, schedule, comm = self.cfg, self.fabric, self.schedule, self.cfg.parallel.comm
        mesh = shard = None
        offload = self.unit.fsdp and self.unit.offload == "optimizer"  # FSDP2's CPUOffloadPolicy
        if self.unit.fsdp:  # one root mesh: FSDP2 over the replicas, TP inside (parallel/fsdp.py)
            fsdp_mesh, mesh = unit_meshes(self.unit, self.pp_rank, self.groups, fabric.device.type)

            def shard(module: torch.nn.Module) -> None:
                # expert parallelism: the held experts stay whole and out of FSDP2's reductions
                experts = {p for layer in moe_layers(module.model) for p in layer.experts.parameters()}
                ignored = experts if self.unit.ep > 1 else None
                apply_fsdp(module, fsdp_mesh, self.unit.shard, self.wire_dtype, ignored, offload=offload)

        elif self.unit.tp > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(self.groups.tensor_parallel, fabric.device.type)
        context = None
        if self.unit.cp > 1:
            from ..parallel.context_parallel import SequenceSlices

            groups = self.groups
            context = SequenceSlices(
                groups.context_parallel,
                cfg.model.seq_len,
                mode=self.cp_mode,
                ulysses_group=groups.context_ulysses,
                ring_group=groups.context_ring,
            )
        self.stages = build_rank_stages(
            cfg.model,
            tokenizer,
            self.unit,
            schedule,
            rows_of_units[self.unit.name],
            self.row,
            fabric.device,
            cfg.trainer.seed,
            tp_mesh=mesh,
            sequence_overlap=comm.tp_overlap,
            sequence_parallel=cfg.parallel.sequence_parallel,
            shard=shard,
            context=context,
            experts=self.groups.expert_parallel,
            compile_blocks=cfg.trainer.compile,
            float8=cfg.model.float8,
            split=cfg.parallel.pp_split if self.unit.name == "llm" else None,
            param_device=torch.device("cpu") if offload else None,
        )
        self.float8_scales = cfg.model.float8 == "tensorwise" and shard is not None
        return mesh

    def models(self) -> list[torch.nn.Module]:
        return [stage.model for stage in self.stages.values()]

    def window_metrics(self, seconds: float, steps: int) -> dict[str, float]:
        """parallel.rebalance_items: this unit's balanced encodes since the last log (comm/item_balance.py)."""
        return {} if self.balance_ledger is None else self.balance_ledger.metrics(steps)

    def called_modules(self) -> list[torch.nn.Module]:
        return list(self.stages.values())  # the executor calls the stages, which run parts of their models

    def batch_fields(self) -> tuple[str, ...] | None:
        return fields_read(self.stages.values())

    # ---------------------------------------------------------------- optimizer
    def _expert_split(self) -> tuple[list, list]:
        """(dense, experts) of the trainable named parameters; experts only under expert parallelism (the
        experts this rank holds, stepped by an optimizer of their own)."""
        held = {id(p) for model in self.models() for layer in moe_layers(model) for p in layer.experts.parameters()}
        experts = [(n, p) for n, p in self.named_parameters if id(p) in held] if self.unit.ep > 1 else []
        dense = [(n, p) for n, p in self.named_parameters if not experts or id(p) not in held]
        return dense, experts

    def _expert_optimizer(self, experts: list):
        from .expert_optim import ExpertOptimizer

        members = self.groups.expert_members
        index = members.index(self.fabric.global_rank)
        return ExpertOptimizer(
            experts, self.cfg.optim, self.groups.expert_data, len(members), index, self.cfg.parallel.comm
        )

    def build_optimizer(self) -> ZeroOneOptimizer | ShardedOptimizer:
        dense, experts = self._expert_split()
        if self.unit.fsdp:  # FSDP2 reduces gradients in its own backward hooks
            zero2 = self.unit.shard == "zero2"
            pipelined = self.schedule.num_stages > 1
            if pipelined or zero2:  # gathered once per step; under a pipeline also reduced once per step
                self.executor.grad_sync = FsdpStepSync(self.stages, self.unit.shard, defer_reduce=pipelined)
            self.optimizer = ShardedOptimizer(
                dense,
                self.cfg.optim,
                copies=self.unit.dp * self.unit.cp * self.unit.tp,
                partial_grads=self.partial_grads,
                device=self.fabric.device,
                regather=fsdp_modules(self.stages.values()) if zero2 else (),
            )
            if experts:
                self.optimizer.experts = self._expert_optimizer(experts)
            return self.optimizer
        stage_of = {id(p): stage for stage, module in self.stages.items() for p in module.parameters()}
        # Context-parallel ranks reduce (and shard) gradients with the data-parallel replicas.
        self.optimizer = ZeroOneOptimizer(
            dense,
            self.cfg.optim,
            self.groups.gradient,
            self.unit.dp * self.unit.cp,
            self.dp_rank * self.unit.cp + self.cp_rank,
            self.unit.tp,
            comm=self.cfg.parallel.comm,
            stage_of=stage_of,
            partial_grads=self.partial_grads,
            tp_group=self.groups.tensor_parallel,
            trace=self.trace,
            comm_group=self.groups.gradient_comm,
            gather_dtype=self.wire_dtype,
            device=self.fabric.device,
            offload=self.unit.offload == "optimizer",
        )
        if experts:  # expert parallelism: the experts this rank holds have an optimizer of their own
            self.optimizer.experts = self._expert_optimizer(experts)
        # each block (parallel/recompute.py BLOCKS) waits for its whole subtree's gathers
        self.optimizer.sync.install_forward_hooks(self.stages.values(), atomic=BLOCKS)
        self.executor.grad_sync = self.optimizer.sync
        return self.optimizer

    # --------------------------------------------------------------------- step
    def forward_backward(self, microbatches, counts, record=False) -> StepRecord:
        weight = self.cfg.model.gen_loss_weight
        device = self.fabric.device
        batches = [batch_to_device(mb, device) for mb in microbatches]
        trace = self.trace is not None
        with self.step_autocast():
            result = self.executor.run(batches, lambda out: _loss(out, *counts(), weight), record=record or trace)
        if trace:
            names = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}
            for item in result.timeline:
                label = f"{names[item.action.kind.value]} {item.action.microbatch}"
                self.trace.compute(label, result.origin + item.start, result.origin + item.end)
            if not record:
                result.timeline = []
        # Loss terms live on a few stages: share them (one copy per replica: TP rank 0 only).
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = torch.stack([result.sums.get("lm_loss_sum", zero), result.sums.get("gen_loss_sum", zero)])
        if self.tp_rank != 0:
            sums.zero_()
        # Only logged: reduced in the background and read at a logging step, so it neither waits for the
        # slowest rank's backward here nor queues behind gradient buckets on the wire.
        work = dist.all_reduce(sums, async_op=True) if self.layout.world_size > 1 else None

        def reduced() -> dict[str, torch.Tensor]:
            if work is not None:
                work.wait()
            return {"lm_loss_sum": sums[0], "gen_loss_sum": sums[1]}

        result.sums, result.pending_sums = {}, reduced
        return result

    def after_backward(self) -> None:
        self.optimizer.reduce_gradients()

    def loss_sums(self, microbatches) -> torch.Tensor:
        with self.step_autocast():
            found = self.executor.evaluate([batch_to_device(mb, self.fabric.device) for mb in microbatches])
        zero = torch.zeros((), dtype=torch.float64, device=self.fabric.device)
        sums = torch.stack([found.get("lm_loss_sum", zero), found.get("gen_loss_sum", zero)])
        if self.tp_rank != 0:  # one copy per replica
            sums.zero_()
        if self.layout.world_size > 1:
            dist.all_reduce(sums)
        return sums

    def set_comm_mode(self, mode: str) -> None:
        """``parallel.comm.interleave_modes``: switch this step's overlap / skip switches."""
        self.optimizer.sync.set_mode(**MODES[mode])

    def replica_gradients(self) -> list[torch.nn.Parameter]:
        """ZeRO-1: this rank's fp32 master slices, whose gradients are its summed slice of the group's; FSDP2:
        every trainable sharded parameter (one whose gradient is None this step counts as zeros)."""
        if isinstance(self.optimizer, ZeroOneOptimizer):
            return self.optimizer.master_params()
        return [p for _, p in self.optimizer.named_params]

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        squared = self.optimizer.grad_norm_squared()
        if self.layout.world_size > 1:
            dist.all_reduce(squared)
        norm = squared.sqrt()
        clip_by_norm(self.optimizer.master_params(), norm, max_norm)
        return norm

    # -------------------------------------------------------------- checkpoints
    def synchronize(self) -> None:
        if self.optimizer is not None:
            self.optimizer.wait_params()

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.close()

    def checkpoint_state(self, saving: bool) -> dict:
        self.synchronize()
        if isinstance(self.optimizer, ShardedOptimizer):  # zero2's parameters are gathered between steps
            self.optimizer.shard_params()
        modules = [stage.model for stage in self.stages.values()]
        zero = isinstance(self.optimizer, ZeroOneOptimizer)
        experts = getattr(self.optimizer, "experts", None)
        # Under ZeRO-1 the trainable values are the masters' chunks; what else model_entries holds (frozen
        # parameters, buffers) every data-parallel replica has whole. Under FSDP2 its DTensors are shards. The
        # experts of expert parallelism come with their optimizer's state (each replica saves its share).
        skip = (
            {n for n, _ in self.named_parameters} if zero else {n for n, _ in experts.named_params} if experts else ()
        )
        entries = model_entries(modules, skip=frozenset(skip))
        if saving:
            from torch.distributed.tensor import DTensor

            replicated = {
                k: v
                for k, v in entries.items()
                if not (self.unit.fsdp and isinstance(v, DTensor)) and (isinstance(v, DTensor) or self.tp_rank == 0)
            }
            cp = self.unit.cp  # context-parallel ranks hold the same replicated values as their replica
            kept = owned_by(replicated, self.dp_rank * cp + self.cp_rank, self.unit.dp * cp)
            entries = {k: v for k, v in entries.items() if k in kept or (self.unit.fsdp and isinstance(v, DTensor))}
        if zero:
            world = dist.get_world_size() if dist.is_initialized() else 1
            return {**entries, **self.optimizer.checkpoint_state(self.fabric.global_rank, world, saving)}
        expert_state = experts.checkpoint_state(saving) if experts is not None else {}
        return {**entries, **adamw_entries(self.optimizer.inner, self.named_parameters), **expert_state}

    def checkpoint_loaded(self, absent: list[str]) -> None:
        if isinstance(self.optimizer, ZeroOneOptimizer):
            self.optimizer.checkpoint_loaded()
            fresh = self.optimizer.mixed_buckets(set(absent))
            if fresh:
                log.warning(
                    "ZeRO-1 buckets mix resumed and fresh optimizer state (%d fresh parameter(s), e.g. %s): one step "
                    "counter per bucket skips Adam's bias correction for the fresh ones at first; FSDP2 or DDP "
                    "(per-parameter counters) do not",
                    len(fresh),
                    fresh[0],
                )
