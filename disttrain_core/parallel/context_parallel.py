"""Context parallelism for the LLM backbone, applied from outside the model.

The ``cp`` ranks of one replica of an LLM stage (units.py: CP peers share a data-parallel index, a
tensor-parallel index and a pipeline stage) receive the same samples. Each holds a slice of every
sequence: the sequence, padded to a multiple of 2cp, is cut into 2cp chunks and rank c keeps chunks c and
2cp-1-c (zig-zag, comm/ring_attention.py), so causal attention costs every rank the same (Ulysses and hybrid:
consecutive pieces of a ring rank's chunks, comm/context_modes.py ``mode_positions``). What changes:

* every decoder block's attention runs over the CP group (``Attention.core_attention``) as ``parallel.cp_mode``
  says: a ring, one all-gather of K/V, Ulysses' all-to-alls, or both (``context_mode``, ``apply_context_parallel``);
* the rotary table holds the angles of the rank's own positions (``Llama.rope_positions``); packed
  documents carry their own positions and ids, sliced the same way (``SequenceSlices.documents``);
* the first LLM stage embeds the whole sequence (token embeddings and image placement need the
  positions) and keeps its slice; the labels are sliced the same way, padded positions ignored;
* everything between, stage boundaries included, carries ``[B, S_padded / cp, D]``.

Gradients. Each CP rank's loss terms cover disjoint positions, so every parameter's gradient is a sum
over the CP ranks, exactly as over data-parallel replicas: the unit reduces gradients over the
data x context group (train/unit_groups.py ``UnitGroups.gradient``). Modules every CP rank runs whole follow the same
rule when their losses are split: a colocated encoder contributes through the positions each rank keeps;
the generation loss, which needs the hidden states of every position, is computed from the all-gathered
sequence by every CP rank and counted 1/cp on each. Image embeddings received from an encoder unit get
their gradient summed over the CP group before they travel back (the encoder hears one CP rank), and the
generation queries sent to a generator unit scale their returning gradient by 1/cp (every CP rank hears
it and the gather's backward sums over the ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm.context_modes import AllGatherAttention, mode_positions, ulysses_attention, ulysses_degree
from ..comm.ring import Ring
from ..comm.ring_attention import documents_of, local_positions, owner_positions, padded_length, ring_attention
from ..models.llama import Attention, Documents, Llama

LAYOUT = "zigzag"


def context_mode(cfg, layout) -> tuple[str, int]:
    """(parallel.cp_mode, ranks per all-to-all) of the layout's context-parallel unit (the LLM's); ("ring", 1)
    without one. ``auto`` is resolved before any process starts (launch/entry.py)."""
    units = [unit for unit in layout.units if unit.cp > 1]
    if not units:
        return "ring", 1
    mode, unit, llm = cfg.parallel.cp_mode, units[0], cfg.model.llm
    if mode == "auto":
        raise ValueError("parallel.cp_mode=auto reached the trainer unresolved; launch through train.py")
    heads, kv_heads = llm.n_heads // unit.tp, max(1, llm.n_kv_heads // unit.tp)
    return mode, ulysses_degree(mode, unit.cp, cfg.parallel.cp_ulysses, heads, kv_heads)


class SequenceSlices:
    """This rank's positions of every sequence, and the moves between whole and sliced sequences.

    ``mode`` (parallel.cp_mode, resolved): ring | allgather | ulysses | hybrid (comm/context_modes.py); hybrid
    takes its ``ulysses_group`` (the all-to-all ranks) and ``ring_group`` (the ranks with its Ulysses index)."""

    def __init__(
        self, group, seq_len: int, layout: str = LAYOUT, mode: str = "ring", ulysses_group=None, ring_group=None
    ):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len = seq_len
        self.padded = padded_length(seq_len, self.size, layout)
        self.layout, self.mode = layout, mode
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        self.ulysses = {"ulysses": self.size, "hybrid": dist.get_world_size(ulysses_group) if ulysses_group else 1}
        self.ulysses = self.ulysses.get(mode, 1)

        def positions(rank: int) -> torch.Tensor:
            if layout != LAYOUT:  # the ring's contiguous layout (tools/bench_cp.py's reference)
                return local_positions(self.padded, self.size, rank, layout)
            return mode_positions(self.padded, self.size, rank, self.ulysses)

        self.positions = positions(self.rank)
        self.local_len = self.positions.numel()
        # Every rank's positions in rank order: where an all-gather's concatenated slices belong.
        self.gathered = torch.cat([positions(r) for r in range(self.size)])
        self._on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, gathered) on ``device``, copied there once: a copy per call from pageable host memory
        would block the host on CUDA (trainer.sync_debug checks that no step does)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (self.positions.to(device), self.gathered.to(device))
        return self._on_device[key]

    def slice(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's positions of ``x`` [B, S, ...] (padded with ``fill``)."""
        pad = self.padded - x.shape[1]
        if pad:
            x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], dim=1)
        return x.index_select(1, self.indices(x.device)[0])

    def documents(self, documents: Documents) -> Documents:
        """This rank's share of packed-document ids and positions; the whole padded row's ids ride along for
        the ring's masks (padding: document -1, position 0)."""
        pad = self.padded - documents.ids.shape[1]
        row_ids = F.pad(documents.ids, (0, pad), value=-1) if pad else documents.ids
        return Documents(self.slice(documents.ids, fill=-1), self.slice(documents.positions), row_ids)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence [B, S, D] from every rank's slice (autograd: gradients summed over the ranks)."""
        return _GatherSequence.apply(x, self)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slices: SequenceSlices):
        ctx.slices = slices
        parts = [torch.empty_like(x) for _ in range(slices.size)]
        dist.all_gather(parts, x.contiguous(), group=slices.group)
        whole = x.new_empty(x.shape[0], slices.padded, *x.shape[2:])
        whole[:, slices.indices(x.device)[1]] = torch.cat(parts, dim=1)
        return whole[:, : slices.seq_len]

    @staticmethod
    def backward(ctx, grad):
        slices = ctx.slices
        grad = F.pad(grad, (0, 0, 0, slices.padded - grad.shape[1])).contiguous()
        dist.all_reduce(grad, group=slices.group)  # each rank's loss reached every position: sum them
        return grad[:, slices.indices(grad.device)[0]], None


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    return _ScaleGradient.apply(x, factor)


