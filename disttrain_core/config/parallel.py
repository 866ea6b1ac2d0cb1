"""Parallelism schema (``parallel.*``): layouts and units, overlapped communication, HotSPa and local SGD."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class UnitConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    # LLM only: context parallelism, ring attention over slices of every sequence (parallel/context_parallel.py)
    cp: int = 1
    # LLM only, MoE models (model.llm.moe): expert parallelism; groups of ep data-parallel replicas share the
    # experts, each holding num_experts / ep of them, tokens exchanged by all-to-all (parallel/expert_parallel.py)
    ep: int = 1
    # Encoder or generator only: run inside the LLM unit (its first / last stage) instead of on
    # processes of its own.
    colocate: bool = False
    # Activation recompute of this unit's blocks (parallel/recompute.py): none | full | selective_op | every_k
    recompute: str = "none"
    recompute_every: int = 2  # every_k: recompute every k-th block
    # How this unit's model state is sharded over its DP replicas (parallel/fsdp.py): zero1 (ZeRO-1:
    # sharded AdamW state, lean flat buffers) | zero2 | zero3 (FSDP2: gradients and optimizer state
    # sharded; zero3 also reshards parameters after forward). A colocated module shards as the LLM unit.
    shard: str = "zero1"
    hsdp_replicas: int = 1  # zero2/zero3: HSDP, the DP replicas as replicas x shards (must divide dp)
    # none | optimizer: ZeRO-Offload. zero1: the fp32 master shard and AdamW's moments on the host, the step run
    # there; zero2/zero3: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer state on the host)
    offload: str = "none"


@dataclass
class UnitsConfig:
    encoder: UnitConfig = field(default_factory=UnitConfig)
    llm: UnitConfig = field(default_factory=UnitConfig)
    generator: UnitConfig = field(default_factory=UnitConfig)
    # The audio tower and the audio generator (model.audio_encoder, model.audio_generator): in the LLM unit's
    # first / last stage unless colocate=false gives them processes of their own, beside the image encoder /
    # generator unit (a branch: same pp, fed by / feeding the LLM directly).
    audio_encoder: UnitConfig = field(default_factory=lambda: UnitConfig(colocate=True))
    # The video tower (model.video_encoder): likewise, in the LLM unit's first stage unless colocate=false.
    video_encoder: UnitConfig = field(default_factory=lambda: UnitConfig(colocate=True))
    audio_generator: UnitConfig = field(default_factory=lambda: UnitConfig(colocate=True))


@dataclass
class CommConfig:
    """How gradient and parameter collectives run (disttrain_core/comm). Results do not depend on it."""

    # ZeRO-1 / DDP: reduce gradient buckets during the last microbatch's backward (off: after backward).
    overlap_grad_reduce: bool = True
    # ZeRO-1: all-gather updated parameter buckets during the next forward (off: right after the step).
    overlap_param_gather: bool = True
    bucket_mb: float = 25.0  # fp32 MB per gradient bucket (also DDP's bucket_cap_mb); 0: one bucket
    # ZeRO-1: the first-used parameters go into buckets of 1/8, 1/4 and 1/2 of bucket_mb, so the first
    # layer's parameter wait and the last gradient reduce-scatter after backward are short.
    graded_buckets: bool = True
    # ZeRO-1 reduce-scatter / all-gather: auto (ring on gloo, the backend's own on NCCL) | ring | native.
    # ring: point-to-point rings on a background thread over their own process group (comm/ring.py).
    collectives: str = "auto"
    # Sequence-parallel TP for Llama blocks with chunked all-gather+matmul / matmul+reduce-scatter
    # (communication of chunk i+1 under the matmul of chunk i). Off: Megatron TP with all-reduces.
    tp_overlap: bool = False
    # What pipeline stage boundaries and ZeRO-1 parameter all-gathers carry: auto (bf16 under bf16-mixed,
    # fp32 otherwise) | fp32 | bf16. The fp32 master weights stay in the optimizer either way.
    wire_dtype: str = "auto"
    skip_collectives: bool = False  # benchmarks only (compute-only timing): gradients are NOT reduced
    # Benchmarks only (ZeRO-1): step n runs in mode interleave_modes[((n - 1) // interleave_block) % len],
    # each of overlap | no_overlap | compute_only, so the modes are timed in one run under the same
    # machine load (tools/bench_overlap.py). compute_only trains a wrong model.
    interleave_modes: list[str] = field(default_factory=list)
    interleave_block: int = 4
    trace: bool = False  # write compute/communication events to <run>/comm_trace/rank<R>.json


@dataclass
class HotSpaConfig:
    """parallel.mode=hotspa: one strategy per length bucket (data.packing.buckets), hot-switched in a step."""

    # One per bucket, like dp2tp2, tp2pp2, dp4, cp2dp2 (factors dp, tp, pp, cp; their product = the world)
    strategies: list[str] = field(default_factory=list)
    # The strategy that holds gradients and runs the optimizer; None: the one with the least model state per
    # process (the most sharded), as HotSPa does.
    home: Optional[str] = None
    # Bucket order within a step: min_switch (the order with the fewest switched bytes, home last) | given
    order: str = "min_switch"
    # One recompute policy per bucket (none | full | selective_op | every_k); None: parallel.recompute for all.
    # Long buckets recompute, short ones need not.
    recompute: Optional[list[str]] = None
    # Time each bucket's rows (perf/bucket_s/<capacity>; on CUDA the device is synchronized after each bucket):
    # what tools/profile_hotspa.py measures strategies with
    time_buckets: bool = False
    # strategies=[auto]: a profile written by tools/profile_hotspa.py (measured t(row) per strategy) instead of
    # the planner's analytic costs
    profile: Optional[str] = None


@dataclass
class LocalSgdPenaltyConfig:
    """EDiT's pseudo-gradient penalty (train/local_sgd/penalty.py), per sync unit; each piece switchable."""

    # drop a worker whose pseudo-gradient norm is anomalous (EWMA z-test); rollback if all are. null: on for the
    # methods edit and a_edit, off for diloco and post_local_sgd
    anomaly: Optional[bool] = None
    ewma_alpha: float = 0.02
    ewma_warmup: int = 10  # normal values seen before the test applies
    threshold: float = 3.0  # z-score above which a norm is anomalous (one-sided)
    # softmax(-G / temperature) weights over the normal workers (else equal). null: as ``anomaly``
    weighting: Optional[bool] = None
    temperature: float = 1.0
    clip: Optional[float] = None  # clip the combined pseudo-gradient of each unit to this norm


