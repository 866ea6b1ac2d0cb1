"""Sequence-parallel tensor parallelism with communication hidden in the matmuls.

Megatron's sequence parallelism keeps the residual stream of a transformer block
split along the sequence over the TP group: norms and residual adds run on
``S / tp`` rows, a column-parallel projection needs the whole sequence
(all-gather, then matmul) and a row-parallel projection produces partial sums
to be reduce-scattered back to sequence chunks. Done naively each collective
waits for, or is waited for by, the matmul beside it.

Here both are decomposed into ``tp`` ring steps (the AsyncTP idea):

* ``all-gather + matmul``: at step ``i`` a rank multiplies the sequence chunk it
  holds while sending that chunk on to its ring neighbour and receiving the next;
  the transfer of chunk ``i + 1`` runs under the matmul of chunk ``i``.
* ``matmul + reduce-scatter``: at step ``i`` a rank computes its contribution to
  one output chunk while the partial sum of the previous chunk travels; the
  chunk that ends the ring on a rank is that rank's fully reduced slice.

Each is the other's backward. Norm weights then see only ``S / tp`` rows on
each rank: their gradients are partial and are summed over the TP group before
the data-parallel reduction (parallel/tensor_parallel.py ``sequence_parallel_partial_params``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .ring import Ring, ring_gather, ring_reduce_scatter
from .sequence_split import SequenceSplit


def _block(x: torch.Tensor, index: int, size: int) -> torch.Tensor:
    rows = x.shape[1] // size
    return x[:, index * rows : (index + 1) * rows]


class AllGatherMatmul(torch.autograd.Function):
    """``[x_0 .. x_{tp-1}] @ w.T`` for every ``w``: the sequence chunks of x all-gathered under the matmuls."""

    @staticmethod
    def forward(ctx, ring: Ring, x: torch.Tensor, *weights: torch.Tensor):
        batch, rows, _ = x.shape
        outs: list[torch.Tensor | None] = [None] * len(weights)

        def consume(chunk, owner):
            for index, weight in enumerate(weights):
                part = F.linear(chunk, weight)  # bf16 under autocast, like the plain projection
                if outs[index] is None:
                    outs[index] = part.new_empty(batch, rows * ring.size, weight.shape[0])
                _block(outs[index], owner, ring.size).copy_(part)

        chunks = ring_gather(ring, x, consume)
        ctx.ring = ring
        ctx.save_for_backward(torch.cat(chunks, dim=1), *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        ring = ctx.ring
        grads = [g.contiguous() for g in grads]

        def contribution(block):
            return sum(_block(g, block, ring.size) @ w.to(g.dtype) for g, w in zip(grads, weights, strict=True))

        grad_x = ring_reduce_scatter(ring, contribution).to(full.dtype)
        flat = full.flatten(0, 1)
        grad_weights = [
            (g.flatten(0, 1).t() @ flat.to(g.dtype)).to(w.dtype) for g, w in zip(grads, weights, strict=True)
        ]
        return None, grad_x, *grad_weights


class MatmulReduceScatter(torch.autograd.Function):
    """``h @ w.T`` summed over the TP group (row parallel), returned as this rank's sequence chunk."""

    @staticmethod
    def forward(ctx, ring: Ring, h: torch.Tensor, weight: torch.Tensor):
        out = ring_reduce_scatter(ring, lambda block: F.linear(_block(h, block, ring.size), weight))
        ctx.ring = ring
        ctx.save_for_backward(h, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        ring = ctx.ring
        grad_h = torch.empty(h.shape, dtype=torch.result_type(grad, weight), device=h.device)

        def consume(chunk, owner):
            _block(grad_h, owner, ring.size).copy_(chunk @ weight.to(chunk.dtype))

        chunks = ring_gather(ring, grad, consume)
        full = torch.cat(chunks, dim=1).flatten(0, 1)
        grad_weight = (full.t() @ h.flatten(0, 1).to(full.dtype)).to(weight.dtype)
        return None, grad_h.to(h.dtype), grad_weight


def _local(weight) -> torch.Tensor:
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _overlapped_block_forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """A Llama decoder block on this rank's sequence chunk ``x`` [B, S/tp, D]."""
    ring, attn, ffn = self._ring, self.attention, self.feed_forward
    q, k, v = AllGatherMatmul.apply(
        ring, self.attention_norm(x), _local(attn.wq.weight), _local(attn.wk.weight), _local(attn.wv.weight)
    )
    h = x + MatmulReduceScatter.apply(ring, attn.attend(q, k, v, rope), _local(attn.wo.weight))
    gate, up = AllGatherMatmul.apply(ring, self.ffn_norm(h), _local(ffn.w1.weight), _local(ffn.w3.weight))
    return h + MatmulReduceScatter.apply(ring, F.silu(gate) * up, _local(ffn.w2.weight))


def _sequence_parallel_run_layers(self, h: torch.Tensor, documents=None) -> torch.Tensor:
    if documents is not None:  # refused before launch (validation); this guards direct use
        raise ValueError("parallel.comm.tp_overlap does not run packed documents; turn it off")
    split = self._sequence_split  # the stack's entry and exit: comm/sequence_split.py, as without the overlap
    h = split.scatter(h)
    for layer in self.layers.values():
        h = layer(h, self.rope)
    return split.leave(h)


def enable_overlapped_sequence_parallel(llama: nn.Module, group) -> None:
    """Switch an (already TP-sharded) Llama's blocks to sequence parallelism with chunked overlap.

    The weights keep their Megatron column/row sharding; only the forward changes (bound methods on
    the instances, so parameter names and checkpoints are those of the plain model).
    """
    ring = Ring(group)
    seq_len = llama.max_seq_len
    if seq_len % ring.size:
        raise ValueError(f"model.seq_len={seq_len} is not divisible by tp={ring.size}; tp_overlap needs it")
    llama._sequence_split = SequenceSplit(group)
    llama.run_layers = types.MethodType(_sequence_parallel_run_layers, llama)
    for block in llama.layers.values():
        block._ring = ring
        block.forward = types.MethodType(_overlapped_block_forward, block)
        block._sequence_parallel = True
