"""FSDP2 under a pipeline (parallel/fsdp.py ``PipelineStepSync``): over a step of 4 microbatches a ZeRO-3 stage
all-gathers each FSDP group once and reduce-scatters it once (in its last backward), where plain FSDP2 does both
per microbatch (the all-gather twice: forward and backward); the gradients are the same (2 gloo ranks, fp32).
Training with it: tests/distributed/test_fsdp.py and test_all_dimensions.py run ZeRO-3 stages in pipelines
against one process."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WORLD, MICROBATCHES = 2, 4


# FSDP2's collectives by the names torch.distributed gives them (2.13: the *_single forms)
COLLECTIVES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}


def _counted(counts: dict):
    """Wrap the collectives FSDP2 issues, counting calls by kind."""
    originals = {}
    for name, kind in COLLECTIVES.items():
        if not hasattr(dist, name):
            continue
        originals[name] = getattr(dist, name)

        def wrapper(*args, _name=name, _kind=kind, **kwargs):
            counts[_kind] = counts.get(_kind, 0) + 1
            return originals[_name](*args, **kwargs)

        setattr(dist, name, wrapper)
    return originals


def _step(pipelined: bool, rank: int) -> tuple[dict, list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    from disttrain_core.parallel.fsdp import PipelineStepSync

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module, reshard_after_forward=True)  # zero3
    sync = PipelineStepSync({0: model}, reshard_after_forward=True) if pipelined else None
    inputs = torch.randn(MICROBATCHES, 3, 8, generator=torch.Generator().manual_seed(1 + rank))
    counts: dict = {}
    originals = _counted(counts)
    try:
        if sync is not None:
            sync.begin_step()
        for k in range(MICROBATCHES):
            loss = model(inputs[k]).pow(2).sum()
            if sync is not None and k == MICROBATCHES - 1:
                sync.arm(0)  # what the executor does before the stage's last backward of the step
            loss.backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    with torch.no_grad():  # a forward outside a step (evaluation) reshards after itself, as zero3 does
        model(inputs[0])
    counts["sharded after"] = all(isinstance(p, DTensor) for p in model.parameters())
    return counts, grads


def _worker(rank: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    plain_counts, plain_grads = _step(False, rank)
    counts, grads = _step(True, rank)
    worst = max((a - b).abs().max().item() for a, b in zip(grads, plain_grads, strict=True))
    torch.save({"plain": plain_counts, "pipelined": counts, "worst": worst}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_a_pipelined_zero3_stage_gathers_and_reduces_once_per_step(tmp_path):
    start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    groups = 2  # the two linear layers (the root holds no parameters of its own)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["worst"] < 1e-6, result
        assert result["pipelined"] == {"all_gather": groups, "reduce_scatter": groups, "sharded after": True}, result
        plain = result["plain"]
        assert plain["reduce_scatter"] == groups * MICROBATCHES and plain["sharded after"], result
        assert plain["all_gather"] >= groups * MICROBATCHES, result  # and again for backward
