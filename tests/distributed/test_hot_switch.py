"""Hot switching on 4 gloo processes (parallel/hot_switch.py): a Llama-shaped parameter set is moved
through a cycle of strategies visiting 12 ordered pairs (dp4, tp4, pp4, dp2tp2, dp2pp2, tp2pp2); after
every switch each rank holds exactly its new boxes of the reference tensors (bit-exact: switches copy)."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed

CYCLE = ["dp4", "tp4", "tp2pp2", "dp4", "dp2tp2", "pp4", "dp2pp2", "tp4", "pp4", "tp2pp2", "dp2tp2", "dp2pp2", "dp4"]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from disttrain_core.parallel.hot_switch import region, run_switch
    from disttrain_core.parallel.switch_plan import PlanCache, Strategy, strategy_layout
    from tests.unit.test_switch_plan import LAYERS, llama_specs

    specs = llama_specs(dim=16, ffn=32, vocab=24, kv=8)
    g = torch.Generator().manual_seed(0)
    full = {name: torch.randn(spec.shape, generator=g) for name, spec in specs.items()}
    strategies = {
        s.name: s
        for s in (Strategy(4), Strategy(tp=4), Strategy(pp=4), Strategy(2, 2), Strategy(2, 1, 2), Strategy(1, 2, 2))
    }
    layouts = {name: strategy_layout(specs, s, LAYERS) for name, s in strategies.items()}
    cache = PlanCache({n: s.shape for n, s in specs.items()}, layouts)
    start = layouts[CYCLE[0]]
    held = {
        n: region(full[n], tuple((0, k) for k in full[n].shape), boxes[rank]).clone()
        for n, boxes in start.items()
        if rank in boxes
    }
    checked = []
    for source, target in zip(CYCLE[:-1], CYCLE[1:], strict=True):
        held = run_switch(cache.get(source, target), held, layouts[source], layouts[target])
        expected = {n for n, boxes in layouts[target].items() if rank in boxes}
        assert set(held) == expected, (source, target, rank)
        for name, tensor in held.items():
            want = region(full[name], tuple((0, k) for k in full[name].shape), layouts[target][name][rank])
            assert torch.equal(tensor, want), (source, target, rank, name)
        checked.append((source, target))
    torch.save(checked, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_parameters_survive_a_cycle_of_switches(tmp_path):
    start_processes(_worker, args=(4, str(tmp_path / "store"), str(tmp_path)), nprocs=4, join=True)
    pairs = set(zip(CYCLE[:-1], CYCLE[1:], strict=True))
    assert len(pairs) >= 12
    for rank in range(4):
        assert len(torch.load(tmp_path / f"{rank}.pt", weights_only=True)) == len(CYCLE) - 1
