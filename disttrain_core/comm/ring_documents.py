"""How one block of ring attention stays inside packed documents (comm/ring_attention.py).

A rank's block at ring step s is its queries (a slice ``rows`` of its local positions) against the key/value
block of rank (r - s) mod W (a slice ``cols``); ``causal`` marks its own block at step 0. Three ways to run it:

* :class:`Unpacked`: no documents; one kernel call over the block.
* :class:`MaskedDocuments` (``model.document_attention=dense``): one call with an additive mask of the block,
  B x S_q x S_k elements in the input dtype (0 where query and key share a document, -inf elsewhere); the
  reference the other way is tested against.
* :class:`DocumentRuns` (``auto``/``varlen``): no mask. Each row of the block is cut into runs of one document
  id; every pair of a query run and a key run of the same document is one unmasked kernel call (causal when
  it is the same run of the rank's own block, skipped when the keys come after the queries there). Blocks
  between different documents are never computed, and on CUDA unmasked calls may take FlashAttention-2.

Why runs pair this way: a rank's local order is increasing in sequence position (zigzag: its head chunk, then
its tail chunk), so inside its own block a run of keys either is the query run, or lies wholly before or
after it. At every other step the ring's plan hands a rank only keys that precede all its queries.

A query run that meets several key runs (its document crosses the zigzag chunks) merges their results with
their log-sum-exp, as the ring merges blocks; a query whose document has no key in the block gets log-sum-exp
-inf and output 0, which the ring's merge ignores.

The runs are read from the host once per batch (one device-to-host copy of the ids, shared by every layer
through the ``Documents`` object's cache, parallel/context_parallel.py).
"""

from __future__ import annotations

import torch

from .attention_blocks import NEG_INF, BlockKernel, block_backward, block_forward, document_mask, kernel_kind

ALL = slice(None)


class Unpacked:
    """No packed documents: the block is one kernel call."""

    def forward(self, step, rows, cols, causal, q, k, v, scale):
        return block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, None, scale)

    def backward(self, step, rows, cols, causal, grads, saved, scale, kernel) -> None:
        _add_block_grads((ALL, ALL, rows), (ALL, ALL, cols), causal, None, grads, saved, scale, kernel)


def _add_block_grads(queries, keys, causal, mask, grads, saved, scale, kernel) -> None:
    """One block's backward (one kernel call) added into the accumulators ``grads`` (dq, dk, dv); ``queries``
    and ``keys`` index the block's rows of the saved tensors ([B, H, S(, D)]: batch, head, position)."""
    grad_out, q, k, v, out, lse = saved
    dq, dk, dv = grads
    block = block_backward(
        grad_out[queries], q[queries], k[keys], v[keys], out[queries], lse[queries], causal, mask, scale, kernel
    )
    dq[queries] += block[0]
    dk[keys] += block[1]
    dv[keys] += block[2]


