"""Context-parallel attention besides the ring: all-gather K/V, Ulysses and the hybrid of Ulysses and the ring.

Every mode takes this rank's queries, keys and values of its own positions ``[B, H, S_local, D]`` (keys and
values may have fewer heads, grouped-query attention) and returns the causal attention of its queries over the
whole sequence, inside packed documents when their ids are given. They differ in what travels:

* ``allgather`` (Llama 3's choice): one all-gather of every rank's K and V (one stacked buffer: two separate
  autograd all-gathers give wrong gradients on gloo, ../shared/reference/cpu-probe.md), then the rank attends
  its queries to each rank's block exactly as the ring would at the step that block arrives (the zig-zag plan,
  the same per-block kernels, merge and document runs); the backward gathers K/V again (only the local ones are
  saved) and reduce-scatters the fp32 dK/dV of every block to its owner. ``cp - 1`` blocks arrive at once
  instead of one per ring step, so nothing overlaps the compute, and the gathered K/V are a transient of
  ``cp`` blocks; with grouped-query attention K/V are small and one collective replaces ``cp - 1`` hops.
* ``ulysses`` (DeepSpeed-Ulysses): one all-to-all swaps the sequence split for a head split, so each rank holds
  ``H / cp`` query heads (and their K/V heads) of the *whole* sequence and runs the unit's ordinary attention
  (any document kernel, whole rows); a second all-to-all swaps back. Queries, keys and values travel in one
  all-to-all, the output in another; the backward is the same two exchanges reversed. Needs the local query
  heads divisible by ``cp``; key/value heads too, or ``cp`` divisible by them, when each is then replicated
  ``cp / kv_heads`` times (its gradient summed back by autograd), as Megatron and DeepSpeed do.
* ``hybrid`` (Megatron's hierarchical CP): the ``cp`` ranks are ``cp / u`` ring ranks of ``u`` Ulysses ranks
  each (``parallel.cp_ulysses = u``; consecutive ranks, so the all-to-all stays inside a node). Ulysses over
  each group of ``u`` yields ``H / u`` heads of that group's share of the sequence, which is a zig-zag ring
  slice of ``cp / u`` ring ranks; ring attention over the ranks with the same Ulysses index completes it.

Positions (``mode_positions``): ring rank ``j`` of ``cp / u`` holds the zig-zag chunks ``j`` and
``2 cp / u - 1 - j``, and its ``u`` Ulysses ranks hold consecutive pieces of those in that order, so the
all-to-all's concatenation in source order *is* the ring rank's local sequence. ``u = 1`` is the ring's (and
all-gather's) zig-zag layout; ``u = cp`` (Ulysses) gives contiguous pieces, which needs no balancing since every
rank then computes ``1 / cp`` of every head's whole causal attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..base.torch_compat import all_gather_tensor, reduce_scatter_tensor
from .ring_attention import _no_autocast, _Plan, _RankBackward, _RankForward, documents_of, local_positions

MODES = ("ring", "allgather", "ulysses", "hybrid")


def mode_positions(padded: int, cp: int, rank: int, ulysses: int = 1) -> torch.Tensor:
    """The positions CP rank ``rank`` holds (``padded``: a multiple of ``2 cp``) when its ``cp`` ranks are
    ``cp / ulysses`` ring ranks of ``ulysses`` all-to-all ranks (module doc)."""
    if cp % ulysses:
        raise ValueError(f"parallel.cp_ulysses={ulysses} must divide parallel.cp={cp}")
    ring_rank, piece = divmod(rank, ulysses)
    ring_slice = local_positions(padded, cp // ulysses, ring_rank, "zigzag")
    size = ring_slice.numel() // ulysses
    return ring_slice[piece * size : (piece + 1) * size]


def kv_replicas(kv_heads: int, ulysses: int) -> int:
    """How many copies of each key/value head an all-to-all over ``ulysses`` ranks needs (1 when they divide)."""
    if kv_heads % ulysses == 0:
        return 1
    if ulysses % kv_heads == 0:
        return ulysses // kv_heads
    raise ValueError(
        f"Ulysses over {ulysses} ranks needs the key/value heads on each rank ({kv_heads}) divisible by it, or "
        f"dividing it (each head then copied); use parallel.cp_mode=ring or allgather, or another parallel.cp"
    )


def heads_split(heads: int, kv_heads: int, ulysses: int) -> bool:
    return heads % ulysses == 0 and (kv_heads % ulysses == 0 or ulysses % kv_heads == 0)


def ulysses_degree(mode: str, cp: int, cp_ulysses: int, heads: int, kv_heads: int) -> int:
    """Ranks per all-to-all of a resolved mode (``heads``/``kv_heads``: a rank's, after tensor parallelism):
    ring/allgather 1, ulysses cp, hybrid ``cp_ulysses`` or, for 0, the largest proper divisor of cp the heads
    allow. Raises ValueError (one line, naming the fix) when the heads do not split."""
    if mode in ("ring", "allgather") or cp == 1:
        return 1
    if mode == "ulysses":
        if not heads_split(heads, kv_heads, cp):
            raise ValueError(
                f"parallel.cp_mode=ulysses with cp={cp}: each rank's {heads} query heads must divide by cp and its "
                f"{kv_heads} key/value heads divide by cp or divide cp; use parallel.cp_mode=ring, allgather or "
                "hybrid, or another cp"
            )
        return cp
    if mode != "hybrid":
        raise ValueError(f"parallel.cp_mode={mode!r}: allowed values are {', '.join(MODES)}, auto")
    if cp_ulysses:
        if cp % cp_ulysses or not 1 < cp_ulysses < cp or not heads_split(heads, kv_heads, cp_ulysses):
            raise ValueError(
                f"parallel.cp_ulysses={cp_ulysses}: hybrid needs a divisor of cp={cp} between 2 and {cp // 2} that "
                f"splits each rank's {heads} query and {kv_heads} key/value heads; set another, or 0 to choose"
            )
        return cp_ulysses
    fits = [d for d in range(cp - 1, 1, -1) if cp % d == 0 and heads_split(heads, kv_heads, d)]
    if not fits:
        raise ValueError(
            f"parallel.cp_mode=hybrid with cp={cp}: no all-to-all size between 2 and cp/2 splits each rank's "
            f"{heads} query and {kv_heads} key/value heads (hybrid needs cp of 4 or more); use ring or allgather"
        )
    return fits[0]


# ------------------------------------------------------------------------------------------------ Ulysses
def _to_heads(parts: list[torch.Tensor], group, u: int) -> list[torch.Tensor]:
    """[B, Hi, S, D] each -> [B, Hi/u, u S, D]: this rank's head group of every rank's positions (source order)."""
    batch, _, seq, dim = parts[0].shape
    heads = [p.shape[1] // u for p in parts]
    send = torch.cat([p.reshape(batch, u, h, seq, dim) for p, h in zip(parts, heads, strict=True)], dim=2)
    send = send.transpose(0, 1).contiguous()  # [u (destination), B, sum Hi/u, S, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    whole = recv.permute(1, 2, 0, 3, 4).reshape(batch, sum(heads), u * seq, dim)
    return list(whole.split(heads, dim=1))


def _to_sequence(parts: list[torch.Tensor], group, u: int) -> list[torch.Tensor]:
    """The inverse of :func:`_to_heads`: [B, h_i, u S, D] each -> [B, h_i u, S, D]."""
    batch, _, length, dim = parts[0].shape
    seq, heads = length // u, [p.shape[1] for p in parts]
    send = torch.cat(parts, dim=1).reshape(batch, sum(heads), u, seq, dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [u (source), B, sum h_i, S, D]: my positions of the source's heads
    dist.all_to_all_single(recv, send, group=group)
    out = []
    for piece in recv.split(heads, dim=2):
        out.append(piece.transpose(0, 1).reshape(batch, piece.shape[2] * u, seq, dim))
    return out


class _Swap(torch.autograd.Function):
    """The sequence/head swap (``to_heads``) or its inverse; each is the other's gradient (a permutation)."""

    @staticmethod
    def forward(ctx, group, u: int, to_heads: bool, *parts):
        ctx.group, ctx.u, ctx.to_heads = group, u, to_heads
        swap = _to_heads if to_heads else _to_sequence
        return tuple(swap(list(parts), group, u))

    @staticmethod
    def backward(ctx, *grads):
        swap = _to_sequence if ctx.to_heads else _to_heads
        return (None, None, None, *swap([g.contiguous() for g in grads], ctx.group, ctx.u))


def ulysses_attention(q, k, v, group, inner, documents=None):
    """Causal attention of local q/k/v [B, H, S, D] by a head split over ``group`` (module doc); ``inner(q, k, v,
    documents)`` attends the head group over the group's whole share of the sequence."""
    u = dist.get_world_size(group)
    copies = kv_replicas(k.shape[1], u)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    qh, kh, vh = _Swap.apply(group, u, True, q, k, v)
    (out,) = _Swap.apply(group, u, False, inner(qh, kh, vh, documents))
    return out


# ------------------------------------------------------------------------------------------------ all-gather
def _gather_kv(k: torch.Tensor, v: torch.Tensor, group, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (K, V) in group-rank order, from one all-gather of the stacked pair."""
    pair = torch.stack([k, v]).contiguous()
    whole = pair.new_empty((world, *pair.shape))
    all_gather_tensor(whole.view(-1), pair.view(-1), group=group)
    return [(whole[r, 0], whole[r, 1]) for r in range(world)]


class AllGatherAttention(torch.autograd.Function):
    """``AllGatherAttention.apply(q, k, v, group, docs)``: the ring's per-rank computation (the same zig-zag
    plan, per-block kernels and merge) over K/V gathered at once; ``docs`` as ``ring_attention``'s."""

    @staticmethod
    def forward(ctx, q, k, v, group, docs=None):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        with _no_autocast(q.device):
            blocks = _gather_kv(k.contiguous(), v.contiguous(), group, world)
            plan = _Plan("zigzag", world, rank, q.shape[2])
            documents = documents_of(docs, world, rank, "zigzag")
            state = _RankForward(q, plan, documents, None)
            for step in range(world):
                state.add(step, *blocks[(rank - step) % world])
            out = state.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, state.lse)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.documents, ctx.kernel = documents, state.kernel
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, k, v, out, lse = ctx.saved_tensors
        world, rank = ctx.world, ctx.rank
        with _no_autocast(q.device):
            blocks = _gather_kv(k.contiguous(), v.contiguous(), ctx.group, world)  # gathered again, not saved
            plan = _Plan("zigzag", world, rank, q.shape[2])
            state = _RankBackward(q, out, lse, out_grad.to(q.dtype).contiguous(), plan, ctx.documents, ctx.kernel)
            grads = torch.zeros((world, 2, *k.shape), dtype=torch.float32, device=k.device)  # per owner: dK, dV
            for step in range(world):
                owner = (rank - step) % world
                state.block(step, *blocks[owner], grads[owner, 0], grads[owner, 1])
            mine = grads.new_empty(grads.shape[1:])
            reduce_scatter_tensor(mine.view(-1), grads.view(-1), group=ctx.group)  # each owner's dK/dV summed
        return state.dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None
