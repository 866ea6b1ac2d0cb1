"""Variable-length text: long-tail length profiles, bucketing by length and packing with document masks.

Real corpora are long-tailed: most documents are short, a few are very long. Padding every sequence to
the longest wastes compute; packing several documents into one row of ``capacity`` tokens does not, as
long as attention never crosses a document and every document's rotary positions restart at 0. A
``PackedRows`` batch therefore carries, besides tokens and labels, each position's document id and its
position inside its document (models/llama.py ``Documents``): the loss of a document packed with others
equals its loss run alone.

Bucketing (HotSPa, seed 001; the public code's ``bucket.py`` as described in shared/reference/
algorithms.md): a global batch is split by length at ``boundaries`` (ascending; bucket k holds the
documents with ``boundaries[k-1] < length <= boundaries[k]``), and inside a bucket documents are packed
greedily -- longest first, then filled from the shortest end -- into rows of the bucket's boundary. Each
bucket can then run under its own parallel strategy (a long bucket needs more sharding, a short one none).
Lengths here count tokens *with* the one that is only a label, so a document of length n yields n - 1
predictions; a document longer than the last boundary is refused, never cut silently.

Length profiles. The synthetic generator draws lengths from a log-normal body with a Pareto tail,
truncated at ``max_len``. The parameters are assumptions stated here, not fitted to a corpus (the HotSPa
paper's length histograms were not available to us): ``commoncrawl`` -- median about 660 tokens, 8% of
documents in a tail that starts at 4K (web pages: mostly short, a thin long tail); ``github`` -- median
about 1,450 tokens and a heavier tail (18% beyond 4K; source files concatenated per repository run long).
Lengths beyond ``max_len`` are clamped to it (0.8% / 2.7% of documents at 32K).
Both are documented in docs/HOTSPA.md with the fractions the generator actually produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

IGNORE = -100


@dataclass(frozen=True)
class LengthProfile:
    """Log-normal body (``median``, ``sigma``) with a Pareto tail (``alpha``) beyond ``tail_start`` that
    takes ``tail_share`` of the documents."""

    median: float
    sigma: float
    tail_start: int
    tail_share: float
    alpha: float


PROFILES = {
    "commoncrawl": LengthProfile(median=600, sigma=0.9, tail_start=4096, tail_share=0.08, alpha=1.1),
    "github": LengthProfile(median=1100, sigma=1.0, tail_start=4096, tail_share=0.18, alpha=0.9),
}


def sample_lengths(
    profile: str | LengthProfile,
    count: int,
    max_len: int,
    generator: torch.Generator,
    min_len: int = 2,
    scale: float = 1.0,
) -> list[int]:
    """``count`` document lengths in [min_len, max_len] from a profile (deterministic given ``generator``).
    ``scale`` shrinks (or stretches) every length of the profile -- its median and the start of its tail --
    keeping its shape: 1/32 draws the 32K-context corpus as a 1K-context one, instead of clamping 32K
    documents at 1K (which makes most tokens long)."""
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(f"length profile {profile!r}: allowed values are {', '.join(PROFILES)}")
        profile = PROFILES[profile]
    if not scale > 0:
        raise ValueError(f"length scale {scale} must be positive")
    if scale != 1.0:
        profile = replace(profile, median=profile.median * scale, tail_start=profile.tail_start * scale)
    if max_len < min_len:
        raise ValueError(f"max_len={max_len} is below min_len={min_len}")
    tail = torch.rand(count, generator=generator) < profile.tail_share
    body = torch.exp(math.log(profile.median) + profile.sigma * torch.randn(count, generator=generator))
    body = body.clamp(max=profile.tail_start)
    # Pareto by inversion: x = start * u^(-1/alpha)
    u = torch.rand(count, generator=generator).clamp(min=1e-12)
    pareto = profile.tail_start * u.pow(-1.0 / profile.alpha)
    lengths = torch.where(tail, pareto, body).round().clamp(min_len, max_len)
    return [int(x) for x in lengths]


@dataclass
class Bucket:
    """Documents (indices into the batch) of one length range, packed into rows of ``capacity`` tokens."""

    capacity: int
    rows: list[list[int]]

    @property
    def documents(self) -> list[int]:
        return [i for row in self.rows for i in row]


def bucket_and_pack(lengths: list[int], boundaries: list[int]) -> list[Bucket]:
    """Split documents by length at ``boundaries`` (ascending) and pack each bucket greedily into rows of its
    boundary; empty buckets are kept (a strategy may still have to run). Deterministic: ties keep index order.
    """
    check_boundaries(boundaries)
    longest = max(lengths, default=0)
    if longest > boundaries[-1]:
        raise ValueError(
            f"a document of {longest} tokens is longer than the last bucket boundary {boundaries[-1]}: "
            f"add a boundary >= {longest} (or cap the documents' length)"
        )
    members: list[list[int]] = [[] for _ in boundaries]
    for index, length in enumerate(lengths):
        members[next(k for k, edge in enumerate(boundaries) if length <= edge)].append(index)
    return [Bucket(edge, pack(chosen, lengths, edge)) for edge, chosen in zip(boundaries, members, strict=True)]


def pack(indices: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Greedy packing of documents ``indices`` into rows of ``capacity`` tokens: each row starts with the
    longest unplaced document and is filled from the shortest end while they fit (HotSPa's rule)."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    placed = [False] * len(order)
    rows = []
    for first in range(len(order)):
        if placed[first]:
            continue
        placed[first] = True
        row, used = [order[first]], lengths[order[first]]
        for j in range(len(order) - 1, first, -1):
            if not placed[j] and used + lengths[order[j]] <= capacity:
                placed[j] = True
                row.append(order[j])
                used += lengths[order[j]]
        rows.append(row)
    return rows


def check_boundaries(boundaries: list[int]) -> None:
    if not boundaries or any(b < 2 for b in boundaries) or list(boundaries) != sorted(set(boundaries)):
        raise ValueError(
            f"bucket boundaries {list(boundaries)} must be a non-empty, strictly ascending list of lengths >= 2"
        )


@dataclass
class PackedRows:
    """Rows of packed documents, all ``[B, S]``: ``tokens``, ``labels`` (next token inside the document;
    -100 at each document's last token and on padding), ``doc_ids`` (-1 on padding) and ``positions``
    (index inside the document; 0 on padding)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())


