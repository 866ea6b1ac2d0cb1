"""Causal ring attention for context parallelism, forward and backward, over point-to-point transfers.

torch's own ``context_parallel`` does not run on CPU/gloo, so this is written out: every rank of a
context-parallel (CP) group of size W holds a slice of every sequence (queries, keys and values of its
own positions); the key/value blocks travel once around the ring while each rank attends its queries
to the block it holds, and the partial results are merged with their log-sum-exp (the online softmax).
The exchange of step i+1's block runs while step i's block is computed (``Ring.exchange``: one send and
one receive per call, every handle waited on before the data is read -- NCCL's contract, comm/p2p.py).

Layouts (which positions a rank holds):

* ``zigzag`` (the default): the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r
  (head and tail). Under a causal mask every rank then computes the same amount of attention: its own
  block (causal) and, for every other rank's block, exactly one dense chunk-by-two-chunks product.
* ``contiguous``: rank r holds chunk r of W. Rank W-1 computes W blocks, rank 0 one: at W = 4 the
  busiest rank does 1.75x the mean work. Kept to measure that (tools/bench_cp.py) and as a reference.

Sequences that do not divide into 2W (or W) chunks are padded at the end by the caller: the padded
positions come after every real one, so causality alone keeps them out of every real query's keys, and
their own outputs are discarded (their labels are ignored).

Packed documents: given every position's document id (each rank knows the whole row's ids), a query
also ignores keys of other documents, so attention never crosses a document boundary; a block where a
query's document has no key contributes nothing to it (log-sum-exp -inf, merged away).

Grouped-query attention: keys and values travel with their own (fewer) heads; query head h attends with
key/value head h // (query heads / key heads), as in ``F.scaled_dot_product_attention(enable_gqa=True)``.

Backward is a second ring (the FlashAttention-2 recurrences per block, from the saved output and
log-sum-exp): key/value blocks travel again, and with them the accumulators of their gradients, which
arrive back at their owner after W hops. Scores, probabilities and accumulators are fp32 whatever the
input dtype; only the local queries, keys, values, output and log-sum-exp are saved for backward.
"""

from __future__ import annotations

import torch

from .ring import Ring, _wait

LAYOUTS = ("zigzag", "contiguous")


def chunk_count(layout: str, world: int) -> int:
    """Equal chunks a sequence is cut into: 2W (zigzag) or W (contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout {layout!r}: allowed values are {', '.join(LAYOUTS)}")
    return 2 * world if layout == "zigzag" else world


def padded_length(seq_len: int, world: int, layout: str = "zigzag") -> int:
    """``seq_len`` rounded up to a multiple of the chunk count."""
    chunks = chunk_count(layout, world)
    return -(-seq_len // chunks) * chunks


def local_positions(seq_len: int, world: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """The sequence positions rank ``rank`` holds, in its local order (``seq_len`` already padded)."""
    chunks = chunk_count(layout, world)
    if seq_len % chunks:
        raise ValueError(f"sequence length {seq_len} is not a multiple of {chunks} chunks; pad it first")
    c = seq_len // chunks
    own = [rank, chunks - 1 - rank] if layout == "zigzag" else [rank]
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in own])


class WorkCounter:
    """Query-key score entries computed by each rank (masked entries of a causal block not counted)."""

    def __init__(self) -> None:
        self.entries = 0

    def add(self, q_rows: int, k_rows: int, causal: bool, heads: int) -> None:
        pairs = q_rows * (q_rows + 1) // 2 if causal else q_rows * k_rows
        self.entries += pairs * heads


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, same_doc=None) -> torch.Tensor:
    """fp32 scores [B, Hk, g, Sq, Sk] of grouped queries [B, Hk, g, Sq, D] against keys [B, Hk, 1, Sk, D];
    ``same_doc`` [B, Sq, Sk]: False where query and key belong to different packed documents."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # local order follows position order inside a rank's own block (both layouts)
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if same_doc is not None:
        s = s.masked_fill(~same_doc[:, None, None], float("-inf"))
    return s


def _block_forward(q, k, v, scale, causal, same_doc=None):
    s = _scores(q, k, scale, causal, same_doc)
    lse = torch.logsumexp(s, dim=-1)
    # A query whose document has no key in this block: lse = -inf, its output 0 (merging ignores it).
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v.float())
    return out, lse


