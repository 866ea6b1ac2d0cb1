"""HotSPa (seed 001): one parallel strategy per length bucket, parameters and gradients hot-switched
between them inside a step, gradients accumulated across strategies, one optimizer update.

Every strategy is a full unit engine over all processes (train/unit_engine.py: its own groups, stages,
pipeline executor, tensor and context parallelism) built for its bucket's row length. One of them, the
*home* (by default the one with the least model state per process), owns the optimizer (ZeRO-1) and the
gradients. A step, for each bucket in order (home last, the others in the order that switches the fewest
bytes, ``bucket_order``):

1. the home's parameters are switched into the bucket's strategy (parallel/hot_switch.py: one plan per
   (from, to) pair, computed identically on every rank, one batched exchange);
2. the strategy runs its bucket's packed rows (split over its data-parallel replicas, one microbatch of
   ``data.packing.rows_per_microbatch`` rows -- or ``tokens_per_microbatch`` tokens -- per replica per slot,
   the last slot padded with empty rows);
3. its gradients are summed over its data(-and-context)-parallel ranks and switched into the home's
   layout, where they are added on one rank of each of the home's gradient groups (its first data- and
   context-parallel rank) -- the home's own reduction then sums the group, so every bucket counts once
   and nothing is rescaled.

The home bucket runs last with the accumulated gradients already in place; the trainer then reduces,
clips and steps the home optimizer as in any layout. Losses are normalized by the step's total label
tokens over all buckets, so the step equals one static step over the same packed rows.

Memory: the home's model state stays; a non-home strategy holds its parameters and gradients only while
its bucket runs (their storage is released after the switch back), plus the fused switch buffers.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning_fabric import Fabric

from ..base.clock import DeviceClock
from ..comm.engine import allreduce_gradients, allreduce_tensors
from ..data.batch import Batch, pad_rows
from ..data.tokenizer import Tokenizer
from ..parallel.hot_switch import run_switch
from ..parallel.hotspa_layout import (
    llm_param_specs,
    local_box_tensors,
)
from ..parallel.plan import build_pipeline, pipeline_broker, pipeline_schedule
from ..parallel.switch_plan import PlanCache, Strategy, strategy_layout
from ..schedule.executor import PipelineExecutor, StepRecord
from .engine import Engine, GlobalCounts
from .unit_engine import UnitEngine

log = logging.getLogger(__name__)


@dataclass
class _Member:
    """One bucket's engine: its strategy and row length, and its executors by microbatch count."""

    strategy: Strategy
    capacity: int
    engine: UnitEngine
    executors: dict[int, PipelineExecutor]
    slot: int  # rows of one microbatch slot over the strategy's replicas

    @property
    def name(self) -> str:
        return self.strategy.name


def bucket_order(plans: PlanCache, names: list[str], home: int, mode: str) -> list[int]:
    """Bucket indices in running order: bucket ``home`` last; the others as given or in the order that
    switches the fewest elements along home -> ... -> home (parameters out, gradients back)."""
    others = [i for i in range(len(names)) if i != home]
    if mode == "given" or len(others) < 2 or len(others) > 7:  # beyond 7! orders: as given
        return others + [home]
    home_name = names[home]

    def cost(order) -> int:
        total = 0
        for i in order:
            total += plans.get(home_name, names[i]).moved() + plans.get(names[i], home_name).moved()
        return total + sum(plans.get(names[a], names[b]).moved() for a, b in zip(order[:-1], order[1:], strict=True))

    return list(min(itertools.permutations(others), key=cost)) + [home]


