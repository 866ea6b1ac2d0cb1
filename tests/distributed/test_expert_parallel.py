"""Expert parallelism (parallel/expert_parallel.py) on 4 gloo processes, dp 4 x ep 2 (EP groups {0,1} and
{2,3}; each expert shard replicated on {0,2} or {1,3}), against one single-process MoE layer holding every
expert: outputs, the loss (aux term included), and gradients once reduced the way data parallelism reduces
them -- router and shared experts over all 4 ranks, each expert shard over its expert-data-parallel pair.
Then MoE with tensor parallelism: tp 2 x dp 2 with ep 2, each expert's hidden width split over its TP pair.
Float64, so agreement is to 1e-10. Also the uneven all-to-all itself and a per-rank capacity case."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .spawn import start_processes

pytestmark = pytest.mark.distributed

WORLD, EP, EXPERTS, TOP_K, DIM, FFN = 4, 2, 4, 2, 6, 10
TIMEOUT_S = 120


def _build(meta: bool = False, **moe):
    from disttrain_core.config.model import MoeConfig
    from disttrain_core.models.common import init_weights
    from disttrain_core.models.moe import MoeFeedForward

    cfg = MoeConfig(num_experts=EXPERTS, top_k=TOP_K, **moe)
    with torch.device("meta" if meta else "cpu"):
        layer = MoeFeedForward(DIM, cfg, FFN)
    if not meta:
        init_weights(layer, seed=0, std=0.3)
    return layer


def _materialize(layer):
    from disttrain_core.models.common import init_weights

    layer.to_empty(device="cpu")
    init_weights(layer, seed=0, std=0.3)  # shard before materialize: the kept experts get their full-model values
    return layer.double()


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return 0.0 if a.numel() == 0 and b.numel() == 0 else (a - b).abs().max().item()


def _compare_with_reference(layer, reference, tokens, sizes, upstream, expert_dp_group) -> dict[str, float]:
    """Run this rank's slice through the EP layer and every token through the reference; return errors."""
    rank = dist.get_rank()
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    x = tokens[mine].clone().requires_grad_(True)
    out = layer(x)
    loss = (out * upstream[mine]).sum() + layer.aux_loss
    loss.backward()
    x_all = tokens.clone().requires_grad_(True)
    expected = reference(x_all)
    reference_loss = (expected * upstream).sum() + reference.aux_loss
    reference_loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    errors = {
        "output": _diff(out, expected[mine]),
        "loss": _diff(total, reference_loss.detach()),
        "input_grad": _diff(x.grad, x_all.grad[mine]),
        "counts": _diff(layer.last_stats.tokens_per_expert, reference.last_stats.tokens_per_expert),
    }
    reference_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=expert_dp_group if name.startswith("experts.") else None)
        errors[f"grad {name}"] = _diff(grad, reference_params[name].grad)
    return errors


def _steer_router(layer) -> None:
    """Router row e reads feature e only, so a token's large features pick its experts."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :EXPERTS] = 4 * torch.eye(EXPERTS, dtype=layer.router.weight.dtype)


def _tensor_parallel_errors(ep_group, tp_group) -> dict[str, float]:
    """tp 2 x dp 2 with ep 2: TP pairs {0, 2} and {1, 3} share their tokens and split every expert's hidden width
    (parallel/tensor_parallel.py), EP pairs {0, 1} and {2, 3} (the data-parallel replicas of one TP rank) split
    the experts. Each rank's output and input gradient are the whole layer's; each gradient slice is the
    reference's, once replicated parameters are summed over the data-parallel pair."""
    from torch.distributed.device_mesh import DeviceMesh

    from disttrain_core.base.dtensor import is_sharded, local_block
    from disttrain_core.parallel.expert_parallel import apply_expert_parallel
    from disttrain_core.parallel.tensor_parallel import apply_expert_tensor_parallel

    layer = _build(meta=True, shared_experts=1, aux_loss_coef=0.1)
    apply_expert_tensor_parallel(layer, DeviceMesh.from_group(tp_group, "cpu"))
    apply_expert_parallel(layer, ep_group, balance_group=ep_group)  # dp = ep = 2: the EP pair is the dp pair
    layer = _materialize(layer)
    reference = _build(shared_experts=1, aux_loss_coef=0.1).double()
    g = torch.Generator().manual_seed(3)
    sizes = [5, 7]  # per data-parallel replica
    tokens = torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64)
    upstream = torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64)
    replica = dist.get_rank(ep_group)
    mine = slice(sum(sizes[:replica]), sum(sizes[: replica + 1]))
    x = tokens[mine].clone().requires_grad_(True)
    out = layer(x)
    ((out * upstream[mine]).sum() + layer.aux_loss).backward()
    x_all = tokens.clone().requires_grad_(True)
    expected = reference(x_all)
    ((expected * upstream).sum() + reference.aux_loss).backward()
    errors = {"output": _diff(out, expected[mine]), "input_grad": _diff(x.grad, x_all.grad[mine])}
    reference_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        grad, offset = local_block(param.grad)
        grad = grad.clone()
        if not name.startswith("experts."):  # router and shared expert: replicated over the data-parallel pair
            dist.all_reduce(grad, group=ep_group)
        held = tuple(slice(o, o + n) for o, n in zip(offset, grad.shape, strict=True))
        errors[f"grad {name}"] = _diff(grad, reference_params[name].grad[held])
        if name.startswith(("experts.", "shared.")):  # every expert weight is split, 1/2 held
            errors[f"split {name}"] = float(not is_sharded(param) or 2 * grad.numel() != param.numel())
    return errors


