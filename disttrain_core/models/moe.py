"""Mixture-of-experts feed-forward for the Llama blocks (single-device code; expert parallelism plugs in
through ``MoeFeedForward.dispatcher``, see parallel/expert_parallel.py).

Experts live in a ModuleDict keyed by their global index "0".."E-1", so parameter names
(``experts.3.w1.weight``) and their seeded init (models/common.py) are the same whether a process holds
every expert or only its expert-parallel share -- the same trick pipeline stages use for layers.

Routing: router logits -> softmax in fp32 (at least) -> top-k experts -> gates = those k probabilities renormalized to
sum 1 (Mixtral, DeepSeek-V3). Renormalizing keeps the output's scale independent of k and of how peaked the
router is; the price is that with top_k = 1 the gate is always 1 and the router learns only from the
balancing signal (Switch Transformer keeps the raw probability for that reason).

Tensor parallelism (``tp_group`` set by parallel/tensor_parallel.py): every expert's and shared expert's hidden
width is split over the group (w1, w3 by output rows, w2 by input columns, DTensors), Megatron's MLP plan per
expert. Every TP rank routes the same tokens the same way and runs its slice of each expert, so the outputs are
partial sums: one all-reduce after the combine sums them (routed and shared together). The tokens and the gates
enter the experts through "copy to the TP region" (their gradients are partial per rank and summed in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..base.dtensor import local
from ..base.torch_compat import current_graph_task_id
from ..comm.group_autograd import sum_gradient, sum_over_group
from ..config.model import MoeConfig
from .common import SwiGLU
from .grouped_experts import KERNELS, run_experts_grouped, use_grouped

ROUTERS = ("aux_loss", "aux_free")


def check_routing(
    num_experts: int, top_k: int, capacity_factor: float = 0.0, router: str = "aux_loss", kernel: str = "auto"
) -> None:
    """Raise ValueError naming the bad routing setting and its fix (the parallel checks: validate_moe)."""
    if kernel not in KERNELS:
        raise ValueError(f"moe.experts_kernel={kernel!r} is unknown: choose one of {', '.join(KERNELS)}")
    if num_experts < 1:
        raise ValueError(f"moe.num_experts={num_experts}: needs at least 1 expert")
    if top_k < 1:
        raise ValueError(f"moe.top_k={top_k}: each token needs at least 1 expert; set top_k >= 1")
    if top_k > num_experts:
        raise ValueError(f"moe.top_k={top_k} > moe.num_experts={num_experts}: set top_k <= num_experts")
    if capacity_factor < 0:
        raise ValueError(f"moe.capacity_factor={capacity_factor} is negative: use 0 (no capacity) or a value > 0")
    if router not in ROUTERS:
        raise ValueError(f"moe.router={router!r} is unknown: choose one of {', '.join(ROUTERS)}")


def route(logits: torch.Tensor, top_k: int, bias: Optional[torch.Tensor] = None):
    """``(probs [N, E], expert_ids [N, k], gates [N, k])`` from router logits [N, E], in fp32 at least
    (bf16 probabilities would make near-equal scores tie and the gates coarse; float64 stays float64).

    ``bias`` (aux-free balancing) shifts the scores used to *choose* experts only; the gates are always
    the chosen experts' plain probabilities, renormalized, so the bias steers load without changing how
    much an expert's output counts.
    """
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    scores = probs if bias is None else probs + bias.to(probs.dtype)
    expert_ids = scores.topk(top_k, dim=-1).indices
    chosen = probs.gather(-1, expert_ids)
    return probs, expert_ids, chosen / chosen.sum(dim=-1, keepdim=True)


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> Optional[int]:
    """Assignments one expert accepts per forward; None: unlimited (capacity_factor 0)."""
    if capacity_factor <= 0:
        return None
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def assignment_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many (token, slot) assignments chose each expert (scatter_add: no host sync)."""
    flat = expert_ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def capacity_mask(expert_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """bool, shaped like ``expert_ids`` [N, k]: the assignments an expert of ``capacity`` accepts.

    Assignments are served in token order (and slot order within a token): an assignment's position in its
    expert's queue is the number of earlier assignments to the same expert. Fixed shapes, no host sync.
    """
    flat = expert_ids.reshape(-1, 1)
    one_hot = torch.zeros(flat.shape[0], num_experts, dtype=torch.int32, device=flat.device).scatter_(1, flat, 1)
    position = one_hot.cumsum(dim=0).gather(1, flat).squeeze(1) - 1
    return (position < capacity).view_as(expert_ids)


def kept_assignments(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat indices of the assignments not dropped, the token of each)`` for ``expert_ids`` [N, k]
    where a dropped assignment holds -1."""
    assignments = (expert_ids.reshape(-1) >= 0).nonzero().squeeze(1)
    return assignments, torch.div(assignments, expert_ids.shape[1], rounding_mode="floor")


def run_experts(experts: nn.ModuleDict, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of the result is ``experts[str(ids[i])](rows[i])``.

    In grouped matmuls where ``experts.kernel`` (moe.experts_kernel) allows (models/grouped_experts.py); else
    rows are sorted by expert (stable) so each expert runs one matmul on its contiguous block. Every expert
    runs, even on zero rows, so all of its parameters get a (zero) gradient: data-parallel gradient
    reduction then sees the same parameter set on every rank.
    """
    if use_grouped(getattr(experts, "kernel", "loop"), experts, rows):
        return run_experts_grouped(experts, rows, ids)
    keys = sorted(int(key) for key in experts.keys())
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=keys[-1] + 1)[keys].tolist()  # host sync: block sizes
    if sum(counts) != ids.numel():
        raise ValueError(f"rows routed to experts this module does not hold (it holds {keys})")
    blocks = rows.index_select(0, order).split(counts)
    outputs = torch.cat([run_expert(experts[str(key)], block) for key, block in zip(keys, blocks, strict=True)])
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return outputs.index_select(0, inverse)