def pack_rows(
    documents: list[torch.Tensor], rows: list[list[int]], capacity: int, pad_id: int = 0, masks: list | None = None
) -> PackedRows:
    """Lay out ``documents`` (1-D token tensors) as ``rows`` (lists of document indices) of ``capacity``
    tokens. A document's id is its index in ``documents``. ``masks``: per document None (every next token is a
    label) or a bool tensor of its length, whether the loss predicts that token (a conversation's assistant
    turns: data/corpus.py)."""
    shape = (len(rows), capacity)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    doc_ids = torch.full(shape, -1, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for index in row:
            doc = documents[index]
            n = doc.numel()
            if start + n > capacity:
                raise ValueError(f"row {r} holds {start + n} tokens, more than its capacity {capacity}")
            tokens[r, start : start + n] = doc
            mask = masks[index] if masks is not None else None
            labels[r, start : start + n - 1] = doc[1:] if mask is None else torch.where(mask[1:], doc[1:], IGNORE)
            doc_ids[r, start : start + n] = index
            positions[r, start : start + n] = torch.arange(n)
            start += n
    return PackedRows(tokens, labels, doc_ids, positions)


def bucket_boundaries(cfg) -> list[int]:
    """``data.packing.buckets``, or one bucket of ``model.seq_len``."""
    buckets = cfg.data.packing.buckets
    return [int(b) for b in buckets] if buckets else [int(cfg.model.seq_len)]


def microbatch_rows(packing, capacity: int) -> int:
    """Packed rows of ``capacity`` tokens per microbatch on one rank: ``packing.tokens_per_microbatch //
    capacity`` (at least one) when a token budget is set, else ``packing.rows_per_microbatch``."""
    budget = packing.tokens_per_microbatch
    return int(packing.rows_per_microbatch) if budget is None else max(1, int(budget) // int(capacity))