def _merge(out, lse, block_out, block_lse):
    """Online softmax: combine two partial attentions (each normalized over its own keys)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return out, new_lse


def _block_backward(q, k, v, out_grad, delta, lse, scale, causal, same_doc=None):
    """Gradients of one block from the global log-sum-exp: (dq, dk, dv), fp32, dk/dv summed over the group."""
    p = torch.exp(_scores(q, k, scale, causal, same_doc) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), out_grad).sum(2, keepdim=True)
    dp = torch.matmul(out_grad, v.float().transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).sum(2, keepdim=True) * scale
    return dq, dk, dv


class _Plan:
    """What rank ``r`` computes at ring step ``s`` (holding the block of rank ``(r - s) mod W``).

    Returns (query slice, key slice, causal) or None when the block is entirely masked.
    """

    def __init__(self, layout: str, world: int, rank: int, local_len: int):
        self.layout, self.world, self.rank = layout, world, rank
        self.half = local_len // 2
        self.all = slice(0, local_len)

    def step(self, step: int):
        if step == 0:
            return self.all, self.all, True
        owner = (self.rank - step) % self.world
        if self.layout == "contiguous":
            return (self.all, self.all, False) if owner < self.rank else None
        if owner < self.rank:  # its head chunk precedes both of mine, its tail follows both
            return self.all, slice(0, self.half), False
        return slice(self.half, None), self.all, False  # only my tail chunk comes after it, and after all of it


class _Documents:
    """Packed-document masks of the blocks a rank computes: its queries' document ids and the whole padded
    row's, from which the ids of any rank's keys follow (every CP rank holds the whole row's ids)."""

    def __init__(self, q_ids: torch.Tensor, row_ids: torch.Tensor, ring: Ring, layout: str):
        self.q_ids = q_ids
        self.k_ids = [
            row_ids[:, local_positions(row_ids.shape[1], ring.size, owner, layout).to(row_ids.device)]
            for owner in range(ring.size)
        ]
        self.rank, self.size = ring.rank, ring.size

    def same(self, step: int, rows: slice, cols: slice) -> torch.Tensor:
        keys = self.k_ids[(self.rank - step) % self.size]
        return self.q_ids[:, rows, None] == keys[:, None, cols]


class RingAttention(torch.autograd.Function):
    """``out = RingAttention.apply(q, k, v, ring, layout, counter, docs)``: causal attention of this rank's
    queries [B, H, S_local, D] over the keys/values [B, Hk, S_local, D] of the whole ring; ``docs``: None or
    (this rank's document ids [B, S_local], the whole padded row's [B, S_padded]) for packed documents."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, layout: str, counter: WorkCounter | None, docs=None):
        batch, heads, local_len, dim = q.shape
        kv_heads = k.shape[1]
        scale = dim**-0.5
        grouped = q.view(batch, kv_heads, heads // kv_heads, local_len, dim)
        plan = _Plan(layout, ring.size, ring.rank, local_len)
        documents = None if docs is None else _Documents(docs[0], docs[1], ring, layout)
        out = torch.zeros(grouped.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(grouped.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for step in range(ring.size):
            if step < ring.size - 1:
                k_next, k_works = ring.exchange(k_cur)
                v_next, v_works = ring.exchange(v_cur)
            todo = plan.step(step)
            if todo is not None:
                rows, cols, causal = todo
                same_doc = None if documents is None else documents.same(step, rows, cols)
                block_out, block_lse = _block_forward(
                    grouped[..., rows, :], k_cur[:, :, None, cols], v_cur[:, :, None, cols], scale, causal, same_doc
                )
                if counter is not None:
                    counter.add(block_out.shape[-2], k_cur[:, :, cols].shape[-2], causal, heads * batch)
                out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if step < ring.size - 1:
                _wait(k_works + v_works)
                k_cur, v_cur = k_next, v_next
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout, ctx.documents = ring, layout, documents
        return out.view(batch, heads, local_len, dim).to(q.dtype)

    @staticmethod
    def backward(ctx, out_grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout, documents = ctx.ring, ctx.layout, ctx.documents
        batch, heads, local_len, dim = q.shape
        kv_heads = k.shape[1]
        scale = dim**-0.5
        grouped = q.view(batch, kv_heads, heads // kv_heads, local_len, dim)
        out_grad = out_grad.float().reshape(out.shape)
        delta = (out_grad * out).sum(-1)  # rowsum(dO * O), once per query row
        plan = _Plan(layout, ring.size, ring.rank, local_len)
        dq = torch.zeros(out.shape, dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        kv_shape = (batch, kv_heads, 1, local_len, dim)
        travelling = None  # (dk, dv) of the block held now, received from the previous holder
        for step in range(ring.size):
            if step < ring.size - 1:
                k_next, k_works = ring.exchange(k_cur)
                v_next, v_works = ring.exchange(v_cur)
            dk = torch.zeros(kv_shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(kv_shape, dtype=torch.float32, device=q.device)
            todo = plan.step(step)
            if todo is not None:
                rows, cols, causal = todo
                block = _block_backward(
                    grouped[..., rows, :],
                    k_cur[:, :, None, cols],
                    v_cur[:, :, None, cols],
                    out_grad[..., rows, :],
                    delta[..., rows],
                    lse[..., rows],
                    scale,
                    causal,
                    None if documents is None else documents.same(step, rows, cols),
                )
                dq[..., rows, :] += block[0]
                dk[..., cols, :] += block[1]
                dv[..., cols, :] += block[2]
            if (
                travelling is not None and ring.size > 1
            ):  # the accumulators of this block from the ranks that held it before
                (dk_in, dv_in), works = travelling
                _wait(works)
                dk += dk_in
                dv += dv_in
            if ring.size == 1:
                travelling = (dk, dv), []
            else:  # pass them on with the block: the next rank holds it next step; after W hops it is home
                dk_in, dk_works = ring.exchange(dk)
                dv_in, dv_works = ring.exchange(dv)
                travelling = (dk_in, dv_in), dk_works + dv_works
            if step < ring.size - 1:
                _wait(k_works + v_works)
                k_cur, v_cur = k_next, v_next
        (dk, dv), works = travelling
        _wait(works)
        dq = dq.view(batch, heads, local_len, dim).to(q.dtype)
        return dq, dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype), None, None, None, None


def ring_attention(q, k, v, ring: Ring, layout: str = "zigzag", counter: WorkCounter | None = None, docs=None):
    """Causal attention of local q [B, H, S, D] against the ring's k/v [B, Hk, S, D] (see module doc);
    ``docs`` = (local document ids [B, S], whole padded row's [B, S_padded]) keeps it inside documents."""
    chunk_count(layout, ring.size)
    return RingAttention.apply(q, k, v, ring, layout, counter, docs)
