"""Causal attention inside packed documents without a dense [S, S] mask (``model.document_attention``).

* ``dense``: one SDPA call with a boolean [B, 1, S, S] mask (same document and causal). It rules out the fused
  kernels and costs S^2 per row; kept as the reference.
* ``varlen``: one causal SDPA call per document of each row (the documents a row holds are read once per forward:
  ``Documents.segments``, a host read). The fused causal kernel runs on each, and the work is the sum of the
  documents' squared lengths instead of the row's. A padding run (id -1) is one more segment, as in the dense mask.
* ``flex``: FlexAttention with a block mask built from the document ids (compiled): on CUDA the fused kernel skips
  whole blocks across documents. torch 2.13 has no FlexAttention backward on the CPU, so training refuses it
  there (validation); its forward is checked against the dense mask on the CPU.
* ``auto``: ``varlen``.

Under ``trainer.compile`` (parallel/compile.py) ``dense`` and ``flex`` are traced into the block's graph and
``varlen`` runs eagerly between two compiled pieces of the block.

Under context parallelism ring attention replaces this call (parallel/context_parallel.py): ``auto``/``varlen``
run one unmasked call per pair of same-document runs of each ring block, ``dense`` one additive mask per block
(comm/ring_documents.py), and ``flex`` is refused.

All three give the same result: a query attends to the earlier positions of its own document.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("auto", "dense", "varlen", "flex")


def segments_of(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """For each row of ``ids`` [B, S], the (start, stop) of each run of equal ids (one host read for the batch)."""
    rows = []
    for row in ids.tolist():
        bounds, start = [], 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                bounds.append((start, i))
                start = i
        rows.append(bounds)
    return rows


def dense_attention(q, k, v, ids: torch.Tensor, gqa: bool) -> torch.Tensor:
    seq_len = q.shape[2]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    mask = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def varlen_attention(q, k, v, segments: list[list[tuple[int, int]]], gqa: bool) -> torch.Tensor:
    """[B, H, S, D] q (k/v may have fewer heads): each (row, segment) block attends causally to itself alone."""
    rows = []
    for b, bounds in enumerate(segments):
        parts = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True, enable_gqa=gqa
            )
            for s, e in bounds
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_documents(q, k, v, ids: torch.Tensor, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    batch, _, seq_len, _ = q.shape

    def same_document_causal(b, h, q_index, k_index):
        return (ids[b, q_index] == ids[b, k_index]) & (q_index >= k_index)

    block_mask = create_block_mask(same_document_causal, batch, None, seq_len, seq_len, device=q.device)
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@functools.cache
def flex_available() -> bool:
    """Whether this torch has FlexAttention (torch 2.5 and newer); without it ``flex`` runs ``varlen``, with a
    warning."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        import logging

        logging.getLogger(__name__).warning(
            "model.document_attention=flex: this torch (%s) has no FlexAttention; packed documents run varlen",
            torch.__version__,
        )
        return False
    return True


def document_attention(kernel: str, q, k, v, documents, gqa: bool) -> torch.Tensor:
    """Causal attention of [B, H, S, D] tensors inside the documents of ``documents`` (models/llama.py)."""
    if kernel == "dense":
        return dense_attention(q, k, v, documents.ids, gqa)
    if kernel == "flex" and flex_available():
        return flex_attention_documents(q, k, v, documents.ids, gqa)
    return _varlen_outside_graphs(q, k, v, documents, gqa)


@torch.compiler.disable
def _varlen_outside_graphs(q, k, v, documents, gqa: bool) -> torch.Tensor:
    """``varlen`` runs eagerly inside a compiled block (trainer.compile): its segments are host integers that
    change with every batch, which a graph would specialize on (a recompile per batch, then eager once the
    recompile limit is hit) or trace into ever longer symbolic expressions. The block's graph stops before
    and resumes after it; the projections, rotary embedding and MLP around it stay compiled."""
    return varlen_attention(q, k, v, documents.segments(), gqa)
