"""Checks of ``parallel.mode=local_sgd`` (train/local_sgd/engine.py) and of ``optim=sgd``: one line each, before
any process starts."""

from __future__ import annotations

from ..config import Config, wire_format
from ..parallel.plan import layout_shard, local_sgd_features
from ..parallel.plan import local_sgd_shard_group as shard_group_size
from .common import _require, resolve_accelerator

METHODS = ("diloco", "post_local_sgd", "edit", "a_edit")


def _check_workers(cfg: Config, world: int) -> int:
    """The method and the worker size (shard_group) against the process count; returns the worker size."""
    ls = cfg.parallel.local_sgd
    _require(
        ls.method in METHODS,
        f"parallel.local_sgd.method={ls.method!r}: allowed values are {', '.join(METHODS)}",
    )
    size = shard_group_size(cfg)
    _require(
        size >= 1 and world % size == 0,
        f"parallel.local_sgd.shard_group={size} does not divide the {world} processes (trainer.devices x "
        "trainer.num_nodes): each worker is shard_group processes; use a divisor, or null for one worker per node",
    )
    return size


def _check_sync_schedule(cfg: Config) -> None:
    """When the workers sync: every sync_every steps, or every sync_interval_s seconds (A-EDiT)."""
    ls = cfg.parallel.local_sgd
    _require(ls.sync_every >= 1, f"parallel.local_sgd.sync_every={ls.sync_every}: use 1 or more local steps")
    interval = ls.sync_interval_s
    if ls.method == "a_edit":
        _require(
            interval is not None and 0 < interval < float("inf"),
            f"parallel.local_sgd.method=a_edit syncs every sync_interval_s seconds (it is {interval}); set "
            "parallel.local_sgd.sync_interval_s to a positive number of seconds, e.g. 600",
        )
        _require(
            interval is None or cfg.trainer.stop_grace_s > interval,
            f"trainer.stop_grace_s={cfg.trainer.stop_grace_s} is shorter than parallel.local_sgd.sync_interval_s="
            f"{interval}: A-EDiT stops at its next sync, so a preempted job would be killed before it saves; give "
            "stop_grace_s more than the interval plus a step and a checkpoint save",
        )
    else:
        _require(
            ls.step_weight == 0,
            f"parallel.local_sgd.step_weight={ls.step_weight} weights A-EDiT's workers by their steps; with "
            f"method={ls.method} every worker takes the same steps: use method=a_edit or set step_weight=0",
        )
        _require(
            interval is None,
            f"parallel.local_sgd.sync_interval_s={interval} is A-EDiT's: with method={ls.method} syncs come every "
            "sync_every steps; use method=a_edit or unset sync_interval_s",
        )


def _check_outer_step(ls) -> None:
    """The step weighting, warmup and outer optimizer of the syncs."""
    _require(
        0 <= ls.step_weight <= 1,
        f"parallel.local_sgd.step_weight={ls.step_weight}: use a value in [0, 1] (0: off, e.g. 0.5)",
    )
    _require(ls.warmup_steps >= 0, f"parallel.local_sgd.warmup_steps={ls.warmup_steps}: use 0 or more steps")
    _require(ls.outer_lr > 0, f"parallel.local_sgd.outer_lr={ls.outer_lr}: use a positive rate, e.g. 0.7")
    _require(
        0 <= ls.outer_momentum < 1,
        f"parallel.local_sgd.outer_momentum={ls.outer_momentum}: use a value in [0, 1), e.g. 0.9",
    )


def _check_worker_layout(cfg: Config, size: int) -> str:
    """What runs inside a worker (the whole model, DDP or FSDP2, its own data); returns the shard mode."""
    p = cfg.parallel
    _require(
        p.cp == 1 and p.ep == 1 and p.tp == 1 and p.pp == 1,
        "parallel.mode=local_sgd holds the whole model in every worker (DDP or FSDP2 inside it); "
        "unset parallel.tp / pp / cp / ep",
    )
    shard = layout_shard(p, "none")
    _require(
        shard in ("none", "zero1", "zero2", "zero3"),
        f"parallel.shard={shard!r}: a local-SGD worker runs none (DDP), zero1, zero2 or zero3",
    )
    _require(
        shard == "none" or size >= 2,
        f"parallel.shard={shard} shards over a worker's processes and parallel.local_sgd.shard_group={size}; use "
        "shard_group=2 or more, or parallel.shard=none",
    )
    _require(
        shard != "zero1" or wire_format(cfg, resolve_accelerator(cfg.trainer.accelerator)) == "fp32",
        "parallel.shard=zero1 under local_sgd gathers parameters in bf16 (parallel.comm.wire_dtype, auto under "
        "bf16-mixed): the pseudo-gradients would come from bf16-rounded weights; set parallel.comm.wire_dtype=fp32 "
        "or use parallel.shard=zero2 / zero3",
    )
    _require(
        p.hsdp_replicas == 1,
        f"parallel.hsdp_replicas={p.hsdp_replicas}: under local_sgd the workers are the replicas "
        "(parallel.local_sgd.shard_group processes each); unset parallel.hsdp_replicas",
    )
    _require(
        cfg.data.producer.address is None,
        "parallel.mode=local_sgd reads its data in each worker (its workers step at their own pace, a producer "
        "serves synchronous steps): unset data.producer.address",
    )
    _require(cfg.model.llm.moe is None, "parallel.mode=local_sgd: MoE models are not supported yet; use a dense LLM")
    return shard


