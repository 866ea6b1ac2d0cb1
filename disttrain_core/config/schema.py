"""Run schema: data, optimizer, trainer, cluster, planner, parallelism, schedule, logging and the root
``Config`` (every other config group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from .model import ModelConfig

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


# ---------------------------------------------------------------------------- data
@dataclass
class SyntheticDataConfig:
    """Parameters of the embedded LAION-like generator (docs/DATA.md)."""

    num_shards: int = 8
    samples_per_shard: int = 512
    seed: int = 1234
    text_only_fraction: float = 0.05
    images_geometric_p: float = 0.45  # P(k images) ~ Geometric(p) on k >= 1, truncated
    max_images: int = 8
    caption_words_log_mean: float = 2.1  # log-normal words per text segment
    caption_words_log_sigma: float = 0.6
    image_side_log_mean: float = 5.3  # log-normal shorter side in pixels (e^5.3 ~ 200 px)
    image_side_log_sigma: float = 0.45
    image_side_max: int = 512
    aspect_log_sigma: float = 0.25


@dataclass
class ReorderConfig:
    intra: bool = True  # Algorithm 2: balance DP groups inside each global batch
    inter: bool = True  # Algorithm 3: order microbatches against 1F1B bubbles


@dataclass
class ProducerConfig:
    """Disaggregated preprocessing (docs/DATA.md): decode, tokenize and reorder off the trainers."""

    workers: int = 0  # decode processes of the producer train.py starts (0: decode in the trainers)
    address: Optional[str] = None  # HOST:PORT of a standalone producer instead (python -m disttrain_core.data.producer)
    listen: str = "127.0.0.1:0"  # where the producer train.py starts listens (port 0: any free port)
    # Shared key; null: train.py makes one for the producer it starts (never written to disk).
    # Standalone: hex:<64 hex digits>, file:<path>, or the environment variable DISTTRAIN_PRODUCER_KEY.
    key: Optional[str] = None
    timeout_s: float = 120.0  # a producer that does not answer within this fails the run with a clear error
    max_frame_mb: int = 1024
    prefetch_steps: int = 2  # global batches prepared ahead
    max_connections: int = 256  # the producer closes connections beyond this many at once
    handshake_timeout_s: float = 10.0  # the producer drops a connection that has not authenticated by then
    reorder: ReorderConfig = field(default_factory=ReorderConfig)


@dataclass
class PackingConfig:
    """Variable-length text packed into rows with document masks (data/packing.py, docs/HOTSPA.md)."""

    enabled: bool = False
    # commoncrawl | github: synthetic documents with those long-tail length profiles (deterministic per step);
    # corpus: the documents of data.packing.corpus (data/corpus.py)
    source: str = "commoncrawl"
    # source=corpus: a .jsonl file or a directory of them ("text" per line), or webdataset shards (a directory,
    # file, glob or brace pattern; a sample's .txt, or its .json "text" / "texts")
    corpus: Optional[str] = None
    documents_per_step: int = 64  # the global batch, in documents
    # Every length of the profile times this (its shape kept): 1/32 draws the seed's 32K-context corpus for a
    # 1K-context model. Lengths are then clamped to the last bucket.
    length_scale: float = 1.0
    # Ascending length boundaries: bucket k packs the documents of length in (buckets[k-1], buckets[k]] into
    # rows of buckets[k] tokens; None: one bucket of model.seq_len. The last is the longest document drawn.
    buckets: Optional[list[int]] = None
    rows_per_microbatch: int = 1  # packed rows per microbatch on one rank (HotSPa: 1)
    # A token budget per microbatch instead: a bucket of c-token rows runs max(1, tokens_per_microbatch // c)
    # rows per microbatch on one rank, so short buckets do not pay per-microbatch costs (TP/CP collectives,
    # pipeline hops) once per short row. None: rows_per_microbatch for every bucket.
    tokens_per_microbatch: Optional[int] = None


@dataclass
class DataConfig:
    name: str = MISSING
    path: str = MISSING  # directory of .tar shards, or a brace pattern like dir/shard-{000..099}.tar
    tokenizer: str = "byte"
    num_workers: int = 1  # decode workers per training process (0 = decode inline)
    prefetch_steps: int = 2  # optimizer steps of decoded samples kept ready ahead of the trainer
    # Niceness added to decode workers so they do not preempt the training threads
    # (which stall each other at every OpenMP barrier when one is descheduled).
    worker_nice: int = 10
    shuffle_shards: bool = True  # reshuffle shard order every epoch (seeded)
    # No shards at data.path: generate the embedded synthetic ones there, but only if data.path is the data
    # group's own location (paths.data_dir/<data.name>) or an existing empty directory (a typo is an error).
    generate_if_missing: bool = False
    # A brace pattern or glob naming shards that do not exist is an error; true: train on those that exist
    # (a warning counts the missing ones).
    allow_missing_shards: bool = False
    max_image_pixels: int = 64_000_000  # larger images are skipped and counted
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)


# --------------------------------------------------------------------------- optim
@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    decay_steps: Optional[int] = None  # None: decay over trainer.max_steps
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # optim=sgd only: torch SGD's momentum and Nesterov switch (weight_decay is added to the gradient, L2)
    momentum: float = 0.0
    nesterov: bool = False
    grad_clip: float = 1.0  # 0 disables clipping
    global_batch_size: int = 16  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 4  # samples per forward/backward on one rank


# ------------------------------------------------------------------------- trainer
@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0 disables periodic checkpoints
    keep_last: int = 2
    async_save: bool = True  # write in a background thread after a CPU snapshot
    save_last: bool = True  # also save when training ends


@dataclass
class TrainerConfig:
    accelerator: str = "auto"  # auto | cpu | cuda
    devices: int = 1  # processes per node
    num_nodes: int = 1
    precision: str = "auto"  # auto (bf16-mixed on CUDA, 32 on CPU) | 32 | bf16-mixed
    backend: str = "auto"  # auto (gloo on CPU, nccl on CUDA) | gloo | nccl
    max_steps: int = 300
    exit_after_step: Optional[int] = None  # stop cleanly after this step (preemption drills)
    log_every_n_steps: int = 10
    seed: int = 42
    # auto (on for CPU, off on CUDA) | true | false | warn. true: torch.use_deterministic_algorithms, and an
    # operator without a deterministic kernel fails (checked before launch); warn: such operators only warn.
    deterministic: Any = "auto"
    tf32: bool = True  # CUDA: TF32 tensor cores for fp32 matmuls and convolutions (bf16-mixed is unaffected)
    # Host synchronizations on the hot path (train/host_sync.py): off | warn | error.
    sync_debug: str = "off"
    threads_per_rank: int = 0  # torch intra-op threads per process; 0 = cores / local processes
    dist_timeout_s: int = 300
    # After SIGTERM/SIGINT the ranks stop at an agreed step and checkpoint (train/stop.py); a rank that has not
    # finished this long after the signal (stuck in a collective) records its flight recorder and exits 143.
    stop_grace_s: float = 600.0
    # Jobs train.py spawns: relaunch every rank from the latest checkpoint up to this many times when one dies
    # (torch's elastic agent). Under torchrun or srun, restarts belong to --max-restarts or the scheduler.
    max_restarts: int = 0
    # How train.py starts this node's ranks: forkserver (forked from a server that imported torch and this
    # package once; a rank starts in a fraction of a second) | spawn (a fresh interpreter per rank).
    start_method: str = "forkserver"
    resume: str = "none"  # none | auto | path to a checkpoint or run directory
    progress_bar: bool = True
    compile: bool = False
    dry_run: bool = False  # validate and print the plan, then exit
    record_timeline: bool = False  # pipeline runs: measured + simulated timeline PNGs at every log step
    # Count this rank's model-state bytes (unique tensor storages) after the last optimizer step and its peak
    # live tensor bytes during the step given here (the allocator's events, via torch.profiler), beside
    # the planner's prediction for its role: <run>/memory/rank<R>.json (train/memory_report.py). 0: off.
    memory_report_step: int = 0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# ------------------------------------------------------------------------- cluster
@dataclass
class ClusterConfig:
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda: what a "device" of this cluster is
    num_gpus: int = 1  # devices in the cluster (for planning)
    gpus_per_node: int = 8
    memory_per_device_gb: float = 80.0
    # Dense peak FLOP/s per device; null = measure a matmul on this machine at startup.
    peak_flops_bf16: Optional[float] = None
    peak_flops_fp32: Optional[float] = None
    intra_node_bandwidth_gbps: float = 900.0  # GB/s per device inside a node
    inter_node_bandwidth_gbps: float = 50.0  # GB/s per device across nodes
    latency_us: float = 10.0  # per message
    memory_bandwidth_gbps: float = 3000.0  # device memory (the optimizer step is bound by it)
    # Planner assumptions for hardware that is not present (analytic cost model, docs/PLANNER.md):
    compute_efficiency: float = 0.6  # achieved / peak FLOP/s of a training step's matmuls
    runtime_overhead_gb: float = 4.0  # CUDA context, communication buffers, fragmentation
    notes: str = ""


@dataclass
class PlannerConfig:
    """The orchestration solver behind ``parallel.mode=auto`` and tools/plan.py (docs/PLANNER.md)."""

    solver: str = "algorithm1"  # algorithm1 | exhaustive
    # auto: bf16-mixed on CUDA clusters (and a CUDA run then trains in it), trainer.precision on CPU
    precision: str = "auto"
    cost: str = "auto"  # auto (profiled if the cluster is this machine, else analytic) | profiled | analytic
    tp_options: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    # Virtual stages per LLM pipeline rank the solver may use. The runtime supports vpp > 1 only in
    # single-unit layouts today, so plans that are meant to run keep [1].
    vpp_options: list[int] = field(default_factory=lambda: [1])
    colocation: bool = True  # may the encoder / generator run inside the LLM's first / last stage
    # Activation recompute the plan assumes and the runtime then applies (parallel/recompute.py): none | full |
    # selective_op | every_k for every unit, or auto: per unit the least recomputation that fits
    recompute: str = "none"
    recompute_every: int = 2
    # Model-state sharding the plan assumes and runs per unit (parallel/fsdp.py): zero1 | zero2 | zero3 |
    # auto (per unit, the least sharding that fits: zero1, zero2, zero3, before any recompute)
    shard: str = "auto"
    dp_overlap: float = 0.0  # share of ZeRO-1 traffic hidden behind compute (issue 7 raises it)
    memory_margin: float = 0.9  # plan to this share of device memory
    baselines: bool = True  # also evaluate the Megatron and FLOPs-proportional layouts
    profile_cache: str = "${oc.env:DISTTRAIN_CACHE,${oc.env:HOME,/tmp}/.cache/disttrain}/profiles"
    profile_repeats: int = 3


# ---------------------------------------------------------------- parallel/schedule
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


@dataclass
class UnitsConfig:
    encoder: UnitConfig = field(default_factory=UnitConfig)
    llm: UnitConfig = field(default_factory=UnitConfig)
    generator: UnitConfig = field(default_factory=UnitConfig)


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
    """EDiT's pseudo-gradient penalty (train/local_sgd_penalty.py), per sync unit; each piece switchable."""

    anomaly: bool = False  # drop a worker whose pseudo-gradient norm is anomalous (EWMA z-test); rollback if all
    ewma_alpha: float = 0.02
    ewma_warmup: int = 10  # normal values seen before the test applies
    threshold: float = 3.0  # z-score above which a norm is anomalous (one-sided)
    weighting: bool = False  # softmax(-G / temperature) weights over the normal workers (else equal)
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
    """parallel.mode=local_sgd (train/local_sgd.py, docs/LOCAL_SGD.md): workers train alone between syncs."""

    # diloco: an outer Nesterov-SGD step on the averaged pseudo-gradient every sync_every steps (Douillard et
    # al. 2023); post_local_sgd: plain parameter averaging every sync_every steps (Lin et al. 2020)
    method: str = "diloco"
    # Processes per worker (the shard group: they train one model replica together, DDP inside); the sync
    # group joins the workers' corresponding processes. None: trainer.devices (one worker per node).
    shard_group: Optional[int] = None
    warmup_steps: int = 0  # synchronous data-parallel steps before the first local one
    sync_every: int = 16  # local steps between syncs
    outer_lr: float = 0.7  # diloco: the outer optimizer (torch SGD over the last synced parameters)
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    # EDiT's layer-wise sync: each decoder block's parameters are synced just before the block's forward in the
    # step after a sync step, the next block's reduction prefetched (overlapped with compute)
    layerwise: bool = False
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
    # Expert parallelism of an MoE LLM (ddp and megatron layouts; manual: parallel.units.llm.ep): inside the
    # data-parallel group, ep replicas share the experts (num_experts / ep each); must divide dp.
    ep: int = 1
    modality_stages: str = "separate"  # megatron only: separate | folded
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
    zero1: bool = False  # alias of shard=zero1 (parallel=zero1)
    comm: CommConfig = field(default_factory=CommConfig)
    hotspa: HotSpaConfig = field(default_factory=HotSpaConfig)
    local_sgd: LocalSgdConfig = field(default_factory=LocalSgdConfig)


@dataclass
class ScheduleConfig:
    name: str = "none"  # none (pp = 1) | gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv
    microbatches: Optional[int] = None  # per step per replica; None: global / (micro * dp)
    vpp: int = 1  # stages per pipeline rank (interleaved_1f1b: >= 2; zbv: 2)
    csv: Optional[str] = None  # a compute-only CSV schedule instead of a generator


# ---------------------------------------------------------------------- logger/paths
@dataclass
class LoggerConfig:
    name: str = MISSING
    tensorboard: bool = True
    jsonl: bool = True  # metrics.jsonl in the run directory (always readable by scripts)


@dataclass
class PathsConfig:
    root_dir: str = str(REPO_ROOT)
    data_dir: str = "${paths.root_dir}/data"
    output_dir: str = "${hydra:runtime.output_dir}"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    task_name: str = "train"
    tags: list[str] = field(default_factory=list)
    # Name of the metric a sweep optimizes (returned by train.py's main).
    optimized_metric: str = "train/loss"
