"""The ring reduce-scatter and all-gather that ZeRO-1 runs on gloo (comm/ring.py) give exactly the
native collectives' results on 3 ranks, writing into slices of larger buffers as the engine does, and
gathering in place (the shard a slice of the output, which the all-gather does not copy onto itself)."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WORLD = 3


def _worker(rank: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    from disttrain_core.comm.ring import RingCollectives

    ring = RingCollectives(dist.new_group(list(range(WORLD))))
    size = 5
    source = torch.randn(WORLD * size + 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expected = source[2 : 2 + WORLD * size].clone()
    dist.all_reduce(expected)
    shards = torch.zeros(3 * size)  # the reduced slice lands in the middle of a bigger shard buffer
    handles = [ring.reduce_scatter(shards[size : 2 * size], source[2 : 2 + WORLD * size].float())]
    shard = torch.arange(size, dtype=torch.float32) + 10 * rank
    gathered = torch.full((WORLD * size + 2,), -1.0)
    handles.append(ring.all_gather(gathered[1 : 1 + WORLD * size], shard))
    in_place = torch.full((WORLD * size,), -1.0)  # ZeRO-1's way: the shard is this rank's slice of the output
    in_place[rank * size : (rank + 1) * size] = shard
    handles.append(ring.all_gather(in_place, in_place[rank * size : (rank + 1) * size]))
    for handle in handles:
        handle.wait()
    from disttrain_core.base.torch_compat import all_gather_tensor

    native = torch.empty(WORLD * size)
    all_gather_tensor(native, shard)
    ring.close()
    result = {
        "reduce_scatter": torch.allclose(shards[size : 2 * size], expected[rank * size : (rank + 1) * size].float()),
        "untouched": bool((shards[:size] == 0).all() and (shards[2 * size :] == 0).all()),
        "all_gather": torch.equal(gathered[1:-1], native),
        "edges": gathered[0].item() == -1 and gathered[-1].item() == -1,
        "all_gather_in_place": torch.equal(in_place, native),
    }
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_ring_collectives_match_the_native_ones(tmp_path):
    start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert all(result.values()), (rank, result)
