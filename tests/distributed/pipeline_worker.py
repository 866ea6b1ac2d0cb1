"""Worker for test_pipeline_executor.py: runs one pipeline step per schedule and saves
losses and gradients by parameter name (one file per rank and schedule)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(
    rank: int,
    world: int,
    store_path: str,
    out_dir: str,
    shards: str,
    overrides: list[str],
    cases: list[tuple[str, int]],
    skip_first_handle: bool = False,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from disttrain_core.comm.p2p import Channels
    from disttrain_core.config import compose
    from disttrain_core.data.tokenizer import ByteTokenizer
    from disttrain_core.parallel.plan import pipeline_broker
    from disttrain_core.parallel.stages import build_rank_stages
    from disttrain_core.parallel.units import build_layout
    from disttrain_core.schedule import executor as executor_module
    from disttrain_core.schedule.executor import PipelineExecutor
    from disttrain_core.schedule.generators import build_schedule
    from disttrain_core.schedule.transfers import channel_pairs
    from tests.distributed.pipeline_reference import loss_of, microbatches

    if skip_first_handle:  # a regression for test_nccl_contract.py: handles filed by position
        executor_module.wait_all = lambda works: [work.wait() for work in works[1:]]
    cfg = compose([f"data.path={shards}"] + overrides)
    batches, n_tokens, n_gen = microbatches(cfg)
    # One unit holding the whole model (encoder and generator folded in), `world` pipeline ranks.
    layout = build_layout({"llm": (1, 1, world)}, True, True, True, True)
    unit = layout.llm
    for name, vpp in cases:
        schedule = build_schedule(name, world, len(batches), vpp)
        broker, rows = pipeline_broker(layout, schedule, batches[0].size)
        stages = build_rank_stages(
            cfg.model, ByteTokenizer(), unit, schedule, rows["llm"], rank, torch.device("cpu"), cfg.trainer.seed
        )
        channels = Channels(channel_pairs(schedule, broker), rank, torch.device("cpu"))
        executor = PipelineExecutor(schedule, stages, rank, rank, broker, channels, torch.device("cpu"))
        record = executor.run(batches, lambda out: loss_of(out, n_tokens, n_gen, cfg.model.gen_loss_weight))
        record.sums = {name: float(value) for name, value in record.sums.items()}
        grads = {
            n: p.grad.clone()
            for stage in stages.values()
            for n, p in stage.model.named_parameters()
            if p.grad is not None
        }
        torch.save({"sums": record.sums, "grads": grads}, os.path.join(out_dir, f"{name}_v{vpp}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit("run through tests/distributed/test_pipeline_executor.py")
