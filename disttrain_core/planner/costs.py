"""Time and memory of one parallelism unit: the cost model the orchestration solver optimizes.

Compute time ``compute(unit, tp, items)`` is the forward + backward time of the *whole*
module (every layer) for ``items`` items on one tensor-parallel group of ``tp`` devices,
including the TP collectives. It comes from one of two sources:

* **profiled** (``planner/profiler.py``): benchmark trials on this machine at several TP
  sizes and input sizes, interpolated piecewise-linearly in the number of items
  (linearly extrapolated past the largest trial);
* **analytic**, for hardware that is not present: FLOPs / (peak x efficiency), the part
  TP can split divided by ``tp``, plus 4 ring all-reduces per transformer block (2 in
  the forward, 2 in the backward) of the block's activations over the intra-node links.

Communication outside a unit's TP group uses ring formulas with the cluster's bandwidths:
point-to-point between pipeline stages (activations forward, gradients back), and the
ZeRO-1 reduce-scatter + all-gather of a unit's gradients and parameters.

The LLM's context parallelism (``cp``) and expert parallelism (``ep``) enter through ``rank_compute``
(a rank's compute is that of ``items / cp`` sequences, plus the ring-attention and all-to-all time
planner/parallel_costs.py derives), the parameters a rank holds (``ep`` splits the routed experts), the
data-parallel group (dp x cp ranks; dp x cp / ep for the experts) and the activations (1/cp).

Memory per device (``memory_bytes``) follows this runtime's layout: the model state of the unit's
shard mode (none, zero1, zero2, zero3: planner/memory.py, the same table tools/memory.py prints), what
a step holds beyond it (FSDP2's gathered parameters, autocast's bf16 weight copies per in-flight
microbatch), and activations per in-flight microbatch from Korthikanti et al. (docs/PLANNER.md); those
methods live in planner/activation_costs.py (``MemoryCosts``, mixed into ``CostModel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import training_precision
from .activation_costs import MemoryCosts, memoized
from .memory import FSDP, split_shard
from .parallel_costs import all_to_all_s, context_parallel_s
from .schedule_choice import DEFAULT as DEFAULT_SCHEDULES
from .unit_work import UnitWork, Workload

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str
    num_devices: int
    per_node: int
    memory_bytes: float
    peak_flops: float  # dense peak of the training precision, per device
    efficiency: float  # achieved / peak for large matmuls (analytic compute only)
    intra_bw: float  # bytes/s per device inside a node
    inter_bw: float  # bytes/s per device across nodes
    latency_s: float  # per message
    hbm_bw: float  # bytes/s of device memory (optimizer step)
    overhead_bytes: float  # runtime context, communication buffers, fragmentation
    p2p_bw: float | None = None  # measured point-to-point bandwidth (profiled machines)
    host_bw: float = 25e9  # bytes/s one device moves to or from host memory (optimizer offload)
    host_adam: float = 0.5e9  # parameters/s the host's AdamW steps for one device (optimizer offload)
    host_memory: float = 2048e9  # bytes of host memory per node (what offloaded optimizer state may use)

    @classmethod
    def from_config(cls, cluster, precision: str, peak_flops: float | None = None, tf32: bool = True) -> Hardware:
        bf16 = precision.startswith("bf16")
        # fp32 on CUDA runs its matmuls on TF32 tensor cores with trainer.tf32 (the default): that peak when set
        tensor_cores = cluster.device == "cuda" and tf32
        fp32 = (tensor_cores and getattr(cluster, "peak_flops_tf32", None)) or cluster.peak_flops_fp32
        peak = peak_flops or (cluster.peak_flops_bf16 if bf16 else fp32)
        if not peak:
            raise ValueError(
                f"cluster {cluster.name}: cluster.peak_flops_{'bf16' if bf16 else 'fp32'} is not set; "
                "set it (FLOP/s per device), or let the profiler measure it (cluster=local_cpu with planner.cost=auto)"
            )
        return cls(
            name=cluster.name,
            device=cluster.device,
            num_devices=int(cluster.num_gpus),
            per_node=int(cluster.gpus_per_node),
            memory_bytes=float(cluster.memory_per_device_gb) * GB,
            peak_flops=float(peak),
            efficiency=float(cluster.compute_efficiency),
            intra_bw=float(cluster.intra_node_bandwidth_gbps) * GB,
            inter_bw=float(cluster.inter_node_bandwidth_gbps) * GB,
            latency_s=float(cluster.latency_us) * 1e-6,
            hbm_bw=float(cluster.memory_bandwidth_gbps) * GB,
            overhead_bytes=float(cluster.runtime_overhead_gb) * GB,
            host_bw=float(getattr(cluster, "host_bandwidth_gbps", 25.0)) * GB,
            host_adam=float(getattr(cluster, "host_adam_gparams", 0.5)) * 1e9,
            host_memory=float(getattr(cluster, "host_memory_per_node_gb", 2048.0)) * GB,
        )


@dataclass(frozen=True)
class PlannerSettings:
    precision: str = "bf16-mixed"
    # none | full | selective_op | every_k: what parallel/recompute.py does; auto: per unit, the least
    # recompute that fits (LayoutModel.evaluate)
    recompute: str = "none"
    recompute_every: int = 2  # every_k
    # none | zero1 | zero2 | zero3 (planner/memory.py); auto: per unit, the least sharding that fits
    shard: str = "auto"
    offload: bool = False  # may auto try zero1+offload / zero3+offload once nothing else fits (planner.offload)
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES  # planner.schedules (planner/schedule_choice.py)
    dp_overlap: float = 0.0  # share of the ZeRO-1 traffic hidden behind compute
    memory_margin: float = 0.9  # plan to this share of device memory
    moment_bytes: float = 8.0  # optimizer state per trainable parameter (AdamW; planner/memory.py)
    outer_bytes: tuple[float, float] = (0.0, 0.0)  # local SGD's anchors and outer momentum per parameter
    # parallel.pp_split: None (even LLM stages), "auto" (balanced per layout: planner/stage_split.py) or block
    # counts per LLM stage
    pp_split: tuple[int, ...] | str | None = None
    # parallel.sequence_parallel: the Llama and ViT stacks' residual stream and norms split over TP
    # (comm/sequence_split.py); planner/activation_costs.py counts their bytes per rank accordingly
    sequence_parallel: bool = True
    # schedule.fill_bubbles: a configured layout's colocated encoder priced in chunks of these blocks each, in the
    # bubbles (planner/fill_split.py; None: no filling; the solver does not search it)
    fill_split: tuple[int, ...] | None = None

    def llm_share(self, stage: int | None, pp: int, layers: int) -> float:
        """The share of the LLM's blocks pipeline stage ``stage`` of ``pp`` holds (None: the average)."""
        split = self.pp_split
        if stage is None or not isinstance(split, tuple) or len(split) != pp:
            return 1.0 / pp
        return split[stage] / layers

    @property
    def act_bytes(self) -> int:
        return 2 if self.precision.startswith("bf16") else 4


