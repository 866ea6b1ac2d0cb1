"""Ring attention inside packed documents without a mask (comm/ring_documents.py ``DocumentRuns``) against the
dense [S, S] reference and the ring's per-block mask, every rank of the ring emulated in one process."""

import pytest
import torch
import torch.nn.functional as F

from disttrain_core.comm.ring_attention import emulated_ring_attention
from disttrain_core.comm.ring_documents import DocumentRuns, _runs


def _rows(lengths: list[list[int]], seq: int) -> torch.Tensor:
    """Document ids of packed rows: documents one after another, -1 padding at the end."""
    rows = []
    for row, doc_lengths in enumerate(lengths):
        ids = [10 * row + d for d, n in enumerate(doc_lengths) for _ in range(n)]
        rows.append(ids + [-1] * (seq - len(ids)))
    return torch.tensor(rows)


def _reference(q, k, v, ids):
    same = (ids[:, :, None] == ids[:, None, :]) & torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same[:, None], enable_gqa=True)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_document_runs_equal_the_dense_reference(world, layout):
    seq = 48  # zigzag at world 4: 8 chunks of 6; documents cross chunk and rank boundaries
    ids = _rows([[5, 17, 1, 9, 10], [30, 3, 2], [48], [6, 10, 12]], seq)
    ids[3, 16:28] = 30  # one id in two places of a row: the reference lets the later part see the earlier one
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, seq, 8, generator=g).requires_grad_()
    k = torch.randn(4, 2, seq, 8, generator=g).requires_grad_()
    v = torch.randn(4, 2, seq, 8, generator=g).requires_grad_()
    grad = torch.randn(4, 4, seq, 8, generator=g)
    results = {}
    for name in ("reference", "dense", "varlen"):
        if name == "reference":
            out = _reference(q, k, v, ids)
        else:
            out = emulated_ring_attention(q, k, v, world, layout, doc_ids=ids, doc_kernel=name)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
        results[name] = (out, gq, gk, gv)
    for name in ("dense", "varlen"):
        for got, want in zip(results[name], results["reference"], strict=True):
            real = (ids != -1)[:, None, :, None].expand_as(got) if got.shape[1] == 4 else slice(None)
            assert (got - want)[real].abs().max().item() < 1e-5, name
    for got, want in zip(results["varlen"], results["dense"], strict=True):
        assert (got - want).abs().max().item() < 1e-5  # padding too: it attends only padding in both


def test_runs_pair_only_within_one_document():
    assert _runs([0, 0, 1, 1, 1, -1]) == [(0, 0, 2), (1, 2, 5), (-1, 5, 6)]
    ids = _rows([[3, 5]], 8)  # [0, 0, 0, 1, 1, 1, 1, 1]; zigzag over 2 ranks, chunks of 2 positions
    local = ids[:, [0, 1, 6, 7]]  # rank 0: documents 0, 0, 1, 1
    other = ids[:, [2, 3, 4, 5]]  # rank 1: documents 0, 1, 1, 1
    runs = DocumentRuns(local, [local, other], world=2, rank=0)
    # own block: each document causal on itself, nothing between them
    assert runs.pairs(0, slice(0, 4), slice(0, 4), True) == [(0, 0, 2, 0, 2, True), (0, 2, 4, 2, 4, True)]
    # rank 1's block (positions 2-5) against rank 0's tail (6, 7: document 1): document 1's keys 3-5 only
    assert runs.pairs(1, slice(2, None), slice(0, 4), False) == [(0, 0, 2, 1, 4, False)]
