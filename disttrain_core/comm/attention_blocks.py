"""One block of attention with its log-sum-exp, forward and backward, on the fused kernel the device has.

Ring attention (comm/ring_attention.py) computes its queries against one key/value block at a time and merges
the partial results with their log-sum-exp; its backward runs each block's backward from the *merged* output
and log-sum-exp (the FlashAttention-2 recurrences). Both need a kernel that returns the log-sum-exp and
accepts it back, without the S_q x S_k score matrix of a written-out softmax:

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward): grouped-query attention native, an
  additive mask in the input dtype;
* CUDA: FlashAttention-2 (``_scaled_dot_product_flash_attention``) for fp16/bf16 without a mask; the
  memory-efficient kernel (``_scaled_dot_product_efficient_attention``) for fp32 or with a mask (its
  log-sum-exp comes padded to 32 rows and goes back padded). FlashAttention-2 takes grouped keys as they
  are; the memory-efficient kernel wants as many key heads as query heads: grouped keys are expanded per
  block there and their gradients summed back.

Packed documents travel as an additive mask of the block (0 where query and key share a document, -inf
elsewhere) in the input dtype: B x S_q x S_k elements, a quarter of the fp32 scores' bytes and one tensor where
a written-out softmax held five; a query with no key of its document in the block gets log-sum-exp -inf (the
kernels return 0 there), so merging ignores it.

The kernels compute in fp32 inside and return the output in the input dtype; the log-sum-exp is fp32. The
callers hold their accumulators in fp32 and run with autocast off (comm/ring_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.torch_compat import PRIVATE

NEG_INF = float("-inf")
EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this
MASK_ALIGNMENT = 16  # its additive mask needs a last-dimension stride that is a multiple of this


def _op(name: str):
    return PRIVATE[f"aten.{name}"]()


@dataclass
class BlockKernel:
    """Which kernel a block runs on, and what its backward needs from a forward of the same kind (the random
    state and sequence offsets flash and efficient attention return; unused without dropout or varlen)."""

    kind: str  # cpu | flash | efficient
    aux: tuple = ()


def kernel_kind(q: torch.Tensor, masked: bool) -> str:
    if q.device.type != "cuda":
        return "cpu"
    return "flash" if not masked and q.dtype in (torch.float16, torch.bfloat16) else "efficient"


def _grouped(k: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys/values with as many heads as the queries (the CUDA kernels want equal head counts)."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _ungrouped(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    if grad.shape[1] == kv_heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _per_head(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The mask as the CUDA kernels take it, [B, H, S_q, S_k]: a broadcast view (no copy)."""
    return None if mask is None else mask.expand(q.shape[0], q.shape[1], -1, -1)


def document_mask(same: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, S_q, S_k] of a block from ``same`` [B, S_q, S_k] (True: same document)."""
    b, sq, sk = same.shape
    padded = -(-sk // MASK_ALIGNMENT) * MASK_ALIGNMENT if same.device.type == "cuda" else sk
    mask = torch.zeros(b, 1, sq, padded, dtype=dtype, device=same.device)[..., :sk]
    return mask.masked_fill_(~same[:, None], NEG_INF)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, BlockKernel]:
    """(out [B, H, S_q, D] in q's dtype, log-sum-exp [B, H, S_q] fp32, kernel) of q [B, H, S_q, D] against
    k/v [B, Hk, S_k, D]; ``causal``: aligned at the top left (a rank's own block); ``mask``: additive."""
    kind = kernel_kind(q, mask is not None)
    if kind == "cpu":
        out, lse = _op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse, BlockKernel(kind)
    if kind == "efficient":  # FlashAttention-2 takes fewer key heads; the memory-efficient kernel does not
        k, v = _grouped(k, q.shape[1]), _grouped(v, q.shape[1])
    mask = _per_head(mask, q)
    if kind == "flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = _op("_scaled_dot_product_flash_attention")(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, BlockKernel(kind, (cum_q, cum_k, seed, offset))
    out, lse, seed, offset = _op("_scaled_dot_product_efficient_attention")(
        q, k, v, mask, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]], BlockKernel(kind, (seed, offset))


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float,
    kernel: BlockKernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, in the inputs' dtype, from the *whole* attention's output and log-sum-exp
    (``out`` in q's dtype, ``lse`` fp32 [B, H, S_q]): the block's share of the gradients."""
    lse = lse.contiguous()
    if kernel.kind == "cpu":
        return _op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    kv_heads = k.shape[1]
    if kernel.kind == "efficient":
        k, v = _grouped(k, q.shape[1]), _grouped(v, q.shape[1])
    mask = _per_head(mask, q)
    if kernel.kind == "flash":
        cum_q, cum_k, seed, offset = kernel.aux
        dq, dk, dv = _op("_scaled_dot_product_flash_attention_backward")(
            grad_out, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
        )
    else:
        seed, offset = kernel.aux
        rows = -(-q.shape[2] // EFFICIENT_LSE_ROWS) * EFFICIENT_LSE_ROWS
        padded = lse.new_zeros(*lse.shape[:-1], rows)
        padded[..., : q.shape[2]] = lse
        dq, dk, dv, _ = _op("_scaled_dot_product_efficient_attention_backward")(
            grad_out, q, k, v, mask, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
    return dq, _ungrouped(dk, kv_heads), _ungrouped(dv, kv_heads)