def run_expert(expert: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    """``expert(x)``; under tensor parallelism (DTensor weights) on this rank's slice of the hidden width, which
    gives this rank's partial sum of the output."""
    w1, w2, w3 = (local(linear.weight) for linear in (expert.w1, expert.w2, expert.w3))
    if w1 is expert.w1.weight:
        return expert(x)
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def combine(outputs: torch.Tensor, token_index: torch.Tensor, gates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum ``gates[i] * outputs[i]`` into row ``token_index[i]`` of a [num_tokens, D] result."""
    weighted = outputs * gates.to(outputs.dtype).unsqueeze(1)
    return outputs.new_zeros(num_tokens, outputs.shape[1]).index_add(0, token_index, weighted)


class Dispatcher(Protocol):
    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor
    ) -> torch.Tensor:
        """tokens [N, D], expert_ids [N, k] (-1: dropped), gates [N, k] -> sum_j gates * expert(token) [N, D]."""
        ...


class LocalDispatcher:
    """Every expert on this process: no communication."""

    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor
    ) -> torch.Tensor:
        if use_grouped(getattr(experts, "kernel", "loop"), experts, tokens):
            # No host sync: a dropped assignment (-1) runs on the first expert with gate 0 instead of being
            # filtered out by a data-dependent nonzero.
            flat, k = expert_ids.reshape(-1), expert_ids.shape[1]
            kept = flat >= 0
            token_index = torch.arange(flat.numel(), device=flat.device) // k
            ids = torch.where(kept, flat, min(int(key) for key in experts.keys()))
            outputs = run_experts_grouped(experts, tokens.index_select(0, token_index), ids)
            kept_gates = torch.where(kept, gates.reshape(-1), torch.zeros((), dtype=gates.dtype, device=gates.device))
            return combine(outputs, token_index, kept_gates, tokens.shape[0])
        assignments, token_index = kept_assignments(expert_ids)
        ids = expert_ids.reshape(-1).index_select(0, assignments)
        outputs = run_experts(experts, tokens.index_select(0, token_index), ids)
        return combine(outputs, token_index, gates.reshape(-1).index_select(0, assignments), tokens.shape[0])


@dataclass
class MoeStats:
    """One forward's routing statistics, detached tensors (reading them is the caller's host sync)."""

    tokens_per_expert: torch.Tensor  # int64 [E], assignments before dropping; global when balance_group is set
    dropped: torch.Tensor  # int64 scalar, assignments this process dropped for capacity
    aux_loss: torch.Tensor  # this process's (partial) aux term

    def load_ratio(self) -> torch.Tensor:
        """max / mean expert load (1 = perfectly balanced)."""
        load = self.tokens_per_expert.float()
        mean = load.mean()
        return torch.where(mean > 0, load.max() / mean.clamp_min(1e-12), torch.ones_like(mean))


class MoeFeedForward(nn.Module):
    """Routed SwiGLU experts (plus optional shared experts) in place of a block's feed-forward.

    After each forward: ``aux_loss`` (a tensor with grad, to add to the training loss: see
    ``collect_aux_losses``) and ``last_stats``. ``balance_group`` (a process group or None) makes the
    balancing statistics global: expert counts and the token count are summed over it, and ``aux_loss`` is
    this process's share, so the shares of the group sum to the aux loss of the whole batch and their
    gradients sum to its gradient.
    """

    def __init__(self, dim: int, cfg: MoeConfig, ffn_dim: int):
        super().__init__()
        check_routing(cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.router, cfg.experts_kernel)
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router_kind, self.bias_update_rate = cfg.router, cfg.bias_update_rate
        hidden = cfg.expert_ffn_dim or ffn_dim
        self.router = nn.Linear(dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): SwiGLU(dim, hidden) for e in range(cfg.num_experts)})
        self.experts.kernel = cfg.experts_kernel  # run_experts: grouped matmuls or a loop (grouped_experts.py)
        self.shared = SwiGLU(dim, hidden * cfg.shared_experts) if cfg.shared_experts > 0 else None
        aux_free = cfg.router == "aux_free"
        # Persistent: a resumed run must keep steering with the bias it had learnt.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts) if aux_free else None)
        # Counts since the last update_bias (microbatches of one step); int64 so a dtype cast leaves it exact.
        self.register_buffer(
            "pending_load", torch.zeros(cfg.num_experts, dtype=torch.int64) if aux_free else None, persistent=False
        )
        self.balance_group = None
        self.tp_group = None  # tensor parallelism: the experts' hidden widths are split over it
        # Sequence parallelism: return the TP ranks' partial sums; the block reduce-scatters them (models/llama.py)
        self.partial_output = False
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_stats: Optional[MoeStats] = None
        # The weight of this process's aux term in the step's loss; the trainer sets it (1 / microbatches per
        # step, times what its gradient reduction divides by), and backward adds it through the output.
        self.aux_scale = 1.0
        # Since the last take_step_stats: dropped assignments and expert counts (global with a balance group).
        self.step_dropped: Optional[torch.Tensor] = None
        self.step_load: Optional[torch.Tensor] = None

    def reset_buffers(self) -> None:
        """Initial values (init_weights calls this after a meta-device module is materialized)."""
        for buffer in (self.expert_bias, self.pending_load):
            if buffer is not None:
                buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, expert_ids, gates = route(self.router(tokens), self.top_k, self.expert_bias)
        counts = assignment_counts(expert_ids, self.num_experts)
        capacity = expert_capacity(self.capacity_factor, tokens.shape[0], self.top_k, self.num_experts)
        if capacity is None:
            routed_ids, dropped = expert_ids, counts.new_zeros(())
        else:
            keep = capacity_mask(expert_ids, self.num_experts, capacity)
            routed_ids, dropped = torch.where(keep, expert_ids, -1), (~keep).sum()
        counts, total = self._balance_counts(counts, tokens.shape[0])
        self.aux_loss = self._aux_loss(probs, counts, total)
        self.last_stats = MoeStats(counts, dropped, self.aux_loss.detach())
        # Activation recompute runs this forward again inside backward: count each forward once.
        first_pass = self.training and current_graph_task_id() == -1
        if self.pending_load is not None and first_pass:
            self.pending_load += counts
        split = self.tp_group is not None and not tokens.is_meta
        rows = sum_gradient(tokens, self.tp_group) if split else tokens
        if tokens.is_meta:  # FLOP counting on the meta device (models/flops.py): no routing outcome exists
            out = self._balanced_estimate(rows, gates)
        else:
            out = self.dispatcher(
                self.experts, rows, routed_ids, sum_gradient(gates, self.tp_group) if split else gates
            )
        if self.shared is not None:
            out = out + run_expert(self.shared, rows)
        if split and not self.partial_output:  # the partial sums of the TP ranks' slices (routed and shared together)
            out = sum_over_group(out, self.tp_group)
        if first_pass and not tokens.is_meta:
            self.step_dropped = dropped if self.step_dropped is None else self.step_dropped + dropped
            self.step_load = counts if self.step_load is None else self.step_load + counts
        if self.aux_scale and self.aux_loss.requires_grad:  # its gradient enters with the output's (any stage)
            out = _AttachAuxLoss.apply(out, self.aux_loss * self.aux_scale)
        return out.view(x.shape)

    def take_step_stats(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(dropped assignments, expert counts [E]) since the last call, then reset; None if no forward ran."""
        if self.step_load is None:
            return None
        stats = (self.step_dropped, self.step_load)
        self.step_dropped = self.step_load = None
        return stats

    def _balanced_estimate(self, tokens: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The output's shape and cost under perfectly balanced routing: the N * k assignments split evenly
        over the experts, each held expert running on its share (what routing costs when nothing is
        dropped, whatever the balance). Shapes only: for meta tensors, where routing cannot be computed."""
        num_tokens, k = gates.shape
        base, extra = divmod(num_tokens * k, self.num_experts)
        rows = tokens.repeat_interleave(k, dim=0).split([base + (e < extra) for e in range(self.num_experts)])
        outputs = [
            run_expert(self.experts[str(e)], block) if str(e) in self.experts else torch.zeros_like(block)
            for e, block in enumerate(rows)
        ]
        weighted = torch.cat(outputs).view(num_tokens, k, -1) * gates.to(tokens.dtype).unsqueeze(-1)
        return weighted.sum(dim=1)

    @torch.no_grad()
    def _balance_counts(self, counts: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(assignment counts, token count), summed over ``balance_group`` when set (one all-reduce)."""
        # torch.full fills on the device; new_tensor would copy a host list there (a host sync on CUDA)
        packed = torch.cat([counts, torch.full((1,), num_tokens, dtype=counts.dtype, device=counts.device)])
        if self.balance_group is not None and not packed.is_meta:
            dist.all_reduce(packed, group=self.balance_group)
        return packed[:-1], packed[-1]

    def _aux_loss(self, probs: torch.Tensor, counts: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """coef * E * sum_e f_e * P_e (Switch/GShard), f_e = share of assignments routed to e (before
        dropping), P_e = mean router probability of e over the batch. With a balance group f_e and the
        token count are global and P_e sums only this process's tokens: its share of the global value."""
        if self.router_kind != "aux_loss" or self.aux_loss_coef == 0:
            return probs.new_zeros(())
        total = total.to(probs.dtype).clamp_min(1)
        fraction = counts.to(probs.dtype) / (total * self.top_k)
        probability = probs.sum(dim=0) / total
        return self.aux_loss_coef * self.num_experts * (fraction * probability).sum()

    @torch.no_grad()
    def update_bias(self) -> None:
        """aux_free: after an optimizer step, raise the bias of under-loaded experts and lower that of
        over-loaded ones by ``bias_update_rate``, from the counts of the forwards since the last update.
        With a balance group the counts are global, so every rank computes the same bias; without one a
        data-parallel job must sum ``pending_load`` itself or its ranks' biases drift apart."""
        if self.expert_bias is None:
            return
        load = self.pending_load.to(self.expert_bias.dtype)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the output; backward also sends gradient 1 to the (already weighted) aux term, so the aux
    loss trains wherever the layer runs without travelling to the pipeline's last stage."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def moe_layers(module: nn.Module) -> list[MoeFeedForward]:
    return [m for m in module.modules() if isinstance(m, MoeFeedForward)]


def collect_aux_losses(module: nn.Module) -> torch.Tensor:
    """Sum of the aux terms of every MoE layer's last forward (0 when there are none): add it to the loss
    right after the forward, before the next one overwrites them."""
    terms = [layer.aux_loss for layer in moe_layers(module) if layer.aux_loss is not None]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


def update_expert_biases(module: nn.Module) -> None:
    """``update_bias`` on every MoE layer (call once per optimizer step)."""
    for layer in moe_layers(module):
        layer.update_bias()


def moe_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    """Summary of the last forward of every MoE layer that ran (detached tensors, no host sync):
    ``tokens_per_expert`` [layers, E], ``dropped`` (total), ``max_load_ratio`` (worst layer's max/mean
    load) and ``aux_loss`` (total). Empty when no MoE layer has run."""
    stats = [layer.last_stats for layer in moe_layers(module) if layer.last_stats is not None]
    if not stats:
        return {}
    return {
        "tokens_per_expert": torch.stack([s.tokens_per_expert for s in stats]),
        "dropped": torch.stack([s.dropped for s in stats]).sum(),
        "max_load_ratio": torch.stack([s.load_ratio() for s in stats]).max(),
        "aux_loss": torch.stack([s.aux_loss for s in stats]).sum(),
    }
