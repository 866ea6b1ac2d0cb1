"""``trainer.fault_tolerance``: what it protects, checked on the whole job before any process starts.

Protected today, on one node, one unit, reading the embedded or webdataset shards in the trainer processes:
``parallel=dp`` (the whole model on every process, DDP inside each replica group); ``parallel=zero1`` (AdamW's
state sharded over each group's processes); ``parallel.shard=zero2|zero3`` (FSDP2 or HSDP inside each group, so
HSDP across groups); ``parallel=megatron_*`` (TP or PP inside each group); DiLoCo and post-local-SGD workers as
replica groups (``parallel=local_sgd``, DDP inside each worker, synced through torchft's quorum). Everything
else is refused here with one line naming what is protected (docs/FAULT_TOLERANCE.md says why for each).
"""

from __future__ import annotations

from ..config import Config
from ..config.fault_tolerance import majority, quorum_minimum
from .common import _require, world_size

PROTECTED = (
    "parallel=dp (DDP inside each replica group), parallel=zero1, parallel.shard=zero2 or zero3 (FSDP2 or HSDP "
    "inside each group), parallel=megatron_* (TP or PP inside each group) and parallel=local_sgd with method=diloco "
    "or post_local_sgd (each group a worker); one unit, reading shards in the trainer processes, on one node"
)


def check_fault_tolerance(cfg: Config, layout) -> None:
    ft = cfg.trainer.fault_tolerance
    if not ft.enabled:
        return
    parallel = cfg.parallel
    zero1 = bool(getattr(parallel, "zero1", False))
    unit = layout.units[0]
    whole_model = len(layout.units) == 1 and unit.pp == 1 and unit.inner == 1
    # FSDP2 (or HSDP) inside a group is HSDP across groups: torchft replicates, the group shards
    sharded = unit.shard in ("zero1", "zero2", "zero3")
    local_sgd = parallel.mode == "local_sgd" and whole_model
    _require(
        (parallel.mode == "ddp" and whole_model and (layout.trains_with_ddp() or sharded))
        or local_sgd
        or (parallel.mode == "megatron" and len(layout.units) == 1),
        f"trainer.fault_tolerance does not protect parallel={parallel.name} (mode {parallel.mode}"
        f"{', ZeRO-1' if zero1 else ''}) yet; it protects {PROTECTED}: use parallel=dp, parallel=auto with "
        "trainer.replan_on_failure (a restart planned for the devices that remain), or trainer.max_restarts for a "
        "restart of every rank from the last checkpoint",
    )
    data = cfg.data
    unprotected = (
        "data.producer" if data.producer.workers > 0 or data.producer.address is not None else None,
        "data.packing" if data.packing.enabled else None,
        "data.format=tokens" if data.format == "tokens" else None,
        "model.llm.moe" if cfg.model.llm.moe is not None else None,
    )
    found = [name for name in unprotected if name]
    _require(
        not found,
        f"trainer.fault_tolerance does not protect runs with {found[0] if found else ''} yet; it protects {PROTECTED}",
    )
    _require(
        cfg.trainer.num_nodes == 1,
        f"trainer.fault_tolerance: train.py starts every replica group on this node, but trainer.num_nodes="
        f"{cfg.trainer.num_nodes}; it protects {PROTECTED}",
    )
    _require(
        cfg.trainer.max_restarts == 0,
        f"trainer.fault_tolerance replaces a failed replica group alone; trainer.max_restarts="
        f"{cfg.trainer.max_restarts} would restart every rank: set trainer.max_restarts=0",
    )
    world, replicas = world_size(cfg), ft.replicas
    _require(
        world >= replicas,
        f"trainer.fault_tolerance.replicas={replicas} replica groups need at least one process each, but the job "
        f"has {world} (trainer.devices={cfg.trainer.devices}); set trainer.devices={replicas} or more",
    )
    _require(
        world % replicas == 0,
        f"trainer.fault_tolerance.replicas={replicas} does not divide the {world} processes "
        f"(trainer.devices={cfg.trainer.devices}) into equal replica groups; use a divisor of {world}",
    )
    group, dp = world // replicas, unit.dp
    _require(
        dp % replicas == 0,
        f"trainer.fault_tolerance.replicas={replicas}: each replica group holds whole TP x PP copies of the model, "
        f"but the layout's dp={dp} is not a multiple of {replicas}; set parallel.dp=-1 or a multiple of {replicas}",
    )
    if local_sgd:
        _check_local_sgd(cfg, group)
    optim, copies = cfg.optim, dp // replicas  # data-parallel copies in a group
    microbatches = optim.global_batch_size // (optim.micro_batch_size * copies)
    _require(
        microbatches >= replicas,
        f"optim.global_batch_size={optim.global_batch_size} is {microbatches} microbatch(es) of "
        f"{optim.micro_batch_size} x {copies} data-parallel cop(ies) per group, fewer than the {replicas} replica "
        f"groups that share each step; use optim.global_batch_size={optim.micro_batch_size * copies * replicas} "
        "or more",
    )
    least, minimum = majority(replicas), quorum_minimum(ft)
    _require(
        least <= minimum <= replicas,
        f"trainer.fault_tolerance.min_replicas={ft.min_replicas} must be a majority of the {replicas} replica "
        f"groups and no more than all of them ({least}..{replicas}): fewer lets two halves of a partitioned "
        "job commit different models",
    )