@dataclass
class LocalSgdSpikesConfig:
    """Fault injection for the penalty's tests and benchmark: on a local step at or after ``start_step``, each
    worker of ``workers`` scales its loss by ``scale`` with probability ``probability`` (drawn from ``seed``,
    the worker and the step: the same on every process)."""

    workers: list[int] = field(default_factory=list)
    probability: float = 0.0
    scale: float = 10.0
    start_step: int = 0
    seed: int = 0


@dataclass
class LocalSgdConfig:
    """parallel.mode=local_sgd (train/local_sgd/engine.py, docs/LOCAL_SGD.md): workers train alone between syncs."""

    # diloco: an outer Nesterov-SGD step on the averaged pseudo-gradient every sync_every steps (Douillard et
    # al. 2023); post_local_sgd: plain parameter averaging every sync_every steps (Lin et al. 2020); edit: DiLoCo's
    # outer step with EDiT's layer-wise sync and pseudo-gradient penalty on by default (Cheng et al. 2025);
    # a_edit: EDiT synced when sync_interval_s seconds have passed since the last sync (fast workers take more
    # local steps than slow ones)
    method: str = "diloco"
    # Processes per worker (the shard group: they train one model replica together, DDP inside); the sync
    # group joins the workers' corresponding processes. None: trainer.devices (one worker per node).
    shard_group: Optional[int] = None
    warmup_steps: int = 0  # synchronous data-parallel steps before the first local one
    sync_every: int = 16  # local steps between syncs (not a_edit)
    sync_interval_s: Optional[float] = None  # a_edit: seconds of local training between syncs (required there)
    # a_edit: mix each worker's sync weight with its share of the steps taken since the last sync,
    # (1 - step_weight) x weight + step_weight x share (the public implementation's use_step_weight; 0: off)
    step_weight: float = 0.0
    outer_lr: float = 0.7  # diloco: the outer optimizer (torch SGD over the last synced parameters)
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    # EDiT's layer-wise sync: each decoder block's parameters are synced just before the block's forward in the
    # step after a sync step, the next block's reduction prefetched (overlapped with compute). null: on for edit
    # and a_edit, off for diloco and post_local_sgd
    layerwise: Optional[bool] = None
    # Anchors (the last synced parameters; pinned) and outer momentum in host memory (CUDA only: on CPU they are
    # in host memory already); a sync moves each unit's anchors to the device and its pseudo-gradient back
    offload: bool = False
    penalty: LocalSgdPenaltyConfig = field(default_factory=LocalSgdPenaltyConfig)
    spikes: LocalSgdSpikesConfig = field(default_factory=LocalSgdSpikesConfig)


