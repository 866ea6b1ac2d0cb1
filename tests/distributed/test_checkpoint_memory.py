"""During an asynchronous save a rank's extra memory is one staging copy of what it saves -- its own shards
(FSDP2 zero3, tensor parallelism) or its share of replicated state (DDP) -- never a gathered full tensor:
measured with the allocator's events (the torch profiler) around ``CheckpointManager.save`` and ``wait``
on 2 ranks, for a 4-layer MLP."""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WIDTH = 512  # 4 x 512 x 512 fp32 weights = 4 MiB of model: large against any per-file overhead


def _worker(rank: int, world: int, store: str, root: str, layout: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain_core.train.checkpoint import CheckpointManager
    from disttrain_core.train.memory_report import allocation_peak

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)])
    if layout == "ddp":
        pass  # every rank holds every parameter; each saves its share (train/state.py owned_by)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(4)}
        parallelize_module(model, mesh, plan)
    from disttrain_core.train.state import owned_by

    state = {f"model.{name}": param.detach() for name, param in model.named_parameters()}
    if layout == "ddp":
        state = owned_by(state, rank, world)
    local = [v.to_local() if hasattr(v, "to_local") else v for v in state.values()]
    own = sum(t.numel() * t.element_size() for t in local)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    group = dist.new_group(backend="gloo")
    manager = CheckpointManager(root, rank, world, dist.barrier, async_save=True, process_group=group)
    measured: dict = {}
    with allocation_peak(measured):
        manager.save(1, state, {}, {})
        manager.wait()
    with open(os.path.join(out, f"{rank}.json"), "w") as handle:
        json.dump({"own": own, "full": full, "peak": measured["peak_delta"]}, handle)
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ddp"])
def test_async_save_stages_only_this_ranks_shards(layout, tmp_path):
    world = 2
    start_processes(
        _worker,
        args=(world, str(tmp_path / "store"), str(tmp_path / "ckpt"), layout, str(tmp_path)),
        nprocs=world,
        join=True,
    )
    for rank in range(world):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["own"] * world == result["full"]  # each rank saves half
        # One staging copy of what it saves (a few bytes of bookkeeping aside); gathering the model would take
        # twice that.
        assert result["own"] <= result["peak"] <= result["own"] + 4096, result
