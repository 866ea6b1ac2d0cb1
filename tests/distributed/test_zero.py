"""ZeRO-1: the same updates as AdamW, with 1/dp of the optimizer state on each replica."""

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from disttrain_core.config import OptimConfig
    from disttrain_core.parallel.zero import ZeroOneOptimizer
    from disttrain_core.train.optim import build_optimizer

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 5))

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    sharded, reference = model(), model()
    zero = ZeroOneOptimizer(list(sharded.named_parameters()), cfg, dist.group.WORLD, world, rank, tp=1)
    plain = build_optimizer(list(reference.named_parameters()), cfg)
    for step in range(3):
        grads = [torch.Generator().manual_seed(100 * step + r) for r in range(world)]
        per_rank = [[torch.randn(p.shape, generator=g) for p in reference.parameters()] for g in grads]
        for p, g in zip(sharded.parameters(), per_rank[rank], strict=True):
            p.grad.copy_(g)  # the .grad are views of ZeRO-1's gradient buffer: written in place, never replaced
        for i, p in enumerate(reference.parameters()):  # the reference sees the summed gradient
            p.grad = sum(per_rank[r][i] for r in range(world))
        zero.reduce_gradients()
        zero.step()
        zero.zero_grad()
        plain.step()
        plain.zero_grad()
    worst = max((a - b).abs().max().item() for a, b in zip(sharded.parameters(), reference.parameters(), strict=True))
    total = sum(p.numel() for p in reference.parameters())
    torch.save({"worst": worst, "bytes": zero.state_bytes(), "total": total}, os.path.join(out, f"{rank}.pt"))
    dist.barrier()  # tear down together (one gloo teardown aborted once when a peer left first)
    dist.destroy_process_group()


def test_zero1_matches_adamw_and_holds_a_dp_th_of_the_state(tmp_path):
    world = 2
    _spawn(_worker, tmp_path, world)
    for rank in range(world):
        result = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert result["worst"] < 1e-6
        full = 12 * result["total"]  # fp32 master weights + two moments, unsharded
        padding = 12 * world * 2  # each of the two flat buffers pads to a multiple of dp
        assert abs(result["bytes"] - full / world) <= padding, (result["bytes"], full)


