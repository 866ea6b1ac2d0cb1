"""The output head and its cross-entropy with the vocabulary split over a tensor-parallel group.

Megatron's vocabulary-parallel cross-entropy: rank r of the group holds rows [r V/tp, (r+1) V/tp) of the head's
weight, so its logits are [positions, V/tp] and nobody holds all V of them. The loss needs three numbers per
position from the whole vocabulary, in two all-reduces over the group: the max logit (for a stable softmax),
then the sum of exponentials together with the label's logit (only the rank holding the label contributes it).
Backward needs no communication for the logits (softmax minus one-hot is local); the hidden states' gradient is
a partial sum over the vocabulary slices, all-reduced once -- the "copy to the TP region" operator's backward.

Why not ``torch.distributed.tensor.parallel.loss_parallel``: it needs its context manager around the loss *and*
the backward, and the pipeline schedules and engines call backward in places the head cannot reach. This
function carries its own backward, composes with ``model.loss_chunk`` (positions in chunks, logits recomputed in
backward as models/chunked_loss.py does) and with the FP32-softmax / autocast-matmul numerics of the plain path.
Without chunks it keeps the local softmax for backward (what the plain path's autograd keeps, 1/tp of it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.group_autograd import sum_gradient, sum_over_group
from .chunked_loss import IGNORE, _autocast_state, _chunks, logits_gradient


def local_rows(weight) -> torch.Tensor:
    """This rank's rows of a vocabulary-parallel weight (a DTensor sharded by rows; FSDP2 over TP hands the
    forward its TP-sharded DTensor, so the same call serves)."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def _label_columns(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each label inside this rank's slice, clamped; True where the label is in the slice)."""
    local = labels - start
    held = (labels != IGNORE) & (local >= 0) & (local < width)
    return local.clamp(0, width - 1), held


def _softmax_and_loss(logits: torch.Tensor, labels: torch.Tensor, start: int, group) -> tuple:
    """Local softmax [n, V/tp] over the whole vocabulary, the summed loss of the chunk, and log-sum-exp [n]."""
    logits = logits.float()
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    logits = logits - top.unsqueeze(-1)
    exp = logits.exp()
    cols, held = _label_columns(labels, start, logits.shape[-1])
    rows = torch.arange(logits.shape[0], device=logits.device)
    # one all-reduce for both: the sum of exponentials and the label's (shifted) logit
    both = torch.stack([exp.sum(dim=-1), logits[rows, cols] * held])
    dist.all_reduce(both, group=group)
    total, target = both[0], both[1]
    valid = labels != IGNORE
    loss = ((total.log() - target) * valid).sum()
    return exp.div_(total.unsqueeze(-1)), loss, top + total.log()


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, group, start):
        n = hidden.shape[0]
        size = chunk if chunk > 0 else max(n, 1)
        ctx.autocast = _autocast_state(hidden.device.type)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        kept = None
        for a, b in _chunks(n, size):
            probs, loss, lse[a:b] = _softmax_and_loss(F.linear(hidden[a:b], weight), labels[a:b], start, group)
            total = total + loss
            kept = probs if chunk <= 0 else None  # without chunks the one softmax is kept for backward
        ctx.save_for_backward(hidden, weight, labels, lse, *([kept] if kept is not None else []))
        ctx.chunk, ctx.group, ctx.start = size, group, start
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse, *kept = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        device_type = hidden.device.type
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            for a, b in _chunks(hidden.shape[0], ctx.chunk):
                h, y = hidden[a:b], labels[a:b]
                if kept:
                    probs = kept[0]
                    matmul_dtype = dtype if enabled else hidden.dtype
                else:  # recomputed: exp(logits - log-sum-exp) is the softmax, no communication
                    logits = F.linear(h, weight)
                    matmul_dtype = logits.dtype
                    probs = (logits.float() - lse[a:b].unsqueeze(-1)).exp_()
                    del logits
                cols, held = _label_columns(y, ctx.start, probs.shape[-1])
                grad_logits = logits_gradient(probs, cols, held, y, grad_total, matmul_dtype)
                del probs
                grad_hidden[a:b] = (grad_logits @ weight.to(matmul_dtype)).to(hidden.dtype)
                grad_weight += (grad_logits.t() @ h.to(matmul_dtype)).float()
        dist.all_reduce(grad_hidden, group=ctx.group)  # each rank's part is its vocabulary slice's share
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def vocab_parallel_embedding(tokens: torch.Tensor, weight, mesh) -> torch.Tensor:
    """Embedding rows from a table whose weight is a DTensor sharded by rows over ``mesh``: each rank looks up
    the tokens in its slice (zeros for the others), one all-reduce sums the lookups. The weight's gradient stays
    this rank's rows (DTensor's row-wise embedding plan returns it replicated at the table's whole size)."""
    local = local_rows(weight)
    start = mesh.get_local_rank() * local.shape[0]
    cols, held = _label_columns(tokens, start, local.shape[0])
    rows = F.embedding(cols, local) * held.unsqueeze(-1).to(local.dtype)
    return sum_over_group(rows, mesh.get_group())


def vocab_parallel_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, group, start: int
) -> torch.Tensor:
    """Sum over positions of the cross-entropy of ``hidden @ weight.T`` (``weight``: this rank's rows of the
    vocabulary, starting at row ``start``) against ``labels`` (-100: no loss), the softmax over the whole
    vocabulary of the group. Every rank returns the same loss."""
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    return _VocabParallelLinearCrossEntropy.apply(flat, weight, labels.reshape(-1), int(chunk), group, int(start))


def vocab_parallel_logits(hidden: torch.Tensor, weight, mesh) -> torch.Tensor:
    """Whole-vocabulary logits from a head whose weight is a DTensor sharded by rows over ``mesh``: the local
    slice, all-gathered (for sampling and evaluation; training takes ``vocab_parallel_loss_sum``)."""
    from torch.distributed.tensor import DTensor, Shard

    local = F.linear(sum_gradient(hidden, mesh.get_group()), local_rows(weight))
    return DTensor.from_local(local, mesh, [Shard(local.dim() - 1)]).full_tensor()
