"""Attention inside packed documents without the dense [S, S] mask (model.document_attention,
models/document_attention.py): varlen (one causal SDPA per document) equals the dense mask in outputs and
gradients, FlexAttention's block mask in its forward (no FlexAttention backward on the CPU), and a packed
document keeps the loss it has alone (tests/unit/test_packing.py runs both kernels)."""

from __future__ import annotations

import pytest
import torch

from disttrain_core.models.document_attention import (
    dense_attention,
    flex_attention_documents,
    segments_of,
    varlen_attention,
)

# two rows: four documents and a padding run; one document filling the row
IDS = torch.tensor([[0] * 10 + [1] * 30 + [2] * 3 + [3] * 17 + [-1] * 4, [5] * 64])


def _qkv(seed: int = 0, heads: int = 4, kv_heads: int = 2):
    g = torch.Generator().manual_seed(seed)
    shape = (2, heads, 64, 16)
    return (
        torch.randn(shape, generator=g),
        torch.randn(2, kv_heads, 64, 16, generator=g),
        torch.randn(2, kv_heads, 64, 16, generator=g),
    )


def test_segments_are_the_runs_of_one_id():
    assert segments_of(IDS) == [[(0, 10), (10, 40), (40, 43), (43, 60), (60, 64)], [(0, 64)]]


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_varlen_equals_the_dense_mask_with_its_gradients(heads, kv_heads):
    results = []
    for kernel in ("dense", "varlen"):
        q, k, v = (t.requires_grad_() for t in _qkv(heads=heads, kv_heads=kv_heads))
        gqa = heads != kv_heads
        if kernel == "dense":
            out = dense_attention(q, k, v, IDS, gqa)
        else:
            out = varlen_attention(q, k, v, segments_of(IDS), gqa)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_equals_the_dense_mask_forward():
    q, k, v = _qkv(1)
    with torch.no_grad():
        torch.testing.assert_close(
            flex_attention_documents(q, k, v, IDS, True), dense_attention(q, k, v, IDS, True), rtol=1e-5, atol=1e-5
        )