def _all_to_all_errors(group) -> dict[str, float]:
    """Rank s sends (s + d) % 3 rows to rank d (some blocks empty); the values name their source, target and
    row. The gradient of sum(received * weight) must come back to the sender's rows."""
    from disttrain_core.comm.all_to_all import all_to_all

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send = [(rank + d) % 3 for d in range(size)]
    recv = [(s + rank) % 3 for s in range(size)]

    def rows(source: int, target: int, count: int) -> torch.Tensor:
        return torch.arange(count, dtype=torch.float64).unsqueeze(1) + 100 * source + 10 * target + torch.zeros(2)

    x = torch.cat([rows(rank, d, n) for d, n in enumerate(send)]).requires_grad_(True)
    received = all_to_all(x, send, recv, group)
    (received * (1 + rank)).sum().backward()  # receiver d weighs its rows by d + 1
    expected_grad = torch.cat([torch.full((n, 2), 1.0 + d, dtype=torch.float64) for d, n in enumerate(send)])
    return {
        "a2a values": _diff(received, torch.cat([rows(s, rank, n) for s, n in enumerate(recv)])),
        "a2a grad": _diff(x.grad, expected_grad),
    }


def _worker(rank: int, store: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    from disttrain_core.parallel.expert_parallel import apply_expert_parallel

    # every process creates every group, in the same order (dist.new_group's contract)
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    expert_dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_group, expert_dp_group = ep_groups[rank // EP], expert_dp_groups[rank % EP]
    world = dist.group.WORLD
    results: dict[str, dict[str, float]] = {"all_to_all": _all_to_all_errors(world)}
    g = torch.Generator().manual_seed(1)

    # 1. random routing; the EP layer is sharded on the meta device, then materialized
    layer = _build(meta=True, shared_experts=1)
    apply_expert_parallel(layer, ep_group, balance_group=world)
    layer = _materialize(layer)
    held = sorted(int(k) for k in layer.experts.keys())
    results["held"] = {"experts": float(held != list(range(2 * (rank % EP), 2 * (rank % EP) + 2)))}
    sizes = [5, 3, 6, 4]
    tokens = torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64)
    upstream = torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64)
    reference = _build(shared_experts=1).double()
    results["random"] = _compare_with_reference(layer, reference, tokens, sizes, upstream, expert_dp_group)

    # 2. uneven routing: ranks 0 and 1 use experts 0 and 1 only (EP rank 1 of group {0,1} gets no rows),
    # rank 2 uses experts 2 and 3 only, rank 3 holds no tokens at all; sharded after materializing
    layer = _build(aux_loss_coef=0.1).double()
    _steer_router(layer)
    apply_expert_parallel(layer, ep_group, balance_group=world)
    reference = _build(aux_loss_coef=0.1).double()
    _steer_router(reference)
    sizes = [4, 3, 5, 0]
    tokens = 0.1 * torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64)
    tokens[:7, 0:2] += 2.0
    tokens[7:, 2:4] += 2.0
    upstream = torch.randn(sum(sizes), DIM, generator=g, dtype=torch.float64)
    results["uneven"] = _compare_with_reference(layer, reference, tokens, sizes, upstream, expert_dp_group)
    results["uneven"]["routing"] = float(layer.last_stats.tokens_per_expert.tolist() != [7, 7, 5, 5])

    # 3. capacity: each rank drops what a single-process layer routing only its tokens drops
    layer = _build(capacity_factor=0.5).double()
    apply_expert_parallel(layer, ep_group, balance_group=world)
    alone = _build(capacity_factor=0.5).double()
    x = torch.randn(8 + 2 * rank, DIM, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
    out = layer(x)
    expected = alone(x)
    results["capacity"] = {
        "output": _diff(out, expected),
        "dropped": float(layer.last_stats.dropped.item() != alone.last_stats.dropped.item()),
        "nothing dropped": float(alone.last_stats.dropped.item() == 0),  # the case must drop something
    }

    # 4. tensor parallelism inside each expert, with expert parallelism across the data-parallel replicas
    results["tensor_parallel"] = _tensor_parallel_errors(ep_group, expert_dp_group)
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_expert_parallel_matches_a_single_process_layer(tmp_path):
    context = start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            assert time.monotonic() < deadline, f"EP workers still running after {TIMEOUT_S} s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        for case, errors in results.items():
            bad = {name: error for name, error in errors.items() if not error < 1e-10}
            assert not bad, (rank, case, bad)