class HotSpaEngine(Engine):
    def __init__(self, run, fabric: Fabric, tokenizer: Tokenizer, timeout=None):
        """``run``: the resolved run (parallel/resolved.py): each bucket's strategy, config and layout."""
        cfg = run.cfg
        self.cfg, self.fabric = cfg, fabric
        self.rank = fabric.global_rank
        strategies = [bucket.strategy for bucket in run.buckets]
        home_name = run.home
        self.names = [s.name for s in strategies]
        # The home is the last bucket with the home strategy: it runs last and owns the optimizer.
        self.home_index = run.home_bucket
        self.members: list[_Member] = []
        for bucket in run.buckets:
            strategy, capacity, scfg, layout = bucket.strategy, bucket.capacity, bucket.config, bucket.layout
            rows = scfg.optim.micro_batch_size
            schedule, broker, rows_of_units = build_pipeline(scfg, layout, 1)
            engine = UnitEngine(scfg, fabric, tokenizer, layout, schedule, broker, rows_of_units, timeout=timeout)
            self.members.append(_Member(strategy, capacity, engine, {1: engine.executor}, rows * strategy.dp))
        self.home = self.members[self.home_index]
        specs = llm_param_specs(cfg, tokenizer)
        layers = cfg.model.llm.n_layers
        layouts = {s.name: strategy_layout(specs, s, layers) for s in strategies}
        # Gradients come home on one rank of each of the home's gradient groups (data x context parallel): the
        # first replica's first context-parallel rank; the home's own reduction sums the group.
        home = self.home.strategy
        layouts[_GRAD] = {
            name: {r: box for r, box in boxes.items() if home.coords(r)[0] == 0 and home.cp_index(r) == 0}
            for name, boxes in layouts[home_name].items()
        }
        self.layouts = layouts
        per_node = int(cfg.trainer.devices)  # ranks are placed node by node (launch/entry.py)
        self.plans = PlanCache({n: s.shape for n, s in specs.items()}, layouts, lambda r: r // per_node)
        self.order = bucket_order(self.plans, self.names, self.home_index, cfg.parallel.hotspa.order)
        self.named_parameters = self.home.engine.named_parameters
        for member in self.members:  # the live tensors must be the boxes the plans assume
            local_box_tensors(member.engine.named_parameters, layouts[member.name], self.rank, check=True)
        # switching's device time since the last log: (start, end) stamps, read at logging steps (DeviceClock: CUDA
        # events on a GPU, where a host clock would time the launches)
        self.clock = DeviceClock(fabric.device)
        self.switches: list = []
        # parallel.hotspa.time_buckets: each bucket's rows timed (the device synchronized after them), since the
        # last log -- what tools/profile_hotspa.py fits t(row) from
        self.time_buckets = bool(cfg.parallel.hotspa.time_buckets)
        self.bucket_seconds = [0.0] * len(self.members)
        capacities = [bucket.capacity for bucket in run.buckets]
        log.info("hotspa: buckets %s, strategies %s, home %s, order %s", capacities, self.names, home_name, self.order)

    def describe(self) -> str:
        buckets = ", ".join(f"{m.capacity}: {m.name}" for m in self.members)
        return f"hotspa {buckets}; home {self.home.name}, order {[self.members[i].capacity for i in self.order]}"

    # ------------------------------------------------------------------ optimizer / state
    def build_optimizer(self):
        self.optimizer = self.home.engine.build_optimizer()
        for member in self.members:
            if member is not self.home:
                _release(member.engine.named_parameters)
        return self.optimizer

    def models(self) -> list[torch.nn.Module]:
        return self.home.engine.models()

    def checkpoint_state(self, saving: bool) -> dict:
        return self.home.engine.checkpoint_state(saving)

    def checkpoint_loaded(self, absent: list[str]) -> None:
        self.home.engine.checkpoint_loaded(absent)

    def synchronize(self) -> None:
        self.home.engine.synchronize()

    def close(self) -> None:
        self.home.engine.close()

    def after_backward(self) -> None:
        self.home.engine.after_backward()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return self.home.engine.clip_gradients(max_norm)

    # ------------------------------------------------------------------ step
    def forward_backward(self, microbatches: list[Batch], counts: GlobalCounts, record: bool = False) -> StepRecord:
        """``microbatches``: one Batch per bucket, holding all of the step's packed rows of that bucket."""
        if len(microbatches) != len(self.members):
            raise ValueError(f"hotspa: {len(microbatches)} bucket batches for {len(self.members)} strategies")
        results = []
        home_params = None
        for index in self.order:
            member = self.members[index]
            if member is not self.home:
                if home_params is None:
                    self.home.engine.synchronize()  # parameter gathers of the last update
                    home_params = self._home_tensors()
                self._switch_in(member, home_params)
            started = time.perf_counter()
            results.append(self._run_bucket(member, microbatches[index], counts, record))
            if self.time_buckets:
                if self.fabric.device.type == "cuda":
                    torch.cuda.synchronize(self.fabric.device)
                self.bucket_seconds[index] += time.perf_counter() - started
            if member is not self.home:
                self._gradients_home(member)
        return _combined(results)

    def eval_models(self) -> list[torch.nn.Module]:
        return [model for member in self.members for model in member.engine.models()]

    def loss_sums(self, microbatches: list[Batch]) -> torch.Tensor:
        """Validation: each bucket's rows forward-only in its own strategy (the home's parameters switched in, as
        a training step does, and released after), the sums added over the buckets."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.fabric.device)
        home_params = None
        for index in self.order:
            member = self.members[index]
            if member is not self.home:
                if home_params is None:
                    home_params = self._home_tensors()
                self._switch_in(member, home_params)
            sums += member.engine.loss_sums(self._bucket_share(member, microbatches[index]))
            if member is not self.home:
                _release(member.engine.named_parameters)
        return sums

    def window_metrics(self, seconds: float, steps: int) -> dict[str, float]:
        """``perf/switch_fraction``: device time spent switching as a share of the steps; with time_buckets,
        ``perf/bucket_s/<capacity>``: each bucket's seconds per step."""
        switched = sum(self.clock.elapsed(start, end) for start, end in self.switches)
        metrics = {"perf/switch_fraction": switched / seconds}
        self.switches = []
        if self.time_buckets:
            for member, spent in zip(self.members, self.bucket_seconds, strict=True):
                metrics[f"perf/bucket_s/{member.capacity}"] = spent / steps
            self.bucket_seconds = [0.0] * len(self.members)
        return metrics

    def _home_tensors(self) -> dict[str, torch.Tensor]:
        return local_box_tensors(self.home.engine.named_parameters, self.layouts[self.home.name], self.rank)

    def _run_bucket(self, member: _Member, rows: Batch, counts: GlobalCounts, record: bool) -> StepRecord:
        return member.engine.forward_backward(self._bucket_share(member, rows), counts, record=record)

    def _bucket_share(self, member: _Member, rows: Batch) -> list[Batch]:
        """This process's block of every microbatch slot of a bucket's rows; the member's engine set to run as
        many slots."""
        engine = member.engine
        slots = pad_rows(rows, member.slot)
        if len(slots) not in member.executors:
            member.executors[len(slots)] = self._executor(member, len(slots))
        engine.executor = member.executors[len(slots)]
        engine.schedule = engine.executor.schedule
        block = engine.unit.block(engine.dp_rank, member.slot)
        return [mb.select(block) for mb in slots]

    def _executor(self, member: _Member, microbatches: int) -> PipelineExecutor:
        """The same stages and channels under a schedule for ``microbatches`` slots."""
        engine = member.engine
        schedule = pipeline_schedule(engine.cfg, engine.layout, microbatches)
        broker, _ = pipeline_broker(engine.layout, schedule, member.slot)
        first = member.executors[1]
        executor = PipelineExecutor(
            schedule,
            engine.stages,
            engine.row,
            self.rank,
            broker,
            first.channels,
            self.fabric.device,
            boundary_dtype=first.dtype,
            autocast=first.autocast,
        )
        executor.grad_sync = first.grad_sync
        return executor

    def _switch_in(self, member: _Member, home_params: dict[str, torch.Tensor]) -> None:
        started = self.clock.stamp()
        params = member.engine.named_parameters
        _restore(params)
        into = local_box_tensors(params, self.layouts[member.name], self.rank)
        plan = self.plans.get(self.home.name, member.name)
        with torch.no_grad():
            run_switch(plan, home_params, self.layouts[self.home.name], self.layouts[member.name], into=into)
        self.switches.append((started, self.clock.stamp()))

    def _gradients_home(self, member: _Member) -> None:
        started = self.clock.stamp()
        engine = member.engine
        local = [_LocalGrad(p) for _, p in engine.named_parameters]
        group = engine.groups.gradient
        if group is not None and dist.get_world_size(group) > 1:
            allreduce_gradients(local, group, float("inf"), 1)  # a sum over the strategy's replicas
        # sequence parallelism: the norms' gradients are partial sums over the strategy's TP group
        pairs = [(p, g.grad) for (_, p), g in zip(engine.named_parameters, local, strict=True) if g.grad is not None]
        engine.partial_grads.complete_tensors(pairs, lambda grads, tp: allreduce_tensors(grads, tp, float("inf"), 1))
        grads = {n: g.grad for (n, _), g in zip(engine.named_parameters, local, strict=True) if g.grad is not None}
        home = self.home.engine
        with torch.no_grad():
            moved = run_switch(
                self.plans.get(member.name, _GRAD), grads, self.layouts[member.name], self.layouts[_GRAD]
            )
            for name, p in home.named_parameters:
                if name in moved:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    # the home's own reduction sums its partially held gradients over its TP group: count once
                    if home.partial_grads.counted_on(p, home.tp_rank):
                        target = _local(p.grad)
                        target.add_(moved[name].view_as(target))
        for _, p in engine.named_parameters:
            p.grad = None
        _release(engine.named_parameters)
        self.switches.append((started, self.clock.stamp()))


_GRAD = "home:grad"


class _LocalGrad:
    """A parameter seen through its local gradient (DTensor shards), for the flat all-reduce."""

    def __init__(self, p: torch.nn.Parameter):
        self.grad = None if p.grad is None else _local(p.grad)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _release(named_parameters) -> None:
    """Free a strategy's parameter storage while another strategy runs (restored before its next bucket)."""
    for _, p in named_parameters:
        storage = _local(p.data).untyped_storage()
        if storage.nbytes():
            p._hotspa_bytes = storage.nbytes()
            storage.resize_(0)


def _restore(named_parameters) -> None:
    for _, p in named_parameters:
        size = getattr(p, "_hotspa_bytes", None)
        if size is not None:
            _local(p.data).untyped_storage().resize_(size)


def _combined(results: list[StepRecord]) -> StepRecord:
    def reduced() -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for result in results:
            for key, value in result.resolve().sums.items():
                total[key] = total[key] + value if key in total else value
        return total

    return StepRecord(pending_sums=reduced)