def merge_block(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one block's attention (``out``, ``lse``) into the fp32 accumulators (views written in place) by their
    log-sum-exp: the online softmax. An accumulator that holds nothing yet has log-sum-exp -inf."""
    merged = torch.logaddexp(acc_lse, lse)
    acc.mul_(torch.exp(acc_lse - merged).unsqueeze(-1))
    acc.addcmul_(out, torch.exp(lse - merged).unsqueeze(-1))
    acc_lse.copy_(merged)


class MaskedDocuments(Unpacked):
    """Packed documents through one additive mask per block (the dense reference)."""

    def __init__(self, q_ids: torch.Tensor, k_ids: list[torch.Tensor], world: int, rank: int):
        self.q_ids, self.k_ids, self.rank, self.world = q_ids, k_ids, rank, world

    def mask(self, step: int, rows: slice, cols: slice, causal: bool, dtype: torch.dtype):
        """(additive mask [B, 1, S_q, S_k], queries with no key in the block [B, S_q]) of step ``step``'s
        block; causality folded in on a rank's own block."""
        keys = self.k_ids[(self.rank - step) % self.world][:, cols]
        same = self.q_ids[:, rows, None] == keys[:, None, :]
        if causal:
            same &= torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
        return document_mask(same, dtype), ~same.any(-1)

    def forward(self, step, rows, cols, causal, q, k, v, scale):
        mask, empty = self.mask(step, rows, cols, causal, q.dtype)
        out, lse, kernel = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], False, mask, scale)
        return out, lse.masked_fill(empty[:, None], NEG_INF), kernel  # the kernels give such rows 0

    def backward(self, step, rows, cols, causal, grads, saved, scale, kernel) -> None:
        mask, _ = self.mask(step, rows, cols, causal, saved[1].dtype)
        _add_block_grads((ALL, ALL, rows), (ALL, ALL, cols), False, mask, grads, saved, scale, kernel)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(document id, start, stop) of each run of one id in a host row."""
    runs, start = [], 0
    for index in range(1, len(ids) + 1):
        if index == len(ids) or ids[index] != ids[start]:
            runs.append((ids[start], start, index))
            start = index
    return runs


def _clip(runs: list[tuple[int, int, int]], part: slice, length: int) -> list[tuple[int, int, int]]:
    """The runs inside ``part`` of a row of ``length``, in the part's own coordinates."""
    lo, hi, _ = part.indices(length)
    return [(doc, max(a, lo) - lo, min(b, hi) - lo) for doc, a, b in runs if a < hi and b > lo]


class DocumentRuns:
    """Packed documents without a mask: one kernel call per pair of same-document runs (module doc)."""

    def __init__(self, q_ids: torch.Tensor, k_ids: list[torch.Tensor], world: int, rank: int):
        self.rank, self.world, self.local = rank, world, q_ids.shape[1]
        q_rows, *k_rows = torch.stack([q_ids, *k_ids]).tolist()  # one device-to-host read
        self.q_runs = [_runs(row) for row in q_rows]
        self.k_runs = [[_runs(row) for row in rows] for rows in k_rows]
        self._pairs: dict[tuple, list] = {}

    def pairs(self, step: int, rows: slice, cols: slice, causal: bool) -> list[tuple]:
        """(row, q start, q stop, k start, k stop, causal) of every same-document pair in the block, in block
        coordinates; built once per step and shared by every layer and the backward."""
        key = (step, rows.start, rows.stop, cols.start, cols.stop, causal)
        if key not in self._pairs:
            owner = (self.rank - step) % self.world
            found = []
            for b, (q_row, k_row) in enumerate(zip(self.q_runs, self.k_runs[owner], strict=True)):
                for doc, qa, qb in _clip(q_row, rows, self.local):
                    for other, ka, kb in _clip(k_row, cols, self.local):
                        if other != doc or (causal and ka >= qb):
                            continue
                        found.append((b, qa, qb, ka, kb, causal and (qa, qb) == (ka, kb)))
            self._pairs[key] = found
        return self._pairs[key]

    def forward(self, step, rows, cols, causal, q, k, v, scale):
        q, k, v = q[:, :, rows], k[:, :, cols], v[:, :, cols]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
        kernel = BlockKernel(kernel_kind(q, masked=False))  # a block without pairs (none at step 0)
        for b, qa, qb, ka, kb, diagonal in self.pairs(step, rows, cols, causal):
            part, part_lse, kernel = block_forward(
                q[b : b + 1, :, qa:qb], k[b : b + 1, :, ka:kb], v[b : b + 1, :, ka:kb], diagonal, None, scale
            )
            merge_block(out[b : b + 1, :, qa:qb], lse[b : b + 1, :, qa:qb], part, part_lse)
        return out, lse, kernel

    def backward(self, step, rows, cols, causal, grads, saved, scale, kernel) -> None:
        r0, c0 = rows.indices(self.local)[0], cols.indices(self.local)[0]  # pairs are in block coordinates
        for b, qa, qb, ka, kb, diagonal in self.pairs(step, rows, cols, causal):
            queries = (slice(b, b + 1), ALL, slice(r0 + qa, r0 + qb))
            keys = (slice(b, b + 1), ALL, slice(c0 + ka, c0 + kb))
            _add_block_grads(queries, keys, diagonal, None, grads, saved, scale, kernel)