def _check_penalty_and_spikes(ls, world: int, size: int) -> None:
    """The outlier penalty of pseudo-gradients and the injected loss spikes (which workers, how often)."""
    pen, spikes = ls.penalty, ls.spikes
    _require(0 < pen.ewma_alpha <= 1, f"parallel.local_sgd.penalty.ewma_alpha={pen.ewma_alpha}: use a value in (0, 1]")
    _require(pen.ewma_warmup >= 2, f"parallel.local_sgd.penalty.ewma_warmup={pen.ewma_warmup}: use 2 or more syncs")
    _require(pen.threshold > 0, f"parallel.local_sgd.penalty.threshold={pen.threshold}: use a positive z-score, e.g. 3")
    _require(pen.temperature > 0, f"parallel.local_sgd.penalty.temperature={pen.temperature}: use a positive value")
    _require(
        pen.clip is None or pen.clip > 0,
        f"parallel.local_sgd.penalty.clip={pen.clip}: use a positive norm, or null for no clipping",
    )
    workers = world // size if size >= 1 and world % size == 0 else 0
    bad = [w for w in spikes.workers if not 0 <= w < workers]
    _require(
        not bad,
        f"parallel.local_sgd.spikes.workers: {bad[0] if bad else ''} is not a worker (0..{workers - 1})",
    )
    _require(
        0 <= spikes.probability <= 1,
        f"parallel.local_sgd.spikes.probability={spikes.probability}: use a value in [0, 1]",
    )


def _check_offload_and_compile(cfg: Config) -> None:
    """Anchors offloaded to host memory, and layerwise syncs against trainer.compile."""
    ls = cfg.parallel.local_sgd
    if ls.offload:  # FSDP2 workers too: their anchors are host copies of the local shards (train/local_sgd/sync.py)
        _require(
            resolve_accelerator(cfg.trainer.accelerator) == "cuda",
            "parallel.local_sgd.offload moves anchors from device to host memory; on CPU they are in host memory "
            "already: unset it (or train on CUDA)",
        )
    _require(
        not (local_sgd_features(ls)[0] and cfg.trainer.compile),
        "parallel.local_sgd.layerwise syncs in forward hooks, which trainer.compile would trace; set one of them "
        "to false",
    )


def validate_local_sgd(cfg: Config) -> None:
    """The settings of ``parallel.mode=local_sgd``, in order: workers, syncs, worker layout, penalty, offload."""
    ls = cfg.parallel.local_sgd
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    size = _check_workers(cfg, world)
    _check_sync_schedule(cfg)
    _check_outer_step(ls)
    _check_worker_layout(cfg, size)
    _check_penalty_and_spikes(ls, world, size)
    _check_offload_and_compile(cfg)


def validate_optimizer(cfg: Config, layout=None) -> None:
    """``optim=sgd`` runs where the optimizer is torch's own over whole parameters (DDP and local SGD); the
    sharded ZeRO-1 optimizer and the planner's memory model are AdamW's. ``layout``: the resolved one, once
    there is one (before, only the mode is checked)."""
    if cfg.optim.name != "sgd":
        return
    _require(
        not cfg.optim.nesterov or cfg.optim.momentum > 0,
        f"optim.nesterov=true needs optim.momentum > 0 (it is {cfg.optim.momentum}); set a momentum, e.g. 0.9",
    )
    mode = cfg.parallel.mode
    _require(
        mode != "local_sgd" or layout_shard(cfg.parallel, "none") != "zero1",
        "optim=sgd with parallel.shard=zero1: ZeRO-1's optimizer inside local-SGD workers is AdamW; use "
        "parallel.shard=zero2 or zero3 (torch SGD on FSDP2's shards), none, or optim=adamw",
    )
    _require(
        mode in ("ddp", "local_sgd") and (mode == "local_sgd" or layout is None or layout.trains_with_ddp()),
        f"optim=sgd runs with parallel=dp (no sharding) or parallel=local_sgd; parallel.mode={mode} shards AdamW "
        "(ZeRO-1 / FSDP2): use optim=adamw",
    )