def generator_stage_params(pieces: tuple, tp: int, pp: int, stage: int | None) -> float:
    """Parameters of one TP rank of generator stage ``stage`` (None: the average): its run of U-Net segments,
    plus the projector and the U-Net's input layers on the first stage and its output layers on the last.
    ``pieces``: (replicated, TP-split) parameters of [first-stage extras, each segment, last-stage extras]."""
    from ..parallel.generator_stages import segment_ranges

    segments = pieces[1:-1]
    runs = segment_ranges(len(segments), pp)
    stages = range(pp) if stage is None else [stage]
    total = 0.0
    for s in stages:
        held = [segments[i] for i in runs[s]] + ([pieces[0]] if s == 0 else []) + ([pieces[-1]] if s == pp - 1 else [])
        total += sum(whole + split / tp for whole, split in held)
    return total / len(stages)


class CostModel(MemoryCosts):
    """Unit-level times (seconds) and memory (bytes) on one hardware for one workload."""

    def __init__(self, workload: Workload, hw: Hardware, settings: PlannerSettings, profile=None):
        self.work, self.hw, self.settings, self.profile = workload, hw, settings, profile
        self._memo: dict = {}

    @property
    def source(self) -> str:
        return "profiled" if self.profile is not None else "analytic"

    def profiled(self) -> dict[str, list[int]]:
        """The TP sizes of each unit whose compute was timed on this machine (everything else is analytic)."""
        if self.profile is None:
            return {}
        return {unit: self.profile.tp_sizes(unit) for unit in self.work.units if self.profile.tp_sizes(unit)}

    # ------------------------------------------------------------------ communication
    def link_bw(self, group_span: int) -> float:
        """Bandwidth for a group spanning ``group_span`` consecutive devices."""
        return self.hw.intra_bw if group_span <= self.hw.per_node else self.hw.inter_bw

    def allreduce_s(self, nbytes: float, n: int, bw: float) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2.0 * (n - 1) / n * nbytes / bw + 2.0 * (n - 1) * self.hw.latency_s

    def p2p_s(self, nbytes: float, bw: float) -> float:
        """One activation forward and its gradient back across a stage boundary."""
        if nbytes <= 0:
            return 0.0
        return 2.0 * (nbytes / (self.hw.p2p_bw or bw) + self.hw.latency_s)

    # ------------------------------------------------------------------------ compute
    def compute(self, unit: str, tp: int, items: float) -> float:
        """Forward + backward seconds of the whole ``unit`` for ``items`` items on ``tp`` devices."""
        key = (unit, tp, items)
        if key not in self._memo:
            if self.profile is not None and self.profile.has(unit, tp):
                self._memo[key] = self.profile.compute(unit, tp, items)
            else:
                self._memo[key] = self._analytic(unit, tp, items)
        return self._memo[key]

    @memoized
    def rank_compute(
        self, unit: str, tp: int, items: float, cp: int = 1, ep: int = 1, cp_mode: str = "ring", cp_ulysses: int = 1
    ) -> float:
        """``compute`` for one rank of a context- and expert-parallel unit: every CP rank runs ``1/cp`` of
        each sequence (1/cp of the matmul FLOPs, and of the attention FLOPs since zig-zag balances them; TP's
        collectives carry 1/cp of the tokens), so its time is that of ``items / cp`` sequences; plus, per
        block, the context-parallel exchanges not hidden behind attention (``cp_mode``: ring, allgather, ulysses or
        hybrid with ``cp_ulysses`` ranks per all-to-all) and the MoE all-to-alls (planner/parallel_costs.py). EP
        does not change a rank's expert FLOPs under balanced routing."""
        seconds = self.compute(unit, tp, items / cp)
        if cp == 1 and ep == 1:
            return seconds
        context = context_parallel_s(self, unit, tp, cp, items, cp_mode, cp_ulysses)
        per_block = context + all_to_all_s(self, unit, tp, cp, ep, items)
        return seconds + self.work.units[unit].layers * per_block

    def seconds_per_flop(self, unit: str, tp: int, items: float = 1.0) -> float:
        """What a FLOP of ``unit`` costs on one rank: measured (profiled compute over the FLOPs it ran) or the
        analytic peak x efficiency. Used to size the compute a communication can hide behind."""
        w = self.work.units[unit]
        if self.profile is None or not self.profile.has(unit, tp) or not w.train_flops:
            return 1.0 / (self.hw.peak_flops * self.hw.efficiency)
        flops = items * ((w.train_flops - w.flops_unsplit) / self.split_tp(unit, tp) + w.flops_unsplit)
        return self.compute(unit, tp, items) / flops

    def _analytic(self, unit: str, tp: int, items: float) -> float:
        w = self.work.units[unit]
        tp = self.split_tp(unit, tp)
        # TP shards the blocks' attention, MLPs and experts (hidden widths) and the LLM's head (by vocabulary rows);
        # the replicated modules and the MoE routers run whole on every TP rank
        flops = items * (w.train_flops - w.flops_unsplit) / tp + items * w.flops_unsplit
        seconds = flops / (self.hw.peak_flops * self.hw.efficiency)
        if tp > 1 and w.params_tp and w.tp_reduces:  # blocks of different widths (the U-Net's transformers)
            each = items * w.tp_reduce_floats / w.tp_reduces * self.settings.act_bytes
            seconds += w.tp_reduces * self.allreduce_s(each, tp, self.hw.intra_bw)
        elif tp > 1 and w.params_tp:
            block_bytes = items * w.tokens * w.dim * self.settings.act_bytes
            # two per block forward and backward; the vocabulary-parallel embedding's lookups and the head's
            # input gradient one each
            reduces = 4 * w.layers + (2 if w.vocab else 0)
            seconds += reduces * self.allreduce_s(block_bytes, tp, self.hw.intra_bw)
        return seconds

    # -------------------------------------------------------------------- unit pieces
    def boundary_bytes(self, unit: str, samples: float) -> float:
        w = self.work.units[unit]
        return samples * w.items_per_sample * w.boundary_floats * self.settings.act_bytes

    @memoized
    def generator_cut_bytes(self, pp: int, samples: float) -> float:
        """The largest boundary between the generator's ``pp`` stages (each stage's last segment's state,
        parallel/generator_stages.py), in the activation dtype; 0 for one stage."""
        from ..parallel.generator_stages import segment_ranges

        w = self.work.units["generator"]
        if pp <= 1 or not w.cut_floats:
            return 0.0
        runs = segment_ranges(len(w.cut_floats) + 1, pp)
        return samples * max(w.cut_floats[run[-1]] for run in runs[:-1]) * self.settings.act_bytes

    @memoized
    def local_params(self, unit: str, tp: int, pp: int, stage: int | None = None, ep: int = 1) -> float:
        """Parameters on one TP rank of a pipeline stage: the stage's share of the blocks (attention and dense
        MLPs and shared experts split by TP; of a MoE, the router whole and 1/(ep tp) of the routed experts) plus
        the embeddings on the first stage and the head on the last; ``stage=None``: the average."""
        w = self.work.units[unit]
        tp = self.split_tp(unit, tp)
        if w.pieces and pp > 1:  # the U-Net cut at level boundaries (parallel/generator_stages.py)
            return generator_stage_params(w.pieces, tp, pp, stage)
        blocks = w.params_dense_tp / tp + w.params_moe_rep + w.params_expert / (ep * tp)
        if stage is None:
            return (blocks + w.rep_local(tp)) / pp
        held = blocks * (self.settings.llm_share(stage, pp, w.layers) if unit == "llm" else 1.0 / pp)
        if w.params_first + w.params_last != w.params_rep:  # a workload without the split: spread evenly
            return held + w.rep_local(tp) / pp
        first = w.rep_local(tp, "first") if stage == 0 else 0
        return held + first + (w.rep_local(tp, "last") if stage == pp - 1 else 0)

    def _split_params(self, unit: str, tp: int, pp: int, stage: int | None, ep: int) -> tuple[float, float]:
        """(non-expert, routed-expert) parameters of one rank of a stage: they are reduced, sharded and
        stepped over different data-parallel groups."""
        local = self.local_params(unit, tp, pp, stage, ep)
        w = self.work.units[unit]
        share = self.settings.llm_share(stage, pp, w.layers) if unit == "llm" else 1.0 / pp
        experts = w.params_expert / (ep * tp) * share
        return local - experts, experts

    @memoized
    def sync_s(
        self,
        unit: str,
        tp: int,
        dp: int,
        pp: int,
        shard: str | None = None,
        microbatches: int = 1,
        cp: int = 1,
        ep: int = 1,
        pipelined: bool = False,
    ) -> float:
        """Data-parallel traffic of a step, exposed part. ZeRO-1 (and DDP, the same bytes): one reduce-scatter
        of fp32 gradients + one all-gather of the updated parameters in the wire dtype (bf16 under
        bf16-mixed, as the runtime sends them). FSDP2 as parallel/fsdp.py runs it: under a pipeline (``pipelined``:
        the layout has more than one schedule stage) zero2 and zero3 gather once per step and reduce-scatter once
        per step (``FsdpStepSync``); without one, a reduce-scatter of the fp32 gradients per microbatch, zero2's
        all-gather once per step (after the optimizer step), zero3's for every microbatch's forward and again for
        its backward except the groups kept gathered after forward (``kept_after_forward``: the last block and
        the LM head, ``kept_params``). The group is the dp x cp ranks (CP ranks' losses
        cover disjoint positions: their gradients add up as replicas' do); routed experts go over their
        expert-data-parallel group of dp x cp / ep ranks, all-reduced once per step under expert parallelism
        (their own optimizer: train/expert_optim.py), whatever the dense parameters' shard mode."""
        ranks = dp * cp
        if ranks <= 1:
            return 0.0
        shard = split_shard(self.shard_of(shard))[0]
        w = self.work.units[unit]
        dense, experts = self._split_params(unit, tp, pp, None, ep)
        bw = self.link_bw(tp * ranks)
        seconds = 0.0
        # zero3 without a pipeline: the share of the parameters gathered again for the backward
        again = 1.0 - min(1.0, self.kept_params(unit, tp, ep) / max(dense + experts, 1.0)) if shard == "zero3" else 0.0
        for params, group, sharded in ((dense, ranks, True), (experts, ranks // ep, ep == 1)):
            trainable = params * w.trainable_fraction
            # a reduce-scatter and an all-gather each move half of what an all-reduce of the same bytes moves
            reduce = self.allreduce_s(trainable * 4, group, bw) / 2
            gather = self.allreduce_s(trainable * self.settings.act_bytes, group, bw) / 2
            if shard in FSDP and sharded and pipelined:
                seconds += reduce + gather
            elif shard in FSDP and sharded:
                seconds += microbatches * reduce + gather * ((1.0 + again) * microbatches if shard == "zero3" else 1)
            elif not sharded:  # the experts' fp32 all-reduce
                seconds += 2 * reduce
            else:
                seconds += reduce + gather
        return seconds * (1.0 - self.settings.dp_overlap)

    @memoized
    def optimizer_s(self, unit: str, tp: int, dp: int, pp: int, cp: int = 1, ep: int = 1) -> float:
        w = self.work.units[unit]
        dense, experts = self._split_params(unit, tp, pp, None, ep)
        local = (dense + experts) * w.trainable_fraction
        # this rank's shards: dense over the dp x cp ranks, experts over their dp x cp / ep ranks
        stepped = dense * w.trainable_fraction / (dp * cp) + experts * w.trainable_fraction * ep / (dp * cp)
        if self.profile is not None and self.profile.optimizer_s_per_param:
            per = self.profile.optimizer_s_per_param
            return stepped * per + local * self.profile.copy_s_per_param
        # AdamW touches master, grad, two moments (read + write) ~ 28 bytes; copy-back 8 bytes
        return (28.0 * stepped + 8.0 * local) / self.hw.hbm_bw


def offload_s(
    costs, unit: str, tp: int, dp: int, pp: int, shard: str, microbatches: int, cp: int = 1, pipelined: bool = False
) -> float:
    """Seconds per step an offloaded optimizer adds in place of the device's step (parallel/offload.py): this
    rank's trainable shard stepped by the host's AdamW (``cluster.host_adam_gparams``), and over the host link
    (``cluster.host_bandwidth_gbps``) its fp32 gradients down and parameters up -- once per step under ZeRO-1 and
    a pipelined or zero2 FSDP2 unit; per microbatch's reduce-scatter and gather under zero3 without a pipeline
    (FSDP2 copies a group's host shard up for each all-gather). Nothing overlaps it."""
    base = split_shard(shard)[0]
    w = costs.work.units[unit]
    dense, _ = costs._split_params(unit, tp, pp, None, 1)
    shard_params = dense * w.trainable_fraction / max(1, dp * cp)
    trips = microbatches if base == "zero3" and not pipelined else 1
    return shard_params / costs.hw.host_adam + 2 * trips * 4.0 * shard_params / costs.hw.host_bw


def interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted ``points``, extended linearly past both ends."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    if len(xs) == 1:
        return float(ys[0] * x / xs[0])
    if x <= xs[0]:
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        return float(max(ys[0] + slope * (x - xs[0]), ys[0] * x / xs[0]))
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


__all__ = ["CostModel", "Hardware", "PlannerSettings", "UnitWork", "interp"]


class PlanningError(ValueError):
    """No layout satisfies the constraints; the message names the binding one."""


def planned_devices(cfg) -> int:
    """Devices to plan for: the processes requested on a CPU cluster, the cluster size on GPUs."""
    if cfg.cluster.device == "cpu":
        return int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    return int(cfg.cluster.num_gpus)


def planned_precision(cfg) -> str:
    choice = cfg.planner.precision
    if choice == "auto":
        return "bf16-mixed" if cfg.cluster.device == "cuda" else training_precision(cfg.trainer.precision, "cpu")
    if choice not in ("32", "bf16-mixed"):
        raise PlanningError(f"planner.precision={choice!r}: allowed values are auto, 32 and bf16-mixed")
    return choice