def _check_local_sgd(cfg: Config, group: int) -> None:
    """Local-SGD workers as replica groups (train/fault_tolerance/workers.py): one worker per group, synced every
    ``sync_every`` steps through torchft's all-reduce and nothing else."""
    from ..parallel.plan import layout_shard, local_sgd_features

    ls, checkpoint = cfg.parallel.local_sgd, cfg.trainer.checkpoint
    _require(
        ls.method in ("diloco", "post_local_sgd") and not any(local_sgd_features(ls)),
        f"trainer.fault_tolerance protects local SGD's diloco and post_local_sgd syncs, not method={ls.method} "
        "with layer-wise sync, EDiT's penalty or A-EDiT's timed syncs (they gather over the sync group outside "
        "torchft's quorum); use parallel.local_sgd.method=diloco",
    )
    _require(
        int(ls.warmup_steps) == 0,
        f"trainer.fault_tolerance with local SGD: parallel.local_sgd.warmup_steps={ls.warmup_steps} is not "
        "protected (its synchronous steps would meet a quorum every step); set parallel.local_sgd.warmup_steps=0",
    )
    _require(
        ls.shard_group in (None, group) and layout_shard(cfg.parallel, "none") == "none",
        f"trainer.fault_tolerance with local SGD makes each replica group of {group} process(es) one worker (DDP "
        f"inside it): parallel.local_sgd.shard_group={ls.shard_group} / parallel.shard="
        f"{layout_shard(cfg.parallel, 'none')} do not match; leave shard_group unset and parallel.shard=none",
    )
    _require(
        checkpoint.every_n_steps % int(ls.sync_every) == 0,
        f"trainer.fault_tolerance with local SGD saves synced models only: trainer.checkpoint.every_n_steps="
        f"{checkpoint.every_n_steps} is not a multiple of parallel.local_sgd.sync_every={ls.sync_every}",
    )


def check_replan(cfg: Config, planned: bool) -> None:
    """``trainer.replan_on_failure``: the solver plans the devices that remain after a rank dies (launch/replan.py).
    ``planned``: the layout is the planner's (parallel=auto, resolved)."""
    trainer = cfg.trainer
    lost = trainer.replan_on_failure
    if lost == 0:
        return
    _require(lost > 0, f"trainer.replan_on_failure={lost}: use 0 (off) or a number of devices the job may lose")
    _require(
        cfg.parallel.mode == "auto" or planned,
        f"trainer.replan_on_failure={lost} re-plans the layout with the solver: use parallel=auto (parallel="
        f"{cfg.parallel.name} names its devices), or trainer.max_restarts for a restart on the same devices",
    )
    _require(
        trainer.checkpoint.every_n_steps > 0,
        f"trainer.replan_on_failure={lost}: the re-planned run resumes from the latest checkpoint; set "
        "trainer.checkpoint.every_n_steps",
    )
    _require(
        trainer.max_restarts == 0 and not trainer.fault_tolerance.enabled and trainer.num_nodes == 1,
        f"trainer.replan_on_failure={lost} restarts the job on this node's remaining devices: it does not combine "
        "with trainer.max_restarts, trainer.fault_tolerance or trainer.num_nodes > 1",
    )
    _require(
        lost < trainer.devices,
        f"trainer.replan_on_failure={lost}: a job of trainer.devices={trainer.devices} can lose at most "
        f"{trainer.devices - 1}",
    )
