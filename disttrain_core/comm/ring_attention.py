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
query's document has no key contributes nothing to it (log-sum-exp -inf, merged away). By default a block
runs one unmasked kernel call per pair of same-document runs; ``dense`` (one additive mask per block) is
the reference (comm/ring_documents.py).

Grouped-query attention: keys and values travel with their own (fewer) heads; query head h attends with
key/value head h // (query heads / key heads), as in ``F.scaled_dot_product_attention(enable_gqa=True)``.

Each block runs on a fused attention kernel that returns its log-sum-exp (comm/attention_blocks.py: the
CPU flash kernel; FlashAttention-2 or the memory-efficient kernel on CUDA), so no S_local x S_local score
matrix exists (packed documents under ``dense``: one additive mask per block). The merged output and
log-sum-exp are fp32, with autocast off inside (the kernels take the inputs' dtype and accumulate in fp32).

Backward is a second ring (the FlashAttention-2 recurrences per block, from the saved output and
log-sum-exp: each block's kernel backward given the *whole* attention's output and log-sum-exp yields that
block's share of the gradients): key/value blocks travel again, and with them the fp32 accumulators of
their gradients, which arrive back at their owner after W hops. Only the local queries, keys, values,
output and log-sum-exp are saved for backward.
"""

from __future__ import annotations

import torch

from .ring import Ring, _wait
from .ring_documents import DocumentRuns, MaskedDocuments, Unpacked, merge_block

DOCUMENT_KERNELS = {"dense": MaskedDocuments, "varlen": DocumentRuns}

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


_POSITIONS: dict[tuple, torch.Tensor] = {}  # (padded length, world, owner, layout, device) -> positions there


def owner_positions(seq_len: int, world: int, owner: int, layout: str, device: torch.device) -> torch.Tensor:
    """:func:`local_positions` on ``device``, built once per shape: a per-call host->device copy would block
    the host on CUDA (pageable memory)."""
    key = (seq_len, world, owner, layout, str(device))
    if key not in _POSITIONS:
        _POSITIONS[key] = local_positions(seq_len, world, owner, layout).to(device)
    return _POSITIONS[key]


def _owner_ids(row_ids: torch.Tensor, world: int, layout: str) -> list[torch.Tensor]:
    """The document ids of every rank's keys, from the whole padded row's ids [B, S_padded]."""
    return [
        row_ids.index_select(1, owner_positions(row_ids.shape[1], world, owner, layout, row_ids.device))
        for owner in range(world)
    ]


def documents_of(docs, world: int, rank: int, layout: str):
    """How the blocks keep to packed documents (comm/ring_documents.py): ``docs`` is None (no documents), or
    (this rank's ids [B, S_local], the whole padded row's [B, S_padded], kernel), kernel ``dense`` (one
    additive mask per block) or ``varlen`` (one unmasked call per same-document pair), or an object built
    before (the runs of a batch, shared by its layers)."""
    if docs is None:
        return Unpacked()
    if not isinstance(docs, tuple):
        return docs
    q_ids, row_ids, kernel = docs if len(docs) == 3 else (*docs, "varlen")
    if kernel not in DOCUMENT_KERNELS:
        raise ValueError(f"ring attention's document kernel {kernel!r}: allowed values are dense, varlen")
    return DOCUMENT_KERNELS[kernel](q_ids, _owner_ids(row_ids, world, layout), world, rank)


class _RankForward:
    """One rank's queries attending to the ring's blocks one at a time; output and log-sum-exp merged in
    fp32 (the first block, the rank's own, starts them; every other block merges in place)."""

    def __init__(self, q, plan: _Plan, documents, counter: WorkCounter | None):
        self.q, self.plan, self.counter = q, plan, counter
        self.documents = documents if documents is not None else Unpacked()
        self.scale = q.shape[-1] ** -0.5
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.kernel = None

    def add(self, step: int, k: torch.Tensor, v: torch.Tensor) -> None:
        todo = self.plan.step(step)
        if todo is None:
            return
        rows, cols, causal = todo
        out, lse, kernel = self.documents.forward(step, rows, cols, causal, self.q, k, v, self.scale)
        if self.counter is not None:
            q_rows, k_rows = len(range(*rows.indices(self.q.shape[2]))), len(range(*cols.indices(k.shape[2])))
            self.counter.add(q_rows, k_rows, causal, self.q.shape[1] * self.q.shape[0])
        if self.out is None:  # step 0: the rank's own block, every query row (each sees itself)
            self.out, self.lse, self.kernel = out.float(), lse, kernel
            return
        merge_block(self.out[:, :, rows], self.lse[..., rows], out, lse)


class _RankBackward:
    """One rank's share of the backward: each block's gradients from the whole attention's output and
    log-sum-exp; dq accumulated here in fp32, each block's dk/dv returned for its owner."""

    def __init__(self, q, out, lse, grad_out, plan: _Plan, documents, kernel):
        self.saved = (grad_out, q, None, None, out, lse)
        self.plan, self.kernel = plan, kernel
        self.documents = documents if documents is not None else Unpacked()
        self.scale = q.shape[-1] ** -0.5
        self.dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def block(self, step: int, k: torch.Tensor, v: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add this rank's gradients of step ``step``'s block to ``dk``/``dv`` (fp32, the block's shape)."""
        todo = self.plan.step(step)
        if todo is None:
            return
        rows, cols, causal = todo
        grad_out, q, _, _, out, lse = self.saved
        saved = (grad_out, q, k, v, out, lse)
        self.documents.backward(step, rows, cols, causal, (self.dq, dk, dv), saved, self.scale, self.kernel)


def _no_autocast(device: torch.device):
    """Autocast off: the kernels take the inputs' dtype, the accumulators stay fp32 (autocast would run the
    merge's products in bf16)."""
    return torch.autocast(device_type=device.type, enabled=False)


class RingAttention(torch.autograd.Function):
    """``out = RingAttention.apply(q, k, v, ring, layout, counter, docs)``: causal attention of this rank's
    queries [B, H, S_local, D] over the keys/values [B, Hk, S_local, D] of the whole ring; ``docs``: None or
    (this rank's document ids [B, S_local], the whole padded row's [B, S_padded]) for packed documents."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, layout: str, counter: WorkCounter | None, docs=None):
        with _no_autocast(q.device):
            plan = _Plan(layout, ring.size, ring.rank, q.shape[2])
            documents = documents_of(docs, ring.size, ring.rank, layout)
            rank = _RankForward(q, plan, documents, counter)
            k_cur, v_cur = k.contiguous(), v.contiguous()
            for step in range(ring.size):
                if step < ring.size - 1:
                    k_next, k_works = ring.exchange(k_cur)
                    v_next, v_works = ring.exchange(v_cur)
                rank.add(step, k_cur, v_cur)
                if step < ring.size - 1:
                    _wait(k_works + v_works)
                    k_cur, v_cur = k_next, v_next
            out = rank.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, rank.lse)
        ctx.ring, ctx.layout, ctx.documents, ctx.kernel = ring, layout, documents, rank.kernel
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        with _no_autocast(q.device):
            plan = _Plan(ctx.layout, ring.size, ring.rank, q.shape[2])
            rank = _RankBackward(q, out, lse, out_grad.to(q.dtype).contiguous(), plan, ctx.documents, ctx.kernel)
            k_cur, v_cur = k.contiguous(), v.contiguous()
            travelling = None  # (dk, dv) of the block held now, received from the previous holder
            for step in range(ring.size):
                if step < ring.size - 1:
                    k_next, k_works = ring.exchange(k_cur)
                    v_next, v_works = ring.exchange(v_cur)
                if travelling is None:
                    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
                    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
                else:  # the accumulators of this block from the ranks that held it before
                    (dk, dv), works = travelling
                    _wait(works)
                rank.block(step, k_cur, v_cur, dk, dv)
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
        return rank.dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, ring: Ring, layout: str = "zigzag", counter: WorkCounter | None = None, docs=None):
    """Causal attention of local q [B, H, S, D] against the ring's k/v [B, Hk, S, D] (see module doc);
    ``docs`` = (local document ids [B, S], whole padded row's [B, S_padded]) keeps it inside documents."""
    chunk_count(layout, ring.size)
    return RingAttention.apply(q, k, v, ring, layout, counter, docs)


class _EmulatedRing(torch.autograd.Function):
    """Every rank of a ring of ``world`` in this process, one after another: the same per-rank forward and
    backward as :class:`RingAttention`, the blocks taken from their owners instead of travelling."""

    @staticmethod
    def forward(ctx, q, k, v, world: int, layout: str, docs=None):
        with _no_autocast(q.device):
            ranks, outs = [], []
            for rank in range(world):
                plan = _Plan(layout, world, rank, q[rank].shape[2])
                documents = documents_of(None if docs is None else (docs[0][rank], *docs[1:]), world, rank, layout)
                state = _RankForward(q[rank], plan, documents, None)
                for step in range(world):
                    owner = (rank - step) % world
                    state.add(step, k[owner], v[owner])
                outs.append(state.out.to(q.dtype))
                ranks.append((plan, documents, state.lse, state.kernel))
        ctx.save_for_backward(q, k, v, torch.stack(outs))
        ctx.ranks, ctx.world = ranks, world
        return torch.stack(outs)

    @staticmethod
    def backward(ctx, out_grad):
        q, k, v, out = ctx.saved_tensors
        world = ctx.world
        with _no_autocast(q.device):
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            dq = []
            for rank, (plan, documents, lse, kernel) in enumerate(ctx.ranks):
                state = _RankBackward(q[rank], out[rank], lse, out_grad[rank].to(q.dtype), plan, documents, kernel)
                for step in range(world):
                    owner = (rank - step) % world
                    state.block(step, k[owner], v[owner], dk[owner], dv[owner])
                dq.append(state.dq)
        return torch.stack(dq).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def emulated_ring_attention(
    q, k, v, world: int, layout: str = "zigzag", doc_ids=None, doc_kernel: str = "varlen"
) -> torch.Tensor:
    """Context parallelism of ``world`` ranks inside one process (tools/gpu_check.py runs it on CUDA, where a
    process has one GPU): whole sequences q [B, H, S, D], k/v [B, Hk, S, D], S a multiple of the layout's
    chunks, ``doc_ids`` [B, S] or None (kept to with ``doc_kernel``: varlen or dense); returns the attention of
    the whole sequence in position order, with gradients, computed rank by rank through the ring's own
    per-block kernels, merge and backward."""
    seq = q.shape[2]
    positions = [owner_positions(seq, world, r, layout, q.device) for r in range(world)]

    def split(t):
        return torch.stack([t.index_select(2, p) for p in positions])

    docs = None
    if doc_ids is not None:
        docs = (torch.stack([doc_ids.index_select(1, p) for p in positions]), doc_ids, doc_kernel)
    local = _EmulatedRing.apply(split(q), split(k), split(v), world, layout, docs)  # [W, B, H, S_local, D]
    out = torch.empty_like(q)
    order = torch.cat(positions)
    return out.index_copy(2, order, torch.cat(list(local.unbind(0)), dim=2))