@dataclass
class ParallelConfig:
    name: str = MISSING
    # ddp: whole model on every process. megatron: one dp x tp x pp for the LLM, the encoder and
    # generator either extra stages with the LLM's dp and tp (separate) or inside its first and
    # last stage (folded). manual: disaggregated units, each with its own dp/tp/pp (parallel.units).
    mode: str = "ddp"
    dp: int = -1  # megatron: -1 = derived from the world size
    tp: int = 1
    pp: int = 1
    # Context parallelism of the LLM (ddp and megatron layouts; manual: parallel.units.llm.cp): each of cp
    # ranks holds 2 of 2cp chunks of every sequence (zig-zag) and attention runs as a ring
    # (parallel/context_parallel.py). Data parallelism is then world / (tp x cp x pp).
    cp: int = 1
    # How the cp ranks attend (every layout's LLM, HotSPa strategies too; comm/context_modes.py, docs/PARALLELISM.md):
    # ring (K/V blocks travel around, overlapped) | allgather (one all-gather of K/V; Llama 3) | ulysses (all-to-all
    # to a head split; local heads divisible by cp) | hybrid (Ulysses over cp_ulysses consecutive ranks, a ring
    # across) | auto (the planner's cost model picks, printed at launch)
    cp_mode: str = "ring"
    cp_ulysses: int = 0  # hybrid: ranks per all-to-all (divides cp; 0: the largest proper divisor the heads allow)
    # Expert parallelism of an MoE LLM (ddp and megatron layouts; manual: parallel.units.llm.ep): inside the
    # data-parallel group, ep replicas share the experts (num_experts / ep each); must divide dp.
    ep: int = 1
    modality_stages: str = "separate"  # megatron only: separate | folded
    # How many LLM blocks each LLM pipeline stage holds, in stage order (pp x virtual stages per rank entries,
    # virtual stage v of rank r being stage v x pp + r), e.g. [1, 3]; null: the same count everywhere; auto: the
    # planner balances the stages' predicted times, the embedding, head and colocated modules included
    # (planner/stage_split.py), and the launch prints and uses its split.
    pp_split: Any = None
    units: UnitsConfig = field(default_factory=UnitsConfig)  # manual only
    # Activation recompute for ddp and megatron layouts (manual: parallel.units.<unit>.recompute):
    # none | full | selective_op | every_k (parallel/recompute.py)
    recompute: str = "none"
    recompute_every: int = 2  # every_k: recompute every k-th block
    # Model-state sharding of ddp and megatron layouts (manual: parallel.units.<unit>.shard):
    # none (torch DDP + a replicated AdamW; ddp layouts only) | zero1 | zero2 | zero3; null: the layout's
    # default (ddp: none, megatron: zero1). Layouts with tp, pp or several units shard at least zero1.
    shard: Optional[str] = None
    hsdp_replicas: int = 1  # zero2/zero3: HSDP replicate x shard mesh over the DP replicas
    offload: str = "none"  # none | optimizer (manual: parallel.units.<unit>.offload); see UnitConfig.offload
    zero1: bool = False  # alias of shard=zero1 (parallel=zero1)
    # Megatron's sequence parallelism with every tensor-parallel Llama and ViT block stack (comm/sequence_split.py):
    # norms and residuals on 1/tp of the sequence, reduce-scatter + all-gather in place of all-reduces. false:
    # plain TP (the residual stream replicated over the TP group). parallel.comm.tp_overlap chunks it.
    sequence_parallel: bool = True
    # Item-level rebalancing (OrchMLLM): each encoder's images, clips and frame groups spread evenly over its
    # data-parallel replicas by an all-to-all, encoded there, their embeddings sent back (comm/item_balance.py)
    rebalance_items: bool = False
    comm: CommConfig = field(default_factory=CommConfig)
    hotspa: HotSpaConfig = field(default_factory=HotSpaConfig)
    local_sgd: LocalSgdConfig = field(default_factory=LocalSgdConfig)


def reads_whole_steps(cfg) -> bool:
    """Settings that make every process read the whole step, whatever the layout: item rebalancing and bubble
    filling plan from every replica's item counts, which each process then knows without asking."""
    return bool(cfg.parallel.rebalance_items or cfg.schedule.fill_bubbles)