def _overlapped_zero(rank: int, world: int, store: str, model: torch.nn.Module, overlap_param_gather: bool):
    """A process group, a dedicated ring group and an overlapped ZeRO-1 with about a bucket a tensor."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from disttrain_core.config import CommConfig, OptimConfig
    from disttrain_core.parallel.zero import ZeroOneOptimizer

    comm_group = dist.new_group(list(range(world)))
    comm = CommConfig(overlap_grad_reduce=True, overlap_param_gather=overlap_param_gather, bucket_mb=1e-5)
    return ZeroOneOptimizer(
        list(model.named_parameters()),
        OptimConfig(),
        dist.group.WORLD,
        world,
        rank,
        tp=1,
        comm=comm,
        comm_group=comm_group,
    )


def _worst_reduced_error(zero, reference: torch.nn.Module, world: int) -> float:
    """Largest difference between ZeRO-1's reduced gradient shards and an all-reduce of the gradients a plain
    copy of the model computed (the sharded model's own .grad are views the reduce-scatter writes into)."""
    expected = {}
    for name, param in reference.named_parameters():
        total = param.grad.clone()
        dist.all_reduce(total)
        expected[name] = total
    from disttrain_core.base.torch_compat import all_gather_tensor

    worst = 0.0
    for flat in zero.flats.values():
        gathered = torch.empty(world * flat.shard_numel)
        shard = torch.cat([master.grad for master in flat.masters])
        all_gather_tensor(gathered, shard)
        full = flat.unshard(gathered)
        for index, (name, _) in enumerate(flat.params):
            worst = max(worst, (flat.parameter_slice(full, index) - expected[name]).abs().max().item())
    return worst


def _spawn(worker, tmp_path, world: int = 2) -> None:
    start_processes(worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)


def _uneven_worker(rank: int, world: int, store: str, out: str) -> None:
    """Replica 1 gives layer 1 no gradient in its last microbatch (think: no images there)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    reference = copy.deepcopy(model)
    zero = _overlapped_zero(rank, world, store, model, overlap_param_gather=True)
    assert len(zero.flats["decay"].buckets) == 4

    def microbatches(net, arm=lambda: None):
        generator = torch.Generator().manual_seed(rank)
        net(torch.randn(3, 8, generator=generator)).pow(2).sum().backward()  # an earlier microbatch
        arm()  # the last microbatch
        x = torch.randn(3, 8, generator=generator)
        last = net(x) if rank == 0 else net[2:](net[0](x))  # layer 1 unused: its buckets wait
        last.pow(2).sum().backward()

    microbatches(model, lambda: zero.sync.arm(0))
    microbatches(reference)
    zero.reduce_gradients()
    torch.save({"worst": _worst_reduced_error(zero, reference, world)}, os.path.join(out, f"uneven{rank}.pt"))
    zero.close()
    dist.destroy_process_group()


def test_overlapped_reduce_scatter_with_a_gradient_missing_on_one_replica(tmp_path):
    """Buckets go out in one fixed order on every replica, so the rings never pair different buckets."""
    _spawn(_uneven_worker, tmp_path)
    for rank in range(2):
        assert torch.load(tmp_path / f"uneven{rank}.pt", weights_only=True)["worst"] < 1e-6


def _order_worker(rank: int, world: int, store: str, out: str) -> None:
    """The layers run in an order unlike their definition order, and differently on the two replicas."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(4)))
    reference = copy.deepcopy(model)
    zero = _overlapped_zero(rank, world, store, model, overlap_param_gather=False)  # a bucket per layer
    bucket_of_layer = {int(n.split(".")[0]): zero.sync.where[id(p)] for n, p in model.named_parameters()}

    def layer_buckets(order):  # the no_decay buffer is empty here: one bucket with no members
        return [key for key in order if key[0] == "decay"]

    default = layer_buckets(zero.sync.reduce_order)
    use = [2, 0, 3, 1] if rank == 0 else [0, 1, 2, 3]
    generator = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(2):
        zero.sync.arm(0)
        x = torch.randn(3, 8, generator=generator)
        h, r = x, x
        for layer in use:
            h, r = model[layer](h), reference[layer](r)
        h.pow(2).sum().backward()
        r.pow(2).sum().backward()
        zero.reduce_gradients()
        worst = max(worst, _worst_reduced_error(zero, reference, world))
        zero.zero_grad()
        reference.zero_grad()
    adopted = [bucket_of_layer[layer] for layer in reversed([2, 0, 3, 1])]  # rank 0's backward order
    torch.save(
        {
            "worst": worst,
            "default": default == [bucket_of_layer[i] for i in (3, 2, 1, 0)],
            "adopted": layer_buckets(zero.sync.reduce_order) == adopted,
        },
        os.path.join(out, f"order{rank}.pt"),
    )
    zero.close()
    dist.destroy_process_group()


def test_reduce_order_is_the_first_replicas_recorded_completion_order(tmp_path):
    """After the first step every replica issues reduce-scatters in the order buckets completed on the
    first replica (not definition order), and the sums stay right when another replica's order differs."""
    _spawn(_order_worker, tmp_path)
    for rank in range(2):
        result = torch.load(tmp_path / f"order{rank}.pt", weights_only=True)
        assert result["default"] and result["adopted"] and result["worst"] < 1e-6, result


def _state_bytes_worker(rank: int, world: int, store: str, out: str) -> None:
    """Model-state bytes at a step boundary, from the unique storages behind parameters, gradients, the
    masters and the optimizer state (lean ZeRO-1: the parameters and gradients are views of the flat
    buffers, and the reduce-scatter lands in place)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 64))
    zero = _overlapped_zero(rank, world, store, model, overlap_param_gather=True)
    for _ in range(2):
        zero.sync.arm(0)
        model(torch.randn(5, 64)).pow(2).sum().backward()
        zero.reduce_gradients()
        zero.step()
        zero.zero_grad()
    zero.wait_params()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += zero.master_params() + [v for s in zero.inner.state.values() for v in s.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    params = sum(p.numel() for p in model.parameters())
    padding = sum(f.padded for f in zero.flats.values()) - params
    torch.save(
        {"bytes": sum(storages.values()), "params": params, "padding": padding}, os.path.join(out, f"s{rank}.pt")
    )
    zero.close()
    dist.destroy_process_group()


def test_lean_zero1_holds_8_plus_12_over_dp_bytes_per_parameter(tmp_path):
    world = 2
    _spawn(_state_bytes_worker, tmp_path, world)
    for rank in range(world):
        r = torch.load(tmp_path / f"s{rank}.pt", weights_only=True)
        bound = (8 + 12 / world) * (r["params"] + r["padding"]) + 64  # + the step counters
        assert r["bytes"] <= bound, (r, bound)
        assert r["bytes"] >= (8 + 12 / world) * r["params"]  # everything counted: nothing left out


def test_zero1_on_the_process_groups_own_collectives_matches_one_process(tmp_path):
    """parallel.comm.collectives=native: the reduce-scatter and all-gather NCCL runs (gloo implements both),
    through torch_compat's names (reduce_scatter_single from torch 2.13, reduce_scatter_tensor before)."""
    from ..conftest import read_metrics, run_train

    common = [
        "model=llama_tiny",
        "model.llm.n_layers=2",
        "model.seq_len=64",
        "trainer.max_steps=5",
        "trainer.precision=32",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=1",
        "trainer.checkpoint.save_last=false",
        "data.num_workers=0",
    ]
    losses = {}
    for name, extra in (
        ("one", ["trainer.devices=1"]),
        ("native", ["parallel=zero1", "trainer.devices=2", "parallel.comm.collectives=native"]),
    ):
        result = run_train([*common, *extra, f"hydra.run.dir={tmp_path / name}"], timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    assert len(losses["one"]) == 5
    assert losses["native"] == pytest.approx(losses["one"], abs=1e-4, rel=0)
