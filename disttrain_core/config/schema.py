"""Run schema: data, optimizer, trainer, cluster, planner, schedule, logging and the root ``Config`` (every
other config group; parallelism: ``config/parallel.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from .data import (  # noqa: F401  re-exported: the data group's schema
    BlendSourceConfig,
    DataConfig,
    HFDataConfig,
    PackingConfig,
    ProducerConfig,
    ReorderConfig,
    SyntheticDataConfig,
    ValDataConfig,
)
from .fault_tolerance import FaultToleranceConfig
from .model import ModelConfig
from .parallel import CommConfig, HotSpaConfig, LocalSgdConfig, ParallelConfig, UnitConfig, UnitsConfig  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


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
    keep_best: bool = False  # also save at every val/loss improvement, never pruned (<checkpoints>/best names it)
    # A fresh run's model weights only, from another run's checkpoint or run directory (TorchTitan's
    # initial_load_path, model only; Megatron's --finetune): step 0, a fresh optimizer and data position. Not read
    # once this run has a checkpoint of its own (trainer.resume=auto resumes that)
    initial_load: Optional[str] = None


@dataclass
class StragglerConfig:
    """A slow process, emulated for benchmarks (train/straggler.py): after each optimizer step a rank in
    ``ranks`` busy-works (factor - 1) x the CPU time its training thread took in the step (needs
    trainer.threads_per_rank=1), with probability ``probability`` per step
    (1: persistently slow; drawn from ``seed``, the rank and the step)."""

    ranks: list[int] = field(default_factory=list)
    factor: float = 1.5
    probability: float = 1.0
    seed: int = 0


@dataclass
class SamplesConfig:
    """What ``trainer.sample_every_n_steps`` generates (train/sampling.py): each prompt continued by the LLM, and,
    for a model with a generator, an image per caption (the captions' LLM states at <gen> condition the
    sampler)."""

    prompts: list[str] = field(default_factory=lambda: ["photo of a red", "drawing of a"])
    captions: list[str] = field(
        default_factory=lambda: [
            "photo of a red circle on white",
            "drawing of a blue square on yellow",
            "painting of a green triangle on black",
            "icon of a yellow ring on blue",
        ]
    )
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling (temperature > 0); 1 keeps every token
    images: Optional[bool] = None  # null: when the model has a generator whose latents decode to pixels
    steps: int = 25  # denoising steps per image
    sampler: str = "ddim"  # ddim (eta 0) | ddpm (eta 1)
    seed: int = 0


@dataclass
class TrainerConfig:
    accelerator: str = "auto"  # auto | cpu | cuda
    devices: int = 1  # processes per node
    # on CPU, at most this many processes per core (more is surely a typo; the 16-process test raises it)
    cpu_processes_per_core: int = 4
    num_nodes: int = 1
    min_nodes: Optional[int] = None  # elastic torchrun --nnodes=min_nodes:num_nodes (launch_env.elastic_nodes)
    precision: str = "auto"  # auto (bf16-mixed on CUDA, 32 on CPU) | 32 | bf16-mixed
    backend: str = "auto"  # auto (gloo on CPU, nccl on CUDA) | gloo | nccl
    max_steps: int = 300
    exit_after_step: Optional[int] = None  # stop cleanly after this step (preemption drills)
    log_every_n_steps: int = 10
    # Validation on the held-out split (data.val; train/evaluation.py): every this many steps and after the last
    # step (0: off); each evaluation reads the split's first val_batches global batches, the same every time.
    val_every_n_steps: int = 0
    val_batches: int = 4
    eval_only: bool = False  # evaluate the resumed model once on data.val and stop (tools/evaluate.py)
    # Samples to look at (train/sampling.py): text, and images from a generator, every this many steps and after
    # the last step (0: off), to <run>/samples/ and every tracker
    sample_every_n_steps: int = 0
    samples: SamplesConfig = field(default_factory=SamplesConfig)
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
    # parallel=auto on one machine: when a rank dies, leave its device out, let the solver plan the devices that
    # remain, and resume from the latest checkpoint in that layout -- up to this many lost devices (0: off;
    # docs/FAULT_TOLERANCE.md "Re-planning after a lost device").
    replan_on_failure: int = 0
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
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    # per-step fault tolerance over replica groups on torchft (config/fault_tolerance.py)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)


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
    peak_flops_fp32: Optional[float] = None  # plain fp32 (no tensor cores)
    peak_flops_tf32: Optional[float] = None  # CUDA fp32 matmuls on tensor cores (trainer.tf32=true)
    intra_node_bandwidth_gbps: float = 900.0  # GB/s per device inside a node
    inter_node_bandwidth_gbps: float = 50.0  # GB/s per device across nodes
    latency_us: float = 10.0  # per message
    memory_bandwidth_gbps: float = 3000.0  # device memory (the optimizer step is bound by it)
    # Planner assumptions for hardware that is not present (analytic cost model, docs/PLANNER.md):
    compute_efficiency: float = 0.6  # achieved / peak FLOP/s of a training step's matmuls
    runtime_overhead_gb: float = 4.0  # CUDA context, communication buffers, fragmentation
    # Optimizer offload (parallel.offload=optimizer): GB/s one device moves to or from host memory (pinned; PCIe
    # Gen5 x16 ~50 GB/s per direction, shared by the node's devices) and billions of parameters per second the
    # host's fused AdamW steps for one device (a share of the node's cores)
    host_bandwidth_gbps: float = 25.0
    host_adam_gparams: float = 0.5
    host_memory_per_node_gb: float = 2048.0  # what the node's offloaded optimizer state may use (DGX H100: 2 TB)
    notes: str = ""


@dataclass
class PlannerConfig:
    """The orchestration solver behind ``parallel.mode=auto`` and tools/plan.py (docs/PLANNER.md)."""

    solver: str = "algorithm1"  # algorithm1 | exhaustive
    # auto: bf16-mixed on CUDA clusters (and a CUDA run then trains in it), trainer.precision on CPU
    precision: str = "auto"
    cost: str = "auto"  # auto (profiled if the cluster is this machine, else analytic) | profiled | analytic
    tp_options: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    # Virtual stages per LLM pipeline rank the solver may use; a plan with vpp > 1 runs under
    # schedule=interleaved_1f1b (in multi-unit layouts too: parallel/plan.py)
    vpp_options: list[int] = field(default_factory=lambda: [1, 2])
    # Schedules a plan may run, per layout the fastest that fits (planner/schedule_choice.py; docs/PLANNER.md): add
    # breadth_first, zb_h1, zb_h2, zbv, dualpipev to the default to let the solver weigh them
    schedules: list[str] = field(default_factory=lambda: ["1f1b", "interleaved_1f1b"])
    colocation: bool = True  # may the encoder / generator run inside the LLM's first / last stage
    # Activation recompute the plan assumes and the runtime then applies (parallel/recompute.py): none | full |
    # selective_op | every_k for every unit, or auto (the default, as shard): per unit the least recomputation
    # that fits
    recompute: str = "auto"
    recompute_every: int = 2
    # Model-state sharding the plan assumes and runs per unit (parallel/fsdp.py): zero1 | zero2 | zero3 |
    # auto (per unit, the least sharding that fits: zero1, zero2, zero3, before any recompute)
    shard: str = "auto"
    # May a unit move its optimizer to the host (parallel.offload=optimizer) where no shard mode and recompute fits
    # it on the device? Opt-in: charged the host link and the host's AdamW at assumed rates (cluster.host_*;
    # docs/MEMORY.md), and it may then pick a layout that needs it over one that fits without it
    offload: bool = False
    dp_overlap: float = 0.0  # share of ZeRO-1 traffic hidden behind compute (0: charged in full; docs/PLANNER.md)
    memory_margin: float = 0.9  # plan to this share of device memory
    baselines: bool = True  # also evaluate the Megatron (best, and as the paper ran it) and FLOPs-proportional ones
    # measured on this machine: under $DISTTRAIN_MEASURED_CACHE when set (base/disk_cache.py), else $DISTTRAIN_CACHE
    profile_cache: str = (
        "${oc.env:DISTTRAIN_MEASURED_CACHE,${oc.env:DISTTRAIN_CACHE,${oc.env:HOME,/tmp}/.cache/disttrain}}/profiles"
    )
    profile_repeats: int = 3


# ---------------------------------------------------------------- schedule
@dataclass
class ScheduleConfig:
    # none (pp = 1) | gpipe | 1f1b | interleaved_1f1b | breadth_first | zb_h1 | zb_h2 | zbv | dualpipev
    name: str = "none"
    microbatches: Optional[int] = None  # per step per replica; None: global / (micro * dp)
    vpp: int = 1  # stages per pipeline rank (interleaved_1f1b, breadth_first: >= 2; zbv, dualpipev: 2)
    csv: Optional[str] = None  # a compute-only CSV schedule instead of a generator
    fill_bubbles: bool = False  # the colocated image encoder split over the pipeline ranks, in their bubbles
    fill_split: Any = None  # its blocks per rank: null (even) | auto (balanced by FLOPs) | [n0, n1, ...]


# ---------------------------------------------------------------------- logger/paths
@dataclass
class LoggerConfig:
    """Experiment trackers (train/trackers.py), several at once: ``logger=[tensorboard,csv,wandb,mlflow]``
    merges each choice's conf/logger/<name>.yaml, which turns its own tracker on."""

    tensorboard: bool = False  # <run>/tensorboard event files
    csv: bool = False  # <run>/csv/metrics.csv (Fabric's CSVLogger): scalars only
    wandb: bool = False  # Weights & Biases (pip install -e .[trackers])
    mlflow: bool = False  # MLflow (pip install -e .[trackers])
    jsonl: bool = True  # metrics.jsonl in the run directory (always readable by scripts)
    wandb_project: str = "disttrain"
    wandb_mode: str = "offline"  # offline (files under <run>/wandb, no network; `wandb sync` uploads) | online
    # None: a SQLite store in <run>/mlflow.db (MLflow 3 keeps its plain-file store in maintenance mode)
    mlflow_tracking_uri: Optional[str] = None
    mlflow_experiment: str = "disttrain"


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
