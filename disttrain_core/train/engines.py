"""Which engine runs a layout, and over which group a step's loss counts are summed."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from lightning_fabric import Fabric

from ..data.tokenizer import Tokenizer
from ..parallel.plan import build_pipeline
from ..parallel.resolved import ResolvedRun
from .engine import DataParallelEngine, Engine
from .unit_engine import UnitEngine


def build_engine(
    run: ResolvedRun,
    fabric: Fabric,
    tokenizer: Tokenizer,
    accumulation: int,
    global_stream: bool,
    timeout: timedelta,
) -> tuple[Engine, object, object, object]:
    """(engine, count group, pipeline schedule, broker) for the run's resolved layout. The count group sums the
    loss counts of the processes that read different samples (None: every process already sees the whole step,
    or there is one process); schedule and broker are None outside the unit engine."""
    cfg, layout = run.cfg, run.layout
    world = fabric.world_size
    group = dist.group.WORLD if world > 1 and not global_stream else None  # every process is a replica
    if cfg.parallel.mode == "hotspa":  # a strategy per length bucket (train/hotspa.py)
        from .hotspa import HotSpaEngine

        return HotSpaEngine(run, fabric, tokenizer, timeout=timeout), None, None, None
    if cfg.parallel.mode == "local_sgd":  # workers step alone between syncs (train/local_sgd/engine.py)
        from .local_sgd.engine import LocalSgdEngine

        engine = LocalSgdEngine(cfg, fabric, tokenizer, layout.llm, timeout=timeout)
        return engine, group, None, None
    if layout.trains_with_ddp():
        return DataParallelEngine(cfg, fabric, tokenizer, layout.llm), group, None, None
    schedule, broker, rows_of_units = build_pipeline(cfg, layout, accumulation)
    engine = UnitEngine(cfg, fabric, tokenizer, layout, schedule, broker, rows_of_units, timeout=timeout)
    return engine, None if global_stream else engine.groups.data_parallel, schedule, broker