def _ring_core(ring: Ring, layout: str, kernel: str):
    """Ring attention for one attention module; packed documents keep to ``kernel`` (``dense``: one additive
    mask per block; ``varlen``: one unmasked call per same-document pair), their runs read once per batch and
    kept on the batch's ``Documents`` for every layer (comm/ring_documents.py)."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        docs = None
        if documents is not None:
            key = ("ring", kernel, ring.size, ring.rank, layout)
            if key not in documents.cache:
                documents.cache[key] = documents_of((documents.ids, documents.row_ids, kernel), *key[2:])
            docs = documents.cache[key]
        return ring_attention(q, k, v, ring, layout, docs=docs)

    return core


def _allgather_core(slices: SequenceSlices, kernel: str):
    """All-gather K/V attention (comm/context_modes.py) for one attention module; document runs as the ring's."""

    def core(q, k, v, documents: Documents | None = None):
        docs = None
        if documents is not None:
            key = ("ring", kernel, slices.size, slices.rank, LAYOUT)  # the same blocks as the ring's plan
            if key not in documents.cache:
                documents.cache[key] = documents_of((documents.ids, documents.row_ids, kernel), *key[2:])
            docs = documents.cache[key]
        return AllGatherAttention.apply(q, k, v, slices.group, docs)

    return core


def _ulysses_core(slices: SequenceSlices, module: Attention, kernel: str):
    """Ulysses (or hybrid: Ulysses inside, a ring across) for one attention module (comm/context_modes.py).

    Pure Ulysses runs the module's own attention over the whole padded row (its document kernel, the row's ids:
    padding is one more document after every real one). Hybrid runs ring attention over ``ring_group`` on the
    ring slice the all-to-all assembled, with that slice's document ids."""
    group = slices.ulysses_group if slices.mode == "hybrid" else slices.group
    ring = Ring(slices.ring_group) if slices.mode == "hybrid" else None

    def inner(q, k, v, documents: Documents | None):
        if ring is None:
            if documents is None:
                return Attention.core_attention(module, q, k, v)
            if "ulysses-row" not in documents.cache:  # positions are not read by attention itself
                documents.cache["ulysses-row"] = Documents(documents.row_ids, documents.row_ids)
            return Attention.core_attention(module, q, k, v, documents.cache["ulysses-row"])
        docs = None
        if documents is not None:
            key = ("hybrid", kernel, ring.size, ring.rank)
            if key not in documents.cache:
                row = documents.row_ids
                mine = row.index_select(1, owner_positions(row.shape[1], ring.size, ring.rank, LAYOUT, row.device))
                documents.cache[key] = documents_of((mine, row, kernel), ring.size, ring.rank, LAYOUT)
            docs = documents.cache[key]
        return ring_attention(q, k, v, ring, LAYOUT, docs=docs)

    def core(q, k, v, documents: Documents | None = None):
        return ulysses_attention(q, k, v, group, inner, documents)

    return core


def apply_context_parallel(module: nn.Module, slices: SequenceSlices) -> int:
    """Context-parallel attention (``slices.mode``) in every Llama attention of ``module`` and the rotary table
    of this rank's positions; returns how many attention modules. Call before materializing (the table is
    rebuilt on reset)."""
    ring = Ring(slices.group) if slices.mode == "ring" else None
    count = 0
    for child in module.modules():
        if isinstance(child, Attention):
            # eager inside a compiled block (trainer.compile): the ring's sends and receives are not traced
            kernel = "dense" if child.document_kernel == "dense" else "varlen"  # flex: refused with cp > 1
            if slices.mode == "ring":
                core = _ring_core(ring, slices.layout, kernel)
            elif slices.mode == "allgather":
                core = _allgather_core(slices, kernel)
            else:
                core = _ulysses_core(slices, child, kernel)
            child.core_attention = torch.compiler.disable(core)
            count += 1
        elif isinstance(child, Llama):
            child.rope_positions = slices.positions
            if child.rope.device.type != "meta":
                child.reset_buffers()
    return count
