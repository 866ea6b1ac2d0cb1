"""Expert parallelism: each rank of an expert-parallel (EP) group holds 1/ep of every MoE layer's experts
and tokens travel to the rank owning their expert with an all-to-all, and back.

Layout: EP groups are carved out of the data-parallel ranks (ep divides dp), so the same expert shard
exists on dp / ep ranks -- its expert-data-parallel group, over which its gradients are reduced, as the
router's and the shared experts' are over the whole dp group. Token routing, gates and capacity stay on
the process that owns the tokens (capacity counts the tokens it routes); only the token rows and the
expert outputs cross the network, so the router gets its gradient locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.all_to_all import all_to_all, exchange_counts
from ..models.moe import (
    MoeFeedForward,
    assignment_counts,
    check_routing,
    combine,
    kept_assignments,
    moe_layers,
    run_experts,
    update_expert_biases,
)


def validate_moe(
    num_experts: int,
    top_k: int,
    ep: int = 1,
    dp: int = 1,
    capacity_factor: float = 0.0,
    router: str = "aux_loss",
) -> None:
    """Raise ValueError with a one-line message naming the bad value and the fix."""
    if ep < 1:
        raise ValueError(f"parallel ep={ep}: expert parallelism needs ep >= 1 (1 = every rank holds all experts)")
    if num_experts % ep:
        raise ValueError(
            f"parallel ep={ep} does not divide moe.num_experts={num_experts}: pick ep among the divisors of "
            f"{num_experts} or change num_experts"
        )
    if dp % ep:
        raise ValueError(
            f"parallel ep={ep} does not divide dp={dp}: EP groups are carved out of the data-parallel "
            f"ranks, pick ep among the divisors of {dp}"
        )
    check_routing(num_experts, top_k, capacity_factor, router)


def expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global expert indices EP rank ``ep_rank`` holds: a contiguous 1/ep of them."""
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class AllToAllDispatcher:
    """Dispatcher for a MoE layer whose experts are spread over ``group`` (``expert_range`` per rank).

    Per forward, three exchanges: the per-expert row counts (so each rank knows what it will receive and
    for which of its experts), the token rows, and the expert outputs back (the last two differentiable;
    their backward passes are the reverse exchanges). One host sync learns the split sizes.
    """

    def __init__(self, group, num_experts: int):
        self.group = group
        self.size = dist.get_world_size(group)
        self.num_experts = num_experts
        self.local = expert_range(num_experts, self.size, dist.get_rank(group))

    def __deepcopy__(self, memo: dict) -> AllToAllDispatcher:
        return self  # a process group cannot be copied; a copied layer talks over the same one

    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor
    ) -> torch.Tensor:
        assignments, token_index = kept_assignments(expert_ids)
        ids = expert_ids.reshape(-1).index_select(0, assignments)
        # Sorted by expert, the rows are grouped by destination rank too (experts are contiguous per rank),
        # and each destination block is ordered by expert: the receiver rebuilds the expert ids from counts.
        order = torch.argsort(ids, stable=True)
        per_rank = len(self.local)
        send_counts = assignment_counts(ids, self.num_experts).view(self.size, per_rank)
        recv_counts = exchange_counts(send_counts, self.group)  # [source rank, local expert]
        send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        received = all_to_all(
            tokens.index_select(0, token_index.index_select(0, order)), send_splits, recv_splits, self.group
        )
        local_ids = torch.arange(self.local.start, self.local.stop, device=ids.device).repeat(self.size)
        outputs = run_experts(experts, received, local_ids.repeat_interleave(recv_counts.reshape(-1)))
        returned = all_to_all(outputs, recv_splits, send_splits, self.group)
        kept_gates = gates.reshape(-1).index_select(0, assignments)
        return combine(returned, token_index.index_select(0, order), kept_gates.index_select(0, order), tokens.shape[0])


def apply_expert_parallel(module: nn.Module, ep_group, balance_group=None) -> list[MoeFeedForward]:
    """Shard every MoE layer of ``module`` over ``ep_group``: keep this rank's experts (on the meta device or
    materialized), drop the others, and route through an ``AllToAllDispatcher``. ``balance_group``, when
    given, becomes each layer's balance group (usually the data-parallel group). Returns the layers."""
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    layers = moe_layers(module)
    for layer in layers:
        if layer.num_experts % size:
            raise ValueError(
                f"parallel ep={size} does not divide moe.num_experts={layer.num_experts}: pick ep among its divisors"
            )
        keep = expert_range(layer.num_experts, size, rank)
        missing = [e for e in keep if str(e) not in layer.experts]
        if missing:
            raise ValueError(
                f"experts {missing} of EP rank {rank} are not in the layer (expert parallelism applied twice?)"
            )
        for key in list(layer.experts.keys()):
            if int(key) not in keep:
                del layer.experts[key]
        layer.dispatcher = AllToAllDispatcher(ep_group, layer.num_experts)
        if balance_group is not None:
            layer.balance_group = balance_group
    return layers


def configure_moe(modules: list[nn.Module], balance_group, aux_scale: float) -> int:
    """Every MoE layer of ``modules`` balances over ``balance_group`` (the ranks that share one global
    microbatch's tokens: data x context replicas) and weighs its aux term by ``aux_scale``. Returns how many
    layers."""
    layers = [layer for module in modules for layer in moe_layers(module)]
    for layer in layers:
        layer.balance_group = balance_group
        layer.aux_scale = aux_scale
    return len(layers)


def moe_step_stats(modules: list[nn.Module]) -> torch.Tensor | None:
    """[assignments dropped for capacity, worst layer's max/mean expert load] over this process's MoE layers
    since the last call (fp64, on the device; None without MoE layers). Resets the layers' counters."""
    dropped, ratios = [], []
    for module in modules:
        for layer in moe_layers(module):
            stats = layer.take_step_stats()
            if stats is None:
                continue
            dropped.append(stats[0].double())
            load = stats[1].double()
            ratios.append(load.max() / load.mean().clamp_min(1e-12))
    if not ratios:
        return None
    return torch.stack([torch.stack(dropped).sum(), torch.stack(ratios).max()])


def update_biases(modules: list[nn.Module]) -> None:
    """aux_free routers: one bias update per optimizer step (counts are global over the balance group)."""
    for module in modules:
        update_expert_biases(module)
