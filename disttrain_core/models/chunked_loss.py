"""The LM head and its cross-entropy in chunks of positions, never holding the whole sequence's logits.

``model.loss_chunk=C`` (0: off): the vocabulary projection and the loss run over C positions at a time. Forward
keeps no logits (only the loss); backward computes each chunk's logits again and turns them into the gradients
of the hidden states and the head's weight at once (one more head matmul per chunk than a plain forward: the
FLOPs of recomputing it, as activation recomputation pays for the blocks). Peak logits memory is C x vocabulary
instead of positions x vocabulary (at 16,384 positions and a 128,256 vocabulary, 8.4 GB of fp32 logits per
microbatch become 0.5 GB at C=1,024). The idea is LitGPT's chunked loss and Liger's fused linear cross-entropy;
this one recomputes rather than storing the weight's gradient from forward (a second vocabulary x width buffer).

Numerics follow the plain path: the head's matmul runs in the autocast dtype (bf16 under bf16 autocast), the
softmax and the loss in fp32, the gradients cast back to the matmul dtype before their matmuls; the loss is the
sum over positions whose label is not -100. In fp32 it equals ``F.cross_entropy(logits.float(), ...)`` to 1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    if device_type not in ("cuda", "cpu"):
        return False, torch.float32
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def logits_gradient(
    probs: torch.Tensor,
    cols: torch.Tensor,
    hit: torch.Tensor,
    labels: torch.Tensor,
    grad_total: torch.Tensor,
    matmul_dtype: torch.dtype,
) -> torch.Tensor:
    """d(sum of losses)/d(logits) of a chunk, in the matmul dtype, from its softmax (changed in place): minus one at
    each row's label column ``cols`` where ``hit`` (the label is among these columns), times the upstream
    gradient, zero on rows whose label is -100."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs[rows, cols] -= hit.to(probs.dtype)
    probs.mul_(((labels != IGNORE).to(probs.dtype) * grad_total).unsqueeze(-1))
    return probs.to(matmul_dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        device_type = hidden.device.type
        ctx.autocast = _autocast_state(device_type)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, stop in _chunks(hidden.shape[0], chunk):
            logits = F.linear(hidden[start:stop], weight).float()
            total = total + F.cross_entropy(logits, labels[start:stop], ignore_index=IGNORE, reduction="sum")
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        device_type = hidden.device.type
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            for start, stop in _chunks(hidden.shape[0], ctx.chunk):
                h = hidden[start:stop]
                y = labels[start:stop]
                logits = F.linear(h, weight)
                matmul_dtype = logits.dtype
                probs = torch.softmax(logits.float(), dim=-1)  # d(sum of losses)/d(logits) = softmax - onehot
                del logits  # one chunk-sized buffer fewer at the peak
                grad_logits = logits_gradient(probs, y.clamp(min=0), y != IGNORE, y, grad_total, matmul_dtype)
                del probs
                grad_hidden[start:stop] = (grad_logits @ weight.to(matmul_dtype)).to(hidden.dtype)
                grad_weight += (grad_logits.t() @ h.to(matmul_dtype)).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Sum over positions of the cross-entropy of ``hidden @ weight.T`` against ``labels`` (-100: no loss),
    ``chunk`` positions at a time. ``hidden``: [..., D]; ``labels``: [...]."""
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), int(chunk))
